"""OCI layer tars merged straight into :mod:`~weenv.packaging.erofs_writer` trees.

The streaming import path (the default of :func:`~weenv.packaging.importer.import_image`):
no layer is extracted to a directory.  Each group's layers are applied, in
order, to an in-memory :class:`~weenv.packaging.erofs_writer.Inode` tree
(:class:`TreeMerger`); files of at most
:data:`~weenv.packaging.erofs_writer.INLINE_MAX` bytes are held in memory
(the writer inlines them).  Other regular files' data, in a group of one
layer, is written into the group image's data area as it streams in (in
the layer's order; the image is a
:class:`~weenv.packaging.chunksink.ChunkSink`, stored chunk by chunk), so it
passes once and never lands in a temporary file.  In a group of several
layers (a later one may delete or replace a file) it goes to one temporary
file per group (:class:`Spool`); the writer then reads each file's data once
from the spool, in tree order, and each piece read is punched out of it
(``fallocate(PUNCH_HOLE)``), so the spool shrinks as the image is stored.

Semantics are those of :mod:`~weenv.packaging.importer.layers` (the old
extracting path follows them too: ``weenv_bench.extracting_import``), applied to inodes instead of files:
image-spec v1.0 ``layer.md`` "Applying Changesets" within a group, and what a
group deletes from the groups below in overlayfs's own form
(Documentation/filesystems/overlayfs.rst): a character device 0/0 for
``.wh.NAME``, ``trusted.overlay.opaque=y`` for ``.wh..wh..opq`` and for a
directory that replaces a non-directory; other ``.wh..wh.*`` entries are
skipped.  Zero 4 KiB blocks of a file become holes (as the extracting path
makes them, with lseek), and GNU sparse members' holes are holes without
being read.

Checked per entry, with :class:`InvalidInputError` naming the layer (``what``:
its digest) and the entry: names of 1..255 bytes (NAME_MAX); ``..`` (an entry
or a hardlink target climbing out of the root); a path through a symlink or
another non-directory made by the same layer; a hardlink to a file the image
does not hold; xattrs the kernel cannot hold (values over 64 KiB, names over
255 bytes after the prefix); files over :data:`MAX_FILE_BYTES`.  Tar headers
themselves are bounded before ``tarfile`` allocates them
(:class:`~weenv.packaging.tarscan.TarScan`, fed by
:func:`~weenv.packaging.importer.layers.open_layer`).

Peak disk: a group of one layer needs none beyond its stored chunks; a
merged group's spool holds its file data (zero blocks and holes left out)
until the writer reads it.  (``weenv bench import`` measures the import's
peak.)

Memory: one :class:`Inode` per entry (about 0.5 KiB, plus names and
xattrs) for every group of the image until the import ends, files of at most
2 KiB, 1 MiB of read buffer and the chunks the sink has in flight
(about 10).  Names (leading ``/`` and ``./`` dropped)
are bytes (``surrogateescape``).
"""

from __future__ import annotations

import os
import stat
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from weenv.errors import InvalidInputError
from weenv.host.punch import punch_hole
from weenv.packaging.erofs_writer import (
    BLOCK,
    INLINE_MAX,
    LAYOUT_CHUNK_BASED,
    LAYOUT_FLAT_INLINE,
    NULL_ADDR,
    SYMLINK_MAX,
    Inode,
    Reader,
    check_name,
    encode_xattr,
    new_dir,
    write_data,
)
from weenv.packaging.importer import layers
from weenv.packaging.importer.layers import (
    _CORRUPT_STREAM_ERRORS,
    OPAQUE_XATTR,
    LayerStats,
    _mtime_ns,
    _xattrs,
)

MAX_FILE_BYTES = 64 << 30
"""Largest regular file (bytes, holes included) an import takes: the largest
image (64 Ki chunks of 1 MiB); a sparse member's declared size is checked
before its block map is made."""
READ_SIZE = 1 << 20
_ZERO = bytes(READ_SIZE)

Parts = tuple[bytes, ...]


