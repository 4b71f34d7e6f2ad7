"""The node chunk cache: verified plaintext chunks on local disk, by digest, bounded in bytes.

Layout under ``root`` (separate from any store)::

    sha256/ab/abcdef...     plaintext of chunk sha256:abcdef... (bytes)
    sha256/ab/.tmp-*        a write in progress (removed on failure, and at start)

A chunk enters the cache only through :meth:`ChunkCache.ensure` (or
:meth:`~ChunkCache.read`), which fetches it with
:meth:`weenv.store.base.Store.get_chunk` (decompressed and sha256-checked there)
and writes it atomically: temporary file, rename(2).  No fsync(2): a chunk
that a crash left short or empty is caught by the check below (**Restarts**).

Fetches are *single-flight*: concurrent calls for one missing chunk ask the
store once; the others wait for that one result, an error included (nothing is
cached then, and the next call tries again).  The lock shared by all chunks
guards the index and a few counters; it is never held during a fetch or a
chunk write (only during the unlink(2) of evicted chunks, so that an eviction
never deletes a chunk fetched again meanwhile).

**Bound and eviction.**  The cached plaintext never exceeds ``max_bytes``
(room is reserved before a chunk is written).  The index is an LRU list (a use
moves a chunk to the end); to make room, the least recently used chunks are
unlinked.  The rule: *any* cached chunk may be evicted, including chunks of
groups mounted through LazyFS, because every chunk in the cache came from the
store, which serves it again on the next read (a content-addressed store never
changes a chunk).  Groups that no longer depend on the cache (fully cached
groups mounted directly from an assembled image, :mod:`weenv.node.data.groups`)
read their own image file, not these chunks.  Chunks being fetched are never
evicted; a reader that finds its chunk evicted between lookup and open fetches
it again.  A chunk larger than ``max_bytes`` is served from memory, uncached.
Prefetch (:mod:`weenv.node.data.prefetch`) stops before it would evict its own work.

**Restarts.**  The index is rebuilt from disk at construction (LRU order by
file mtime; leftover temporary files removed; over-bound chunks evicted), so a
new daemon on the same home fetches nothing already here.  A chunk found on disk
is *unverified* until its first use in this process, which hashes it (sha256 of
up to one chunk, once): a truncated or corrupted file (a crash, a full disk, a
tampering) is deleted and fetched again, never served.  Every read also checks
the file's size against the :class:`ChunkRef`, so a chunk truncated while the
daemon runs is fetched again too.

**Full disk.**  A write that fails with ENOSPC/EDQUOT evicts least recently
used chunks (at least twice the chunk, and a quarter of the cache) and retries
once; if it fails again, :class:`~weenv.errors.CapacityError` names the cache
(LazyFS answers the read with EIO).  Nothing waits for space to appear.

**Priority.**  Fetches are *demand* (a reader waits) or *prefetch*
(``prefetch=True``).  :meth:`ChunkCache.wait_demand_idle` lets background
prefetch yield while any demand fetch runs.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import re
import shutil
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from weenv.config import settings
from weenv.errors import FULL_ERRNOS, CapacityError, DigestMismatchError, InvalidInputError
from weenv.formats.manifest import ChunkRef, check_digest
from weenv.store.base import Store, decode_frame
from weenv.store.file import atomic_write

log = logging.getLogger(__name__)

GiB = 1 << 30
DEFAULT_MAX_BYTES_CAP = 10 * GiB
DEFAULT_MAX_FRACTION = 0.20
"""Default bound: 20% of the cache's file system, at most 10 GiB (``WEENV_CACHE_BYTES`` overrides)."""

_HEX = re.compile(r"^[0-9a-f]{64}\Z")


class _FrameRejected(Exception):
    """What waiters of a chunk get when the pack frame its leader held was bad: they ask again."""


def default_max_bytes(root: str | os.PathLike[str]) -> int:
    """``WEENV_CACHE_BYTES`` if set, else 20% of the file system holding ``root``
    (which must exist), at most 10 GiB."""
    bound = settings().cache.max_bytes
    if bound is not None:
        return bound
    st = os.statvfs(root)
    return min(DEFAULT_MAX_BYTES_CAP, int(st.f_blocks * st.f_frsize * DEFAULT_MAX_FRACTION))


