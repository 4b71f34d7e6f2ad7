# Generated from _groups_async.py by scripts/gen_sync.py: do not edit; edit _groups_async.py and run it.
"""RL groups and tree search on the blocking face (see :mod:`weenv.sdk.groups`):
``rollout_group``, ``release_task``, :class:`Group`, :class:`Tree`.

Generated from :mod:`weenv.sdk._groups_async` by ``scripts/gen_sync.py``.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
from dataclasses import dataclass

from weenv.api.models import EnvironmentInfo
from weenv.errors import (
    BusyError,
    CommandTimeoutError,
    NotFoundError,
    StateError,
    WeenvError,
)
from weenv.sdk import _core
from weenv.sdk._sync import Sandbox, _Connection
from weenv.sdk._core import ConnectionConfig
from weenv.sdk._meter import meter, note_begun
from weenv.sdk.groups import (
    SETUP_SLACK_S,
    TASK_LABEL,
    Task,
    TaskState,
    check_branches,
    check_group_size,
    failed_callable,
    failed_command,
    first_error,
    state_name,
    template_info,
    timed_out,
)

log = logging.getLogger("weenv.sdk.groups")

NODE_HINT = "weenv.node"
"""Metadata key a cluster's gateway sets to the node it placed an environment on."""


@dataclass
class _Root:
    """A node's root environment of a task state: what its groups fork."""

    id: str
    digest: str
    """The state's digest it was made from."""
    node: str | None
    """The cluster node id it runs on (a placement hint), None on one node."""


class Group(list):
    """A rollout group: ``n`` sandboxes forked from a task's state on one node,
    in a list.  ``state``: the :class:`~weenv.sdk.groups.TaskState`;
    ``placement``: metadata that places an environment (or, by the same key,
    a trainer's rollout worker) beside the group on a cluster (empty on one
    node); ``tally``: the group's environment tax (a :func:`weenv.meter` open
    from the group's start to :meth:`kill`).  As a context manager it kills
    its sandboxes on exit."""

    def __init__(self, task: Task, state: TaskState, sandboxes: list[Sandbox], root: _Root, metering: meter):
        super().__init__(sandboxes)
        self.task = task
        self.state = state
        self.root = root.id
        self.placement = {NODE_HINT: root.node} if root.node else {}
        self._meter = metering
        self.tally = metering.tally
        self._closed = False

    def kill(self) -> None:
        """Kill every sandbox of the group (the task's root stays) and close its meter.  Idempotent."""
        _kill_all(self)
        if not self._closed:
            self._closed = True
            self._meter.__exit__(None, None, None)

    def __enter__(self) -> Group:
        return self

    def __exit__(self, *exc) -> None:
        self.kill()


def rollout_group(
    task: Task,
    n: int,
    *,
    timeout: float | None = None,
    api_url: str | None = None,
    api_key: str | None = None,
    request_timeout: float | None = None,
) -> Group:
    """``n`` sandboxes forked from ``task``'s state (built first if the store
    has none: :mod:`weenv.sdk.groups`) on the node the connection reaches (a
    cluster's gateway places the task's root on one of its nodes).
    ``timeout``: seconds each sandbox lives (default the task's ``keep``).
    Raises :class:`InvalidInputError` (``n`` not in 1 to the node's fork
    maximum), :class:`SetupError` (the setup failed or timed out: nothing is
    left), what creating and forking raise; no sandbox is left then."""
    n = check_group_size(n)
    metering = meter(f"group of {n} of {task.template}")
    metering._open()
    conn = _Connection(ConnectionConfig.resolve(api_url, api_key, request_timeout))
    try:
        state = _state(conn, task)
        root = _root(conn, task, state)
        started = time.monotonic()
        try:
            children = conn.drive(_core.fork(root.id, n, timeout=timeout))
        except (NotFoundError, StateError):  # the root is gone (its timeout, a node restarted): a new one
            _forget_root(conn, task, state.name)
            root = _root(conn, task, state)
            children = conn.drive(_core.fork(root.id, n, timeout=timeout))
        group = [Sandbox(c, conn.retain()) for c in children if isinstance(c, EnvironmentInfo)]
        error = first_error(children)
        if error is not None:
            _kill_all(group)
            raise error
        note_begun(conn.config, [sb.id for sb in group], started)
        return Group(task, state, group, root, metering)
    except BaseException:
        metering.__exit__(None, None, None)
        raise
    finally:
        conn.release()


def release_task(task: Task, *, api_url: str | None = None, api_key: str | None = None) -> int:
    """Kill ``task``'s root environments on the node the connection reaches
    (its state stays in the store); how many there were."""
    conn = _Connection(ConnectionConfig.resolve(api_url, api_key))
    try:
        mine = [k for k in task._roots if k[0] == conn.config.where]
        for k in mine:
            conn.drive(_core.kill(task._roots.pop(k).id))
        return len(mine)
    finally:
        conn.release()


def _state(conn: _Connection, task: Task) -> TaskState:
    """``task``'s state as the store holds it, built if it holds none."""
    template = conn.drive(template_info(task.template))
    key = task.setup_key
    name = state_name(task.template, template.digest, key)
    rebuilt = None
    try:
        found = conn.drive(template_info(name))
    except NotFoundError:
        if name in task._built:
            rebuilt = f"snapshot {name} ({task._built[name]}) is gone from the store: its setup ran again"
            log.warning("task %s: %s", task.template, rebuilt)
    else:
        task._built[name] = found.digest
        return TaskState(name, found.digest, template.digest, key)
    t = time.monotonic()
    digest = _build(conn, task, name)
    task._built[name] = digest
    return TaskState(name, digest, template.digest, key, built=True, build_s=time.monotonic() - t, rebuilt=rebuilt)


