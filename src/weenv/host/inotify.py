"""inotify(7) through libc: one instance, its watches and its event records.

Python's standard library has no inotify; this is the small Linux-only edge
(ctypes over ``inotify_init1``, ``inotify_add_watch``, ``inotify_rm_watch``)
that :mod:`weenv.server.e2b.watch` builds on.  A watch is set on an open
descriptor's ``/proc/self/fd/N`` (the caller resolved the path, confined, and
opened it), so what is watched is that very inode, never a path looked up
again from the host.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
from dataclasses import dataclass

from weenv.errors import CapacityError, InvalidInputError, NotFoundError

IN_ACCESS, IN_MODIFY, IN_ATTRIB, IN_CLOSE_WRITE = 0x1, 0x2, 0x4, 0x8
IN_MOVED_FROM, IN_MOVED_TO, IN_CREATE, IN_DELETE = 0x40, 0x80, 0x100, 0x200
IN_DELETE_SELF, IN_MOVE_SELF = 0x400, 0x800
IN_UNMOUNT, IN_Q_OVERFLOW, IN_IGNORED = 0x2000, 0x4000, 0x8000
IN_ONLYDIR, IN_ISDIR = 0x01000000, 0x40000000
IN_NONBLOCK, IN_CLOEXEC = os.O_NONBLOCK, os.O_CLOEXEC

_HEADER = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len (then the name)
READ_SIZE = 64 << 10
"""Bytes of event records read at once (each is 16 bytes plus its name, at most 272)."""

_libc = ctypes.CDLL(None, use_errno=True)


@dataclass(frozen=True)
class Event:
    """One inotify record: the watch it came from, its mask bits, the rename
    ``cookie`` pairing a MOVED_FROM with its MOVED_TO, the entry's ``name``
    in the watched directory (``""`` for the directory itself)."""

    wd: int
    mask: int
    cookie: int
    name: str


class Inotify:
    """One inotify instance (non-blocking, close-on-exec); :meth:`fileno` polls
    readable when events wait.  Raises :class:`CapacityError` when the host's
    ``fs.inotify.max_user_instances`` is reached."""

    def __init__(self) -> None:
        fd = _libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            if err in (errno.EMFILE, errno.ENFILE, errno.ENOMEM):
                raise CapacityError(f"cannot make an inotify instance: {os.strerror(err)}")
            raise OSError(err, os.strerror(err))
        self.fd = fd

    def fileno(self) -> int:
        return self.fd

    def add(self, fd: int, mask: int) -> int:
        """Watch the file open as ``fd`` for ``mask``; its watch descriptor (the
        same one again for an inode already watched: its mask is replaced).
        Raises :class:`CapacityError` at the host's ``max_user_watches``,
        :class:`NotFoundError` when it is gone, :class:`InvalidInputError` when
        it is not a directory and ``mask`` has ``IN_ONLYDIR``."""
        wd = _libc.inotify_add_watch(self.fd, f"/proc/self/fd/{fd}".encode(), ctypes.c_uint32(mask))
        if wd >= 0:
            return wd
        err = ctypes.get_errno()
        if err == errno.ENOSPC:
            raise CapacityError("the host's inotify watches are used up (fs.inotify.max_user_watches)")
        if err == errno.ENOENT:
            raise NotFoundError("the directory to watch is gone")
        if err == errno.ENOTDIR:
            raise InvalidInputError("not a directory")
        raise OSError(err, os.strerror(err))

    def remove(self, wd: int) -> None:
        """Stop watch ``wd`` (its IN_IGNORED record follows); one already gone is fine."""
        _libc.inotify_rm_watch(self.fd, ctypes.c_int(wd))

    def read(self) -> list[Event]:
        """The records waiting now (``[]`` if none)."""
        try:
            data = os.read(self.fd, READ_SIZE)
        except BlockingIOError:
            return []
        out, off = [], 0
        while off + _HEADER.size <= len(data):
            wd, mask, cookie, size = _HEADER.unpack_from(data, off)
            raw = data[off + _HEADER.size : off + _HEADER.size + size].split(b"\0", 1)[0]
            out.append(Event(wd, mask, cookie, os.fsdecode(raw)))
            off += _HEADER.size + size
        return out

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
