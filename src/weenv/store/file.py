"""The local-directory store (``file:///path``), the embedded default.

Layout under the root::

    chunks/sha256/ab/abcdef...      zstd frame of a chunk (address: plaintext sha256)
    manifests/sha256/abcdef...      canonical JSON of a manifest
    packs/sha256/abcdef...          a prefetch pack (address: sha256 of these bytes)
    refs/templates/NAME             a digest, one line
    refs/groups/NAME
    refs/buildcache/KEY
    refs/prefetch/HEX               a template's prefetch profile

Writes are atomic: a temporary file in the same directory, fsync'd data, then
rename(2) over the final name.  Ref writes and deletes hold ``refs/.lock``
(flock(2), exclusive), so :meth:`FileStore.swap_ref` is a real compare-and-swap
among every process on this host using the store (on NFS, as far as its
locking goes).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from weenv.errors import (
    InvalidInputError,
    NotFoundError,
    StoreUnavailableError,
    WeenvError,
)
from weenv.formats.limits import MAX_REF_BYTES
from weenv.formats.manifest import check_digest
from weenv.store.base import Store, read_limit, ref_moved, too_large

log = logging.getLogger(__name__)

STREAM_PIECE = 1 << 20
"""Bytes per piece of :meth:`FileStore._stream`."""


def atomic_write(path: Path, data: bytes, *, durable: bool = True) -> None:
    """Write ``data`` to ``path`` atomically (temporary file + rename).

    ``durable``: fsync(2) the file before the rename, so that after a crash the
    name holds the whole content or is absent.  Without it a crash may leave
    the name with a short or empty file: only for files whose readers check
    them (the node chunk cache hashes a chunk found on disk before its first
    use)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.rename(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def _read_capped(path: Path, limit: int) -> bytes:
    """At most ``limit + 1`` bytes of ``path`` (a longer file is damaged: its parse fails)."""
    with open(path, "rb") as f:
        return f.read(limit + 1)


class FileStore(Store):
    """A store in a local directory ``root`` (created if missing).

    A failed system call (a full or read-only file system, no permission, a
    path too long) is raised as :class:`StoreUnavailableError` naming the store;
    a ref whose file is not one digest line as :class:`InvalidInputError`
    naming the ref."""

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root).absolute()
        self.url = f"file://{self.root}"
        with self._os_errors("create"):
            self.root.mkdir(parents=True, exist_ok=True)

    @contextlib.contextmanager
    def _os_errors(self, action: str):
        """Map an ``OSError`` (not already a weenv error) to :class:`StoreUnavailableError`."""
        try:
            yield
        except (WeenvError, FileNotFoundError):
            raise
        except OSError as exc:
            raise self._unavailable(action, exc) from exc

    def _unavailable(self, action: str, exc: OSError) -> StoreUnavailableError:
        where = f" ({exc.filename})" if exc.filename else ""
        error = StoreUnavailableError(f"cannot {action} store {self.url}: {exc.strerror or exc}{where}")
        error.errno = exc.errno
        return error

    def _path(self, space: str, digest: str) -> Path:
        hexdigest = check_digest(digest).split(":", 1)[1]
        if space == "chunks":
            return self.root / "chunks" / "sha256" / hexdigest[:2] / hexdigest
        if space in ("manifests", "packs"):
            return self.root / space / "sha256" / hexdigest
        raise InvalidInputError(f"unknown store space {space!r}")

    def _has(self, space: str, digest: str) -> bool:
        with self._os_errors("read"):
            return self._path(space, digest).is_file()

    def _put(self, space: str, digest: str, data: bytes) -> None:
        with self._os_errors("write to"):
            atomic_write(self._path(space, digest), data)

    def _open(self, space: str, digest: str, limit: int):
        """The blob's file, open, after checking its size against ``limit``."""
        try:
            with self._os_errors("read"):
                f = self._path(space, digest).open("rb")
        except FileNotFoundError:
            raise NotFoundError(f"no {space[:-1]} {digest} in {self.url}") from None
        try:
            size = os.fstat(f.fileno()).st_size
        except OSError as exc:
            f.close()
            raise self._unavailable("read", exc) from exc
        if size > limit:
            f.close()
            raise too_large(f"{space[:-1]} {digest} in {self.url}", size, limit)
        return f

    def _get(self, space: str, digest: str, max_bytes: int | None = None) -> bytes:
        limit = read_limit(space, max_bytes)
        with self._open(space, digest, limit) as f, self._os_errors("read"):
            data = f.read(limit + 1)  # it may have grown since the fstat
        if len(data) > limit:
            raise too_large(f"{space[:-1]} {digest} in {self.url}", len(data), limit)
        return data

    def _stream(self, space: str, digest: str, max_bytes: int | None = None) -> Iterator[bytes]:
        limit = read_limit(space, max_bytes)
        f = self._open(space, digest, limit)
        got = 0
        with f, self._os_errors("read"):
            while piece := f.read(STREAM_PIECE):
                got += len(piece)
                if got > limit:
                    raise too_large(f"{space[:-1]} {digest} in {self.url}", got, limit)
                yield piece

    def _list(self, space: str) -> Iterator[str]:
        base = self.root / space / "sha256"
        if not base.is_dir():
            return
        for _dirpath, _dirs, files in os.walk(base):
            for name in files:
                if not name.startswith(".tmp-"):
                    yield f"sha256:{name}"

    def _modified(self, space: str, digest: str) -> float | None:
        try:
            with self._os_errors("read"):
                return self._path(space, digest).stat().st_mtime
        except FileNotFoundError:
            return None

    def _delete(self, space: str, digest: str) -> None:
        with self._os_errors("delete from"):
            self._path(space, digest).unlink(missing_ok=True)

    def _ref_path(self, kind: str, name: str) -> Path:
        self._check_ref(kind, name)
        return self.root / "refs" / kind / name

    @contextlib.contextmanager
    def _refs_locked(self):
        """Hold ``refs/.lock`` exclusively (flock(2)) for a ref's read-check-write."""
        with self._os_errors("lock refs of"):
            (self.root / "refs").mkdir(parents=True, exist_ok=True)
            fd = os.open(self.root / "refs" / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def set_ref(self, kind: str, name: str, digest: str) -> None:
        check_digest(digest)
        path = self._ref_path(kind, name)
        with self._refs_locked(), self._os_errors("write to"):
            atomic_write(path, (digest + "\n").encode())

    def swap_ref(self, kind: str, name: str, digest: str, *, expected: str | None) -> None:
        """:meth:`Store.swap_ref`, atomically: the read, the check and the write
        happen under ``refs/.lock``."""
        check_digest(digest)
        path = self._ref_path(kind, name)
        with self._refs_locked():
            current = self.ref_or_none(kind, name)
            if current != expected:
                raise ref_moved(self.url, kind, name, current, expected)
            with self._os_errors("write to"):
                atomic_write(path, (digest + "\n").encode())

    def get_ref(self, kind: str, name: str) -> str:
        path = self._ref_path(kind, name)
        try:
            data = _read_capped(path, MAX_REF_BYTES)
        except FileNotFoundError:
            raise NotFoundError(f"no {kind[:-1]} named {name!r} in {self.url}") from None
        except IsADirectoryError:
            raise InvalidInputError(f"ref {kind}/{name} in {self.url} is a directory, not a ref") from None
        except OSError as exc:
            raise self._unavailable("read", exc) from exc
        return self._parse_ref(kind, name, data)

    def _parse_ref(self, kind: str, name: str, data: bytes) -> str:
        try:
            return check_digest(data.decode().strip())
        except (UnicodeDecodeError, InvalidInputError):
            raise InvalidInputError(
                f"ref {kind}/{name} in {self.url} is damaged: it holds {data[:80]!r}, not a digest"
            ) from None

    def delete_ref(self, kind: str, name: str, *, expected: str | None = None) -> None:
        """:meth:`Store.delete_ref`; with ``expected`` atomically (under ``refs/.lock``)."""
        path = self._ref_path(kind, name)
        with self._refs_locked():
            if expected is not None and self.ref_or_none(kind, name) != expected:
                return
            with self._os_errors("delete from"):
                path.unlink(missing_ok=True)

    def ref_names(self, kind: str) -> list[str]:
        self._check_ref(kind, "x")
        base = self.root / "refs" / kind
        with self._os_errors("read"):
            if not base.is_dir():
                return []
            return sorted(p.name for p in base.iterdir() if not p.name.startswith(".tmp-"))

    def list_refs(self, kind: str) -> dict[str, str]:
        """Every ref of ``kind``; a damaged ref (not a digest) is left out with a warning."""
        self._check_ref(kind, "x")
        base = self.root / "refs" / kind
        refs = {}
        with self._os_errors("read"):
            if not base.is_dir():
                return {}
            for p in sorted(base.iterdir()):
                if not p.is_file() or p.name.startswith(".tmp-"):
                    continue
                try:
                    refs[p.name] = self._parse_ref(kind, p.name, _read_capped(p, MAX_REF_BYTES))
                except InvalidInputError as exc:
                    log.warning("%s", exc)
                except FileNotFoundError:  # deleted meanwhile
                    continue
        return refs
