"""Fork: N new environments from one running environment's file system.

:meth:`Forks.fork` captures the parent once (:meth:`Captures.take`: frozen for
milliseconds, then it runs on), then creates ``count`` children concurrently,
each as a create does (admission, provisioner reservation, group mounts
shared with the parent, container, first command) but with its upper dir a
snapshot of the capture (:meth:`NodeDisk.clone`: the parent's files,
whiteouts and opaque directories, no data copied) instead of an empty one.
A child is an environment of the parent's template with the parent's
resources, variables, metadata, priority and network policy (its
``EnvironmentInfo.network``, ``allow_out`` and ``deny_out``: a child of a parent
without network has none, one of a parent limited by lists has the same lists;
a parent adopted from an ``env.json`` written before these fields gives its
children no network); it diverges from its parent and
its siblings from there (each writes its own upper dir).  Process state is not
forked: each child's first process starts anew.

One child that fails does not fail the others: the result lists each child's
info or its error, in order (as E2B's fork answer does); a failed child was
undone as a failed create is (nothing of it remains).  The capture is
dropped once every child has its upper dir (the children keep the extents).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from weenv.api.models import CreateRequest, EnvironmentInfo
from weenv.config import settings
from weenv.errors import InvalidInputError, RuntimeFailedError, WeenvError
from weenv.node.state.snapshot import Capture, Captures
from weenv.node.table import Environment, check_timeout

log = logging.getLogger(__name__)


def request_like(info: EnvironmentInfo, template: str, *, timeout: float | None, **fields) -> CreateRequest:
    """The create of an environment like ``info``'s (its resources, variables,
    metadata, priority and network policy) from ``template``, its timeout
    ``timeout`` (default its own); ``fields``: other request fields.  Raises
    :class:`~pydantic.ValidationError`."""
    return CreateRequest(
        template=template,
        resources=info.resources,
        envs=info.envs,
        metadata=info.metadata,
        priority=info.priority,
        network=info.network,
        allow_out=info.allow_out,
        deny_out=info.deny_out,
        public_traffic=info.public_traffic,
        timeout=info.timeout_s if timeout is None else timeout,
        **fields,
    )


DEFAULT_MAX_FORK = 100
"""Children one fork may ask for, unless ``WEENV_MAX_FORK`` says otherwise."""
FORK_WORKERS = 8
"""Children created at once (each is mostly waiting for runc)."""


def max_fork_from_env() -> int:
    """``WEENV_MAX_FORK`` (a positive integer), else :data:`DEFAULT_MAX_FORK`."""
    return settings().runtime.max_fork


def check_count(count: int, maximum: int) -> int:
    """``count``; :class:`InvalidInputError` unless an int in [1, ``maximum``]."""
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= maximum:
        raise InvalidInputError(f"bad fork count {count!r}: want 1 to {maximum} children")
    return count


@dataclass
class ForkResult:
    """What :meth:`Forks.fork` did."""

    parent: str
    children: list[EnvironmentInfo | WeenvError] = field(default_factory=list)
    """Each child's info, or the error that kept it from starting, in order."""
    pause_s: float = 0.0
    """Seconds the parent was frozen for the capture."""
    total_s: float = 0.0
    """Seconds from the call until every child answered its first command (or failed)."""


class Forks:
    """Forks of the node's environments (see the module doc).  ``create_child(capture,
    timeout)`` creates one child of ``capture`` (raising what a create raises)."""

    def __init__(
        self,
        captures: Captures,
        create_child: Callable[[Capture, float | None], EnvironmentInfo],
        *,
        maximum: int | None = None,
        workers: int = FORK_WORKERS,
    ):
        self.captures = captures
        self.create_child = create_child
        self.maximum = max_fork_from_env() if maximum is None else maximum
        self.workers = workers

    def fork(self, e: Environment, count: int, timeout: float | None = None) -> ForkResult:
        """``count`` children of ``e``, each destroyed ``timeout`` seconds from
        now (default the parent's ``timeout_s``).  Raises
        :class:`InvalidInputError` (a count not in [1, :attr:`maximum`], or a bad
        ``timeout``: checked before the parent is frozen),
        :class:`StateError` (``e`` is not running or paused), what
        :meth:`Captures.take` raises (nothing is created then); each child's
        own failure is in the result instead."""
        count = check_count(count, self.maximum)
        if timeout is not None:
            timeout = check_timeout(timeout)
        t = time.perf_counter()
        capture = self.captures.take(e)
        result = ForkResult(e.info.id, pause_s=capture.pause_s)
        try:
            with ThreadPoolExecutor(min(count, self.workers), thread_name_prefix=f"fork-{e.info.id}") as pool:
                futures = [pool.submit(self.create_child, capture, timeout) for _ in range(count)]
                for f in futures:
                    try:
                        result.children.append(f.result())
                    except WeenvError as exc:
                        result.children.append(exc)
                    except Exception as exc:  # a bug's error, given to the caller as a runtime failure
                        log.exception("fork child of %s", e.info.id)
                        result.children.append(RuntimeFailedError(f"fork child of {e.info.id}: {exc}"))
        finally:
            self.captures.drop(capture)
        result.total_s = time.perf_counter() - t
        return result
