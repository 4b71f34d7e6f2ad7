"""Reset of an environment in place: back to its template's state, or to a capture's.

:meth:`Resets.reset` keeps the environment (its id, directory, resources,
network namespace and address, group mounts, bundle) and replaces what an
episode changed.  Its next state is prepared ahead, in the background, after
each reset and after each snapshot (for a reset to that snapshot):

- a *spare* upper dir (:meth:`Snapshotter.make_spare`): empty (the template's
  state) or a snapshot of a capture (:mod:`weenv.node.state.snapshot`; metadata
  only, shared extents), so the reset does not wait for a btrfs transaction;
- a *container made ahead* over it: an overlay of the same group mounts over
  the spare at ``rootfs.next``, a bundle ``bundle.next/`` (the environment's
  config with that root and cgroup) and ``runc create`` of container
  ``weenv-<id>.<n>`` (the next number; its first process waits in runc's exec
  FIFO, its exec agent's socket is ``agent2.sock.next``), as the warm pool
  makes creates' containers (:mod:`weenv.node.state.pool`).

A reset whose spare is of the source it asks for then costs:

1. kill its processes (SIGKILL to its first process: the kernel ends every
   other process of its pid namespace with it; commands' output readers end);
2. move (``MS_MOVE``) its rootfs aside to ``rootfs.old.<token>`` and the one made ahead to ``rootfs``,
   rename the spare into place as its upper dir (the old one to
   ``disk.old.<token>``), ``bundle/`` to ``bundle.old.<old container id>/``,
   ``bundle.next/`` to ``bundle/`` and the agent's socket to ``agent2.sock``
   (renames only; each replaced thing under a name of its own, so one that
   could not be deleted does not stand in a later reset's way): the environment's
   container id is now the one made ahead (:func:`~weenv.node.table.current_container_id`,
   read from ``bundle/container``; its cgroup ``/`` that id);
3. start it (:meth:`Runc.start`: runc's exec FIFO read in process, ~1 ms,
   against ``runc run``'s ~26 ms here).

The killed container (``bundle.old.*/``), the old rootfs and upper dir are deleted in
the background (what cannot be deleted now is tried again at the next reset),
before the next spare and container are made, under the
environment's lock (a reset meanwhile waits for it; a destroy, a stop and
recovery remove all three containers: its own, the replaced one, the one made
ahead).  Without a spare of that source, or when the move is refused (then
that environment's resets make none ahead again; a node whose environments'
mount is shared, which refuses every move, finds so at its start,
:meth:`Resets.check_moves`, and makes none), it goes as before: the container made ahead is removed, the killed one deleted
while its upper dir is swapped (made now without a spare) under a new
overlay, and the container run again from its bundle (``runc run``), keeping
its id.  ``WEENV_RESET_AHEAD=0`` turns containers made ahead off.

A spare (and the container made ahead on it) is a snapshot taken when it was
made: writes of the episode after it are not in it (they are in the upper dir
it replaces).  A container made ahead costs a waiting ``runc init`` (~2 MB
anonymous memory, no CPU), a cgroup and an overlay mount per environment
reset or snapshotted; a memory-releasing pause keeps it (it runs nothing of
the environment's), a daemon restart removes it (the next reset runs its
container itself, then makes one ahead again).

No group is mounted, no manifest read, no bundle or network made: it costs a
container start and a few renames, against a create's admission, resolve,
mounts, bundle and network, and what the episode's setup would cost again.
A reset that fails midway leaves the environment ``stopped`` (its resources
still held, its container id the one its bundle names; :meth:`Node.destroy`
removes it as usual).  Its state is written before its container is killed
(:func:`~weenv.node.table.staged_info`): on a full node disk the reset is
refused (:class:`DiskFullError`) with the environment as it was.  A command
starting meanwhile waits until the new container runs (the environment's
:class:`~weenv.node.table.Gate`); one that started before is killed with the old one.  A destroy that begins (:meth:`Resets.forget`) stops
every preparation for that environment, even if it fails midway.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from weenv.config import settings
from weenv.errors import MountError, NotFoundError, RuntimeFailedError
from weenv.host import mounts
from weenv.node.provision import Provisioner
from weenv.node.runtime.commands import Commands
from weenv.node.runtime.container import Containers
from weenv.node.snapshotter import Snapshotter
from weenv.node.state.pause import Pauses
from weenv.node.table import Environment, container_id, current_container_id, staged_info

log = logging.getLogger(__name__)


class _CannotMove(Exception):
    """The rootfs of a container made ahead could not be moved in place (mount(2) ``MS_MOVE``)."""


NO_SPARE = object()
"""The spare's source when an environment has none."""


