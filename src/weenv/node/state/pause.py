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

**Memory released** (:meth:`Pauses.release`; ``pause(release_memory=True)``,
or by the reaper once an environment has been paused :attr:`Pauses.release_after`
seconds, ``WEENV_PAUSE_RELEASE_S``; or at its timeout when it was created with
``on_timeout="pause"``): E2B's filesystem-only pause.  Its file system is kept
as it is (its upper dir stays on the node's disk, its overlay mounted, so the
files API still reaches it) and every process of it ends (its container is
deleted, with its cgroup: the memory goes back to the node).  It then counts
against the node's disk only (its disk limit held, :meth:`Provisioner.hold_disk`),
not against CPU and memory admission.  Resume reserves it again
(:class:`CapacityError` if the node is full now: it stays paused) and runs its
container again from its bundle: its first process starts anew over the same
files.  ``EnvironmentInfo.memory_released`` tells the two pauses apart.  A
node process killed meanwhile leaves it to the next one, which adopts it
paused without a container (:mod:`weenv.node.state.recovery`).  (Resume on another
node from a published snapshot: :mod:`weenv.node.state.handoff`.)

**A full disk.**  Each of these calls writes the state it leaves
(``env.json``) before the step it cannot undo (a freeze, a container deleted
or run anew; :func:`~weenv.node.table.staged_info`), and puts it in place
after: a node disk with no room refuses the call with :class:`DiskFullError`
(naming the environment, "no space left") before anything is done, and the
environment stays as it was (running, or paused).  Commands do not start
while a pause or resume freezes, ends or restarts the container (its
:class:`~weenv.node.table.Gate`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from weenv.api.models import EnvironmentInfo
from weenv.config import settings
from weenv.errors import StateError
from weenv.node.cgroups import Cgroup, open_cgroups
from weenv.node.provision import Provisioner
from weenv.node.table import Environment, check_timeout, staged_info

if TYPE_CHECKING:
    from weenv.node.runtime.commands import Commands
    from weenv.node.runtime.container import Containers
    from weenv.node.state.handoff import Handoffs

log = logging.getLogger(__name__)

PAUSED = "paused"


def release_after_from_env() -> float | None:
    """``WEENV_PAUSE_RELEASE_S``: seconds after which a paused environment's memory
    is released (a positive number), else None (never, unless asked)."""
    return settings().runtime.pause_release_s


class Pauses:
    """Pausing and resuming environments (see the module doc).  ``containers``
    and ``commands``: the node's, for the pause that releases memory (without
    them only the freezer's pause is served)."""

    def __init__(
        self,
        provisioner: Provisioner,
        open_cgroup: Callable[[str], Cgroup] = open_cgroups,
        *,
        freeze_timeout: float = 10.0,
        containers: Containers | None = None,
        commands: Commands | None = None,
        release_after: float | None = None,
        handoffs: Handoffs | None = None,
    ):
        self.provisioner = provisioner
        self.open_cgroup = open_cgroup
        self.freeze_timeout = freeze_timeout
        self.containers = containers
        self.commands = commands
        self.release_after = release_after
        """Seconds paused after which the reaper releases a paused environment's memory (None: never)."""
        self.handoffs = handoffs
        """Publishes a memory release to the store when enabled, so any node resumes it (:mod:`weenv.node.state.handoff`)."""

    def pause(self, e: Environment, *, release_memory: bool = False) -> EnvironmentInfo:
        """Freeze ``e`` (or with ``release_memory``, :meth:`release` it); its
        info (``state: "paused"``).  Raises :class:`StateError` if it is paused
        already or not running, :class:`CgroupError` if it does not freeze in
        time (it is running again then)."""
        if release_memory:
            return self.release(e)
        with e.lock:
            if e.info.state != "running":
                raise StateError(f"environment {e.info.id} is {e.info.state}, not running: cannot pause it")
            paused = e.info.model_copy(update={"state": PAUSED, "paused_at": time.time()})
            with staged_info(e.dir, paused):  # a full disk refuses here: it runs on, untouched
                cg = self.open_cgroup(f"/{e.container_id}")
                self.provisioner.pause(e.info.id)  # thaws it if the provisioner had frozen it
                try:
                    with e.gate.shut():  # no command half started in it while it freezes
                        cg.freeze(timeout=self.freeze_timeout)
                        # paused before the gate opens: a command waiting there is refused (check_running),
                        # not started in the frozen cgroup; the reaper passes it by (EnvironmentTable.expired)
                        _apply(e, paused)
                except BaseException:
                    self._provision(e)
                    raise
            return e.info

    def release(self, e: Environment) -> EnvironmentInfo:
        """Pause ``e`` releasing its memory (see the module doc): running, or
        paused by the freezer; its info (``state: "paused"``,
        ``memory_released``).  Raises :class:`StateError` if it is neither, or
        its memory is released already."""
        assert self.containers is not None and self.commands is not None, "Pauses without the node's containers"
        with e.lock:
            if e.info.state not in ("running", PAUSED) or e.info.memory_released:
                what = "paused with its memory released" if e.info.memory_released else e.info.state
                raise StateError(f"environment {e.info.id} is {what}: cannot release its memory")
            released = e.info.model_copy(
                update={
                    "state": PAUSED,
                    "memory_released": True,
                    "paused_at": e.info.paused_at if e.info.state == PAUSED else time.time(),
                }
            )
            # its state written before its container goes (a full disk refuses here: nothing is done),
            # in place once it went
            with staged_info(e.dir, released):
                self.provisioner.detach(e.info.id)  # its CPU and memory reservation goes
                self.thaw_for_destroy(e)
                with e.gate.shut():  # no command half started in the container going now
                    procs = self.commands.forget(e)
                    for p in procs:
                        p.log.abandon()
                    self.containers.delete(
                        e.info.id, e.dir, ahead=False
                    )  # every process ends; the files stay (and the container made ahead for a reset: it runs nothing)
                    _apply(e, released)  # commands are refused from here on (check_running)
                for p in procs:
                    p.wait(10)
                try:
                    self.provisioner.hold_disk(
                        _disk_key(e), e.info.resources.disk_bytes, f"paused environment {e.info.id}'s disk"
                    )
                except Exception as exc:  # it had that room a moment ago; counted or not, it stays paused
                    log.warning("cannot count paused environment %s's disk: %s", e.info.id, exc)
        if self.handoffs is not None and self.handoffs.enabled:
            try:  # no process writes its files now: what is published is what a resume here would find
                self.handoffs.publish(e)
            except Exception as exc:  # released all the same; it resumes on this node only
                log.warning("cannot publish paused environment %s to the store: %s", e.info.id, exc)
        return e.info

    def due(self, envs: list[Environment], now: float) -> list[Environment]:
        """Those of ``envs`` paused by the freezer for :attr:`release_after` seconds or more at ``now``."""
        if self.release_after is None:
            return []
        return [
            e
            for e in envs
            if e.info.state == PAUSED
            and not e.info.memory_released
            and e.info.paused_at is not None
            and now - e.info.paused_at >= self.release_after
        ]

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
            running = e.info.model_copy(
                update={
                    "state": "running",
                    "paused_at": None,
                    "memory_released": False,
                    "timeout_s": timeout,
                    "expires_at": time.time() + timeout,
                }
            )
            with staged_info(e.dir, running):  # a full disk refuses here: it stays paused, untouched
                with e.gate.shut():
                    released = e.info.memory_released
                    if released:
                        self._restart(e)
                    else:
                        self.provisioner.resume(
                            e.info.id, f"/{e.container_id}", e.info.resources, priority=e.info.priority
                        )
                        self.open_cgroup(f"/{e.container_id}").thaw()
                    _apply(e, running)
            if released and self.handoffs is not None and self.handoffs.enabled:
                self.handoffs.consumed(e.info.id)  # it runs again: its published pause is spent
            return e.info

    def _restart(self, e: Environment) -> None:
        """Reserve the memory-released ``e`` again and run its container from its
        bundle (under ``e.lock``).  Raises :class:`CapacityError` (it stays paused,
        its disk counted) or what the container's start raises (the same)."""
        self.provisioner.free_disk(_disk_key(e))
        try:
            self.provisioner.reserve(e.info.id, e.info.resources, priority=e.info.priority)
            try:
                self.containers.restart(e.info.id, e.dir)
            except BaseException:
                self.provisioner.detach(e.info.id)
                self.containers.delete(e.info.id, e.dir)
                raise
        except BaseException:
            self.provisioner.hold_disk(
                _disk_key(e), e.info.resources.disk_bytes, f"paused environment {e.info.id}'s disk"
            )
            raise
        try:
            self.provisioner.attach(e.info.id, f"/{e.container_id}")
        except Exception as exc:  # it runs anyway, with the limits its bundle gives
            log.warning("provisioning of environment %s after its resume failed: %s", e.info.id, exc)
            self.provisioner.detach(e.info.id)

    def forget(self, e: Environment) -> None:
        """``e`` is destroyed: stop counting its disk as a paused environment's."""
        self.provisioner.free_disk(_disk_key(e))

    def thaw_for_destroy(self, e: Environment) -> None:
        """Thaw a paused ``e`` that is being destroyed (a frozen process dies
        only once thawed); errors are logged."""
        if e.info.state != PAUSED or e.info.memory_released:
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


def _apply(e: Environment, info: EnvironmentInfo) -> None:
    """Set ``e``'s state fields (the lifecycle's) to ``info``'s, in place (its info object is shared)."""
    for name in ("state", "paused_at", "memory_released", "timeout_s", "expires_at"):
        setattr(e.info, name, getattr(info, name))


def disk_key(env_id: str) -> str:
    """The key under which a memory-released environment's disk is held (:meth:`Provisioner.hold_disk`)."""
    return f"paused-{env_id}"


def _disk_key(e: Environment) -> str:
    return disk_key(e.info.id)


def check_running(e: Environment) -> None:
    """Raise :class:`StateError` if ``e`` is paused (its commands would wait for a thaw)."""
    if e.info.state == PAUSED:
        raise StateError(f"environment {e.info.id} is paused: resume it first")
