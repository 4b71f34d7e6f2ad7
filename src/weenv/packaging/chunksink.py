"""A group image stored chunk by chunk while it is written: no image file.

:func:`~weenv.packaging.erofs_writer.write_image` writes an image front to
back (file data from block 1, then directory blocks, then metadata) and
comes back only to the superblock in block 0.  :class:`ChunkSink` takes those
writes as a file would and stores each chunk (``chunk_size`` bytes of the
image) as soon as the writer has gone past it: :data:`PUT_WORKERS` threads
hash, compress and write chunks (sha256 and zstd release the GIL) while the
writer goes on.  Chunk 0, which holds the superblock, is kept in memory and
stored last.  So an image costs no disk of its own, only its stored chunks,
and its chunks are compressed while it is being written, not after.

At most ``window`` chunks are in memory (queued or being stored); a write
that would queue more waits for the oldest one.  A store error is raised by
the write (or :meth:`ChunkSink.finish`) that collects it.
"""

from __future__ import annotations

import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from weenv.formats.manifest import ChunkRef
from weenv.store.base import Store

PUT_WORKERS = 2
"""Threads storing one image's chunks (this machine has 2 cores)."""


@dataclass(frozen=True)
class SinkResult:
    """What a finished :class:`ChunkSink` stored."""

    chunks: list[ChunkRef]
    """The image's chunks, in image order."""
    new: list[str]
    """Digests of the chunks the store did not have (written by this sink)."""
    stored: int
    """Stored (zstd) bytes of those."""
    size: int
    """The image's bytes."""


class ChunkSink:
    """A write-only image file, stored as chunks of ``chunk_size`` bytes in
    ``store`` while it is written.

    File methods: :meth:`write`, :meth:`seek`, :meth:`tell`, :meth:`truncate`.
    A write may land anywhere in chunk 0 or at or after the start of the chunk
    under way; a chunk already handed to the store cannot be rewritten
    (:class:`ValueError`).  Seeking past the end and writing there fills the
    gap with zeros.  :meth:`finish` stores the rest and returns a
    :class:`SinkResult`; :meth:`abort` stops and returns the digests it wrote
    (a caller rolling back deletes them).  As a context manager, an exception
    leaving the block aborts."""

    def __init__(self, store: Store, chunk_size: int, *, workers: int = PUT_WORKERS, window: int | None = None):
        self.store = store
        self.chunk_size = chunk_size
        self.window = window if window is not None else workers + max(2, (8 << 20) // chunk_size)
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="chunk-put")
        self._pending: deque[tuple[int, Future]] = deque()
        self._refs: dict[int, ChunkRef] = {}
        self._new: list[str] = []
        self._new_set: set[str] = set()
        self._stored = 0
        self._head = bytearray()  # chunk 0 once the writer is past it
        self._buf = bytearray()  # chunk self._index, under way
        self._index = 0
        self._pos = 0
        self._end = 0
        self._closed = False

    # --- file methods ------------------------------------------------------------------
    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._end}[whence]
        if base + offset < 0:
            raise ValueError("negative seek position")
        self._pos = base + offset
        return self._pos

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        pos = self._pos
        cs = self.chunk_size
        if self._index > 0 and pos < cs and view:  # chunk 0, kept until the end
            k = min(len(view), cs - pos)
            self._head[pos : pos + k] = view[:k]
            pos += k
            view = view[k:]
        if view:
            base = self._index * cs
            if pos < base:
                raise ValueError(f"image bytes at {pos} are in a chunk already stored")
            if pos > self._end:
                self._zeros(pos - self._end)
            off = pos - base
            if off < len(self._buf):  # rewriting the chunk under way
                k = min(len(view), len(self._buf) - off)
                self._buf[off : off + k] = view[:k]
                pos += k
                view = view[k:]
            if view:
                self._append(view)
                pos += len(view)
        self._pos = pos
        return n

    def truncate(self, size: int | None = None) -> int:
        size = self._pos if size is None else size
        if size > self._end:
            self._zeros(size - self._end)
        elif size < self._end:
            base = self._index * self.chunk_size
            if size < base:
                raise ValueError(f"cannot truncate to {size}: the chunks before {base} are stored")
            del self._buf[size - base :]
            self._end = size
        return size

    # --- the end -------------------------------------------------------------------------
    def finish(self) -> SinkResult:
        """Store the chunk under way and chunk 0, wait for every chunk; the result."""
        if self._closed:
            raise ValueError("the sink is closed")
        try:
            if self._index == 0:
                self._head, self._buf = self._buf, bytearray()
            elif self._buf:
                self._submit(self._index, bytes(self._buf))
                self._buf = bytearray()
            if self._head:
                self._submit(0, bytes(self._head))
            while self._pending:
                self._collect()
        except BaseException:
            self.abort()
            raise
        self._close()
        count = -(-self._end // self.chunk_size)
        return SinkResult([self._refs[i] for i in range(count)], list(self._new), self._stored, self._end)

    def abort(self) -> list[str]:
        """Stop: wait for the chunks being stored (errors ignored), drop the
        rest; the digests of every chunk this sink wrote."""
        while self._pending:
            try:
                self._collect()
            except Exception:  # noqa: BLE001 - rolling back: what was written is what counts
                pass
        self._close()
        return list(self._new)

    def __enter__(self) -> ChunkSink:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None and not self._closed:
            self.abort()
        self._close()

    # --- inside ----------------------------------------------------------------------------
    def _close(self) -> None:
        if not self._closed:
            self._closed = True
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._head, self._buf = bytearray(), bytearray()

    def _zeros(self, n: int) -> None:
        zero = bytes(min(n, self.chunk_size))
        while n:
            k = min(n, len(zero))
            self._append(memoryview(zero)[:k])
            n -= k

    def _append(self, view: memoryview) -> None:
        """Add ``view`` at the end of the image (the writer's position)."""
        if self._closed:
            raise ValueError("the sink is closed")
        cs = self.chunk_size
        while view:
            take = view[: cs - len(self._buf)]
            self._buf += take
            view = view[len(take) :]
            self._end += len(take)
            if len(self._buf) == cs:
                if self._index == 0:
                    self._head = self._buf
                else:
                    self._submit(self._index, self._buf)  # handed over, not copied: a new buffer follows
                self._buf = bytearray()
                self._index += 1

    def _submit(self, index: int, data: bytes | bytearray) -> None:
        while len(self._pending) >= self.window:
            self._collect()
        expect = getattr(self.store, "expect_chunk", None)  # a leased store: one lease write per batch
        if expect is not None:
            expect(data)
        self._pending.append((index, self._pool.submit(self.store.put_chunk, data)))

    def _collect(self) -> None:
        index, future = self._pending.popleft()
        ref, written = future.result()
        self._refs[index] = ref
        if written and ref.digest not in self._new_set:
            self._new_set.add(ref.digest)
            self._new.append(ref.digest)
            self._stored += ref.stored_size
