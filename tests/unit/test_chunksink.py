"""A group image stored chunk by chunk while it is written
(:mod:`weenv.packaging.chunksink`): the chunks are the image's, in order;
chunk 0 may be rewritten to the end; a stored chunk may not; a failed or
aborted sink says what it wrote."""

from __future__ import annotations

import hashlib
import os

import pytest

from weenv.packaging.chunksink import ChunkSink
from weenv.store.file import FileStore

CS = 64 << 10


def _image(store: FileStore, result) -> bytes:
    return b"".join(store.get_chunk(c.digest) for c in result.chunks)


def test_chunks_are_the_images_bytes_in_order(tmp_path):
    store = FileStore(tmp_path / "s")
    data = os.urandom(5 * CS + 1234)
    sink = ChunkSink(store, CS, window=3)
    sink.seek(4096)  # as the EROFS writer starts: block 0 left for the superblock
    pos, sizes = 4096, (1, 4095, CS, 7, 3 * CS + 100)
    i = 0
    while pos < len(data):
        n = sizes[i % len(sizes)]
        sink.write(data[pos : pos + n])
        pos += n
        i += 1
        assert len(sink._pending) <= 3
    sink.seek(1024)
    sink.write(data[1024:1152])  # chunk 0 is held until the end: rewritable
    sink.seek(0, os.SEEK_END)
    sink.truncate(len(data))
    result = sink.finish()
    expected = bytearray(data)
    expected[:1024] = bytes(1024)
    expected[1152:4096] = bytes(4096 - 1152)
    assert result.size == len(data) and len(result.chunks) == 6
    assert [c.size for c in result.chunks] == [CS] * 5 + [1234]
    assert _image(store, result) == bytes(expected)
    assert sorted(result.new) == sorted({c.digest for c in result.chunks})
    assert result.stored == sum(c.stored_size for c in result.chunks)


def test_a_stored_chunk_cannot_be_rewritten_and_the_one_under_way_can(tmp_path):
    store = FileStore(tmp_path / "s")
    with ChunkSink(store, CS) as sink:
        sink.write(bytes(3 * CS + 10))
        with pytest.raises(ValueError, match="already stored"):
            sink.seek(CS + 5)
            sink.write(b"x")
        sink.seek(3 * CS + 2)
        sink.write(b"abc")  # inside the chunk under way
        with pytest.raises(ValueError, match="stored"):
            sink.truncate(2 * CS)
        sink.seek(0, os.SEEK_END)
        result = sink.finish()
    last = store.get_chunk(result.chunks[-1].digest)
    assert last == bytes(2) + b"abc" + bytes(5)


def test_a_small_image_is_one_chunk_and_known_chunks_are_not_new(tmp_path):
    store = FileStore(tmp_path / "s")
    data = os.urandom(10_000)
    with ChunkSink(store, CS) as sink:
        sink.write(data)
        first = sink.finish()
    assert len(first.chunks) == 1 and first.chunks[0].digest == "sha256:" + hashlib.sha256(data).hexdigest()
    with ChunkSink(store, CS) as sink:
        sink.write(data)
        again = sink.finish()
    assert again.chunks == first.chunks and again.new == [] and again.stored == 0


def test_abort_says_what_was_written_and_stops(tmp_path):
    store = FileStore(tmp_path / "s")
    sink = ChunkSink(store, CS)
    sink.write(os.urandom(4 * CS + 1))
    written = sink.abort()
    assert len(written) == 3  # chunks 1..3 stored; chunk 0 and the rest never were
    assert sorted(written) == sorted(store.list_chunks())
    with pytest.raises(ValueError, match="closed"):
        sink.write(os.urandom(CS))


def test_a_store_error_is_raised_and_the_sink_aborted(tmp_path):
    class Full(FileStore):
        calls = 0

        def _put(self, space, digest, data):
            Full.calls += 1
            if Full.calls == 2:
                raise OSError(28, "No space left on device")
            super()._put(space, digest, data)

    store = Full(tmp_path / "s")
    with pytest.raises(Exception, match="No space"):
        with ChunkSink(store, CS, window=2) as sink:
            for _ in range(8):
                sink.write(os.urandom(CS))
            sink.finish()
    assert sink._closed