@dataclass
class ResetTiming:
    """Seconds of one reset's phases."""

    stop_s: float = 0.0
    """Killing its processes (the container's deletion overlaps the upper dir's phase)."""
    overlay_s: float = 0.0
    """Unmounting the overlay, swapping in the new upper dir, mounting it again."""
    runtime_s: float = 0.0
    """Running the container again (``runc run --detach``), or starting the one made ahead (``runc start``)."""
    spare: bool = False
    """The new upper dir was made ahead."""
    ahead: bool = False
    """The container was made ahead (``runc create``): the reset started it (``runtime_s``: ``runc start``)."""
    total_s: float = 0.0


@dataclass
class _Spares:
    """Per environment: the source (a capture's path, or None: empty) of its spare upper dir."""

    sources: dict[str, object] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self, env_id: str, upper_from: Path | None) -> bool:
        """Whether the spare of ``env_id`` is of ``upper_from`` (it is used up either way)."""
        with self.lock:
            return self.sources.pop(env_id, NO_SPARE) == upper_from

    def put(self, env_id: str, upper_from: Path | None) -> None:
        with self.lock:
            self.sources[env_id] = upper_from

    def forget(self, env_id: str) -> None:
        """``env_id`` has no spare (it is being replaced, or the environment went)."""
        with self.lock:
            self.sources.pop(env_id, None)


def _log_failure(done, env_id: str) -> None:
    """Log what a background preparation of ``env_id``'s next reset raised (its future would keep it unseen)."""
    if not done.cancelled() and done.exception() is not None:
        log.warning("preparing the next reset of environment %s failed: %s", env_id, done.exception())