# --- the spool: regular files' data, one temporary file -----------------------------------
class Spool:
    """An unlinked temporary file under ``directory`` holding regular files'
    data, appended in tar order.  A file's data is a list of extents
    ``(offset in the file, offset in the spool, length)``; :meth:`reader`
    yields it for the writer and punches each range once read.

    ``live``: bytes stored and not yet punched; ``peak``: the most ``live``
    has been (both bytes)."""

    def __init__(self, directory: str | os.PathLike[str]):
        try:
            self.fd = os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
        except OSError:  # a file system without O_TMPFILE
            import tempfile

            self.fd, name = tempfile.mkstemp(dir=directory, prefix=".weenv-spool-")
            os.unlink(name)
        self.end = 0
        self.live = 0
        self.peak = 0

    def append(self, data: bytes | memoryview) -> int:
        """Store ``data``; its offset in the spool."""
        at = self.end
        view = memoryview(data)
        while view:
            n = os.pwrite(self.fd, view, self.end)
            view = view[n:]
            self.end += n
        self.live += self.end - at
        self.peak = max(self.peak, self.live)
        return at

    def punch(self, offset: int, length: int) -> None:
        """Free ``length`` bytes at ``offset`` (they read back as zeros)."""
        if length and punch_hole(self.fd, offset, length):
            self.live -= length

    def reader(self, extents: list[tuple[int, int, int]], size: int) -> Reader:
        """A :data:`~weenv.packaging.erofs_writer.Reader` of a file of ``size``
        bytes whose data is ``extents`` (holes between and after them)."""

        def read() -> Iterator[bytes | int]:
            pos = 0
            for file_off, spool_off, length in extents:
                if file_off > pos:
                    yield file_off - pos
                done = 0
                while done < length:
                    piece = os.pread(self.fd, min(READ_SIZE, length - done), spool_off + done)
                    if not piece:
                        raise InvalidInputError("the import's spool file ended early")
                    self.punch(spool_off + done, len(piece))  # freed as read: a large file is not on disk twice
                    yield piece
                    done += len(piece)
                pos = file_off + length
            if size > pos:
                yield size - pos

        return read

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def image_reader(read_at: Callable[[int, int], bytes], node: Inode) -> Reader | bytes | None:
    """Where a regular file of a written image lives in that image
    (``read_at(offset, n)`` reads the image): a reader for :func:`write_image`'s
    layouts (inline tail, one run of blocks, block map with holes)."""
    if node._layout == LAYOUT_FLAT_INLINE or node.size == 0:
        return node._tail
    size = node.size

    def read() -> Iterator[bytes | int]:
        if node._layout == LAYOUT_CHUNK_BASED:
            for i, addr in enumerate(node._map):
                n = min(BLOCK, size - i * BLOCK)
                yield n if addr == NULL_ADDR else read_at(addr * BLOCK, n)
            return
        done = 0
        while done < size:
            piece = read_at(node._blkaddr * BLOCK + done, min(READ_SIZE, size - done))
            if not piece:
                raise InvalidInputError("a group image being imported ended early")
            yield piece
            done += len(piece)

    return read


# --- the groups below, names only -----------------------------------------------------------
class _VDir(layers._Dir):
    """A directory of the :class:`View`; ``group`` unused."""

    __slots__ = ("inode",)

    def __init__(self, inode: Inode | None):
        super().__init__(-1)
        self.inode = inode
        """The topmost group's inode of this directory (its metadata), None above the image."""


def is_whiteout(node: Inode) -> bool:
    return stat.S_ISCHR(node.mode) and node.rdev == (0, 0)


def is_opaque(node: Inode) -> bool:
    return node.children is not None and node.xattrs.get(OPAQUE_XATTR) == b"y"