def _build(conn: _Connection, task: Task, name: str) -> str:
    """Run ``task``'s setup in a fresh environment, publish it as snapshot
    ``name`` and destroy the environment; the snapshot's digest."""
    deadline = time.monotonic() + task.timeout
    info = conn.drive(
        _core.create(
            task.template, timeout=task.timeout + SETUP_SLACK_S, envs=task.envs or None, metadata={TASK_LABEL: name}
        )
    )
    sb = Sandbox(info, conn.retain())
    try:
        _run_setup(sb, task, deadline)
        try:
            return (sb.create_snapshot(name)).digest
        except BusyError:  # another client published this state meanwhile: theirs is as good
            return (conn.drive(template_info(name))).digest
    finally:
        with contextlib.suppress(WeenvError):
            sb.kill()


def _run_setup(sb: Sandbox, task: Task, deadline: float) -> None:
    if callable(task.setup):
        try:
            done = task.setup(sb)
            if inspect.isawaitable(done):
                done = done
        except Exception as exc:
            if time.monotonic() >= deadline:
                raise timed_out(task, None) from exc
            raise failed_callable(task, exc) from exc
        if time.monotonic() >= deadline:
            raise timed_out(task, None)
        return
    for command in task.setup:
        left = deadline - time.monotonic()
        if left <= 0:
            raise timed_out(task, command)
        try:
            result = sb.commands.run(command, timeout=left)
        except CommandTimeoutError as exc:
            raise timed_out(task, command) from exc
        if result.exit_code != 0:
            raise failed_command(task, command, result)


def _root(conn: _Connection, task: Task, state: TaskState) -> _Root:
    """The node's root environment of ``state`` (made from the snapshot and
    paused with its memory released, the first time)."""
    key = (conn.config.where, state.name)
    root = task._roots.get(key)
    if root is not None and root.digest == state.digest:
        return root
    if root is not None:  # made from a state since rebuilt
        _forget_root(conn, task, state.name)
    info = conn.drive(_core.create(state.name, timeout=task.keep, metadata={TASK_LABEL: state.name}))
    try:
        conn.drive(_core.pause(info.id, True))
    except BaseException:
        with contextlib.suppress(WeenvError):
            conn.drive(_core.kill(info.id))
        raise
    other = task._roots.get(key)
    if other is not None and other.digest == state.digest:  # a concurrent group made one meanwhile: share it
        with contextlib.suppress(WeenvError):
            conn.drive(_core.kill(info.id))
        return other
    root = task._roots[key] = _Root(info.id, state.digest, info.metadata.get(NODE_HINT))
    return root


def _kill_all(sandboxes: list[Sandbox]) -> None:
    """Kill each of ``sandboxes`` (those already gone are no error)."""
    for sb in sandboxes:
        with contextlib.suppress(WeenvError):
            sb.kill()


def _forget_root(conn: _Connection, task: Task, name: str) -> None:
    root = task._roots.pop((conn.config.where, name), None)
    if root is not None:
        with contextlib.suppress(WeenvError):
            conn.drive(_core.kill(root.id))


class Tree:
    """Tree search over environments: :meth:`branch` forks one ``b`` ways,
    :meth:`save` keeps a state, :meth:`reset` brings one back to it in place.
    :meth:`close` (or leaving ``async with``) kills the branches it made and
    deletes the states it saved.  ``tally``: its environment tax (a
    :func:`weenv.meter` open from its start to :meth:`close`)."""

    def __init__(self, name: str | None = None):
        self._meter = meter(name or "tree search")
        self.tally = self._meter._open()
        self.branches: list[Sandbox] = []
        self._saved: list[tuple[str, _Connection]] = []
        self._closed = False

    def branch(self, sb: Sandbox, b: int, *, timeout: float | None = None) -> list[Sandbox]:
        """``b`` children of ``sb`` as its file system is now (each one's first
        process starts anew); if one cannot start, the others are killed and its error raised."""
        started = time.monotonic()
        children = sb.fork(check_branches(b), timeout=timeout)
        made = [c for c in children if isinstance(c, Sandbox)]
        error = first_error(children)
        if error is not None:
            _kill_all(made)
            raise error
        self.branches.extend(made)
        note_begun(sb._conn.config, [c.id for c in made], started)
        return made

    def save(self, sb: Sandbox, name: str | None = None) -> str:
        """Keep ``sb``'s state (a snapshot, default name fresh); its name, for :meth:`reset`."""
        info = sb.create_snapshot(name)
        self._saved.append((info.name, sb._conn.retain()))  # deleted at close, if sb is gone by then too
        return info.name

    def reset(self, sb: Sandbox, state: str | None = None) -> None:
        """``sb`` back in place to ``state`` (a name :meth:`save` gave, taken on
        its node), or to its template's state: same id, a fresh file system."""
        sb.reset(state)

    def close(self) -> None:
        """Kill the branches it made, delete the states it saved, close its meter.  Idempotent."""
        if self._closed:
            return
        self._closed = True
        _kill_all(self.branches)
        for name, conn in self._saved:
            try:
                with contextlib.suppress(WeenvError):
                    conn.drive(_core.delete_snapshot(name))
            finally:
                conn.release()
        self._meter.__exit__(None, None, None)

    def __enter__(self) -> Tree:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
