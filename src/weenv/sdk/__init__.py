"""weenv's Python SDK: environments on a weenv daemon, as sandboxes.

::

    from weenv import Sandbox

    with Sandbox.create("task", timeout=600) as sb:           # killed on exit
        r = sb.commands.run("python3 -c 'print(6*7)'", on_stdout=print)
        assert r.exit_code == 0 and r.stdout == "42\\n"
        sb.files.write("/workspace/data.bin", b"\\x00\\x01")
        sandboxes = Sandbox.create_many("task", count=64)   # one request, created concurrently

    with weenv.meter("iteration-1") as tally:                 # the environment tax of a batch
        ...
    print(tally.share, tally.phases)                          # weenv.formats.tax.Tally

:class:`AsyncSandbox` offers the same calls as coroutines.  RL groups (a task's
setup run once, a group forked from its state) and tree search:
:mod:`weenv.sdk.groups` (``weenv.Task``, ``weenv.rollout_group``, ``weenv.Tree``).  The daemon is found
by ``api_url``/``api_key`` arguments, else ``WEENV_API_URL`` and ``WEENV_API_KEY``
(TCP), else the local daemon's Unix socket (``$WEENV_HOME/run/weenv.sock``).
:class:`NodeClient` (and :class:`AsyncNodeClient`) is the node's API as records
(environments by id, captured commands, stats, the cache, shutdown), what the
``weenv`` command uses.

One implementation of the logic serves both faces (:mod:`weenv.sdk._core`:
generator flows free of I/O); :mod:`weenv.sdk._async` and :mod:`weenv.sdk._sync`
only drive them with ``httpx.AsyncClient`` or ``httpx.Client``, and the second is
generated from the first (``scripts/gen_sync.py``).  The async face closes with
``aclose()`` where the blocking one has ``close()``.  Errors are
those of :mod:`weenv.errors`, re-exported here.
"""

from weenv.errors import (
    AuthenticationError,
    CapacityError,
    CommandTimeoutError,
    DaemonError,
    InvalidInputError,
    NotFoundError,
    OutputLimitError,
    SetupError,
    WeenvError,
)
from weenv.sdk._async import AsyncCommandHandle, AsyncNodeClient, AsyncSandbox
from weenv.sdk._core import CommandResult
from weenv.sdk._groups_async import (
    AsyncGroup,
    AsyncTree,
    async_release_task,
    async_rollout_group,
)
from weenv.sdk._groups_sync import Group, Tree, release_task, rollout_group
from weenv.sdk._meter import meter
from weenv.sdk._sync import CommandHandle, NodeClient, Sandbox
from weenv.sdk.groups import Task, TaskState

__all__ = [
    "AsyncCommandHandle",
    "AsyncGroup",
    "AsyncNodeClient",
    "AsyncSandbox",
    "AsyncTree",
    "AuthenticationError",
    "CapacityError",
    "CommandHandle",
    "CommandResult",
    "CommandTimeoutError",
    "DaemonError",
    "Group",
    "InvalidInputError",
    "NodeClient",
    "NotFoundError",
    "OutputLimitError",
    "Sandbox",
    "SetupError",
    "Task",
    "TaskState",
    "Tree",
    "WeenvError",
    "async_release_task",
    "async_rollout_group",
    "meter",
    "release_task",
    "rollout_group",
]
