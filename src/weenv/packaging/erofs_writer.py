"""weenv's own EROFS image writer (uncompressed), from the kernel's on-disk format.

Written from ``Documentation/filesystems/erofs.rst`` and ``fs/erofs/erofs_fs.h``
of Linux; the kernel stays the only reader (file-backed EROFS mounts).  Why our
own and not mkfs.erofs: Debian 12 ships erofs-utils 1.5, which cannot store a
file name of 255 bytes (NAME_MAX, allowed by Linux and Docker); no newer
erofs-utils installs on Debian 12 (not in bookworm-backports; trixie's 1.8.6
needs libc6 >= 2.38).  Owning the writer also lets one read OCI layer tar
streams straight into an image and lay files out in a chosen order.

The image (block size 4 KiB)::

    block 0          superblock at byte 1024 (128 bytes)
    blocks 1..D      data: regular files' blocks (in :attr:`Tree` order),
                     then directories' and long symlinks' full blocks
    blocks D+1..     metadata (``meta_blkaddr``): every inode, extended
                     form (64 bytes: 64-bit size, 32-bit uid/gid, mtime in ns),
                     its inline xattrs, then either its inline tail (directory
                     blocks, symlink targets, small files: ``FLAT_INLINE``),
                     nothing (other files without holes: ``FLAT_PLAIN``, one
                     contiguous run of blocks), or a 4-byte block map per 4 KiB
                     (sparse files: ``CHUNK_BASED``, the source's holes are
                     holes, so sparse and > 4 GiB files cost only their data)

Why files without holes are never ``CHUNK_BASED`` (issue 18): the kernel maps
each block of a chunk-based file through its block map, a metadata read of the
backing file inside the page fault.  In a memory cgroup at its limit with the
OOM killer disabled (cgroup v1 ``oom_kill_disable``: weenv's elastic
provisioner waits for tasks there), only the fault's own page can wait; that
nested read's charge fails instead, the kernel logs "readahead error at folio N @
nid M" (seen on ``libc.so.6``) and the process dies of SIGBUS.  A
``FLAT_PLAIN`` file's blocks are found by arithmetic, as in mkfs.erofs images.
The read of the data itself is the same nested allocation for every image,
mkfs.erofs's too (SIGBUS in 7 of 20 runs at such a limit, with no kernel
message); with the ``directio`` mount option the same runs gave none in 20
(weenv mounts group images so: :mod:`weenv.host.mounts`).
Zero blocks inside data are stored as data (only a source's holes are holes).

Everything is deterministic: the same tree (names, contents, modes, owners,
mtimes, xattrs, hardlinks) and UUID give the same bytes.  Directory entries
are sorted by name bytes, inodes numbered breadth first (root first).

Limits enforced before anything is written (:class:`InvalidInputError`
naming the path): names of 1..255 bytes without ``/`` or NUL, xattr names in
the ``user.``/``trusted.``/``security.`` namespaces or POSIX ACLs with at most
255 bytes after the prefix, values of at most 65,535 bytes (the kernel's
``XATTR_SIZE_MAX`` is 64 KiB), symlink targets of at most 4,095 bytes.
"""

from __future__ import annotations

import os
import stat
import struct
import uuid as uuid_mod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import BinaryIO

from weenv.errors import InvalidInputError

BLOCK = 4096
BLKBITS = 12
SUPER_OFFSET = 1024
MAGIC = 0xE0F5E1E2
INCOMPAT_CHUNKED_FILE = 0x4
LAYOUT_FLAT_PLAIN, LAYOUT_FLAT_INLINE, LAYOUT_CHUNK_BASED = 0, 2, 4
NULL_ADDR = 0xFFFFFFFF
NAME_MAX = 255
XATTR_VALUE_MAX = 65535
SYMLINK_MAX = 4095
INODE_SIZE = 64
INLINE_MAX = 2048
"""Regular files up to this many bytes live in their inode's block (no data block)."""

_FT = {
    stat.S_IFREG: 1,
    stat.S_IFDIR: 2,
    stat.S_IFCHR: 3,
    stat.S_IFBLK: 4,
    stat.S_IFIFO: 5,
    stat.S_IFSOCK: 6,
    stat.S_IFLNK: 7,
}
_XATTR_PREFIXES = (("user.", 1), ("trusted.", 4), ("security.", 6))
_ACL = {"system.posix_acl_access": 2, "system.posix_acl_default": 3}

