"""The environment table: what the node keeps of each environment, by id, with
their timeouts (the reaper) and their saved info (``env.json``).

An :class:`Environment` is one running (or stopped) environment: its info, its
template, its directory and the commands started in it.  The
:class:`EnvironmentTable` holds them under one lock; every other part of the
node reaches an environment through it (:meth:`EnvironmentTable.get` raises
:class:`NotFoundError` for an unknown id).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from weenv.api.models import MAX_TIMEOUT_S, EnvironmentInfo
from weenv.errors import FULL_ERRNOS, InvalidInputError, NotFoundError, disk_full
from weenv.formats.manifest import TemplateManifest
from weenv.node.disk import NodeDisk

log = logging.getLogger(__name__)

CONTAINER_PREFIX = "weenv-"
"""An environment's container id is this and its id."""
AGENT_SOCKET = "agent2.sock"
"""The exec agent's listening socket, in the environment's directory (outside its rootfs).
``2``: its requests name a user; an environment adopted from an older weenv has
``agent.sock`` and runs its commands through ``runc exec``."""
UNDELIVERED = "undelivered"
"""A file in an environment's directory while the answer naming it has not
reached its client (:meth:`Node.create` ``undelivered``); recovery removes such
an environment."""


CONTAINER_FILE = "container"
"""In a bundle directory: the id of the container made from it, when it is not
:func:`container_id` (a container made ahead for a reset, :mod:`weenv.node.state.reset`)."""


def container_id(env_id: str) -> str:
    """The runc container id environment ``env_id`` is created with."""
    return CONTAINER_PREFIX + env_id


def bundle_container_id(env_id: str, bundle: Path) -> str:
    """The id of the container of environment ``env_id`` made from the bundle
    directory ``bundle``: its :data:`CONTAINER_FILE`, else :func:`container_id`."""
    try:
        return (bundle / CONTAINER_FILE).read_text().strip() or container_id(env_id)
    except FileNotFoundError:
        return container_id(env_id)


def current_container_id(env_id: str, env_dir: Path) -> str:
    """The id of environment ``env_id``'s container (from ``env_dir/bundle``;
    it changes at each reset that starts a container made ahead)."""
    return bundle_container_id(env_id, env_dir / "bundle")


