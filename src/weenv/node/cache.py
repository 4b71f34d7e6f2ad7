"""The node chunk cache: verified plaintext chunks on local disk, by digest.

Layout under ``root`` (separate from any store)::

    sha256/ab/abcdef...     plaintext of chunk sha256:abcdef... (bytes)
    sha256/ab/.tmp-*        a write in progress (removed on failure)

A chunk enters the cache only through :meth:`ChunkCache.ensure`, which fetches
it with :meth:`weenv.store.base.Store.get_chunk` (decompressed and sha256-checked
there) and writes it atomically: temporary file, fsync, rename(2).  A file
under its final name is therefore always complete and verified; the cache does
not re-hash on read.

Fetches are *single-flight*: concurrent ``ensure`` calls for one missing chunk
ask the store once; the others wait for that one result, an error included
(nothing is cached then, and the next call tries again).  The only lock shared
by all chunks guards a dict and a few counters; it is never held during a fetch
or a disk write.
"""

from __future__ import annotations

import os
import shutil
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from weenv.packaging.manifest import ChunkRef, check_digest
from weenv.store.base import Store
from weenv.store.file import atomic_write


@dataclass(frozen=True)
class CacheStats:
    """Counters of a :class:`ChunkCache` since it was created (or :meth:`ChunkCache.reset_stats`)."""

    chunks_fetched: int
    """Chunks fetched from the store (a failed fetch does not count)."""
    bytes_fetched: int
    """Bytes fetched from the store: the stored (zstd) size of each fetched chunk
    (``ChunkRef.stored_size``; the plaintext size when only a digest was given)."""
    bytes_served: int
    """Plaintext bytes returned by :meth:`ChunkCache.read`."""
    fetch_errors: int
    """Fetches that raised (each counted once, however many callers waited)."""


class ChunkCache:
    """Plaintext chunks in ``root``, fetched on demand from ``store``.

    Thread-safe.  Errors: whatever ``store.get_chunk`` raises
    (:class:`~weenv.errors.NotFoundError`, :class:`~weenv.errors.DigestMismatchError`,
    backend ``OSError``\\s), and ``OSError`` from the local disk.
    """

    def __init__(self, root: str | os.PathLike[str], store: Store):
        self.root = Path(root).absolute()
        self.store = store
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()  # guards _inflight and the counters only
        self._inflight: dict[str, Future[Path]] = {}
        self._chunks_fetched = 0
        self._bytes_fetched = 0
        self._bytes_served = 0
        self._fetch_errors = 0

    # --- paths -------------------------------------------------------------------------
    def path(self, digest: str) -> Path:
        """Where chunk ``digest`` lives (whether or not it is cached)."""
        hexdigest = check_digest(digest).split(":", 1)[1]
        return self.root / "sha256" / hexdigest[:2] / hexdigest

    def has(self, digest: str) -> bool:
        """Whether chunk ``digest`` is cached (complete and verified)."""
        return self.path(digest).is_file()

    # --- fetching ----------------------------------------------------------------------
    def ensure(self, chunk: ChunkRef | str) -> Path:
        """Path of the cached plaintext of ``chunk``, fetching it if missing.

        ``chunk`` is a :class:`ChunkRef` (preferred: its ``stored_size`` feeds
        ``bytes_fetched``) or a bare digest.  Blocks while a fetch (this
        caller's or another's) runs; raises the fetch's error to every waiter.
        """
        digest = chunk.digest if isinstance(chunk, ChunkRef) else check_digest(chunk)
        path = self.path(digest)
        if path.is_file():
            return path
        with self._lock:
            future = self._inflight.get(digest)
            leader = future is None
            if leader:
                # Checked under the lock: a leader renames the file into place
                # before it leaves _inflight, so no finished fetch is missed.
                if path.is_file():
                    return path
                future = self._inflight[digest] = Future()
        if not leader:
            return future.result()
        try:
            stored_digest = chunk.stored_digest if isinstance(chunk, ChunkRef) else None
            plaintext = self.store.get_chunk(digest, stored_digest=stored_digest)
            atomic_write(path, plaintext)
        except BaseException as exc:
            with self._lock:
                self._fetch_errors += 1
                del self._inflight[digest]
            future.set_exception(exc)
            raise
        stored = chunk.stored_size if isinstance(chunk, ChunkRef) else len(plaintext)
        with self._lock:
            self._chunks_fetched += 1
            self._bytes_fetched += stored
            del self._inflight[digest]
        future.set_result(path)
        return path

    def read(self, chunk: ChunkRef | str, offset: int, size: int) -> bytes:
        """Up to ``size`` plaintext bytes of ``chunk`` from byte ``offset`` (fetching it if missing).

        Returns fewer bytes only at the chunk's end.
        """
        path = self.ensure(chunk)
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            data = os.pread(fd, size, offset)
        finally:
            os.close(fd)
        with self._lock:
            self._bytes_served += len(data)
        return data

    # --- bookkeeping -------------------------------------------------------------------
    @property
    def chunks_fetched(self) -> int:
        return self._chunks_fetched

    @property
    def bytes_fetched(self) -> int:
        return self._bytes_fetched

    @property
    def bytes_served(self) -> int:
        return self._bytes_served

    def stats(self) -> CacheStats:
        """A consistent snapshot of the counters."""
        with self._lock:
            return CacheStats(
                self._chunks_fetched, self._bytes_fetched, self._bytes_served, self._fetch_errors
            )

    def reset_stats(self) -> None:
        with self._lock:
            self._chunks_fetched = self._bytes_fetched = self._bytes_served = self._fetch_errors = 0

    def cached_digests(self) -> list[str]:
        """Digests of every cached chunk (a directory walk; for tools and tests)."""
        base = self.root / "sha256"
        if not base.is_dir():
            return []
        return sorted(
            f"sha256:{p.name}" for p in base.glob("*/*") if not p.name.startswith(".tmp-")
        )

    def clear(self) -> None:
        """Remove every cached chunk.  Do not call while chunks are being read or
        fetched (a reader may see a missing file; a fetch may land afterwards)."""
        shutil.rmtree(self.root / "sha256", ignore_errors=True)
