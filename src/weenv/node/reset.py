"""Reset of an environment in place: back to its template's state, or to a capture's.

:meth:`Resets.reset` keeps the environment (its id, directory, resources,
network namespace and address, group mounts, bundle) and replaces what an
episode changed:

1. kill its processes (its container is deleted: first process, agent,
   commands; their output readers end);
2. unmount its overlay, delete its upper dir's subvolume and make a new one:
   empty (the template's state) or a snapshot of a capture
   (:mod:`weenv.node.snapshot`; metadata only, shared extents);
3. mount the overlay again over the same group mounts and run the container
   again from its bundle (its first process anew, a new exec agent).

No group is mounted, no manifest read, no bundle or network made: it costs a
container start and a few ioctls, against a create's admission, resolve,
mounts, bundle and network, and what the episode's setup would cost again.
A reset that fails midway leaves the environment ``stopped`` (its resources
still held; :meth:`Node.destroy` removes it as usual).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from weenv.errors import NotFoundError
from weenv.node.commands import Commands
from weenv.node.container import Containers
from weenv.node.pause import Pauses
from weenv.node.provision import Provisioner
from weenv.node.snapshotter import Snapshotter
from weenv.node.table import Environment, save_info

log = logging.getLogger(__name__)


class Resets:
    """Resets of environments in place (see the module doc)."""

    def __init__(self, snapshotter: Snapshotter, containers: Containers, commands: Commands,
                 provisioner: Provisioner, pauses: Pauses):  # fmt: skip
        self.snapshotter = snapshotter
        self.containers = containers
        self.commands = commands
        self.provisioner = provisioner
        self.pauses = pauses

    def reset(self, e: Environment, upper_from: Path | None) -> float:
        """Reset ``e`` (running, paused or stopped) to an empty upper dir, or to
        the capture subvolume ``upper_from``; it runs afterwards.  Returns the
        seconds it took.  Raises :class:`NotFoundError` if it is being
        destroyed, :class:`MountError` or :class:`RuntimeFailedError` (it is
        ``stopped`` then)."""
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
            self.containers.delete(e.info.id, e.dir)
            for p in procs:
                p.wait(10)
            self.snapshotter.unmount(e.dir)
            self.snapshotter.replace_upper(e.dir, e.info.resources.disk_bytes, upper_from)
            self.snapshotter.mount(e.dir, e.lowers)
            self.containers.restart(e.info.id, e.dir)
            e.info.state = "running"
            try:
                self.provisioner.reserve(e.info.id, e.info.resources, priority=e.info.priority)
                self.provisioner.attach(e.info.id, f"/{e.container_id}")
            except Exception as exc:  # it runs anyway, with the limits its bundle gives
                log.warning("provisioning of environment %s after its reset failed: %s", e.info.id, exc)
                self.provisioner.detach(e.info.id)
            save_info(e.dir, e.info)
        return time.perf_counter() - t
