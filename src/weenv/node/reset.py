"""Reset of an environment in place: back to its template's state, or to a capture's.

:meth:`Resets.reset` keeps the environment (its id, directory, resources,
network namespace and address, group mounts, bundle) and replaces what an
episode changed:

1. kill its processes (SIGKILL to its first process: the kernel ends every
   other process of its pid namespace with it; commands' output readers end),
   then, while the next step runs, delete its container (``runc delete``);
2. unmount its overlay and swap in a new upper dir: empty (the template's
   state) or a snapshot of a capture (:mod:`weenv.node.snapshot`; metadata
   only, shared extents).  The new one was made ahead (a *spare*,
   :meth:`Snapshotter.make_spare`) after the previous reset of the same
   source, or after the snapshot it goes back to, so the reset does not wait
   for a btrfs transaction; without a spare of that source it is made now;
3. mount the overlay again over the same group mounts and run the container
   again from its bundle (its first process anew, a new exec agent).

The old upper dir is deleted and the next spare made in the background, under
the environment's lock (a reset meanwhile waits for it; a destroy removes
both).  A spare is a snapshot taken when it was made: writes of the episode
after it are not in it (they are in the upper dir it replaces).

No group is mounted, no manifest read, no bundle or network made: it costs a
container start and a few renames, against a create's admission, resolve,
mounts, bundle and network, and what the episode's setup would cost again.
A reset that fails midway leaves the environment ``stopped`` (its resources
still held; :meth:`Node.destroy` removes it as usual).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from weenv.errors import NotFoundError
from weenv.node.commands import Commands
from weenv.node.container import Containers
from weenv.node.pause import Pauses
from weenv.node.provision import Provisioner
from weenv.node.snapshotter import Snapshotter
from weenv.node.table import Environment, save_info

log = logging.getLogger(__name__)

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
    """Running the container again (``runc run --detach``)."""
    spare: bool = False
    """The new upper dir was made ahead."""
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


class Resets:
    """Resets of environments in place (see the module doc)."""

    def __init__(self, snapshotter: Snapshotter, containers: Containers, commands: Commands,
                 provisioner: Provisioner, pauses: Pauses):  # fmt: skip
        self.snapshotter = snapshotter
        self.containers = containers
        self.commands = commands
        self.provisioner = provisioner
        self.pauses = pauses
        self._spares = _Spares()
        self._background = ThreadPoolExecutor(1, thread_name_prefix="reset-spares")

    def close(self) -> None:
        """Wait for the background work (old upper dirs deleted, spares made) of the node closing."""
        old, self._background = self._background, ThreadPoolExecutor(1, thread_name_prefix="reset-spares")
        old.shutdown(wait=True)

    def prepare(self, e: Environment, upper_from: Path | None) -> None:
        """Make, in the background, the upper dir a reset of ``e`` to ``upper_from``
        (a capture's subvolume, or None: empty) will swap in (see the module doc)."""
        self._background.submit(self._prepare, e, upper_from)

    def _prepare(self, e: Environment, upper_from: Path | None) -> None:
        with e.lock:
            if not e.dir.exists() or e.info.state not in ("running", "paused"):
                return
            self.snapshotter.drop_retired(e.dir)
            try:
                if upper_from is not None and not upper_from.exists():  # its snapshot was deleted meanwhile
                    return
                self.snapshotter.make_spare(e.dir, e.info.resources.disk_bytes, upper_from)
            except Exception as exc:  # the next reset makes its upper dir itself
                log.warning("no spare upper dir for environment %s: %s", e.info.id, exc)
                return
            self._spares.put(e.info.id, upper_from)

    def reset(self, e: Environment, upper_from: Path | None) -> ResetTiming:
        """Reset ``e`` (running, paused or stopped) to an empty upper dir, or to
        the capture subvolume ``upper_from``; it runs afterwards.  Returns the
        phases' seconds.  Raises :class:`NotFoundError` if it is being
        destroyed, :class:`MountError` or :class:`RuntimeFailedError` (it is
        ``stopped`` then)."""
        timing = ResetTiming()
        t = time.perf_counter()
        with e.lock:
            if not e.dir.exists():
                raise NotFoundError(f"no environment {e.info.id!r}")
            self.pauses.thaw_for_destroy(e)
            procs = self.commands.forget(e)
            for p in procs:
                p.log.abandon()
            self.provisioner.detach(e.info.id)
            e.info.state = "stopped"
            self.containers.kill(e.info.id, e.dir)
            deleting = threading.Thread(target=self._delete_container, args=(e,), name=f"reset-{e.info.id}")
            deleting.start()
            try:
                for p in procs:
                    p.wait(10)
                t1 = time.perf_counter()
                timing.stop_s = t1 - t
                timing.spare = self._spares.take(e.info.id, upper_from)
                self.snapshotter.unmount(e.dir)
                self.snapshotter.replace_upper(e.dir, e.info.resources.disk_bytes, upper_from, spare=timing.spare)
                self.snapshotter.mount(e.dir, e.lowers)
                timing.overlay_s = time.perf_counter() - t1
            finally:
                deleting.join()
            t2 = time.perf_counter()
            self.containers.restart(e.info.id, e.dir)
            timing.runtime_s = time.perf_counter() - t2
            e.info.state = "running"
            if e.info.memory_released:  # it was paused so: its disk is its own again
                self.pauses.forget(e)
                e.info.memory_released, e.info.paused_at = False, None
            try:
                self.provisioner.reserve(e.info.id, e.info.resources, priority=e.info.priority)
                self.provisioner.attach(e.info.id, f"/{e.container_id}")
            except Exception as exc:  # it runs anyway, with the limits its bundle gives
                log.warning("provisioning of environment %s after its reset failed: %s", e.info.id, exc)
                self.provisioner.detach(e.info.id)
            save_info(e.dir, e.info)
        timing.total_s = time.perf_counter() - t
        self.prepare(e, upper_from)  # the next reset's upper dir; the old one deleted
        return timing

    def _delete_container(self, e: Environment) -> None:
        try:
            self.containers.delete(e.info.id, e.dir)
        except Exception as exc:  # restart fails on it, with runc's message
            log.warning("deleting the container of environment %s for its reset: %s", e.info.id, exc)