Reader = Callable[[], Iterator[bytes | int]]
"""Yields a regular file's content in pieces of any size: ``bytes``, or an
``int`` n for a hole of n zero bytes (never materialized: whole blocks of it
become holes in the image without being built or compared)."""


@dataclass
class Inode:
    """One inode of the tree: what an EROFS inode stores.

    ``mode``: type and permission bits (``st_mode``); ``size``: bytes (regular
    files; directories and symlinks get theirs from their content);
    ``data``: a regular file's content (:data:`Reader`), a symlink's target;
    ``rdev``: ``(major, minor)`` of a device; ``xattrs``: full name -> value;
    ``children``: a directory's entries, name (bytes) -> inode (a hardlinked
    inode appears under several names)."""

    mode: int
    uid: int = 0
    gid: int = 0
    mtime_ns: int = 0
    size: int = 0
    data: Reader | bytes | None = None
    rdev: tuple[int, int] = (0, 0)
    xattrs: dict[str, bytes] = field(default_factory=dict)
    children: dict[bytes, Inode] | None = None
    nlink: int = 0
    # layout (set by write_image)
    _layout: int = 0
    _blkaddr: int = 0
    _tail: bytes = b""
    _map: list[int] | None = None
    _dir_blocks: list[bytes] | None = None
    _nid: int = 0
    _ino: int = 0
    _placed: bool = False
    """Its data is already in the image (:func:`write_data`), before :func:`write_image`."""


def new_dir(mode: int = 0o755, **kw) -> Inode:
    """A directory :class:`Inode` (``mode``: permission bits)."""
    return Inode(mode=stat.S_IFDIR | (mode & 0o7777), children={}, **kw)


def check_name(name: bytes, where: str) -> None:
    """:class:`InvalidInputError` unless ``name`` is a valid entry name (1..255 bytes, no ``/`` or NUL)."""
    if not name or len(name) > NAME_MAX or b"/" in name or b"\0" in name or name in (b".", b".."):
        raise InvalidInputError(f"{where}: bad file name ({len(name)} bytes; at most {NAME_MAX}, no '/' or NUL)")


def encode_xattr(name: str, value: bytes, where: str) -> tuple[int, bytes, bytes]:
    """``(index, suffix, value)`` of one xattr; :class:`InvalidInputError` if EROFS cannot hold it."""
    if len(value) > XATTR_VALUE_MAX:
        raise InvalidInputError(
            f"{where}: xattr {name!r} holds {len(value)} bytes, more than the kernel's limit ({XATTR_VALUE_MAX})"
        )
    if name in _ACL:
        return _ACL[name], b"", value
    for prefix, index in _XATTR_PREFIXES:
        if name.startswith(prefix):
            suffix = os.fsencode(name[len(prefix) :])
            if not suffix or len(suffix) > NAME_MAX:
                raise InvalidInputError(f"{where}: xattr name {name!r} is empty or longer than {NAME_MAX} bytes")
            return index, suffix, value
    raise InvalidInputError(f"{where}: xattr {name!r} is in no namespace EROFS stores (user, trusted, security, ACLs)")


def _xattr_body(node: Inode, where: str) -> tuple[int, bytes]:
    """``(i_xattr_icount, inline xattr bytes)``."""
    if not node.xattrs:
        return 0, b""
    entries = sorted(encode_xattr(k, v, where) for k, v in node.xattrs.items())
    body = bytearray(12)  # h_name_filter, h_shared_count = 0, reserved
    for index, suffix, value in entries:
        e = struct.pack("<BBH", len(suffix), index, len(value)) + suffix + value
        body += e + bytes(-len(e) % 4)
    if len(body) > 12 + 4 * 0xFFFE:
        raise InvalidInputError(f"{where}: its xattrs take {len(body)} bytes, more than an inode holds")
    return (len(body) - 12) // 4 + 1, bytes(body)


