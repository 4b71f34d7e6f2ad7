"""Cgroups behind one interface: :func:`open_cgroups` picks v1 or v2 for this host.

Detection reads ``/proc/self/mountinfo`` as runc does (libcontainer
``cgroups.IsCgroup2UnifiedMode`` / hybrid handling): a cgroup2 file system
mounted at ``/sys/fs/cgroup`` is a pure v2 host; otherwise, if v1 hierarchies
carry the controllers (``cgroup`` mounts with ``cpu``, ``memory``... in their
super options), they are used, the cgroup2 mount of a hybrid host
(``/sys/fs/cgroup/unified``) holding no controller weenv needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from weenv.errors import NotFoundError
from weenv.node.cgroups.base import (
    CPU_PERIOD_US,
    Cgroup,
    CgroupError,
    LimitRefusedError,
    Limits,
    Pressure,
    Usage,
)
from weenv.node.cgroups.v1 import CgroupV1
from weenv.node.cgroups.v2 import CgroupV2

CGROUP_ROOT = "/sys/fs/cgroup"


@dataclass(frozen=True)
class Layout:
    """Where the cgroup hierarchies are mounted."""

    v1: dict[str, Path] = field(default_factory=dict)
    """Controller -> mount point of its v1 hierarchy."""
    v2: Path | None = None
    """The cgroup2 mount point, if any."""

    @property
    def version(self) -> int:
        """2 on a pure v2 host (cgroup2 at ``/sys/fs/cgroup``) or when no v1
        hierarchy carries the memory controller; else 1."""
        if self.v2 is not None and (str(self.v2) == CGROUP_ROOT or "memory" not in self.v1):
            return 2
        return 1


def parse_mountinfo(text: str) -> Layout:
    """The cgroup mounts of a ``/proc/PID/mountinfo`` text (``proc(5)``).  Only
    mounts of a hierarchy's root (field 4 is ``/``) count."""
    v1: dict[str, Path] = {}
    v2: Path | None = None
    for line in text.splitlines():
        pre, sep, post = line.partition(" - ")
        if not sep:
            continue
        fields, tail = pre.split(), post.split()
        if len(fields) < 5 or len(tail) < 3 or fields[3] != "/":
            continue
        point = Path(fields[4].replace("\\040", " "))
        fstype, super_opts = tail[0], tail[2].split(",")
        if fstype == "cgroup2":
            if v2 is None or str(point) == CGROUP_ROOT:
                v2 = point
        elif fstype == "cgroup":
            for opt in super_opts:
                if opt in Cgroup.CONTROLLERS and opt not in v1:
                    v1[opt] = point
    return Layout(v1=v1, v2=v2)


def detect(mountinfo: Path = Path("/proc/self/mountinfo")) -> Layout:
    return parse_mountinfo(mountinfo.read_text())


def open_cgroups(path: str, *, layout: Layout | None = None, version: int | None = None) -> Cgroup:
    """The cgroup ``path`` (``"/weenv-<id>"``, runc's ``linux.cgroupsPath``) on
    this host, v1 or v2 by :class:`Layout` (detected when not given).
    ``version`` forces a backend.  Raises :class:`NotFoundError` when the host
    has no hierarchy of that version, :class:`InvalidInputError` for a bad path."""
    layout = layout or detect()
    version = version or layout.version
    if version == 2:
        if layout.v2 is None:
            raise NotFoundError("this host has no cgroup2 mount")
        return CgroupV2(path, layout.v2)
    if not layout.v1:
        raise NotFoundError("this host has no cgroup v1 hierarchy")
    return CgroupV1(path, layout.v1)


def environment_dirs(env_id: str) -> list[Path]:
    """Every cgroup directory of environment ``env_id``'s containers on this host
    (``weenv-<id>`` and ``weenv-<id>.N``, the containers a reset made ahead), in
    any hierarchy, named ones (``systemd``, ``unified``) too: where runc made them."""
    import glob

    if not env_id or "/" in env_id or "*" in env_id:
        return []
    return [
        Path(c)
        for name in (glob.escape(env_id), glob.escape(env_id) + ".*")
        for c in glob.glob(f"{CGROUP_ROOT}/*/weenv-{name}") + glob.glob(f"{CGROUP_ROOT}/weenv-{name}")
    ]


def remove_environment_dirs(env_id: str) -> list[str]:
    """Remove the cgroup directories of ``env_id`` (:func:`environment_dirs`) that
    have no task left: those a create killed between ``runc create`` making
    them and runc recording its container leaves, which ``runc delete`` does not
    know.  Returns the ones that could not be removed (still in use), with why."""
    failed = []
    for d in environment_dirs(env_id):
        try:
            d.rmdir()
        except FileNotFoundError:
            continue
        except OSError as exc:
            failed.append(f"{d}: {exc.strerror}")
    return failed


__all__ = [
    "environment_dirs",
    "remove_environment_dirs",
    "CPU_PERIOD_US",
    "Cgroup",
    "CgroupError",
    "CgroupV1",
    "CgroupV2",
    "Layout",
    "LimitRefusedError",
    "Limits",
    "Pressure",
    "Usage",
    "detect",
    "open_cgroups",
    "parse_mountinfo",
]
