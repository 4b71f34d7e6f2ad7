"""Freeing a byte range of a file without changing its size: fallocate(2)
with ``FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE`` (Linux; ext4, xfs, btrfs,
tmpfs).  Python's ``os`` has no fallocate with a mode, so libc's is called."""

from __future__ import annotations

import ctypes
import ctypes.util

FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)


def punch_hole(fd: int, offset: int, length: int) -> bool:
    """Free ``length`` bytes of ``fd`` at ``offset`` (they read back as
    zeros); whether the file system did (False where it cannot, e.g.
    EOPNOTSUPP: the bytes then stay allocated, nothing else changes)."""
    if length <= 0:
        return True
    return _libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length) == 0