def _dir_blocks(node: Inode, nid_of: Callable[[Inode], int], parent: Inode) -> list[bytes]:
    """The directory's blocks of dirents (the last one as long as it is used)."""
    assert node.children is not None
    entries = sorted([(b".", node), (b"..", parent), *node.children.items()], key=lambda e: e[0])
    blocks, group, used = [], [], 0
    for name, child in entries:
        if used + 12 + len(name) > BLOCK:
            blocks.append(group)
            group, used = [], 0
        group.append((name, child))
        used += 12 + len(name)
    blocks.append(group)
    out = []
    for group in blocks:
        head, names = bytearray(), bytearray()
        nameoff = 12 * len(group)
        for name, child in group:
            head += struct.pack("<QHBB", nid_of(child), nameoff + len(names), _FT[stat.S_IFMT(child.mode)], 0)
            names += name
        out.append(bytes(head + names))
    return out


def _dir_size_blocks(node: Inode) -> list[int]:
    """Used bytes of each of the directory's blocks (depends only on names)."""
    assert node.children is not None
    names = sorted([b".", b"..", *node.children])
    sizes, used = [], 0
    for name in names:
        if used + 12 + len(name) > BLOCK:
            sizes.append(used)
            used = 0
        used += 12 + len(name)
    sizes.append(used)
    return sizes


def _walk(root: Inode) -> list[tuple[Inode, Inode, str]]:
    """Every distinct inode once, breadth first, with its (first) parent and path."""
    order, seen, queue = [(root, root, "/")], {id(root)}, [(root, "/")]
    while queue:
        node, path = queue.pop(0)
        for name, child in sorted(node.children.items()):
            check_name(name, path)
            child_path = path.rstrip("/") + "/" + os.fsdecode(name)
            if id(child) in seen:
                if child.children is not None:
                    raise InvalidInputError(f"{child_path}: a directory is linked twice")
                continue
            seen.add(id(child))
            order.append((child, node, child_path))
            if child.children is not None:
                queue.append((child, child_path))
    return order


@dataclass(frozen=True)
class ImageStats:
    """What :func:`write_image` wrote."""

    size: int
    """Bytes (a multiple of 4 KiB)."""
    inodes: int
    """Distinct inodes, the root included (hardlinks once)."""


WRITER = "weenv-erofs 1"
"""The writer's name and format version, for a group's provenance."""


