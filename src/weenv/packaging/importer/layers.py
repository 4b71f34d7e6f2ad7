"""Applying OCI layer tars to group trees (Linux only: mknod, lchown, xattrs).

A *group tree* is a directory that becomes one layer group: an overlayfs lower
layer.  Layers are applied to it in order (image-spec v1.0 ``layer.md``,
"Applying Changesets"), and what the layers delete from the groups *below*
is written in overlayfs's own form (Documentation/filesystems/overlayfs.rst,
"whiteouts and opaque directories"):

- ``D/.wh.NAME`` (NAME deleted): ``D/NAME`` is removed from this group tree
  (it came from an earlier layer of the same group) and, if ``D/NAME`` is
  visible in the groups below, a character device 0/0 is made in its place.
- ``D/.wh..wh..opq`` (D's lower contents hidden): D's entries from earlier
  layers of this group are removed and D gets ``trusted.overlay.opaque=y``.
  Entries of the same layer stay, wherever the marker sits in the tar.
- A directory that replaces a non-directory of this group tree (a whiteout or a
  file from an earlier layer merged into the same group) is made opaque: the
  groups below may hold an older directory of that name whose children must
  not come back.
- Other ``.wh..wh.*`` entries (AUFS bookkeeping) are skipped.

Entries keep owner (numeric uid/gid), mode with setuid/setgid/sticky, mtime
(ns), xattrs (PAX ``SCHILY.xattr.*``, libarchive's ``LIBARCHIVE.xattr.*``,
``security.capability`` set after chown, which clears it), hardlinks (to an
earlier entry of the same group; to a file of a lower group it is copied),
symlinks (targets stored verbatim), character and block devices, fifos, and
holes: runs of zero 4 KiB blocks are skipped with lseek, so sparse files stay
sparse.  An image's own ``trusted.overlay.*`` xattrs are escaped as
``trusted.overlay.overlay.*``, which overlayfs (Linux >= 6.7) shows as the
original name.

Safety: entry names are normalised (``./`` and leading ``/`` dropped); ``..``
is refused.  Nothing is written through a symlink: each parent is checked with
lstat(2) and files are created with ``O_EXCL | O_NOFOLLOW``.  A parent that is
a non-directory made by the *same* layer (``link -> /etc`` then ``link/x``) is
refused with :class:`InvalidInputError`; one from an earlier layer of the group
is replaced by a directory, as it would be with one group per layer.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import gzip
import hashlib
import os
import queue
import shutil
import stat
import tarfile
import threading
import urllib.parse
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import zstandard

from weenv.errors import DigestMismatchError, InvalidInputError
from weenv.formats.limits import MAX_LAYER_ENTRIES, MAX_LAYER_FILE_BYTES
from weenv.packaging.importer.source import ImageSource, Layer
from weenv.packaging.tarscan import TarScan

WHITEOUT_PREFIX = ".wh."
OPAQUE_MARKER = ".wh..wh..opq"
OPAQUE_XATTR = "trusted.overlay.opaque"
OVERLAY_XATTR_PREFIX = "trusted.overlay."
BLOCK = 4096
READ_SIZE = 1 << 20
READ_AHEAD = 8
"""Pieces of :data:`READ_SIZE` a layer's read-ahead thread holds at most."""
_ZERO_BLOCK = bytes(BLOCK)
_ZERO_READ = bytes(READ_SIZE)
_GZIP_MAGIC = b"\x1f\x8b"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_DEFAULT_DIR_MODE = 0o755


# --- the image's merged tree (names only) -------------------------------------------
class _Dir:
    __slots__ = ("children", "group")

    def __init__(self, group: int):
        self.group = group
        """Index of the topmost group holding this directory (its metadata's source)."""
        self.children: dict[str, _Dir | int] = {}