class Gate:
    """Many pass at once (:meth:`passing`: a command starting), or one holds it
    shut (:meth:`shut`: a reset or pause replacing or freezing the container),
    waiting until those passing are through; those who come meanwhile wait
    until it opens.  So a command starts wholly before the container it runs
    in is replaced (and is killed and forgotten with it) or wholly after (in
    the new one): never with the container id, the agent's socket or the bundle
    half replaced."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._passing = 0
        self._shut = False

    @contextlib.contextmanager
    def passing(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._shut)
            self._passing += 1
        try:
            yield
        finally:
            with self._cond:
                self._passing -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def shut(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._shut)
            self._shut = True
            self._cond.wait_for(lambda: self._passing == 0)
        try:
            yield
        finally:
            with self._cond:
                self._shut = False
                self._cond.notify_all()


class Environment:
    """What the node keeps of one environment."""

    def __init__(self, info: EnvironmentInfo, template: TemplateManifest, dir: Path):
        self.info = info
        self.template = template
        self.dir = dir
        self.lock = threading.Lock()
        self.processes: dict[int, Any] = {}
        """Streamed and background commands by pid inside the environment (under the table's lock):
        :class:`weenv.node.runtime.process.Process` objects, kept here untyped so that the table,
        below the runtime, does not import it."""
        self.lowers: list[Path] = []
        """The group mount points its overlay uses (lazy or direct), as the template lists its groups."""
        self.init_pid: int | None = None
        """Host pid of its first process, once looked up (:meth:`Node.mounted_files`)."""
        self.cid: str | None = None
        """Its container's id when it is not :func:`container_id` (after a reset
        started a container made ahead; :func:`current_container_id`)."""
        self.gate = Gate()
        """Commands start through it; a reset or pause holds it shut while its
        container is replaced or frozen (:meth:`Node.spawn`)."""
        self.destroyed = False
        """Set when its destroy begins (:meth:`Node.destroy`): background work
        (a reset's preparation) makes nothing for it from then on, even if the
        destroy fails midway and leaves its directory."""

    def env_for(self, env: dict[str, str] | None) -> dict[str, str]:
        """A command's variables: the template's, then the create's, then its own."""
        return {**self.template.runtime.env, **self.info.envs, **(env or {})}

    @property
    def container_id(self) -> str:
        """Its runc container's id (its cgroup is ``/`` and this)."""
        return self.cid or container_id(self.info.id)

    @property
    def rootfs(self) -> Path:
        return self.dir / "rootfs"

    @property
    def upper(self) -> Path:
        """Its overlay upper dir (its own changes), on the node's disk."""
        return NodeDisk.upper(self.dir)

    @property
    def agent_socket(self) -> Path:
        """The exec agent's listening socket (on the host, outside the rootfs)."""
        return self.dir / AGENT_SOCKET


class EnvironmentTable:
    """Environments by id.  Thread-safe: :attr:`lock` guards the table and
    every environment's :attr:`Environment.processes`."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._envs: dict[str, Environment] = {}

    def __len__(self) -> int:
        with self.lock:
            return len(self._envs)

    def count_locked(self) -> int:
        """How many, with :attr:`lock` held by the caller."""
        return len(self._envs)

    def get(self, env_id: str) -> Environment:
        """Raises :class:`NotFoundError` for an unknown id."""
        with self.lock:
            e = self._envs.get(env_id)
        if e is None:
            raise NotFoundError(f"no environment {env_id!r}")
        return e

    def add(self, e: Environment) -> None:
        with self.lock:
            self._envs[e.info.id] = e

    def pop(self, env_id: str) -> Environment:
        """Take ``env_id`` out (its destroy begins); :class:`NotFoundError` if unknown."""
        with self.lock:
            e = self._envs.pop(env_id, None)
        if e is None:
            raise NotFoundError(f"no environment {env_id!r}")
        return e

    def all(self) -> list[Environment]:
        with self.lock:
            return list(self._envs.values())

    def ids(self) -> list[str]:
        with self.lock:
            return list(self._envs)

    def infos(self, status: Callable[[], dict[str | None, str | None]]) -> list[EnvironmentInfo]:
        """Every environment's info, ``state`` followed from ``status()``
        (container id -> runc status; called once, only if one runs)."""
        envs = self.all()
        if any(e.info.state == "running" for e in envs):
            states = status()
            for e in envs:
                follow(e, states.get(e.container_id))
        return [e.info for e in envs]

    def set_timeout(self, env_id: str, timeout: float) -> EnvironmentInfo:
        """Destroy the environment ``timeout`` seconds from now (saved: a restarted
        node must not reap it at the old time).  Raises :class:`NotFoundError`, or
        :class:`InvalidInputError` for a timeout not in (0, 7 days], :class:`DiskFullError`
        (no room to save it: the old timeout stands)."""
        timeout = check_timeout(timeout)
        e = self.get(env_id)
        with e.lock:  # not between a pause's or reset's saved state and its step: that save would undo this one
            after = e.info.model_copy(update={"timeout_s": timeout, "expires_at": time.time() + timeout})
            with staged_info(e.dir, after):  # a full disk refuses it (DiskFullError): nothing changes
                e.info.timeout_s, e.info.expires_at = after.timeout_s, after.expires_at
        return e.info

    def expired(self, now: float) -> list[str]:
        """Ids of the environments whose ``expires_at`` is at or before ``now``
        (time.time()), but paused ones (their timeout stands still until resumed)."""
        with self.lock:
            return [i for i, e in self._envs.items() if e.info.expires_at <= now and e.info.state != "paused"]

    def reap(self, destroy: Callable[[str], None], now: float | None = None) -> list[str]:
        """``destroy`` every environment whose timeout passed; their ids (one
        destroyed meanwhile by another caller is left out)."""
        reaped = []
        for env_id in self.expired(time.time() if now is None else now):
            try:
                destroy(env_id)
            except NotFoundError:  # destroyed meanwhile
                continue
            log.info("reaped environment %s (its timeout passed)", env_id)
            reaped.append(env_id)
        return reaped


def follow(e: Environment, runc_status: str | None) -> None:
    """A running environment whose container stopped (its first process
    died) or vanished is ``"stopped"``: commands can no longer run in it."""
    if e.info.state == "running" and runc_status in (None, "stopped"):
        e.info.state = "stopped"


def check_timeout(timeout: float) -> float:
    """``timeout`` as float seconds; :class:`InvalidInputError` unless in (0, :data:`MAX_TIMEOUT_S`]."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not (0 < timeout <= MAX_TIMEOUT_S):
        raise InvalidInputError(f"bad timeout {timeout!r}: want seconds in (0, {MAX_TIMEOUT_S:.0f}]")
    return float(timeout)


def check_priority(priority: int) -> int:
    """``priority``; :class:`InvalidInputError` unless an int in [-1000, 1000]."""
    if isinstance(priority, bool) or not isinstance(priority, int) or not -1000 <= priority <= 1000:
        raise InvalidInputError(f"bad priority {priority!r}: want an integer in [-1000, 1000]")
    return priority


def save_info(env_dir: Path, info: EnvironmentInfo) -> None:
    """Write ``env_dir/env.json`` whole or not at all (a node killed mid-write
    must not leave a file recovery cannot read).  :class:`NotFoundError` if the
    directory is gone (destroyed meanwhile), :class:`DiskFullError` naming the
    environment if the node's disk is full (``env.json`` unchanged, no
    temporary file left)."""
    with staged_info(env_dir, info, undoable=True):
        pass


@contextlib.contextmanager
def staged_info(env_dir: Path, info: EnvironmentInfo, *, undoable: bool = False) -> Iterator[None]:
    """Save ``info`` as ``env_dir/env.json`` around a step that cannot be undone
    (a container deleted, killed or run anew): it is written to a temporary
    file first, so a full disk refuses (:class:`DiskFullError`, raised here,
    before the block runs: the caller has changed nothing yet), and replaces
    ``env.json`` (a rename, no new data) only once the block ended without an
    exception; otherwise the temporary file goes and ``env.json`` is as it was.
    ``info`` is dumped now: pass the state the block leaves.  Writers of one
    environment's ``env.json`` hold its lock (:attr:`Environment.lock`).

    The rename itself failing (a full file system's metadata, rarely) after
    the block's step: with ``undoable`` (nothing in the block, the caller can
    still give up) :class:`DiskFullError`; without, logged, not raised (the
    step is done and the state in memory is right; ``env.json`` is behind
    until the environment's next save)."""
    tmp = env_dir / f"env.json.{secrets.token_hex(4)}.tmp"  # two writers never share one
    try:
        with open(tmp, "x") as f:
            f.write(info.model_dump_json(indent=2))
    except FileNotFoundError:  # destroyed meanwhile
        raise NotFoundError(f"no environment {info.id!r}") from None
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if exc.errno in FULL_ERRNOS:
            raise disk_full(f"environment {info.id}", "cannot save its state", exc) from exc
        raise
    try:
        yield
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    try:
        os.replace(tmp, env_dir / "env.json")
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(exc, FileNotFoundError):
            raise NotFoundError(f"no environment {info.id!r}") from None
        if undoable and exc.errno in FULL_ERRNOS:
            raise disk_full(f"environment {info.id}", "cannot save its state", exc) from exc
        if undoable:
            raise
        # the block's step is done: saying "nothing was done" (DiskFullError) would be false
        log.error("environment %s: its state is applied but not saved (env.json is behind): %s", info.id, exc)


def stale_info_files(env_dir: Path) -> list[Path]:
    """Temporary files of :func:`staged_info` a killed node process left in ``env_dir``."""
    try:
        return [env_dir / n for n in os.listdir(env_dir) if n.startswith("env.json.") and n.endswith(".tmp")]
    except FileNotFoundError:
        return []