def write_image(
    root: Inode,
    out: BinaryIO,
    *,
    uuid: str,
    build_time: int | None = None,
    first: Sequence[str] = (),
    placed_blocks: int = 0,
) -> ImageStats:
    """Write the EROFS image of the tree under ``root`` (a directory
    :class:`Inode`) to ``out`` (a seekable file at offset 0); returns its
    :class:`ImageStats`.

    ``uuid``: the file system UUID; ``build_time``: seconds since the epoch
    stored in the superblock (default: one after the newest mtime, so builds
    repeat).  Regular files' :data:`Reader` s are read once,
    in breadth-first order, except that the regular files named in ``first``
    (paths ``/a/b``, an access profile's files: :mod:`weenv.packaging.erofs_extents`)
    have their data written first, contiguous, in that order (names not in the
    tree, or not regular files, are skipped; the file tree is the same).
    ``placed_blocks``: blocks ``1..placed_blocks`` of ``out`` already hold
    the data of the files marked ``_placed`` (:func:`write_data`, in the
    order their data arrived; ``out`` is at the end of them): those keep it
    there, the others' data follows.  Raises :class:`InvalidInputError` (see the
    module doc) before writing anything, and :class:`InvalidInputError` if a
    file yields more or fewer bytes than its size.
    """
    try:
        uid_bytes = uuid_mod.UUID(uuid).bytes
    except (ValueError, TypeError) as exc:
        raise InvalidInputError(f"not a UUID: {uuid!r}") from exc
    if root.children is None:
        raise InvalidInputError("the root of an image is not a directory")
    order = _walk(root)
    if build_time is None:
        build_time = max(n.mtime_ns for n, _, _ in order) // 1_000_000_000 + 1
    links: dict[int, int] = {}
    for node, _, _ in order:
        if node.children is not None:
            node.nlink = 2 + sum(1 for c in node.children.values() if c.children is not None)
            for c in node.children.values():
                if c.children is None:
                    links[id(c)] = links.get(id(c), 0) + 1
    xbodies = {}
    for node, _, path in order:
        if node.children is None:
            node.nlink = links[id(node)]
        xbodies[id(node)] = _xattr_body(node, path)
        if stat.S_ISLNK(node.mode):
            target = node.data if isinstance(node.data, bytes) else b""
            if not target or len(target) > SYMLINK_MAX:
                raise InvalidInputError(f"{path}: symlink target of {len(target)} bytes (1..{SYMLINK_MAX})")
    # 1. data: regular files' blocks, from block 1 (after the placed ones)
    next_block = 1 + placed_blocks
    out.seek(next_block * BLOCK)
    for node, _, path in _data_order(order, first):
        if not stat.S_ISREG(node.mode) or node._placed:
            continue
        icount, xbody = xbodies[id(node)]
        if node.size <= INLINE_MAX and INODE_SIZE + len(xbody) + node.size <= BLOCK:
            node._tail = _read_all(node, path)
            node._layout = LAYOUT_FLAT_INLINE if node._tail else LAYOUT_FLAT_PLAIN
            continue
        next_block = write_data(out, node, path, next_block)
    # 2. sizes of directories and symlinks, inline tails or plain blocks; nids
    dir_sizes = {id(n): _dir_size_blocks(n) for n, _, _ in order if n.children is not None}
    pos = 0
    for ino, (node, _, _) in enumerate(order, 1):
        node._ino = ino
        icount, xbody = xbodies[id(node)]
        isize = INODE_SIZE + len(xbody)
        if node.children is not None:
            sizes = dir_sizes[id(node)]
            node.size = BLOCK * (len(sizes) - 1) + sizes[-1]
            tail_len = sizes[-1]
        elif stat.S_ISLNK(node.mode):
            node.size = len(node.data)
            tail_len = node.size
        elif stat.S_ISREG(node.mode):
            tail_len = len(node._tail)
        else:
            node.size, tail_len = 0, 0
        if node.children is not None or stat.S_ISLNK(node.mode):
            node._layout = LAYOUT_FLAT_INLINE if isize + tail_len <= BLOCK else LAYOUT_FLAT_PLAIN
            if node._layout == LAYOUT_FLAT_PLAIN:
                tail_len = 0
        extra = tail_len if node._layout == LAYOUT_FLAT_INLINE else 0
        if node._layout == LAYOUT_CHUNK_BASED:
            extra = 4 * len(node._map)
        elif extra and (pos + isize) % BLOCK + extra > BLOCK:
            pos += -pos % BLOCK  # the inline tail may not cross a block
        node._nid = pos // 32
        pos += isize + extra
        pos += -pos % 32
    if root._nid != 0:
        raise AssertionError("the root is the first inode")
    # 3. directories' and long symlinks' blocks, now that nids are known
    for node, parent, _ in order:
        if node.children is not None:
            blocks = _dir_blocks(node, lambda n: n._nid, parent)
        elif stat.S_ISLNK(node.mode):
            blocks = [node.data[i : i + BLOCK] for i in range(0, len(node.data), BLOCK)]
        else:
            continue
        full = blocks if node._layout == LAYOUT_FLAT_PLAIN else blocks[:-1]
        node._tail = b"" if node._layout == LAYOUT_FLAT_PLAIN else blocks[-1]
        node._blkaddr = next_block if full else 0
        for b in full:
            out.write(b + bytes(BLOCK - len(b)))
            next_block += 1
    # 4. metadata
    meta_blkaddr = next_block
    meta = bytearray(pos + (-pos % BLOCK))
    for node, _, _ in order:
        icount, xbody = xbodies[id(node)]
        if node._layout == LAYOUT_CHUNK_BASED:
            i_u = struct.pack("<HH", 0, 0)  # chunk = one block, a 4-byte block map
        elif stat.S_ISCHR(node.mode) or stat.S_ISBLK(node.mode):
            major, minor = node.rdev
            i_u = struct.pack("<I", (minor & 0xFF) | (major << 8) | ((minor & ~0xFF) << 12))
        else:
            i_u = struct.pack("<I", node._blkaddr)
        sec, nsec = divmod(node.mtime_ns, 1_000_000_000)
        inode = struct.pack(
            "<HHHHQ4sIIIQII16x",
            1 | node._layout << 1,
            icount,
            node.mode & 0xFFFF,
            0,
            node.size,
            i_u,
            node._ino,
            node.uid,
            node.gid,
            sec,
            nsec,
            node.nlink,
        )
        at = node._nid * 32
        body = inode + xbody
        if node._layout == LAYOUT_CHUNK_BASED:
            body += struct.pack(f"<{len(node._map)}I", *node._map)
        elif node._layout == LAYOUT_FLAT_INLINE:
            body += node._tail
        meta[at : at + len(body)] = body
    out.seek(meta_blkaddr * BLOCK)
    out.write(meta)
    total_blocks = meta_blkaddr + len(meta) // BLOCK
    sb = struct.pack(
        "<IIIBBHQQIIII16s16sI",
        MAGIC,
        0,
        0,
        BLKBITS,
        0,
        0,
        len(order),
        build_time,
        0,
        total_blocks,
        meta_blkaddr,
        0,
        uid_bytes,
        b"",
        INCOMPAT_CHUNKED_FILE,
    )
    sb += bytes(128 - len(sb))
    out.seek(SUPER_OFFSET)
    out.write(sb)
    out.seek(0, os.SEEK_END)
    out.truncate(total_blocks * BLOCK)
    return ImageStats(total_blocks * BLOCK, len(order))