class Resets:
    """Resets of environments in place (see the module doc)."""

    def __init__(
        self,
        snapshotter: Snapshotter,
        containers: Containers,
        commands: Commands,
        provisioner: Provisioner,
        pauses: Pauses,
    ):
        self.snapshotter = snapshotter
        self.containers = containers
        self.commands = commands
        self.provisioner = provisioner
        self.pauses = pauses
        self._spares = _Spares()
        self.ahead = ahead_from_env()
        """Whether resets start a container made ahead (``WEENV_RESET_AHEAD``, default on)."""
        self.moves = True
        """Whether a rootfs can move (mount(2) ``MS_MOVE``) in the environments' file
        system: False when its mount is shared (:meth:`check_moves`, at the node's start)."""
        self._no_move: set[str] = set()
        """Environments whose rootfs refused to move: their resets run their container again."""
        self._background = ThreadPoolExecutor(1, thread_name_prefix="reset-spares")

    def check_moves(self, environments: Path) -> bool:
        """Check once (the node starts) that rootfs mounts can move in
        ``environments`` (its mount is not shared, see :func:`mounts.is_shared`);
        if they cannot, no container is made ahead on this node.  Whether they can."""
        self.moves = not mounts.is_shared(environments)
        if not self.moves:
            log.warning(
                "%s is a shared mount (mount(2) MS_MOVE refuses it): resets on this node run "
                "their container again instead of starting one made ahead",
                environments,
            )
        return self.moves

    def forget(self, e: Environment) -> None:
        """``e`` is being destroyed: no background work makes anything for it from now on."""
        e.destroyed = True
        self._spares.forget(e.info.id)
        self._no_move.discard(e.info.id)

    def _makes_ahead(self, e: Environment) -> bool:
        return self.ahead and self.moves and e.info.id not in self._no_move

    def close(self) -> None:
        """Wait for the background work (old upper dirs deleted, spares made) of the node closing."""
        old, self._background = self._background, ThreadPoolExecutor(1, thread_name_prefix="reset-spares")
        old.shutdown(wait=True)

    def prepare(self, e: Environment, upper_from: Path | None) -> None:
        """Make, in the background, the upper dir a reset of ``e`` to ``upper_from``
        (a capture's subvolume, or None: empty) will swap in, and the container
        it will start (see the module doc)."""
        self._background.submit(self._prepare, e, upper_from).add_done_callback(
            lambda done, env_id=e.info.id: _log_failure(done, env_id)
        )

    def _prepare(self, e: Environment, upper_from: Path | None) -> None:
        with e.lock:
            if e.destroyed or not e.dir.exists():
                return
            self._retire(e)
            if e.info.state not in ("running", "paused"):
                return
            self._spares.forget(e.info.id)  # the spare there now is replaced (or gone if that fails)
            self._discard_ahead(e)  # it runs over the spare replaced now
            try:
                if upper_from is not None and not upper_from.exists():  # its snapshot was deleted meanwhile
                    return
                self.snapshotter.make_spare(e.dir, e.info.resources.disk_bytes, upper_from)
            except Exception as exc:  # the next reset makes its upper dir itself
                log.warning("no spare upper dir for environment %s: %s", e.info.id, exc)
                return
            self._spares.put(e.info.id, upper_from)
            if self._makes_ahead(e):
                try:
                    self._make_ahead(e)
                except Exception as exc:  # the next reset runs its container itself
                    log.warning("no container made ahead for environment %s: %s", e.info.id, exc)
                    self._discard_ahead(e)

    def _retire(self, e: Environment) -> None:
        """Delete what the last reset of ``e`` replaced: its container (if a
        container made ahead took over), its rootfs (moved aside) and upper dir."""
        try:
            self.containers.delete_retiring(e.info.id, e.dir)
        except Exception as exc:  # destroy and recovery try again
            log.warning("deleting the replaced container of environment %s: %s", e.info.id, exc)
        self.snapshotter.unmount_retired(e.dir)
        self.snapshotter.drop_retired(e.dir)

    def _make_ahead(self, e: Environment) -> None:
        """Mount an overlay over ``e``'s spare upper dir and create (unstarted) a
        container on it, with the next container id (``weenv-<id>.<n>``)."""
        self.snapshotter.mount(e.dir, e.lowers, ahead=True)
        self.containers.make_ahead(e.info.id, e.dir, next_container_id(e.info.id, e.container_id))

    def _discard_ahead(self, e: Environment) -> None:
        """Remove ``e``'s container made ahead and its rootfs, if any."""
        self.containers.discard_ahead(e.info.id, e.dir)
        self.snapshotter.unmount_ahead(e.dir)

    def reset(self, e: Environment, upper_from: Path | None) -> ResetTiming:
        """Reset ``e`` (running, paused or stopped) to an empty upper dir, or to
        the capture subvolume ``upper_from``; it runs afterwards.  Returns the
        phases' seconds.  Raises :class:`NotFoundError` if it is being
        destroyed, :class:`DiskFullError` (no room for its state: nothing
        done), :class:`MountError` or :class:`RuntimeFailedError` (it is
        ``stopped`` then)."""
        timing = ResetTiming()
        t = time.perf_counter()
        with e.lock:
            if e.destroyed or not e.dir.exists():
                raise NotFoundError(f"no environment {e.info.id!r}")
            after = e.info.model_copy(update={"state": "running", "memory_released": False, "paused_at": None})
            with staged_info(e.dir, after):  # a full disk refuses here: it is as it was, untouched
                try:
                    self._reset_locked(e, upper_from, timing, t)
                except BaseException:
                    sync_container_id(e)  # what the reset got to: the id its bundle names
                    raise
        timing.total_s = time.perf_counter() - t
        self.prepare(e, upper_from)  # the next reset's upper dir and container; the old ones deleted
        return timing

    def _reset_locked(self, e: Environment, upper_from: Path | None, timing: ResetTiming, t: float) -> None:
        """:meth:`reset`'s work, with ``e.lock`` held."""
        self.pauses.thaw_for_destroy(e)
        self.provisioner.detach(e.info.id)
        with e.gate.shut():  # no command half started in the container replaced now
            self._replace_locked(e, upper_from, timing, t)
        try:
            self.provisioner.reserve(e.info.id, e.info.resources, priority=e.info.priority)
            self.provisioner.attach(e.info.id, f"/{e.container_id}")
        except Exception as exc:  # it runs anyway, with the limits its bundle gives
            log.warning("provisioning of environment %s after its reset failed: %s", e.info.id, exc)
            self.provisioner.detach(e.info.id)

    def _replace_locked(self, e: Environment, upper_from: Path | None, timing: ResetTiming, t: float) -> None:
        """:meth:`reset`'s replacement of ``e``'s container and upper dir (its gate shut, its lock held)."""
        procs = self.commands.forget(e)
        for p in procs:
            p.log.abandon()
        e.info.state = "stopped"
        timing.spare = self._spares.take(e.info.id, upper_from)
        timing.ahead = (
            timing.spare
            and self._makes_ahead(e)
            and self.containers.ahead_id(e.info.id, e.dir) is not None
            and self.snapshotter.is_mounted_ahead(e.dir)
        )
        if not timing.ahead:
            self._discard_ahead(e)
        self.containers.kill(e.info.id, e.dir)
        if timing.ahead:
            try:
                self._swap_ahead(e, procs, timing, t)
            except _CannotMove as exc:  # e.g. a shared parent mount refuses the move: run it as before
                log.warning(
                    "the container made ahead for environment %s cannot take over (%s); "
                    "its resets run its container again",
                    e.info.id,
                    exc,
                )
                self._no_move.add(e.info.id)
                self._discard_ahead(e)
                timing.ahead = False
        if not timing.ahead:
            self._swap_upper(e, procs, upper_from, timing, t)
        e.init_pid = None
        e.info.state = "running"
        if e.info.memory_released:  # it was paused so: its disk is its own again
            self.pauses.forget(e)
            e.info.memory_released, e.info.paused_at = False, None

    def _swap_ahead(self, e: Environment, procs: list, timing: ResetTiming, t: float) -> None:
        """With ``e``'s container killed: move its rootfs aside (``rootfs.old``),
        the container made ahead's in its place (its upper dir becomes ``e``'s
        own), make that container ``e``'s and start it.  The old container,
        rootfs and upper dir go in the background (:meth:`_retire`).  Raises :class:`_CannotMove` (nothing
        of the container made ahead changed) when its rootfs cannot move,
        :class:`MountError`; a container made ahead that does not start (its
        ``runc init`` died while it waited) is deleted and run anew from the same
        bundle and rootfs (:class:`RuntimeFailedError` if that fails too)."""
        for p in procs:
            p.wait(10)
        t1 = time.perf_counter()
        timing.stop_s = t1 - t
        try:
            aside = self.snapshotter.move_aside(e.dir)
        except MountError as exc:
            raise _CannotMove(str(exc)) from exc
        try:
            self.snapshotter.move_ahead(e.dir)
        except MountError as exc:
            self.snapshotter.move_back(e.dir, aside)
            raise _CannotMove(str(exc)) from exc
        self.snapshotter.swap_in_spare(e.dir)
        try:
            e.cid = self.containers.promote_ahead(e.info.id, e.dir)
        except OSError as exc:  # its bundle stays e's own: run that one over the rootfs now in place
            log.warning(
                "the container made ahead for environment %s cannot take over (%s); running its container again",
                e.info.id,
                exc,
            )
            self.containers.delete(e.info.id, e.dir)
            self.containers.restart(e.info.id, e.dir)
            timing.ahead = False
            timing.runtime_s = time.perf_counter() - t1
            return
        t2 = time.perf_counter()
        timing.overlay_s = t2 - t1
        try:
            self.containers.start_ahead(e.container_id)
        except RuntimeFailedError as exc:  # its runc init died while it waited: run it anew, same bundle and rootfs
            log.warning(
                "the container made ahead for environment %s did not start (%s); running it anew", e.info.id, exc
            )
            self.containers.delete(e.info.id, e.dir, ahead=False)
            self.containers.restart(e.info.id, e.dir)
        timing.runtime_s = time.perf_counter() - t2

    def _swap_upper(self, e: Environment, procs: list, upper_from: Path | None, timing: ResetTiming, t: float) -> None:
        """With ``e``'s container killed: delete it, swap in the new upper dir
        (the spare, if ``timing.spare``) under a new overlay and run the
        container again from its bundle."""
        deleting = threading.Thread(target=self._delete_container, args=(e,), name=f"reset-{e.info.id}")
        deleting.start()
        try:
            for p in procs:
                p.wait(10)
            t1 = time.perf_counter()
            timing.stop_s = t1 - t
            self.snapshotter.unmount(e.dir)
            self.snapshotter.replace_upper(e.dir, e.info.resources.disk_bytes, upper_from, spare=timing.spare)
            self.snapshotter.mount(e.dir, e.lowers)
            timing.overlay_s = time.perf_counter() - t1
        finally:
            deleting.join()
        t2 = time.perf_counter()
        self.containers.restart(e.info.id, e.dir)
        timing.runtime_s = time.perf_counter() - t2

    def _delete_container(self, e: Environment) -> None:
        try:
            self.containers.delete(e.info.id, e.dir)
        except Exception as exc:  # restart fails on it, with runc's message
            log.warning("deleting the container of environment %s for its reset: %s", e.info.id, exc)


def sync_container_id(e: Environment) -> None:
    """Set ``e.cid`` to the container its bundle names (after a reset that failed midway)."""
    try:
        cid = current_container_id(e.info.id, e.dir)
    except OSError:
        return
    e.cid = cid if cid != container_id(e.info.id) else None


def next_container_id(env_id: str, current: str) -> str:
    """The id of the container made ahead of ``current`` (environment
    ``env_id``'s): ``weenv-<id>.1`` after ``weenv-<id>``, then ``.2``..."""
    base = container_id(env_id)
    n = current[len(base) + 1 :] if current.startswith(base + ".") else ""
    return f"{base}.{int(n) + 1 if n.isdigit() else 1}"


def ahead_from_env() -> bool:
    """``WEENV_RESET_AHEAD``: ``0`` turns off containers made ahead for resets (default on)."""
    return settings().runtime.reset_ahead