@dataclass(frozen=True)
class CacheStats:
    """Counters of a :class:`ChunkCache` since it was created (or :meth:`ChunkCache.reset_stats`),
    and its current size."""

    chunks_fetched: int
    """Chunks fetched from the store (a failed fetch does not count)."""
    bytes_fetched: int
    """Bytes fetched from the store: the stored (zstd) size of each fetched chunk
    (``ChunkRef.stored_size``; the plaintext size when only a digest was given)."""
    bytes_served: int
    """Plaintext bytes returned by :meth:`ChunkCache.read`."""
    fetch_errors: int
    """Fetches that raised (each counted once, however many callers waited)."""
    chunks_evicted: int = 0
    """Chunks removed to stay under the bound or after ENOSPC."""
    chunks_prefetched: int = 0
    """Of ``chunks_fetched``, those fetched with ``prefetch=True``."""
    chunks_invalid: int = 0
    """Cached chunks found truncated or corrupt (deleted and fetched again)."""
    chunks_cached: int = 0
    """Chunks in the cache now."""
    bytes_cached: int = 0
    """Plaintext bytes in the cache now (at most ``max_bytes``)."""
    max_bytes: int = 0
    reads_hit: int = 0
    """Reads (not prefetches) that found their chunk in the cache."""
    reads_missed: int = 0
    """Reads that did not: they fetched the chunk, or waited for its fetch."""


@dataclass
class _Entry:
    size: int
    verified: bool


