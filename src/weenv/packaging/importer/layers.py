"""Reading OCI layer tars, and what applying them to a group means.

weenv streams layers into the image writer (:mod:`~weenv.packaging.importer.tartree`);
the old path that extracted them to a directory tree first lives in the benchmarks
(``weenv_bench.extracting_import``), kept to compare against.  Both follow the
rules below.

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
import gzip
import hashlib
import os
import queue
import stat
import tarfile
import threading
import urllib.parse
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
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
_GZIP_MAGIC = b"\x1f\x8b"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


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
            piece = self._buf[self._pos : self._pos + n]
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
            out += self._buf[self._pos : self._pos + take]
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
            scan = TarScan(
                max_entries=MAX_LAYER_ENTRIES, max_bytes=MAX_LAYER_FILE_BYTES, what=what, sparse=True, compressed=False
            )
            tar_bytes = _HashingReader(stream, on_read=scan.feed)  # type: ignore[arg-type]
            if read_ahead:
                ahead = _ReadAhead(tar_bytes)
                stop.callback(ahead.close)
            tar = tarfile.open(fileobj=ahead or tar_bytes, mode="r|")  # type: ignore[arg-type]
        except _STREAM_ERRORS as exc:
            kind = (
                "truncated or corrupt layer"
                if isinstance(exc, EOFError)
                else "not a readable (tar, tar+gzip, tar+zstd) layer"
            )
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
        target = name[len(prefix) :]
        if target in ("", ".", "..", b"", b".", b".."):
            raise InvalidInputError(f"{what}: a bad whiteout")
        return "whiteout", target
    return "entry", None


def _xattrs(m: tarfile.TarInfo) -> dict[str, bytes]:
    """The entry's xattrs from PAX records (SCHILY.xattr.NAME = raw value;
    LIBARCHIVE.xattr.URLENCODED-NAME = base64 value)."""
    found: dict[str, bytes] = {}
    for key, value in m.pax_headers.items():
        if key.startswith("SCHILY.xattr."):
            found[key[len("SCHILY.xattr.") :]] = value.encode("utf-8", "surrogateescape")
        elif key.startswith("LIBARCHIVE.xattr."):
            name = urllib.parse.unquote(key[len("LIBARCHIVE.xattr.") :])
            found[name] = base64.b64decode(value + "=" * (-len(value) % 4))
    out = {}
    for key, value in found.items():
        if key.startswith(OVERLAY_XATTR_PREFIX):
            key = OVERLAY_XATTR_PREFIX + "overlay." + key[len(OVERLAY_XATTR_PREFIX) :]
        out[key] = value
    return out


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
