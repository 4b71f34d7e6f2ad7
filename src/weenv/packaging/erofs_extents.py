"""Where each regular file's data lies in an EROFS image, and the files a
prefetch profile's chunks hold (issue 18: startup files together).

Read from the kernel's on-disk format (``Documentation/filesystems/erofs.rst``,
``fs/erofs/erofs_fs.h``): superblock at byte 1024 (``root_nid`` at +14,
``meta_blkaddr`` at +40), inodes at ``meta_blkaddr * 4096 + nid * 32``
(compact: 32 bytes, extended: 64; layout in ``i_format`` bits 1..3), inline
xattrs of ``12 + 4 * (icount - 1)`` bytes after the inode, directory blocks
of 12-byte dirents (nid, nameoff, file type) followed by their names.
Uncompressed layouts only (``FLAT_PLAIN``, ``FLAT_INLINE``, ``CHUNK_BASED``):
what weenv's writer and ``mkfs.erofs`` without ``-z`` write.
"""

from __future__ import annotations

import bisect
import os
import stat
import struct
from collections.abc import Callable, Iterable

from weenv.errors import InvalidInputError
from weenv.packaging.erofs_writer import (
    BLOCK,
    LAYOUT_CHUNK_BASED,
    LAYOUT_FLAT_INLINE,
    LAYOUT_FLAT_PLAIN,
    MAGIC,
    NULL_ADDR,
)

_CHUNK_INDEXES = 0x20  # EROFS_CHUNK_FORMAT_INDEXES (erofs_fs.h): chunk indexes rather than a block map
MAX_DEPTH = 4096

Extent = tuple[int, int]
"""``(start, end)`` byte offsets of file data in the image (end exclusive)."""


def file_extents(read_at: Callable[[int, int], bytes]) -> dict[str, list[Extent]]:
    """Every regular file's data extents in the image ``read_at(offset, n)``
    reads, by path (``/a/b``; a hardlinked file under its first path in
    name order, breadth first).  Inline tails (in the metadata area) are not
    data extents.  Raises :class:`InvalidInputError` for an image that is not
    an uncompressed EROFS image."""
    sb = read_at(1024, 128)
    if len(sb) < 64 or struct.unpack_from("<I", sb, 0)[0] != MAGIC or sb[12] != 12:
        raise InvalidInputError("not an EROFS image with 4 KiB blocks")
    root_nid = struct.unpack_from("<H", sb, 14)[0]
    meta = struct.unpack_from("<I", sb, 40)[0] * BLOCK
    out: dict[str, list[Extent]] = {}
    seen = {root_nid}
    queue = [(root_nid, "")]
    while queue:
        nid, path = queue.pop(0)
        mode, size, layout, extents, tail = _inode(read_at, meta, nid)
        if not stat.S_ISDIR(mode):
            continue
        data = b"".join(read_at(s, e - s) for s, e in extents) + tail
        for name, child, ftype in _dirents(data[:size]):
            if name in (b".", b"..") or child in seen:
                continue
            seen.add(child)
            child_path = path + "/" + os.fsdecode(name)
            if ftype == 2:
                queue.append((child, child_path))
            elif ftype == 1:
                cmode, _s, _l, cext, _t = _inode(read_at, meta, child)
                if stat.S_ISREG(cmode):
                    out[child_path] = cext
    return out


def _inode(read_at, meta: int, nid: int) -> tuple[int, int, int, list[Extent], bytes]:
    """``(mode, size, layout, data extents, inline tail)`` of inode ``nid``."""
    at = meta + nid * 32
    head = read_at(at, 64)
    fmt, icount, mode = struct.unpack_from("<HHH", head, 0)
    extended = fmt & 1
    layout = (fmt >> 1) & 7
    size = struct.unpack_from("<Q" if extended else "<I", head, 8)[0]
    i_u = struct.unpack_from("<I", head, 16)[0]
    body = at + (64 if extended else 32) + (12 + 4 * (icount - 1) if icount else 0)
    if layout == LAYOUT_FLAT_PLAIN:
        return mode, size, layout, _merge([(i_u * BLOCK, i_u * BLOCK + size)] if size else []), b""
    if layout == LAYOUT_FLAT_INLINE:
        full = size - size % BLOCK
        return mode, size, layout, [(i_u * BLOCK, i_u * BLOCK + full)] if full else [], read_at(body, size - full)
    if layout == LAYOUT_CHUNK_BASED:
        cfmt = i_u & 0xFFFF
        chunk = BLOCK << (cfmt & 0x1F)
        count = -(-size // chunk)
        if cfmt & _CHUNK_INDEXES:
            body += -(body - meta) % 8
            raw = read_at(body, 8 * count)
            addrs = [struct.unpack_from("<I", raw, 8 * i + 4)[0] for i in range(count)]
        else:
            addrs = list(struct.unpack(f"<{count}I", read_at(body, 4 * count)))
        ext = [(a * BLOCK, a * BLOCK + min(chunk, size - i * chunk)) for i, a in enumerate(addrs) if a != NULL_ADDR]
        return mode, size, layout, _merge(ext), b""
    raise InvalidInputError(f"inode {nid}: layout {layout} is compressed or unknown (uncompressed images only)")


def _merge(extents: list[Extent]) -> list[Extent]:
    out: list[Extent] = []
    for s, e in extents:
        if out and out[-1][1] == s:
            out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


def _dirents(data: bytes):
    """``(name, nid, file type)`` of each dirent in a directory's bytes."""
    for base in range(0, len(data), BLOCK):
        blk = data[base : base + BLOCK]
        if len(blk) < 12:
            return
        count = struct.unpack_from("<H", blk, 8)[0] // 12
        ents = [struct.unpack_from("<QHBB", blk, 12 * i) for i in range(count)]
        for i, (nid, nameoff, ftype, _r) in enumerate(ents):
            end = ents[i + 1][1] if i + 1 < count else len(blk)
            yield blk[nameoff:end].rstrip(b"\0"), nid, ftype


def files_in_chunks(extents: dict[str, list[Extent]], chunks: Iterable[int], chunk_size: int) -> list[str]:
    """The files whose data a profile's chunk reads touched, in access order:
    chunk by chunk in ``chunks`` order (chunk indices of one group), within a
    chunk by offset; each file once."""
    by_chunk: dict[int, list[tuple[int, str]]] = {}
    for path, ext in extents.items():
        for s, e in ext:
            for c in range(s // chunk_size, (e - 1) // chunk_size + 1):
                by_chunk.setdefault(c, []).append((max(s, c * chunk_size), path))
    order, seen = [], set()
    for c in chunks:
        for _off, path in sorted(by_chunk.get(c, ())):
            if path not in seen:
                seen.add(path)
                order.append(path)
    return order


def files_in_ranges(extents: dict[str, list[Extent]], ranges: Iterable[tuple[int, int]]) -> list[str]:
    """The files whose data the reads ``ranges`` (``(offset, bytes)`` of one
    group's image, in order) overlap, in the order first touched (within a
    read by offset); each file once."""
    starts = sorted((s, e, path) for path, ext in extents.items() for s, e in ext)
    keys = [s for s, _e, _p in starts]
    order, seen = [], set()
    for off, n in ranges:
        end = off + n
        i = max(0, bisect.bisect_right(keys, off) - 1)
        while i < len(starts) and starts[i][0] < end:
            s, e, path = starts[i]
            if e > off and path not in seen:
                seen.add(path)
                order.append(path)
            i += 1
    return order