class View(layers.View):
    """The merged tree of the groups stacked so far: a directory is a
    :class:`_VDir`, any other entry the :class:`Inode` that shows
    (:meth:`lookup` is the extracting path's)."""

    def __init__(self) -> None:
        self.root = _VDir(None)

    def apply_group(self, root: Inode) -> None:
        """Stack a finished group tree, with overlayfs's rules: a whiteout
        removes, an opaque directory or one over a non-directory replaces, a
        directory over a directory merges."""
        if is_opaque(root):
            self.root = _VDir(root)
        self.root.inode = root
        stack = [(root, self.root)]
        while stack:
            node, vdir = stack.pop()
            for name, child in node.children.items():
                if is_whiteout(child):
                    vdir.children.pop(name, None)
                elif child.children is not None:
                    old = vdir.children.get(name)
                    if isinstance(old, _VDir) and not is_opaque(child):
                        old.inode = child
                        sub = old
                    else:
                        sub = _VDir(child)
                        vdir.children[name] = sub
                    stack.append((child, sub))
                else:
                    vdir.children[name] = child

    def read_file(self, path: str) -> bytes | None:
        """A regular file's bytes (holes as zeros) by absolute path, None if
        the image shows none there (used for ``/etc/passwd`` and ``/etc/group``)."""
        node = self.lookup(tuple(os.fsencode(p) for p in path.split("/") if p))
        if not isinstance(node, Inode) or not stat.S_ISREG(node.mode):
            return None
        data = node.data
        if data is None or isinstance(data, bytes):
            return data or b""
        return b"".join(bytes(p) if isinstance(p, int) else p for p in data())


# --- one group's tree -----------------------------------------------------------------------
def entry_parts(name: str, what: str) -> Parts:
    """A tar entry name as path components below the root (bytes, each checked
    by :func:`~weenv.packaging.erofs_writer.check_name`); ``..`` is refused."""
    parts = []
    for part in name.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            raise InvalidInputError(f"{what}: entry {name!r} climbs out of the root ('..')")
        raw = os.fsencode(part)
        check_name(raw, f"{what}: entry {name[:300]!r}")
        parts.append(raw)
    return tuple(parts)


def _show(parts: Parts) -> str:
    return "/" + os.fsdecode(b"/".join(parts))