class View:
    """The merged tree of the groups applied so far, names only: a directory is a
    node, any other entry the index of the group that holds it.  It answers
    "is this path visible below the group being written?"."""

    def __init__(self) -> None:
        self.root = _Dir(-1)

    def lookup(self, parts: tuple[str, ...]) -> _Dir | int | None:
        node: _Dir | int | None = self.root
        for part in parts:
            if not isinstance(node, _Dir):
                return None
            node = node.children.get(part)
            if node is None:
                return None
        return node

    def apply_group(self, tree: Path, group: int) -> None:
        """Stack the finished group tree ``tree`` (index ``group``) on the view,
        with overlayfs's rules: a whiteout removes, an opaque directory or one
        over a non-directory replaces, a directory over a directory merges."""
        if _is_opaque(tree):
            self.root = _Dir(group)
        self.root.group = group
        stack: list[tuple[str, _Dir]] = [(os.fspath(tree), self.root)]
        while stack:
            path, node = stack.pop()
            with os.scandir(path) as it:
                for entry in it:
                    st = entry.stat(follow_symlinks=False)
                    if _is_whiteout(st):
                        node.children.pop(entry.name, None)
                    elif stat.S_ISDIR(st.st_mode):
                        old = node.children.get(entry.name)
                        if isinstance(old, _Dir) and not _is_opaque(entry.path):
                            old.group = group
                            child = old
                        else:
                            child = _Dir(group)
                            node.children[entry.name] = child
                        stack.append((entry.path, child))
                    else:
                        node.children[entry.name] = group


def _is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def _is_opaque(path: str | os.PathLike[str]) -> bool:
    try:
        return os.getxattr(path, OPAQUE_XATTR, follow_symlinks=False) == b"y"
    except OSError:
        return False


# --- reading a layer blob --------------------------------------------------------------
class _HashingReader:
    """Reads from ``f``, hashing (sha256) and counting every byte."""

    def __init__(self, f: IO[bytes], prefix: bytes = b"", on_read: Callable[[bytes], None] | None = None):
        self._f = f
        self._on_read = on_read
        self._prefix = prefix
        self.sha = hashlib.sha256(prefix)
        self.count = len(prefix)

    def read(self, n: int = -1) -> bytes:
        if self._prefix:
            if n is not None and 0 <= n < len(self._prefix):
                data, self._prefix = self._prefix[:n], self._prefix[n:]
                return data
            data, self._prefix = self._prefix, b""
            rest = self._f.read() if n is None or n < 0 else self._f.read(n - len(data))
            self.sha.update(rest)
            self.count += len(rest)
            return data + rest
        data = self._f.read(n)
        if self._on_read is not None:
            self._on_read(data)
        self.sha.update(data)
        self.count += len(data)
        return data

    def drain(self) -> None:
        while self.read(READ_SIZE):
            pass

    def digest(self) -> str:
        return "sha256:" + self.sha.hexdigest()


_CORRUPT_STREAM_ERRORS = (EOFError, tarfile.TarError, zlib.error, zstandard.ZstdError, gzip.BadGzipFile)
"""What a truncated or corrupt tar, gzip or zstd stream raises (BadGzipFile is an OSError)."""
_STREAM_ERRORS = (OSError, *_CORRUPT_STREAM_ERRORS)


