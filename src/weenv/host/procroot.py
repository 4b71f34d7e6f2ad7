"""File access through a live process's root: the tree *with its mounts*, as that
process sees it (its mount namespace: ``/proc``, ``/dev``, ``/dev/shm``, bind
mounts), confined as :class:`~weenv.host.rootfs.RootFS` confines (openat2
``RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS`` from that root).

The root is ``/proc/PID/root`` opened anew for each call (no descriptor of it is
kept, so nothing holds the environment's mounts busy), and each opening is
checked against a pidfd taken when the object was made: a PID that was reused
after its process ended is refused (:class:`NotFoundError`), never followed.

What the process's mounts forbid (read-only ``/sys``, ``/proc/sys``) is forbidden
here too; on top, a file is read or written only when it lies on a file system
that holds files' content (:data:`CONTENT_FS`: overlayfs, tmpfs, ext4, xfs,
btrfs, erofs, FUSE, NFS...), checked on the ``O_PATH`` descriptor of the final
target (``fstatfs(2)``'s ``f_type``), after every symbolic link is followed
and before the file is opened for reading or writing.  Nothing is read from or
written into a kernel pseudo file system (procfs, sysfs, cgroupfs, debugfs,
tracefs, securityfs, bpf, devpts, mqueue...): the host side holds every
capability, the environment's processes do not, so a symbolic link planted
inside (``/tmp/k -> /proc/kallsyms``, ``-> /proc/kmsg``, which blocks) would
otherwise read kernel addresses or the host's kernel log as root, and a write
there (``/proc/PID/oom_score_adj``) could do more than a process inside may.
An allowlist, not a denylist: a pseudo file system the kernel adds later is
refused too.  Such a path raises :class:`~weenv.errors.PseudoFileError` naming
the kind (listing and stat of those directories stay allowed: they read no
content); a caller that must read such a file has a process inside the
environment read it, with that process's rights (E2B's files API does).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import posixpath
import select
import weakref
from typing import BinaryIO

from weenv.errors import InvalidInputError, NotFoundError, PseudoFileError
from weenv.host.rootfs import _DIR, RootFS, _libc

CONTENT_FS = {
    0x794C7630: "overlayfs",
    0x01021994: "tmpfs",
    0x858458F6: "ramfs",
    0xEF53: "ext4",
    0x58465342: "xfs",
    0x9123683E: "btrfs",
    0xE0F5E1E2: "erofs",
    0x73717368: "squashfs",
    0x65735546: "fuse",
    0x6969: "nfs",
    0xFF534D42: "cifs",
    0xFE534D42: "smb2",
    0x01021997: "9p",
    0x2FC12FC1: "zfs",
    0xF2F52010: "f2fs",
    0x00C36400: "ceph",
    0xCA451A4E: "bcachefs",
    0x4D44: "vfat",
    0x2011BAB0: "exfat",
    0x9660: "iso9660",
}
"""statfs(2) ``f_type`` (linux/magic.h) of the file systems whose files are read
and written through a process's root: those holding files' content."""
PSEUDO_FS = {
    0x9FA0: "procfs",
    0x62656572: "sysfs",
    0x63677270: "cgroup2",
    0x27E0EB: "cgroup",
    0x64626720: "debugfs",
    0x74726163: "tracefs",
    0x73636673: "securityfs",
    0xCAFE4A11: "bpf",
    0x1CD1: "devpts",
    0x19800202: "mqueue",
    0x6165676C: "pstore",
    0x62656570: "configfs",
    0xDE5E81E4: "efivarfs",
    0xF97CFF8C: "selinuxfs",
    0x42494E4D: "binfmt_misc",
    0x65735543: "fusectl",
    0x6E736673: "nsfs",
}
"""Names of kernel pseudo file systems' ``f_type``, for the error message (any kind not in
:data:`CONTENT_FS` is refused, named or not)."""


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

    def __init__(self, pid: int, *, expect_cgroup: str | None = None, shift: int = 0):
        super().__init__(f"/proc/{pid}/root", shift)
        self._pidfd = pin_process(pid, expect_cgroup=expect_cgroup)
        weakref.finalize(self, os.close, self._pidfd)
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

    def _require_file(self, fd: int, path: str) -> None:
        """Also refuse a final target outside :data:`CONTENT_FS` (``fd``: its
        ``O_PATH`` descriptor, not opened for reading or writing yet)."""
        super()._require_file(fd, path)
        _require_content_fs(fd, path)

    def on_pseudo_fs(self, path: str) -> bool:
        """Whether ``path``, or the deepest of its parents that resolves from
        here, lies on a file system outside :data:`CONTENT_FS`: a path of the
        process's ``/proc`` that only exists for processes inside (``/proc/self``)
        resolves nowhere from outside, though its ``/proc`` is procfs."""
        while True:
            try:
                with self._open(path, os.O_PATH) as fd:
                    return fs_type(fd) not in CONTENT_FS
            except (NotFoundError, InvalidInputError):
                if path in ("/", ""):
                    return False
                path = posixpath.dirname(path.rstrip("/")) or "/"

    def open_write(self, path: str, mode: int = 0o644, **options) -> BinaryIO:
        """:meth:`RootFS.open_write` (``options``: its keywords), the file checked to lie on a content file system."""
        f = super().open_write(path, mode, **options)
        try:  # a file this call created was checked by no _require_file: it is empty, nothing written yet
            _require_content_fs(f.fileno(), path)
        except BaseException:
            f.close()
            raise
        return f


def _require_content_fs(fd: int, path: str) -> None:
    """Raise :class:`PseudoFileError` unless the open file ``fd`` lies on one of :data:`CONTENT_FS`."""
    magic = fs_type(fd)
    if magic not in CONTENT_FS:
        kind = PSEUDO_FS.get(magic, f"a file system of type {magic:#x}")
        raise PseudoFileError(
            f"{path}: on {kind}, which is not a file system of files' content: "
            "its files are not read or written from outside the environment",
            kind,
        )


def pin_process(pid: int, *, expect_cgroup: str | None = None) -> int:
    """A pidfd of the live process ``pid`` (the caller closes it): it names that
    very process for as long as it is open, whatever process gets the number
    later (``setns(pidfd, ...)`` joins its namespaces, or fails with ``ESRCH``
    once it ended).  ``expect_cgroup``: its cgroup v2 path must be it or below
    it, checked after the pidfd is taken, so the pidfd is known to be that
    cgroup's process.  Raises :class:`NotFoundError` when it is gone or is another."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        raise NotFoundError(f"process {pid} is gone") from None
    if expect_cgroup is not None and not _in_cgroup(pid, expect_cgroup):
        os.close(pidfd)
        raise NotFoundError(f"process {pid} is not in cgroup {expect_cgroup}")
    return pidfd


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