@dataclass
class TreeMerger:
    """The tree of one group (``root``), its layers applied in order over
    ``view`` (the groups below).

    Regular files' data goes to ``spool`` (read back by
    :func:`~weenv.packaging.erofs_writer.write_image` in tree order), or,
    with ``image`` (the group image's file, e.g. a
    :class:`~weenv.packaging.chunksink.ChunkSink`; one layer per group),
    straight into the image's data area in the order it arrives
    (:func:`~weenv.packaging.erofs_writer.write_data`): the data passes once,
    and no temporary file holds it.  A file a later entry of the same layer
    replaces then keeps its blocks in the image, unreferenced.  Pass
    :attr:`placed_blocks` to ``write_image`` then."""

    view: View
    spool: Spool | None = None
    image: object | None = None
    root: Inode = field(init=False)
    placed_blocks: int = 0
    """Blocks of the image holding file data written as it arrived."""
    _new: set[Parts] = field(default_factory=set)

    def __post_init__(self) -> None:
        if (self.spool is None) == (self.image is None):
            raise ValueError("a TreeMerger takes a spool or an image, one of them")
        if self.image is not None:
            self.image.seek(BLOCK)
        self.root = new_dir()
        self._copy_dir_meta((), self.root)

    def apply_layer(self, tar: tarfile.TarFile, what: str) -> LayerStats:
        """Apply every entry of the layer ``tar`` (streamed); ``what`` names the
        layer in errors.  Raises :class:`InvalidInputError`."""
        self._new = set()
        stats = LayerStats()
        name = "(start)"
        try:
            for member in tar:
                name = member.name
                stats.entries += 1
                self._apply(tar, member, entry_parts(member.name, what), stats, f"{what}: entry {name[:300]!r}")
        except _CORRUPT_STREAM_ERRORS as exc:
            raise InvalidInputError(f"{what}: truncated or corrupt layer (at {name[:300]!r}): {exc}") from exc
        except OSError as exc:
            raise InvalidInputError(f"{what}: cannot read {name[:300]!r}: {exc}") from exc
        return stats

    # --- entries ----------------------------------------------------------------------
    def _apply(self, tar: tarfile.TarFile, m: tarfile.TarInfo, parts: Parts, stats: LayerStats, what: str) -> None:
        if layers.apply_marker(self, m, parts, stats, what):
            return
        if not parts:
            if not m.isdir():
                raise InvalidInputError(f"{what}: the root entry is not a directory")
            self._set_meta(self.root, m, what)
            return
        name = parts[-1]
        parent = self._ensure_dir(parts[:-1], what)
        old = parent.children.get(name)
        replaced_non_dir = False
        if old is not None:
            if m.isdir() and old.children is not None:
                self._set_meta(old, m, what, clear_xattrs=True)
                self._new.add(parts)
                return
            replaced_non_dir = old.children is None
            del parent.children[name]
        if m.islnk():
            node = self._hardlink(m, what)
        else:
            node = Inode(mode=0)
            self._set_meta(node, m, what)
            if m.isdir():
                node.children = {}
                if replaced_non_dir:
                    node.xattrs[OPAQUE_XATTR] = b"y"
            elif m.isreg():
                stats.bytes += self._file_data(tar, m, node, what)
            elif m.issym():
                node.data = os.fsencode(m.linkname)
                if not node.data or len(node.data) > SYMLINK_MAX:
                    raise InvalidInputError(f"{what}: a symlink target of {len(node.data)} bytes (1..{SYMLINK_MAX})")
            elif m.ischr() or m.isblk():
                node.rdev = (m.devmajor, m.devminor)
            elif not m.isfifo():
                raise InvalidInputError(f"{what}: unsupported entry type {m.type!r}")
        parent.children[name] = node
        self._new.add(parts)

    def _set_meta(self, node: Inode, m: tarfile.TarInfo, what: str, *, clear_xattrs: bool = False) -> None:
        kind = {
            tarfile.DIRTYPE: stat.S_IFDIR,
            tarfile.SYMTYPE: stat.S_IFLNK,
            tarfile.CHRTYPE: stat.S_IFCHR,
            tarfile.BLKTYPE: stat.S_IFBLK,
            tarfile.FIFOTYPE: stat.S_IFIFO,
        }.get(m.type, stat.S_IFREG)
        node.mode = kind | (m.mode & 0o7777)
        if kind == stat.S_IFLNK:
            node.mode = kind | 0o777
        node.uid, node.gid, node.mtime_ns = m.uid, m.gid, _mtime_ns(m)
        xattrs = _xattrs(m)
        if kind == stat.S_IFLNK:  # Linux keeps no user.* xattrs on symlinks (as the extracting path)
            xattrs = {k: v for k, v in xattrs.items() if not k.startswith("user.")}
        for key, value in xattrs.items():
            encode_xattr(key, value, what)
        if clear_xattrs:
            opaque = node.xattrs.get(OPAQUE_XATTR)
            node.xattrs = {OPAQUE_XATTR: opaque} if opaque is not None else {}
        node.xattrs.update(xattrs)

    def _file_data(self, tar: tarfile.TarFile, m: tarfile.TarInfo, node: Inode, what: str) -> int:
        """Read a regular member's data into memory (small) or the spool; its size."""
        size = m.size
        if size < 0 or size > MAX_FILE_BYTES:
            raise InvalidInputError(f"{what}: a file of {size} bytes (at most {MAX_FILE_BYTES} are taken)")
        node.size = size
        if m.sparse is not None:
            pieces = _sparse_pieces(tar, m, what)
        else:
            src = tar.extractfile(m)
            pieces = iter(lambda: src.read(READ_SIZE), b"")  # type: ignore[union-attr]
        if size <= INLINE_MAX and m.sparse is None:
            data = b"".join(pieces)
            if len(data) != size:
                raise InvalidInputError(f"{what}: {len(data)} bytes of data, its header says {size}")
            node.data = data
            return size
        if self.image is not None:
            node.data = lambda: _holed(pieces)
            self.placed_blocks = write_data(self.image, node, what, 1 + self.placed_blocks) - 1
            node._placed, node.data = True, None
            return size
        extents: list[tuple[int, int, int]] = []
        pos = 0
        for piece in pieces:
            if isinstance(piece, int):
                pos += piece
                continue
            for start, end in _data_runs(piece, pos):
                at = self.spool.append(memoryview(piece)[start:end])
                if extents and extents[-1][0] + extents[-1][2] == pos + start and extents[-1][1] + extents[-1][2] == at:
                    f, s, n = extents[-1]
                    extents[-1] = (f, s, n + end - start)
                else:
                    extents.append((pos + start, at, end - start))
            pos += len(piece)
        if pos != size:
            raise InvalidInputError(f"{what}: {pos} bytes of data, its header says {size}")
        node.data = self.spool.reader(extents, size)
        return size

    def _hardlink(self, m: tarfile.TarInfo, what: str) -> Inode:
        target_parts = entry_parts(m.linkname, what)
        if not target_parts:
            raise InvalidInputError(f"{what}: a hardlink to the root")
        node: Inode | None = self.root
        for part in target_parts:
            if node is None or node.children is None:
                if node is not None:
                    raise InvalidInputError(f"{what}: hardlink target {m.linkname!r} goes through a non-directory")
                break
            node = node.children.get(part)
        if node is not None and node.children is None and not is_whiteout(node):
            return node
        below = self.view.lookup(target_parts)
        if node is None and isinstance(below, Inode) and self._visible_below(target_parts):
            # A link to a file of a lower group: overlayfs cannot link across
            # layers, so the file is copied (data, owner, mode, xattrs, mtime).
            return Inode(
                mode=below.mode,
                uid=below.uid,
                gid=below.gid,
                mtime_ns=below.mtime_ns,
                size=below.size,
                data=below.data,
                rdev=below.rdev,
                xattrs=dict(below.xattrs),
            )
        raise InvalidInputError(f"{what}: hardlink to {m.linkname!r}: no such file in the image")

    def _whiteout(self, parts: Parts, mtime_ns: int, what: str) -> None:
        if parts in self._new:
            return  # the same layer made it: a whiteout only hides lower layers
        parent = self._dir_in_tree(parts[:-1])
        if parent is not None:
            parent.children.pop(parts[-1], None)
        if self._visible_below(parts):
            parent = self._ensure_dir(parts[:-1], what)
            parent.children[parts[-1]] = Inode(mode=stat.S_IFCHR | 0o600, mtime_ns=mtime_ns)

    def _opaque(self, parts: Parts, what: str) -> None:
        node = self._ensure_dir(parts, what)
        for name in [n for n in node.children if parts + (n,) not in self._new]:
            del node.children[name]
        node.xattrs[OPAQUE_XATTR] = b"y"

    def _visible_below(self, parts: Parts) -> bool:
        """Whether ``parts`` shows through this group from below: in the view,
        and no prefix in this tree is a non-directory or an opaque directory."""
        if self.view.lookup(parts) is None:
            return False
        node: Inode | None = self.root
        for i in range(len(parts)):
            if node is None:
                return True
            if node.children is None or is_opaque(node):
                return False
            node = node.children.get(parts[i])
        return True

    def _dir_in_tree(self, parts: Parts) -> Inode | None:
        """The directory ``parts`` of this tree, None unless every prefix is one."""
        node: Inode | None = self.root
        for part in parts:
            node = node.children.get(part)
            if node is None or node.children is None:
                return None
        return node

    def _ensure_dir(self, parts: Parts, what: str) -> Inode:
        """The directory ``parts`` of this tree, missing parents made with the
        metadata the image shows for them below (or 0755 root)."""
        node = self.root
        for i, part in enumerate(parts):
            child = node.children.get(part)
            if child is not None and child.children is not None:
                node = child
                continue
            replaced = child is not None
            if replaced and parts[: i + 1] in self._new and not is_whiteout(child):
                kind = "symlink" if stat.S_ISLNK(child.mode) else "non-directory"
                raise InvalidInputError(
                    f"{what}: it lies under {_show(parts[: i + 1])}, which this layer made a {kind}"
                )
            child = new_dir()
            self._copy_dir_meta(parts[: i + 1], child)
            if replaced:
                child.xattrs[OPAQUE_XATTR] = b"y"
            node.children[part] = child
            node = child
        return node

    def _copy_dir_meta(self, parts: Parts, node: Inode) -> None:
        below = self.view.lookup(parts)
        if isinstance(below, _VDir) and below.inode is not None:
            src = below.inode
            node.mode, node.uid, node.gid, node.mtime_ns = src.mode, src.uid, src.gid, src.mtime_ns
            node.xattrs = {k: v for k, v in src.xattrs.items() if k != OPAQUE_XATTR}
        else:
            node.mode, node.uid, node.gid, node.mtime_ns = stat.S_IFDIR | 0o755, 0, 0, 0


