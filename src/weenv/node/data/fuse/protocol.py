"""The FUSE kernel protocol, as far as a read-only file system needs it.

Message layouts and numbers from the kernel's ``include/uapi/linux/fuse.h``
(protocol 7.x; Debian 12's headers predate some of these, so they are spelled
out here).  Every request read from ``/dev/fuse`` starts with a
:data:`IN_HEADER` (40 bytes); every reply written is one :data:`OUT_HEADER`
(16 bytes) followed by the operation's payload, in one write(2).  A
*notification* is a reply with ``unique`` 0 and the notify code in ``error``.
"""

from __future__ import annotations

import struct

KERNEL_VERSION = 7
KERNEL_MINOR = 31
"""The minor version weenv answers INIT with (if the kernel's is lower, the kernel's).
7.31 has every message below in its current size (``fuse_init_out`` of 64
bytes, ``max_pages``)."""

ROOT_ID = 1

# --- opcodes (enum fuse_opcode) --------------------------------------------------------
LOOKUP = 1
FORGET = 2
GETATTR = 3
OPEN = 14
READ = 15
STATFS = 17
RELEASE = 18
FLUSH = 25
INIT = 26
OPENDIR = 27
READDIR = 28
RELEASEDIR = 29
ACCESS = 34
INTERRUPT = 36
DESTROY = 38
BATCH_FORGET = 42

NO_REPLY = frozenset({FORGET, BATCH_FORGET, INTERRUPT})
"""Requests the kernel expects no reply to (an INTERRUPT may be answered with
EAGAIN; weenv lets the interrupted request finish instead)."""

# --- INIT flags ------------------------------------------------------------------------
ASYNC_READ = 1 << 0
BIG_WRITES = 1 << 5
ASYNC_DIO = 1 << 15
PARALLEL_DIROPS = 1 << 18
ABORT_ERROR = 1 << 21
MAX_PAGES = 1 << 22
INIT_EXT = 1 << 30

# --- open reply flags (FOPEN_*) --------------------------------------------------------
FOPEN_DIRECT_IO = 1 << 0
FOPEN_KEEP_CACHE = 1 << 1

# --- notifications (enum fuse_notify_code) ---------------------------------------------
NOTIFY_INVAL_INODE = 2
"""Drop an inode's cached pages (and attributes) in the kernel: ``fuse_notify_inval_inode_out``."""
NOTIFY_INVAL_INODE_OUT = struct.Struct("<Qqq")
"""fuse_notify_inval_inode_out: ino, off, len (``len`` <= 0: to the end)."""
NOTIFY_RESEND = 7
"""Linux >= 6.9: every request the server has read but not answered goes back to
the pending queue, to be read again (its ``unique`` then has :data:`UNIQUE_RESEND` set)."""
UNIQUE_RESEND = 1 << 63

# --- messages --------------------------------------------------------------------------
IN_HEADER = struct.Struct("<IIQQIIIHH")
"""fuse_in_header: len, opcode, unique, nodeid, uid, gid, pid, total_extlen, padding."""
OUT_HEADER = struct.Struct("<IiQ")
"""fuse_out_header: len, error (a negative errno, or a notify code), unique."""
INIT_IN = struct.Struct("<IIII")
"""fuse_init_in (its first 16 bytes): major, minor, max_readahead, flags."""
INIT_OUT = struct.Struct("<IIIIHHIIHHI28x")
"""fuse_init_out (64 bytes): major, minor, max_readahead, flags, max_background,
congestion_threshold, max_write, time_gran, max_pages, map_alignment, flags2."""
ATTR = struct.Struct("<QQQQQQIIIIIIIIII")
"""fuse_attr (88 bytes): ino, size, blocks, atime, mtime, ctime, atimensec,
mtimensec, ctimensec, mode, nlink, uid, gid, rdev, blksize, flags."""
ENTRY_OUT = struct.Struct("<QQQQII")
"""fuse_entry_out before its fuse_attr: nodeid, generation, entry_valid,
attr_valid, entry_valid_nsec, attr_valid_nsec."""
ATTR_OUT = struct.Struct("<QII")
"""fuse_attr_out before its fuse_attr: attr_valid, attr_valid_nsec, dummy."""
OPEN_OUT = struct.Struct("<QIi")
"""fuse_open_out: fh, open_flags, backing_id."""
OPEN_IN = struct.Struct("<II")
"""fuse_open_in: flags, open_flags."""
READ_IN = struct.Struct("<QQIIQII")
"""fuse_read_in: fh, offset, size, read_flags, lock_owner, flags, padding."""
DIRENT = struct.Struct("<QQII")
"""fuse_dirent before its name: ino, off (the cookie of the next entry), namelen, type."""
KSTATFS = struct.Struct("<QQQQQIIII24x")
"""fuse_kstatfs (80 bytes): blocks, bfree, bavail, files, ffree, bsize, namelen, frsize, padding."""

DT_DIR = 4
DT_REG = 8

MIN_READ_BUFFER = 8192


def reply(unique: int, payload: bytes = b"", error: int = 0) -> list[bytes]:
    """The buffers of one reply (``error``: a positive errno, 0 for success)."""
    if error:
        return [OUT_HEADER.pack(OUT_HEADER.size, -error, unique)]
    return [OUT_HEADER.pack(OUT_HEADER.size + len(payload), 0, unique), payload]


def notify_resend() -> bytes:
    return OUT_HEADER.pack(OUT_HEADER.size, NOTIFY_RESEND, 0)


def notify_inval_inode(ino: int, offset: int = 0, length: int = 0) -> list[bytes]:
    """The buffers of ``FUSE_NOTIFY_INVAL_INODE`` for ``ino``'s pages from
    ``offset`` (``length`` 0: to the end)."""
    body = NOTIFY_INVAL_INODE_OUT.pack(ino, offset, length)
    return [OUT_HEADER.pack(OUT_HEADER.size + len(body), NOTIFY_INVAL_INODE, 0), body]


def dirent(ino: int, next_off: int, name: bytes, dtype: int) -> bytes:
    """One fuse_dirent, padded to 8 bytes (FUSE_DIRENT_ALIGN)."""
    entry = DIRENT.pack(ino, next_off, len(name), dtype) + name
    return entry + b"\0" * (-len(entry) % 8)
