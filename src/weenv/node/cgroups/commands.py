"""Command groups: one child cgroup per command, so a kill reaches all it started.

A command run in an environment can leave processes its own tree no longer
holds: a fork bomb whose first shell returned at once, a ``setsid``'d or
double-forked daemon.  They are reparented to the environment's init, so
neither the command's process group nor a walk of its descendants finds them.
Cgroup membership cannot be left that way: every fork inherits it and a
process inside an environment cannot write to cgroupfs (runc mounts it
read-only and drops ``CAP_SYS_ADMIN``).  So each command starts in a child of
the environment's cgroup, ``/weenv-<id>/cmd-<token>``, and killing the command
kills that group:

1. freeze it (v1 ``freezer.state``, v2 ``cgroup.freeze``) and wait until the
   kernel reports it frozen: no process of it can fork any more;
2. SIGKILL every process listed in ``cgroup.procs`` (but those the caller
   excludes: the exec agent's handler, which reports the command's exit);
3. thaw it: the killed processes die (a frozen task dies on thaw) and the
   environment's init reaps them.

The group lives only where it is needed: on cgroup v1 in the ``freezer``
hierarchy alone (the environment's cpu, memory and pids limits stay on its own
group, which the other hierarchies keep counting), on v2 in the unified
hierarchy without controllers of its own (so the environment's group, which
has processes, need not enable any in ``cgroup.subtree_control``); either way
every limit of the environment applies to it, hierarchically.  ``runc delete``
removes child groups with the environment's.
"""

from __future__ import annotations

import functools
import os
import secrets
import signal
import time
from pathlib import Path

from weenv.errors import NotFoundError
from weenv.node.cgroups import Cgroup, CgroupV1, CgroupV2, Layout, detect
from weenv.node.cgroups.base import _map

PREFIX = "cmd-"


@functools.cache
def host_layout() -> Layout:
    """This host's cgroup mounts, read once (a command group is made per command;
    /proc/self/mountinfo of a busy node is long)."""
    return detect()


def process_cgroup(pid: int, *, layout: Layout | None = None) -> str | None:
    """The cgroup host process ``pid`` is in, where command groups live (v1:
    the ``freezer`` hierarchy's path, v2: the unified one's), e.g.
    ``"/weenv-<id>.2"``; None when it is gone or not listed."""
    layout = layout or host_layout()
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _hid, controllers, path = line.split(":", 2)
        if (layout.version == 2 and controllers == "") or (layout.version == 1 and "freezer" in controllers.split(",")):
            return path
    return None


def same_environment(cgroup: str, expected: str) -> bool:
    """Whether ``cgroup`` is ``expected`` (an environment's ``"/weenv-<id>"`` or
    ``"/weenv-<id>.N"``) or another container cgroup of that environment
    (``"/weenv-<id>.M"``: a reset started a container made ahead)."""
    base = expected.split(".", 1)[0]
    return cgroup == base or (cgroup.startswith(base + ".") and "/" not in cgroup[len(base) :])


class CommandGroup:
    """The child cgroup ``parent/cmd-<token>`` of one command (``parent``: the
    environment's ``"/weenv-<id>"``).  Nothing is made until :meth:`create`."""

    def __init__(self, parent: str, *, layout: Layout | None = None, name: str | None = None):
        layout = layout or host_layout()
        path = f"{parent}/{name or PREFIX + secrets.token_hex(6)}"
        self.cgroup: Cgroup
        if layout.version == 2:
            if layout.v2 is None:
                raise NotFoundError("this host has no cgroup2 mount")
            self.cgroup = CgroupV2(path, layout.v2)
        else:
            if "freezer" not in layout.v1:
                raise NotFoundError("this host has no cgroup v1 freezer hierarchy")
            self.cgroup = CgroupV1(path, {"freezer": layout.v1["freezer"]})
        self.path = path

    @property
    def dir(self) -> Path:
        return self.cgroup.directories()[0]

    def create(self) -> None:
        """Make the group's directory (its parent must exist: :class:`NotFoundError` if not)."""
        try:
            self.dir.mkdir()
        except OSError as exc:
            raise _map(exc, self.dir) from exc

    def add(self, pid: int) -> None:
        """Move host process ``pid`` into the group (its later children are born in it)."""
        self.cgroup.add_process(pid)

    def pids(self) -> list[int]:
        """Host pids in the group; ``[]`` once it is gone."""
        try:
            return self.cgroup.procs()
        except NotFoundError:
            return []

    def kill(self, *, exclude: frozenset[int] = frozenset(), settle_s: float = 2.0) -> int:
        """SIGKILL every process of the group but ``exclude`` (frozen meanwhile,
        see the module doc) and wait up to ``settle_s`` seconds until only
        ``exclude`` is left; the number of processes signalled.  A group
        already gone is fine (0)."""
        try:
            self.cgroup.freeze(timeout=settle_s)
        except NotFoundError:
            return 0
        except Exception:  # it did not freeze in time (a task in D state): kill what is listed anyway
            pass
        killed = 0
        try:
            for pid in self.pids():
                if pid not in exclude:
                    try:
                        os.kill(pid, signal.SIGKILL)
                        killed += 1
                    except ProcessLookupError:
                        pass
        finally:
            try:
                self.cgroup.thaw()
            except NotFoundError:
                pass
        deadline = time.monotonic() + settle_s
        while any(p not in exclude for p in self.pids()) and time.monotonic() < deadline:
            time.sleep(0.002)
        return killed

    def remove(self) -> bool:
        """Remove the group if it has no process left; whether it is gone."""
        try:
            self.dir.rmdir()
        except FileNotFoundError:
            return True
        except OSError:  # EBUSY: processes remain
            return False
        return True