class _ReadAhead:
    """Reads ``f`` (1 MiB at a time) in a thread of its own, up to
    :data:`READ_AHEAD` pieces ahead of :meth:`read`: the blob's decompression
    and both sha256s (which release the GIL) overlap the tar's processing.
    An error of the thread is raised by the :meth:`read` that reaches it."""

    def __init__(self, f):
        self._f = f
        self._queue: queue.Queue = queue.Queue(READ_AHEAD)
        self._stop = threading.Event()
        self._buf, self._pos, self._done = b"", 0, False
        self._thread = threading.Thread(target=self._run, name="layer-read-ahead", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                piece = self._f.read(READ_SIZE)
                self._queue.put(piece)
                if not piece:
                    return
        except BaseException as exc:  # handed to the reader
            self._queue.put(exc)

    def read(self, n: int = -1) -> bytes:
        if 0 <= n <= len(self._buf) - self._pos:  # within the piece at hand (tarfile reads 10 KiB at a time)
            if self._pos == 0 and n == len(self._buf):
                self._pos = n
                return self._buf
            piece = self._buf[self._pos:self._pos + n]
            self._pos += n
            return piece
        out = bytearray()
        while n < 0 or len(out) < n:
            if self._pos >= len(self._buf):
                if self._done:
                    break
                item = self._queue.get()
                if isinstance(item, BaseException):
                    self._done = True
                    raise item
                if not item:
                    self._done = True
                    break
                self._buf, self._pos = item, 0
            take = len(self._buf) - self._pos if n < 0 else min(n - len(out), len(self._buf) - self._pos)
            if not out and take == len(self._buf) - self._pos == len(self._buf):
                self._pos = len(self._buf)
                if n < 0 or take == n:
                    return self._buf
                out += self._buf
                continue
            out += self._buf[self._pos:self._pos + take]
            self._pos += take
        return bytes(out)

    def drain(self) -> None:
        while self.read(READ_SIZE):
            pass

    def close(self) -> None:
        """Stop the thread (whatever it has not read stays unread) and wait for it."""
        self._stop.set()
        while self._thread.is_alive():
            with contextlib.suppress(queue.Empty):
                self._queue.get(timeout=0.05)
        self._thread.join()


@contextlib.contextmanager
def open_layer(source: ImageSource, layer: Layer, what: str, *, read_ahead: bool = False) -> Iterator[tarfile.TarFile]:
    """The layer's tar, streamed (``tarfile`` mode ``r|``) from its blob, gzip or
    zstd decompressed by magic number.  On leaving the block the rest of the
    blob is read and both digests are checked: the blob's against
    ``layer.digest``/``layer.size``, the tar's against ``layer.diff_id``.
    Every tar byte passes a :class:`~weenv.packaging.tarscan.TarScan` before
    ``tarfile`` reads it: extended headers of at most
    :data:`~weenv.formats.limits.MAX_TAR_HEADER_BYTES`, GNU sparse maps
    bounded, at most :data:`~weenv.formats.limits.MAX_LAYER_ENTRIES` entries
    and :data:`~weenv.formats.limits.MAX_LAYER_FILE_BYTES` of files.

    ``read_ahead``: decompress and hash in a thread of its own (:class:`_ReadAhead`).

    Raises :class:`InvalidInputError` for a truncated or corrupt blob,
    :class:`DigestMismatchError` for a digest or size that does not match.
    """
    ahead = None
    with source.open_blob(layer.location, what) as blob, contextlib.ExitStack() as stop:
        try:
            head = blob.read(4)
            raw = _HashingReader(blob, head)
            if head.startswith(_GZIP_MAGIC):
                stream = gzip.GzipFile(fileobj=raw, mode="rb")  # type: ignore[arg-type]
            elif head == _ZSTD_MAGIC:
                stream = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)  # type: ignore[arg-type]
            else:
                stream = raw  # type: ignore[assignment]
            scan = TarScan(max_entries=MAX_LAYER_ENTRIES, max_bytes=MAX_LAYER_FILE_BYTES, what=what,
                           sparse=True, compressed=False)  # fmt: skip
            tar_bytes = _HashingReader(stream, on_read=scan.feed)  # type: ignore[arg-type]
            if read_ahead:
                ahead = _ReadAhead(tar_bytes)
                stop.callback(ahead.close)
            tar = tarfile.open(fileobj=ahead or tar_bytes, mode="r|")  # type: ignore[arg-type]
        except _STREAM_ERRORS as exc:
            kind = "truncated or corrupt layer" if isinstance(exc, EOFError) else "not a readable (tar, tar+gzip, tar+zstd) layer"
            raise InvalidInputError(f"{what}: {kind}: {exc}") from exc
        try:
            yield tar
            (ahead or tar_bytes).drain()
            raw.drain()
        except _STREAM_ERRORS as exc:
            raise InvalidInputError(f"{what}: truncated or corrupt layer: {exc}") from exc
        finally:
            tar.close()
    if layer.size is not None and raw.count != layer.size:
        raise DigestMismatchError(f"{what}: blob has {raw.count} bytes, the manifest says {layer.size}")
    if layer.digest is not None and raw.digest() != layer.digest:
        raise DigestMismatchError(f"{what}: blob digest {raw.digest()} does not match the manifest's {layer.digest}")
    if tar_bytes.digest() != layer.diff_id:
        raise DigestMismatchError(
            f"{what}: uncompressed digest {tar_bytes.digest()} does not match the config's diff_id {layer.diff_id}"
        )