def _data_runs(piece: bytes, pos: int) -> Iterator[tuple[int, int]]:
    """``(start, end)`` of the runs of ``piece`` (at file offset ``pos``, a
    multiple of 4 KiB) outside its all-zero 4 KiB blocks (the last block may
    be short)."""
    n = len(piece)
    if piece == _ZERO[:n] if n <= READ_SIZE else piece.count(0) == n:
        return
    start = 0
    zero = _ZERO[:BLOCK]
    for off in range(0, n, BLOCK):
        if piece[off : off + BLOCK] == zero[: min(BLOCK, n - off)]:
            if start < off:
                yield start, off
            start = off + BLOCK
    if start < n:
        yield start, n


def _holed(pieces: Iterator[bytes | int]) -> Iterator[bytes | memoryview | int]:
    """``pieces`` (bytes from file offsets that are multiples of 4 KiB, and
    holes as ints) with their all-zero 4 KiB blocks turned into holes."""
    pos = 0
    for piece in pieces:
        if isinstance(piece, int):
            pos += piece
            yield piece
            continue
        at = 0
        for start, end in _data_runs(piece, pos):
            if start > at:
                yield start - at
            yield memoryview(piece)[start:end]
            at = end
        if len(piece) > at:
            yield len(piece) - at
        pos += len(piece)