def write_data(out: BinaryIO, node: Inode, path: str, next_block: int) -> int:
    """Write the regular file ``node``'s data (its :data:`Reader`) as whole
    blocks at block ``next_block`` of ``out`` (where ``out`` is), a hole of
    the reader's as a hole; set its layout (``FLAT_PLAIN`` without holes,
    else ``CHUNK_BASED``); the next free block.  ``path`` names it in
    errors (:class:`InvalidInputError` if the reader gives more or fewer
    bytes than ``node.size``)."""
    node._map, next_block = _write_blocks(out, node, path, next_block)
    if NULL_ADDR in node._map:
        node._layout = LAYOUT_CHUNK_BASED
    else:  # no hole: one contiguous run, found without a block map
        node._layout, node._blkaddr, node._map = LAYOUT_FLAT_PLAIN, (node._map or [0])[0], None
    return next_block


def _data_order(order: list[tuple[Inode, Inode, str]], first: Sequence[str]) -> list[tuple[Inode, Inode, str]]:
    """``order`` with the entries whose paths are in ``first`` moved to the front, in ``first``'s order."""
    if not first:
        return order
    rank = {}
    for i, p in enumerate(first):
        rank.setdefault(p, i)
    picked = sorted((e for e in order if e[2] in rank), key=lambda e: rank[e[2]])
    return picked + [e for e in order if e[2] not in rank]


def _pieces(node: Inode) -> Iterator[bytes | int]:
    if node.data is None:
        return iter(())
    if isinstance(node.data, bytes):
        return iter((node.data,))
    return node.data()


def _read_all(node: Inode, path: str) -> bytes:
    data = b"".join(bytes(p) if isinstance(p, int) else p for p in _pieces(node))
    if len(data) != node.size:
        raise InvalidInputError(f"{path}: {len(data)} bytes of data, its size says {node.size}")
    return data