# --- writing a group tree ---------------------------------------------------------------
@dataclass
class LayerStats:
    """What applying one layer did."""

    entries: int = 0
    bytes: int = 0
    """Regular file bytes written (holes included)."""
    whiteouts: int = 0
    opaque_dirs: int = 0


@dataclass
class GroupTree:
    """The tree of group ``index`` under ``root`` (created empty), written over
    ``view`` (the groups below; their trees are ``lower_trees``, by index)."""

    root: Path
    index: int
    view: View
    lower_trees: list[Path]
    _dir_times: dict[tuple[str, ...], int] = field(default_factory=dict)
    _new: set[tuple[str, ...]] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.root.mkdir(mode=0o700)
        self._copy_dir_meta((), self.root)

    # --- layers ---------------------------------------------------------------------
    def apply_layer(self, tar: tarfile.TarFile, what: str) -> LayerStats:
        """Apply every entry of the layer ``tar`` (streamed); ``what`` names the
        layer in errors.  Raises :class:`InvalidInputError` for an unsafe or
        malformed entry."""
        self._new = set()
        stats = LayerStats()
        name = "(start)"
        try:
            for member in tar:
                name = member.name
                stats.entries += 1
                self._apply(tar, member, _parts(member.name, what), stats, what)
        except _CORRUPT_STREAM_ERRORS as exc:
            raise InvalidInputError(f"{what}: truncated or corrupt layer (at {name!r}): {exc}") from exc
        except OSError as exc:
            raise InvalidInputError(f"{what}: cannot apply {name!r}: {exc}") from exc
        return stats

    def finish(self) -> None:
        """Set directory mtimes (children first), now that nothing more is written."""
        for parts in sorted(self._dir_times, key=len, reverse=True):
            ns = self._dir_times[parts]
            st = _lstat(self._path(parts))
            if st is not None and stat.S_ISDIR(st.st_mode):  # a later layer may have removed it
                os.utime(self._path(parts), ns=(ns, ns), follow_symlinks=False)
        self._dir_times.clear()

    def _apply(self, tar: tarfile.TarFile, m: tarfile.TarInfo, parts: tuple[str, ...],
               stats: LayerStats, what: str) -> None:
        if apply_marker(self, m, parts, stats, f"{what}: {m.name!r}"):
            return
        if not parts:
            if not m.isdir():
                raise InvalidInputError(f"{what}: the root entry {m.name!r} is not a directory")
            self._set_meta(self.root, m, (), is_dir=True)
            return
        self._ensure_dir(parts[:-1], what)
        path = self._path(parts)
        old = _lstat(path)
        replaced_non_dir = False
        if old is not None:
            if m.isdir() and stat.S_ISDIR(old.st_mode):
                self._set_meta(path, m, parts, is_dir=True, clear_xattrs=True)
                self._new.add(parts)
                return
            replaced_non_dir = not stat.S_ISDIR(old.st_mode)
            _remove(path, old)
        if m.isdir():
            os.mkdir(path, 0o700)
            self._set_meta(path, m, parts, is_dir=True)
            if replaced_non_dir:
                os.setxattr(path, OPAQUE_XATTR, b"y", follow_symlinks=False)
        elif m.isreg():
            stats.bytes += self._write_file(tar, m, path, what)
        elif m.issym():
            os.symlink(m.linkname, path)
            self._set_meta(path, m, parts, symlink=True)
        elif m.islnk():
            self._hardlink(m, path, what)
        elif m.ischr() or m.isblk():
            kind = stat.S_IFCHR if m.ischr() else stat.S_IFBLK
            os.mknod(path, kind | 0o600, os.makedev(m.devmajor, m.devminor))
            self._set_meta(path, m, parts)
        elif m.isfifo():
            os.mkfifo(path, 0o600)
            self._set_meta(path, m, parts)
        else:
            raise InvalidInputError(f"{what}: entry {m.name!r} has unsupported type {m.type!r}")
        self._new.add(parts)

    def _write_file(self, tar: tarfile.TarFile, m: tarfile.TarInfo, path: Path, what: str) -> int:
        src = tar.extractfile(m)
        if src is None:  # pragma: no cover - isreg() members always have data
            raise InvalidInputError(f"{what}: no data for {m.name!r}")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            written = _copy_sparse(src, fd)
            if written != m.size:
                raise InvalidInputError(f"{what}: {m.name!r} has {written} bytes of data, its header says {m.size}")
            self._set_meta_fd(fd, m)
        finally:
            os.close(fd)
        return written

    def _hardlink(self, m: tarfile.TarInfo, path: Path, what: str) -> None:
        target_parts = _parts(m.linkname, what)
        if not target_parts:
            raise InvalidInputError(f"{what}: hardlink {m.name!r} points at the root")
        self._check_parents(target_parts[:-1], what)
        target = self._path(target_parts)
        st = _lstat(target)
        if st is not None and not stat.S_ISDIR(st.st_mode) and not _is_whiteout(st):
            os.link(target, path, follow_symlinks=False)
            return
        below = self.view.lookup(target_parts)
        if st is None and isinstance(below, int):
            # A link to a file of a lower group: overlayfs cannot link across
            # layers, so the file is copied (data, owner, mode, xattrs, mtime).
            _copy_entry(self.lower_trees[below] / os.path.join(*target_parts), path)
            return
        raise InvalidInputError(f"{what}: hardlink {m.name!r} -> {m.linkname!r}: no such file in the image")

    def _whiteout(self, parts: tuple[str, ...], mtime_ns: int, what: str) -> None:
        if parts in self._new:
            return  # the same layer made it: a whiteout only hides lower layers
        if self._dirs_in_tree(parts[:-1]):
            old = _lstat(self._path(parts))
            if old is not None:
                _remove(self._path(parts), old)
        if self._visible_below(parts):
            self._ensure_dir(parts[:-1], what)
            path = self._path(parts)
            os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(0, 0))
            os.utime(path, ns=(mtime_ns, mtime_ns), follow_symlinks=False)  # repeatable images

    def _opaque(self, parts: tuple[str, ...], what: str) -> None:
        self._ensure_dir(parts, what)
        path = self._path(parts)
        with os.scandir(path) as it:
            entries = list(it)
        for entry in entries:
            if parts + (entry.name,) not in self._new:
                _remove(Path(entry.path), entry.stat(follow_symlinks=False))
        os.setxattr(path, OPAQUE_XATTR, b"y", follow_symlinks=False)

    def _visible_below(self, parts: tuple[str, ...]) -> bool:
        """Whether ``parts`` shows through this group from below: present in the
        view, and no parent in this tree is a non-directory (a whiteout or a
        file hides what is below it) or an opaque directory."""
        if self.view.lookup(parts) is None:
            return False
        for i in range(len(parts)):
            st = _lstat(self._path(parts[:i]))
            if st is None:
                continue
            if not stat.S_ISDIR(st.st_mode) or _is_opaque(self._path(parts[:i])):
                return False
        return True

    def _dirs_in_tree(self, parts: tuple[str, ...]) -> bool:
        """Whether every prefix of ``parts`` is a directory (not a symlink) in this tree."""
        for i in range(1, len(parts) + 1):
            st = _lstat(self._path(parts[:i]))
            if st is None or not stat.S_ISDIR(st.st_mode):
                return False
        return True

    # --- directories ------------------------------------------------------------------
    def _ensure_dir(self, parts: tuple[str, ...], what: str) -> None:
        """Make ``parts`` a directory of this tree, creating missing parents with
        the metadata the image shows for them below (or 0755 root)."""
        for i in range(1, len(parts) + 1):
            prefix = parts[:i]
            path = self._path(prefix)
            st = _lstat(path)
            if st is not None and stat.S_ISDIR(st.st_mode):
                continue
            replaced = False
            if st is not None:
                if prefix in self._new and not _is_whiteout(st):
                    raise InvalidInputError(
                        f"{what}: an entry lies under /{'/'.join(prefix)}, which this layer made "
                        f"a {'symlink' if stat.S_ISLNK(st.st_mode) else 'non-directory'}"
                    )
                _remove(path, st)
                replaced = True
            os.mkdir(path, 0o700)
            self._copy_dir_meta(prefix, path)
            if replaced:
                os.setxattr(path, OPAQUE_XATTR, b"y", follow_symlinks=False)

    def _check_parents(self, parts: tuple[str, ...], what: str) -> None:
        for i in range(1, len(parts) + 1):
            st = _lstat(self._path(parts[:i]))
            if st is not None and not stat.S_ISDIR(st.st_mode):
                raise InvalidInputError(f"{what}: path /{'/'.join(parts)} goes through a non-directory")

    def _copy_dir_meta(self, parts: tuple[str, ...], path: Path) -> None:
        below = self.view.lookup(parts)
        if isinstance(below, _Dir) and below.group >= 0:
            src = self.lower_trees[below.group] / os.path.join(*parts) if parts else self.lower_trees[below.group]
            st = os.lstat(src)
            os.chown(path, st.st_uid, st.st_gid, follow_symlinks=False)
            os.chmod(path, stat.S_IMODE(st.st_mode))
            for key in os.listxattr(src, follow_symlinks=False):
                if key != OPAQUE_XATTR:
                    os.setxattr(path, key, os.getxattr(src, key, follow_symlinks=False), follow_symlinks=False)
            self._dir_times[parts] = st.st_mtime_ns
        else:
            os.chown(path, 0, 0, follow_symlinks=False)
            os.chmod(path, _DEFAULT_DIR_MODE)
            self._dir_times[parts] = 0

    # --- metadata -----------------------------------------------------------------------
    def _set_meta(self, path: Path, m: tarfile.TarInfo, parts: tuple[str, ...], *,
                  is_dir: bool = False, symlink: bool = False, clear_xattrs: bool = False) -> None:
        os.chown(path, m.uid, m.gid, follow_symlinks=False)
        if not symlink:
            os.chmod(path, m.mode & 0o7777)
        xattrs = _xattrs(m)
        if clear_xattrs:
            for key in os.listxattr(path, follow_symlinks=False):
                if key not in xattrs and key != OPAQUE_XATTR:
                    os.removexattr(path, key, follow_symlinks=False)
        for key, value in xattrs.items():
            _setxattr(path, key, value, symlink)
        ns = _mtime_ns(m)
        if is_dir:
            self._dir_times[parts] = ns
        else:
            os.utime(path, ns=(ns, ns), follow_symlinks=False)

    def _set_meta_fd(self, fd: int, m: tarfile.TarInfo) -> None:
        os.fchown(fd, m.uid, m.gid)
        os.fchmod(fd, m.mode & 0o7777)
        for key, value in _xattrs(m).items():
            os.setxattr(fd, key, value)
        ns = _mtime_ns(m)
        os.utime(fd, ns=(ns, ns))

    def _path(self, parts: tuple[str, ...]) -> Path:
        return self.root.joinpath(*parts) if parts else self.root