class ChunkCache:
    """Plaintext chunks in ``root``, fetched on demand from ``store``, at most
    ``max_bytes`` of them (default :func:`default_max_bytes`).

    Thread-safe.  Errors: whatever ``store.get_chunk`` raises
    (:class:`~weenv.errors.NotFoundError`, :class:`~weenv.errors.DigestMismatchError`,
    :class:`~weenv.errors.StoreUnavailableError`, backend ``OSError``\\s),
    :class:`~weenv.errors.CapacityError` when the disk stays full after eviction,
    and ``OSError`` from the local disk.
    """

    def __init__(self, root: str | os.PathLike[str], store: Store, *, max_bytes: int | None = None):
        self.root = Path(root).absolute()
        self.store = store
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_bytes = default_max_bytes(self.root) if max_bytes is None else int(max_bytes)
        if self.max_bytes < 0:
            raise InvalidInputError(f"bad cache bound {max_bytes!r}: want bytes >= 0")
        self._lock = threading.Lock()  # guards the index, _inflight and the counters
        self._demand_idle = threading.Condition(self._lock)
        self._inflight: dict[str, Future[Path | bytes]] = {}
        self._index: OrderedDict[str, _Entry] = OrderedDict()  # LRU first
        self._bytes = 0  # indexed + reserved plaintext bytes
        self._demand = 0  # demand fetches running
        self.frames: Callable[[str], bytes | None] | None = None
        """Where a demand fetch looks first (set by :class:`~weenv.node.data.prefetch.Prefetcher`):
        digest -> the chunk's zstd frame, taken out of a prefetch pack streaming
        now (received, not yet taken by a prefetch worker), or None.  The frame is
        checked as a store's is; a bad one is dropped and the store asked."""
        self.reset_stats()
        self._load()

    # --- the index ------------------------------------------------------------------------
    def _load(self) -> None:
        """Rebuild the index from disk (a restart finds its chunks again)."""
        base = self.root / "sha256"
        found: list[tuple[int, str, int]] = []
        if base.is_dir():
            for sub in base.iterdir():
                if not sub.is_dir():
                    continue
                for p in sub.iterdir():
                    try:
                        if p.name.startswith(".tmp-") or not _HEX.match(p.name) or p.name[:2] != sub.name:
                            p.unlink()  # an interrupted write, or not ours
                            continue
                        st = p.stat()
                    except OSError:
                        continue
                    found.append((st.st_mtime_ns, "sha256:" + p.name, st.st_size))
        found.sort()
        with self._lock:
            for _mtime, digest, size in found:
                self._index[digest] = _Entry(size, verified=False)
                self._bytes += size
            self._evict_locked(0)
        if found:
            log.info("chunk cache %s: %d chunks, %d bytes found on disk", self.root, len(found), self._bytes)

    def _evict_locked(self, need: int, *, at_least: int = 0) -> int:
        """Unlink LRU chunks until ``need`` more bytes fit under the bound (and at
        least ``at_least`` bytes went).  Caller holds ``_lock``.  Returns bytes freed."""
        freed = 0
        for digest in list(self._index):
            if self._bytes + need <= self.max_bytes and freed >= at_least:
                break
            if digest in self._inflight:
                continue
            entry = self._index.pop(digest)
            self._bytes -= entry.size
            freed += entry.size
            self._evicted += 1
            try:
                os.unlink(self.path(digest))
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("cannot evict %s: %s", digest, exc)
        return freed

    def _forget(self, digest: str) -> None:
        """Drop a chunk whose file is missing or bad (it will be fetched again)."""
        with self._lock:
            entry = self._index.pop(digest, None)
            if entry is not None:
                self._bytes -= entry.size
                self._invalid += 1
                try:
                    os.unlink(self.path(digest))
                except FileNotFoundError:
                    pass

    # --- paths -------------------------------------------------------------------------
    def path(self, digest: str) -> Path:
        """Where chunk ``digest`` lives (whether or not it is cached)."""
        hexdigest = check_digest(digest).split(":", 1)[1]
        return self.root / "sha256" / hexdigest[:2] / hexdigest

    def has(self, digest: str) -> bool:
        """Whether chunk ``digest`` is cached (an unverified chunk found at start counts)."""
        with self._lock:
            return check_digest(digest) in self._index

    def has_all(self, digests) -> bool:
        """Whether every chunk of ``digests`` is cached (one lock, no disk access)."""
        with self._lock:
            return all(d in self._index for d in digests)

    def fetching_any(self, digests) -> bool:
        """Whether a fetch (or a pack frame's decode) of a chunk of ``digests`` runs now (one lock)."""
        with self._lock:
            return any(d in self._inflight for d in digests)

    # --- fetching ----------------------------------------------------------------------
    def ensure(self, chunk: ChunkRef | str, *, prefetch: bool = False) -> Path:
        """Path of the cached plaintext of ``chunk``, fetching it if missing.

        ``chunk`` is a :class:`ChunkRef` (preferred: its ``stored_size`` feeds
        ``bytes_fetched`` and its ``size`` is checked) or a bare digest.  Blocks
        while a fetch (this caller's or another's) runs; raises the fetch's
        error to every waiter.  The file may be evicted once this returns; use
        :meth:`read` to read it.  Raises :class:`CapacityError` for a chunk
        larger than ``max_bytes`` (which :meth:`read` serves uncached).
        """
        got = self._get(chunk, prefetch)
        if isinstance(got, bytes):
            raise CapacityError(f"chunk of {len(got)} bytes does not fit the cache bound of {self.max_bytes} bytes")
        return got

    def put_frame(self, chunk: ChunkRef, frame: bytes) -> bool:
        """Cache ``chunk`` from ``frame``, its zstd frame as a prefetch pack
        holds it (:mod:`weenv.packaging.profile`), as a prefetch fetch counted
        in ``chunks_fetched``/``bytes_fetched``.  The chunk's fetch slot is
        taken before the frame is decoded, so a reader asking for the chunk
        meanwhile waits for the decode instead of fetching it again; a bad
        frame raises :class:`DigestMismatchError` here, and such a reader then
        fetches the chunk itself (never fails for it).  False, and nothing
        done, when the chunk is cached (or found on disk) or another fetch of it runs."""
        return self._get(chunk, prefetch=True, frame=frame) is not None

    def _get(self, chunk: ChunkRef | str, prefetch: bool = False, frame: bytes | None = None) -> Path | bytes | None:
        """The chunk's path (or its bytes when over the bound), fetched if
        missing.  With ``frame`` (its zstd frame, from a prefetch pack) it is
        decoded, checked and written instead of a fetch, and only by a leader:
        None if the chunk is cached, on disk or in flight."""
        digest = chunk.digest if isinstance(chunk, ChunkRef) else check_digest(chunk)
        path = self.path(digest)
        counted = prefetch or frame is not None  # reads only count as hits or misses
        while True:
            with self._lock:
                entry = self._index.get(digest)
                if not counted:
                    counted = True
                    if entry is not None:
                        self._reads_hit += 1
                    else:
                        self._reads_missed += 1
                if frame is not None and (entry is not None or digest in self._inflight):
                    return None
                if entry is not None and entry.verified:
                    self._index.move_to_end(digest)
                    return path
                future = self._inflight.get(digest)
                leader = future is None
                if leader:
                    future = self._inflight[digest] = Future()
                    if not prefetch:
                        self._demand += 1
            if leader:
                break
            try:
                return future.result()
            except _FrameRejected:  # the leader's pack frame was bad: ask again (this caller may lead now)
                continue
        try:
            if entry is not None and self._verify(digest, chunk, path):
                with self._lock:
                    if digest in self._index:
                        self._index[digest].verified = True
                        self._index.move_to_end(digest)
                result: Path | bytes = path
            else:
                if entry is not None:
                    log.warning("cached chunk %s is truncated or corrupt; fetching it again", digest)
                    self._forget(digest)
                given = None
                if frame is None and not prefetch and self.frames is not None and isinstance(chunk, ChunkRef):
                    given = self._from_pack(chunk)
                elif frame is not None:
                    try:
                        given = (decode_frame(digest, frame, size=chunk.size, where="a prefetch pack"), len(frame))
                    except DigestMismatchError as exc:
                        with self._lock:
                            self._end_flight(digest, prefetch)
                        future.set_exception(_FrameRejected())  # its waiters fetch it themselves
                        raise exc
                # a chunk that came in a pack counts as prefetched, whoever asked for it
                result = self._fetch(chunk, digest, path, prefetch or given is not None, given)
        except BaseException as exc:
            with self._lock:
                if frame is None or not isinstance(exc, DigestMismatchError):  # a bad pack frame is the pack's
                    self._fetch_errors += 1
                if self._inflight.get(digest) is future:
                    self._end_flight(digest, prefetch)
            if not future.done():
                future.set_exception(exc)
            raise
        with self._lock:
            self._end_flight(digest, prefetch)
        future.set_result(result)
        return result

    def _from_pack(self, chunk: ChunkRef) -> tuple[bytes, int] | None:
        """The plaintext of ``chunk`` and its stored size from a pack streaming
        now (:attr:`frames`), checked; None if no pack holds it (or its frame is bad)."""
        try:
            frame = self.frames(chunk.digest)
        except Exception as exc:  # an optimization: the store still has it
            log.debug("pack frame of %s: %s", chunk.digest, exc)
            return None
        if frame is None:
            return None
        try:
            return decode_frame(chunk.digest, frame, size=chunk.size, where="a prefetch pack"), len(frame)
        except DigestMismatchError as exc:
            log.warning("%s; fetching it from the store", exc)
            return None

    def _end_flight(self, digest: str, prefetch: bool) -> None:  # caller holds _lock
        del self._inflight[digest]
        if not prefetch:
            self._demand -= 1
            if self._demand == 0:
                self._demand_idle.notify_all()

    @staticmethod
    def _verify(digest: str, chunk: ChunkRef | str, path: Path) -> bool:
        """Whether the file at ``path`` holds chunk ``digest`` (size, then sha256)."""
        try:
            data = path.read_bytes()
        except OSError:
            return False
        if isinstance(chunk, ChunkRef) and len(data) != chunk.size:
            return False
        return "sha256:" + hashlib.sha256(data).hexdigest() == digest

    def _fetch(
        self, chunk: ChunkRef | str, digest: str, path: Path, prefetch: bool, given: tuple[bytes, int] | None = None
    ) -> Path | bytes:
        if given is not None:
            plaintext, stored = given
        else:
            if isinstance(chunk, ChunkRef):
                plaintext = self.store.get_chunk(digest, stored_digest=chunk.stored_digest, size=chunk.size)
            else:
                plaintext = self.store.get_chunk(digest)
            stored = chunk.stored_size if isinstance(chunk, ChunkRef) else len(plaintext)
        n = len(plaintext)
        with self._lock:
            self._chunks_fetched += 1
            self._bytes_fetched += stored
            if prefetch:
                self._prefetched += 1
            if n > self.max_bytes:
                return plaintext  # served uncached
            self._evict_locked(n)
            self._bytes += n  # reserved: the bound holds while the write runs
        try:
            self._write(path, plaintext)
        except BaseException:
            with self._lock:
                self._bytes -= n
            raise
        with self._lock:
            self._index[digest] = _Entry(n, verified=True)
        return path

    def _write(self, path: Path, data: bytes) -> None:
        try:
            atomic_write(path, data, durable=False)
            return
        except OSError as exc:
            if exc.errno not in FULL_ERRNOS:
                raise
            with self._lock:
                freed = self._evict_locked(0, at_least=max(2 * len(data), self._bytes // 4))
            log.warning("chunk cache %s: disk full; evicted %d bytes and retrying", self.root, freed)
        try:
            atomic_write(path, data, durable=False)
        except OSError as exc:
            if exc.errno not in FULL_ERRNOS:
                raise
            raise CapacityError(
                f"the disk of the node chunk cache {self.root} is full even after evicting "
                f"cached chunks ({os.strerror(exc.errno)}); free space or lower WEENV_CACHE_BYTES"
            ) from exc

    def read(self, chunk: ChunkRef | str, offset: int, size: int, *, prefetch: bool = False) -> bytes:
        """Up to ``size`` plaintext bytes of ``chunk`` from byte ``offset`` (fetching it if missing).

        Returns fewer bytes only at the chunk's end.  A cached file of the wrong
        size (for a :class:`ChunkRef`), or one evicted since the lookup, is
        fetched again.
        """
        for _attempt in range(3):
            got = self._get(chunk, prefetch)
            if isinstance(got, bytes):
                data = got[offset : offset + size]
                break
            try:
                fd = os.open(got, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                self._forget(chunk.digest if isinstance(chunk, ChunkRef) else chunk)
                continue
            try:
                if isinstance(chunk, ChunkRef) and os.fstat(fd).st_size != chunk.size:
                    log.warning("cached chunk %s has the wrong size; fetching it again", chunk.digest)
                    self._forget(chunk.digest)
                    continue
                data = os.pread(fd, size, offset)
                break
            finally:
                os.close(fd)
        else:
            raise OSError(errno.EIO, f"chunk {chunk} keeps disappearing from the node cache {self.root}")
        with self._lock:
            self._bytes_served += len(data)
        return data

    def held(self, digest: str, *, wait_s: float = 0.0) -> bytes | None:
        """The plaintext of chunk ``digest`` if this cache holds it, else None:
        never a store fetch (what a node serves its peers, :mod:`weenv.node.data.peers`).
        A fetch of it in progress here is waited for up to ``wait_s`` seconds.
        Not re-hashed (a peer checks what it gets); a file of another size than
        indexed, or gone meanwhile, is None."""
        digest = check_digest(digest)
        with self._lock:
            entry = self._index.get(digest)
            future = None if entry is not None else self._inflight.get(digest)
            if entry is not None:
                self._index.move_to_end(digest)
        if entry is None and future is not None and wait_s > 0:
            try:
                got = future.result(timeout=wait_s)
            except Exception:  # its fetch failed or is still running: not held
                return None
            if isinstance(got, bytes):
                return got
            with self._lock:
                entry = self._index.get(digest)
        if entry is None:
            return None
        try:
            data = self.path(digest).read_bytes()
        except OSError:
            return None
        return data if len(data) == entry.size else None

    def wait_demand_idle(self, timeout: float) -> bool:
        """Block until no demand fetch runs (or ``timeout`` seconds); whether idle."""
        with self._demand_idle:
            return self._demand_idle.wait_for(lambda: self._demand == 0, timeout)

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

    @property
    def bytes_cached(self) -> int:
        """Plaintext bytes in the cache (plus writes in progress)."""
        return self._bytes

    def stats(self) -> CacheStats:
        """A consistent snapshot of the counters."""
        with self._lock:
            return CacheStats(
                self._chunks_fetched,
                self._bytes_fetched,
                self._bytes_served,
                self._fetch_errors,
                self._evicted,
                self._prefetched,
                self._invalid,
                len(self._index),
                self._bytes,
                self.max_bytes,
                self._reads_hit,
                self._reads_missed,
            )

    def reset_stats(self) -> None:
        with getattr(self, "_lock", threading.Lock()):
            self._chunks_fetched = self._bytes_fetched = self._bytes_served = self._fetch_errors = 0
            self._evicted = self._prefetched = self._invalid = 0
            self._reads_hit = self._reads_missed = 0

    def cached_digests(self) -> list[str]:
        """Digests of every cached chunk (a directory walk; for tools and tests)."""
        base = self.root / "sha256"
        if not base.is_dir():
            return []
        return sorted(f"sha256:{p.name}" for p in base.glob("*/*") if not p.name.startswith(".tmp-"))

    def clear(self) -> None:
        """Remove every cached chunk.  Do not call while chunks are being read or
        fetched (a reader may see a missing file; a fetch may land afterwards)."""
        with self._lock:
            shutil.rmtree(self.root / "sha256", ignore_errors=True)
            self._index.clear()
            self._bytes = 0