def _write_blocks(out: BinaryIO, node: Inode, path: str, next_block: int) -> tuple[list[int], int]:
    """Append a regular file's blocks to the data area (``out`` at block
    ``next_block``); its block map (:data:`NULL_ADDR` for a block wholly in
    the reader's holes) and the next free block.  :class:`InvalidInputError`
    if the reader yields more or fewer bytes than ``node.size``."""
    block_map: list[int] = []
    pending = bytearray()  # the block under way
    has_data = False  # it holds bytes the reader gave (not only hole)
    got = 0
    for piece in _pieces(node):
        got += piece if isinstance(piece, int) else len(piece)
        if got > node.size:
            raise InvalidInputError(f"{path}: more data than its size ({node.size} bytes)")
        if isinstance(piece, int):  # a hole: end the block under way, then whole blocks are holes
            if pending:
                fill = min(piece, BLOCK - len(pending))
                pending += bytes(fill)
                piece -= fill
                if len(pending) < BLOCK:
                    continue
                if has_data:
                    out.write(pending)
                    block_map.append(next_block)
                    next_block += 1
                else:
                    block_map.append(NULL_ADDR)
                pending, has_data = bytearray(), False
            whole, rest = divmod(piece, BLOCK)
            block_map.extend([NULL_ADDR] * whole)
            pending += bytes(rest)
            continue
        if not piece:
            continue
        if pending:
            take = min(len(piece), BLOCK - len(pending))
            pending += piece[:take]
            piece = piece[take:]
            if len(pending) == BLOCK:  # it holds some of this piece: data
                out.write(pending)
                block_map.append(next_block)
                next_block += 1
                pending = bytearray()
        full = len(piece) - len(piece) % BLOCK
        if full:  # straight from the piece, no copy
            with memoryview(piece) as view:
                out.write(view[:full])
            block_map.extend(range(next_block, next_block + full // BLOCK))
            next_block += full // BLOCK
        pending += piece[full:]
        has_data = bool(pending)
    if got != node.size:
        raise InvalidInputError(f"{path}: {got} bytes of data, its size says {node.size}")
    if pending:
        if has_data:
            out.write(bytes(pending) + bytes(BLOCK - len(pending)))
            block_map.append(next_block)
            next_block += 1
        else:
            block_map.append(NULL_ADDR)
    return block_map, next_block


# --- a tree from a directory on disk -------------------------------------------------------
def tree_from_dir(source: str | os.PathLike[str]) -> Inode:
    """The :class:`Inode` tree of directory ``source`` (lstat, xattrs not
    followed through symlinks; hardlinks share one inode).  Raises
    :class:`InvalidInputError` for an entry that cannot be read or stored."""
    source = os.fspath(source)
    by_ino: dict[tuple[int, int], Inode] = {}

    def make(path: str, st: os.stat_result) -> Inode:
        key = (st.st_dev, st.st_ino)
        if key in by_ino and not stat.S_ISDIR(st.st_mode):
            return by_ino[key]
        rel = "/" + os.path.relpath(path, source) if path != source else "/"
        node = Inode(
            mode=st.st_mode, uid=st.st_uid, gid=st.st_gid, mtime_ns=st.st_mtime_ns, xattrs=_read_xattrs(path, rel)
        )
        if stat.S_ISREG(st.st_mode):
            node.size = st.st_size
            node.data = _file_reader(path)
        elif stat.S_ISLNK(st.st_mode):
            node.data = os.fsencode(os.readlink(path))
        elif stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
            node.rdev = (os.major(st.st_rdev), os.minor(st.st_rdev))
        elif stat.S_ISDIR(st.st_mode):
            node.children = {}
            try:
                with os.scandir(path) as it:
                    for entry in it:
                        name = os.fsencode(entry.name)
                        check_name(name, rel)
                        node.children[name] = make(entry.path, entry.stat(follow_symlinks=False))
            except OSError as exc:
                raise InvalidInputError(f"{rel}: cannot read: {exc.strerror}") from exc
        by_ino[key] = node
        return node

    return make(source, os.lstat(source))


def _read_xattrs(path: str, rel: str) -> dict[str, bytes]:
    try:
        names = os.listxattr(path, follow_symlinks=False)
        return {n: os.getxattr(path, n, follow_symlinks=False) for n in names}
    except OSError as exc:
        raise InvalidInputError(f"{rel}: cannot read its xattrs: {exc.strerror}") from exc


def _file_reader(path: str) -> Reader:
    def read() -> Iterator[bytes]:
        with open(path, "rb") as f:
            # skip holes without reading them
            fd, size, offset = f.fileno(), os.fstat(f.fileno()).st_size, 0
            while offset < size:
                try:
                    data_at = os.lseek(fd, offset, os.SEEK_DATA)
                except OSError:  # only holes from here on
                    data_at = size
                if offset < data_at:
                    yield data_at - offset  # a hole
                    offset = data_at
                if offset >= size:
                    break
                hole_at = os.lseek(fd, offset, os.SEEK_HOLE)
                f.seek(offset)
                while offset < hole_at:
                    piece = f.read(min(hole_at - offset, 1 << 20))
                    if not piece:
                        return
                    yield piece
                    offset += len(piece)

    return read