# --- helpers ------------------------------------------------------------------------------
def apply_marker(tree, m: tarfile.TarInfo, parts: tuple, stats: LayerStats, what: str) -> bool:
    """If entry ``m`` (at ``parts``) is a whiteout or opaque marker (:func:`marker`),
    apply it to ``tree`` (its ``_opaque(dir parts, what)`` or ``_whiteout(parts,
    mtime_ns, what)``), count it in ``stats`` and return True."""
    kind, target = marker(parts[-1] if parts else "", what)
    if kind == "opaque":
        stats.opaque_dirs += 1
        tree._opaque(parts[:-1], what)
    elif kind == "whiteout":
        stats.whiteouts += 1
        tree._whiteout(parts[:-1] + (target,), _mtime_ns(m), what)
    return kind != "entry"


def marker(name, what: str):
    """What an entry's last name (``str`` or ``bytes``) says: ``("opaque",
    None)`` for ``.wh..wh..opq``, ``("skip", None)`` for other ``.wh..wh.*``
    (AUFS bookkeeping: ``.wh..wh.plnk``, ``.wh..wh.aufs``), ``("whiteout",
    NAME)`` for ``.wh.NAME``, ``("entry", None)`` otherwise.
    :class:`InvalidInputError` (``what``: the entry) for ``.wh.``, ``.wh..``, ``.wh...``."""
    prefix = WHITEOUT_PREFIX if isinstance(name, str) else WHITEOUT_PREFIX.encode()
    if name == (OPAQUE_MARKER if isinstance(name, str) else OPAQUE_MARKER.encode()):
        return "opaque", None
    if name.startswith(prefix + prefix):
        return "skip", None
    if name.startswith(prefix):
        target = name[len(prefix):]
        if target in ("", ".", "..", b"", b".", b".."):
            raise InvalidInputError(f"{what}: a bad whiteout")
        return "whiteout", target
    return "entry", None


