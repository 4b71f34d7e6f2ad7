"""File access through a live process's root: the tree *with its mounts*, as that
process sees it (its mount namespace: ``/proc``, ``/dev``, ``/dev/shm``, bind
mounts), confined as :class:`~weenv.host.rootfs.RootFS` confines (openat2
``RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS`` from that root).

The root is ``/proc/PID/root`` opened anew for each call (no descriptor of it is
kept, so nothing holds the environment's mounts busy), and each opening is
checked against a pidfd taken when the object was made: a PID that was reused
after its process ended is refused (:class:`NotFoundError`), never followed.

What the process's mounts forbid (read-only ``/sys``, ``/proc/sys``) is forbidden
here too; on top, nothing is written into a kernel pseudo file system (procfs,
sysfs, cgroupfs): the host side holds every capability, the environment's
processes do not, so a write there (``/proc/PID/oom_score_adj``) could do more
than a process inside may.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import weakref
from typing import BinaryIO

from weenv.errors import InvalidInputError, NotFoundError
from weenv.host.rootfs import _DIR, RootFS, _libc

PSEUDO_FS = {0x9FA0: "procfs", 0x62656572: "sysfs", 0x63677270: "cgroup2", 0x27E0EB: "cgroup"}
"""statfs(2) ``f_type`` of the file systems nothing is written into (linux/magic.h)."""


def fs_type(fd: int) -> int:
    """``f_type`` of the file system holding the open file ``fd`` (fstatfs(2))."""
    buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux
    if _libc.fstatfs(ctypes.c_int(fd), buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF


class ProcessRootFS(RootFS):
    """:class:`RootFS` over the root of the live process ``pid`` (see the module
    docstring).  ``expect_cgroup``: the process's cgroup v2 path must be it or
    below it (e.g. ``/weenv-<id>``), checked once, after its pidfd is taken, so
    the pidfd is known to be the environment's process.  Raises
    :class:`NotFoundError` when the process is gone or is another one."""

    def __init__(self, pid: int, *, expect_cgroup: str | None = None):
        super().__init__(f"/proc/{pid}/root")
        try:
            self._pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            raise NotFoundError(f"process {pid} is gone") from None
        weakref.finalize(self, os.close, self._pidfd)
        if expect_cgroup is not None and not _in_cgroup(pid, expect_cgroup):
            raise NotFoundError(f"process {pid} is not in cgroup {expect_cgroup}")
        os.close(self._root_fd())  # the root opens (and the process still lives)

    def _root_fd(self) -> int:
        try:
            fd = os.open(self.root, _DIR | os.O_CLOEXEC)
        except (FileNotFoundError, ProcessLookupError):
            raise NotFoundError(f"the process of {self.root} is gone") from None
        if not _alive(self._pidfd):  # opened after it ended: the PID may be another process's now
            os.close(fd)
            raise NotFoundError(f"the process of {self.root} is gone")
        return fd

    def open_write(self, path: str, mode: int = 0o644, *, make_parents: bool = True,
                   owner: tuple[int, int] | None = None) -> BinaryIO:  # fmt: skip
        f = super().open_write(path, mode, make_parents=make_parents, owner=owner)
        kind = PSEUDO_FS.get(fs_type(f.fileno()))
        if kind is not None:  # opened (O_TRUNC does nothing there), nothing written yet
            f.close()
            raise InvalidInputError(f"{path}: on {kind}, which files are not written into from outside")
        return f


def _alive(pidfd: int) -> bool:
    p = select.poll()
    p.register(pidfd, select.POLLIN)  # readable once the process exited
    return not p.poll(0)


def _in_cgroup(pid: int, cgroup: str) -> bool:
    with contextlib.suppress(OSError):
        with open(f"/proc/{pid}/cgroup") as f:
            for line in f:
                if line.startswith("0::"):
                    path = line[3:].rstrip("\n")
                    return path == cgroup or path.startswith(cgroup.rstrip("/") + "/")
    return False