def _sparse_pieces(tar: tarfile.TarFile, m: tarfile.TarInfo, what: str) -> Iterator[bytes | int]:
    """A GNU sparse member's data as pieces and holes (ints), from its map,
    without reading the holes (``tarfile`` itself would fill them with zeros)."""
    fileobj = tar.fileobj
    fileobj.seek(m.offset_data)
    pos = 0
    for offset, length in m.sparse:
        if length == 0:  # the map's end marker, and unused slots of old GNU headers
            continue
        if offset < pos or offset + length > m.size:
            raise InvalidInputError(f"{what}: a GNU sparse map out of order or past its size")
        if offset > pos:
            yield offset - pos
        done = 0
        while done < length:
            piece = fileobj.read(min(READ_SIZE, length - done))
            if not piece:
                raise InvalidInputError(f"{what}: truncated sparse data")
            yield piece
            done += len(piece)
        pos = offset + length
    if m.size > pos:
        yield m.size - pos


def release(root: Inode, read_at: Callable[[int, int], bytes]) -> None:
    """Point every regular file of the written group tree ``root`` at its data
    in the group's image, read by ``read_at(offset, n)`` (hardlinks to it from
    groups above, and :meth:`View.read_file`, read it there once the spool is
    gone: from the store, the image itself is never on disk)."""
    seen: set[int] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        for child in node.children.values():
            if id(child) in seen:
                continue
            seen.add(id(child))
            if child.children is not None:
                stack.append(child)
            elif stat.S_ISREG(child.mode):
                child.data = image_reader(read_at, child)