def _parts(name: str, what: str) -> tuple[str, ...]:
    """A tar entry name as path components below the root; ``..`` is refused."""
    parts = []
    for part in name.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            raise InvalidInputError(f"{what}: entry {name!r} climbs out of the root ('..')")
        parts.append(part)
    return tuple(parts)


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def _remove(path: Path, st: os.stat_result) -> None:
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _xattrs(m: tarfile.TarInfo) -> dict[str, bytes]:
    """The entry's xattrs from PAX records (SCHILY.xattr.NAME = raw value;
    LIBARCHIVE.xattr.URLENCODED-NAME = base64 value)."""
    found: dict[str, bytes] = {}
    for key, value in m.pax_headers.items():
        if key.startswith("SCHILY.xattr."):
            found[key[len("SCHILY.xattr."):]] = value.encode("utf-8", "surrogateescape")
        elif key.startswith("LIBARCHIVE.xattr."):
            name = urllib.parse.unquote(key[len("LIBARCHIVE.xattr."):])
            found[name] = base64.b64decode(value + "=" * (-len(value) % 4))
    out = {}
    for key, value in found.items():
        if key.startswith(OVERLAY_XATTR_PREFIX):
            key = OVERLAY_XATTR_PREFIX + "overlay." + key[len(OVERLAY_XATTR_PREFIX):]
        out[key] = value
    return out


