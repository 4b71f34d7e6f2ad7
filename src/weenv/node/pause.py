"""Pause and resume of environments, with the cgroup freezer.

:meth:`Pauses.pause` freezes the environment's cgroup (v1 ``freezer.state``,
v2 ``cgroup.freeze``): every process of it (its first process, the exec
agent, every command and what they started, in their own child groups) stops
at once where it is and uses no CPU; its memory, open files, sockets, pids and
file system stay as they were.  :meth:`Pauses.resume` thaws it: the processes
go on from where they stopped, with the same pids and memory.

What a pause keeps is what the kernel keeps: it lasts while the node's machine
runs.  A daemon restart keeps paused environments paused (the freezer state
is the kernel's, the ``paused`` state is in ``env.json``); a reboot ends them.
Nothing is checkpointed to disk (process checkpoints need CRIU, which does not
work on this kernel; see issue 16).

A paused environment stays reserved with the provisioner, uncontrolled
(:meth:`Provisioner.pause`): the freezer keeps its memory resident, so its
memory limit (at most that is held) and its disk limit go on counting against
the node's admission and the memory the others may grow into; its CPU does not
(it uses none), and its quotas are not resized while paused.  So a node never
admits more than it could run were every paused environment resumed, and resume
admits nothing: it takes control again (:meth:`Provisioner.resume`), except for
an environment that was not provisioned (its reservation failed at a restart):
that one is reserved then (:class:`CapacityError` if the node is full: it stays
paused).
While paused, commands are refused (:class:`StateError`), files can be read
and written (the host reaches its root), and its timeout stands still: resume
sets it again (the given seconds, else the environment's ``timeout_s``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from weenv.errors import StateError
from weenv.node.cgroups import Cgroup, open_cgroups
from weenv.node.models import EnvironmentInfo
from weenv.node.provision import Provisioner
from weenv.node.table import Environment, check_timeout, save_info

log = logging.getLogger(__name__)

PAUSED = "paused"


class Pauses:
    """Pausing and resuming environments (see the module doc)."""

    def __init__(self, provisioner: Provisioner, open_cgroup: Callable[[str], Cgroup] = open_cgroups,
                 *, freeze_timeout: float = 10.0):  # fmt: skip
        self.provisioner = provisioner
        self.open_cgroup = open_cgroup
        self.freeze_timeout = freeze_timeout

    def pause(self, e: Environment) -> EnvironmentInfo:
        """Freeze ``e``; its info (``state: "paused"``).  Raises :class:`StateError`
        if it is paused already or not running, :class:`CgroupError` if it
        does not freeze in time (it is running again then)."""
        with e.lock:
            if e.info.state != "running":
                raise StateError(f"environment {e.info.id} is {e.info.state}, not running: cannot pause it")
            cg = self.open_cgroup(f"/{e.container_id}")
            self.provisioner.pause(e.info.id)  # thaws it if the provisioner had frozen it
            try:
                cg.freeze(timeout=self.freeze_timeout)
            except BaseException:
                self._provision(e)
                raise
            e.info.state = PAUSED  # the reaper passes it by (EnvironmentTable.expired)
            save_info(e.dir, e.info)
            return e.info

    def resume(self, e: Environment, timeout: float | None = None) -> EnvironmentInfo:
        """Thaw ``e``, reserved again with the provisioner, its timeout
        ``timeout`` seconds (default its ``timeout_s``) from now; its info.
        Raises :class:`StateError` if it is not paused, :class:`CapacityError`
        if it was not provisioned and the node cannot hold it now (it stays
        paused), :class:`InvalidInputError` for a bad timeout."""
        timeout = check_timeout(e.info.timeout_s if timeout is None else timeout)
        with e.lock:
            if e.info.state != PAUSED:
                raise StateError(f"environment {e.info.id} is {e.info.state}, not paused: cannot resume it")
            self.provisioner.resume(e.info.id, f"/{e.container_id}", e.info.resources, priority=e.info.priority)
            self.open_cgroup(f"/{e.container_id}").thaw()
            e.info.state = "running"
            e.info.timeout_s = timeout
            e.info.expires_at = time.time() + timeout
            save_info(e.dir, e.info)
            return e.info

    def thaw_for_destroy(self, e: Environment) -> None:
        """Thaw a paused ``e`` that is being destroyed (a frozen process dies
        only once thawed); errors are logged."""
        if e.info.state != PAUSED:
            return
        try:
            self.open_cgroup(f"/{e.container_id}").thaw()
        except Exception as exc:
            log.warning("cannot thaw paused environment %s to destroy it: %s", e.info.id, exc)

    def _provision(self, e: Environment) -> None:
        try:
            self.provisioner.resume(e.info.id, f"/{e.container_id}", e.info.resources, priority=e.info.priority)
        except Exception as exc:  # it runs anyway, with the limits it had
            log.warning("provisioning of environment %s after a failed pause failed: %s", e.info.id, exc)
            self.provisioner.detach(e.info.id)


def check_running(e: Environment) -> None:
    """Raise :class:`StateError` if ``e`` is paused (its commands would wait for a thaw)."""
    if e.info.state == PAUSED:
        raise StateError(f"environment {e.info.id} is paused: resume it first")