def _setxattr(path: Path, key: str, value: bytes, symlink: bool) -> None:
    try:
        os.setxattr(path, key, value, follow_symlinks=False)
    except OSError as exc:
        # Linux allows only trusted.* and security.* xattrs on symlinks.
        if not (symlink and exc.errno in (errno.EPERM, errno.ENOTSUP)):
            raise


def _mtime_ns(m: tarfile.TarInfo) -> int:
    text = m.pax_headers.get("mtime")
    if text:
        whole, _, frac = text.partition(".")
        try:
            sign = -1 if whole.startswith("-") else 1
            return int(whole) * 1_000_000_000 + sign * int((frac + "000000000")[:9])
        except ValueError:
            pass
    return int(m.mtime) * 1_000_000_000


def _copy_sparse(src: IO[bytes], fd: int) -> int:
    """Copy ``src`` to ``fd``, skipping (lseek) 4 KiB blocks of zeros; return bytes."""
    pos = 0
    while True:
        buf = src.read(READ_SIZE)
        if not buf:
            break
        n = len(buf)
        if buf == _ZERO_READ[:n]:
            pos += n
            continue
        view = memoryview(buf)
        start = 0  # first byte of the current run of data blocks
        for off in range(0, n, BLOCK):
            if buf[off:off + BLOCK] == _ZERO_BLOCK[:min(BLOCK, n - off)]:
                if start < off:
                    os.pwrite(fd, view[start:off], pos + start)
                start = off + BLOCK
        if start < n:
            os.pwrite(fd, view[start:n], pos + start)
        pos += n
    os.ftruncate(fd, pos)
    return pos


def _copy_entry(src: Path, dest: Path) -> None:
    """Copy one non-directory ``src`` to ``dest`` with owner, mode, xattrs, mtime."""
    st = os.lstat(src)
    if stat.S_ISLNK(st.st_mode):
        os.symlink(os.readlink(src), dest)
    elif stat.S_ISREG(st.st_mode):
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            with open(src, "rb") as f:
                _copy_sparse(f, fd)
        finally:
            os.close(fd)
    else:
        os.mknod(dest, stat.S_IFMT(st.st_mode) | 0o600, st.st_rdev)
    os.chown(dest, st.st_uid, st.st_gid, follow_symlinks=False)
    if not stat.S_ISLNK(st.st_mode):
        os.chmod(dest, stat.S_IMODE(st.st_mode))
    for key in os.listxattr(src, follow_symlinks=False):
        _setxattr(dest, key, os.getxattr(src, key, follow_symlinks=False), stat.S_ISLNK(st.st_mode))
    os.utime(dest, ns=(st.st_mtime_ns, st.st_mtime_ns), follow_symlinks=False)
