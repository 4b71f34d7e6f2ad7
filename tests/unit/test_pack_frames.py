"""Prefetch packs' frame lists, driving a :class:`Prefetcher` directly over a
FileStore and a chunk cache in a temporary directory (no environment, no FUSE)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from weenv.node.data.cache import ChunkCache
from weenv.node.data.prefetch import Prefetcher
from weenv.packaging.profile import PrefetchPack, PrefetchProfile, build_pack, frame_bound
from weenv.store.file import FileStore

MiB = 1 << 20
SRC = str(Path(__file__).resolve().parents[2] / "src")


class _NoLazy:
    def read_seq(self):
        return 0

    def first_reads(self, *a):
        return []


def _prefetcher(tmp_path, n=6, **kw):
    store = FileStore(tmp_path / "store")
    plains = [os.urandom(MiB) for _ in range(n)]
    refs = [store.put_chunk(p)[0] for p in plains]
    cache = ChunkCache(tmp_path / "cache", store, max_bytes=1 << 30)
    return store, cache, Prefetcher(cache, store, _NoLazy(), **kw), refs, plains


def _job(pf, refs, pack):
    return pf._start_job("e", [("sha256:" + "0" * 64, r) for r in refs], groups=None, pack=pack)


def test_frame_sizes_must_be_positive_and_within_zstd_bound(tmp_path):
    """A frame list with a 0, a negative size, or a frame larger than any zstd
    frame of its chunk is not a pack: the profile does not load."""
    store, cache, pf, refs, plains = _prefetcher(tmp_path, n=2)
    pf.close()
    data, frames = build_pack(plains)
    digest = store.put_pack(data)
    for bad in ([0, frames[1]], [-5, frames[1]], [frames[0], frame_bound(refs[1].size) + 1]):
        with pytest.raises(ValidationError):
            PrefetchProfile(
                template="sha256:" + "1" * 64,
                groups=["sha256:" + "0" * 64],
                chunks=[(0, 0), (0, 1)],
                refs=refs,
                pack={"digest": digest, "frames": bad},
                window_s=1.0,
            )
    PrefetchProfile(
        template="sha256:" + "1" * 64,
        groups=["sha256:" + "0" * 64],
        chunks=[(0, 0), (0, 1)],
        refs=refs,
        pack={"digest": digest, "frames": frames},
        window_s=1.0,
    )


def test_a_pack_of_wrong_frames_is_not_read_again(tmp_path):
    """Frames that decode to other chunks: every chunk still arrives (one by
    one), and the next job of that pack does not stream it again."""
    store, cache, pf, refs, plains = _prefetcher(tmp_path)
    try:
        data, frames = build_pack(plains[1:] + plains[:1])  # rotated: frame i is chunk i+1's
        pack = PrefetchPack(digest=store.put_pack(data), frames=frames)
        job = _job(pf, refs, pack)
        assert job.done.wait(30)
        assert [cache.path(r.digest).read_bytes() for r in refs] == plains
        assert job.from_pack == 0 and job.stream is not None
        cache.clear()
        again = pf._start_job("f", [("sha256:" + "0" * 64, r) for r in refs], groups=None, pack=pack)
        assert again.stream is None and again.done.wait(30)
        assert all(cache.has(r.digest) for r in refs)
    finally:
        pf.close()


def test_frame_declaring_a_huge_plaintext_is_not_decoded(tmp_path):
    """A 64 KiB frame in a pack declaring (and holding) 1 GiB of zeros for a
    1 MiB chunk is rejected from its header, not decoded first (it took 1 GiB
    of memory per worker before the check)."""
    script = textwrap.dedent(f"""
        import os, resource, sys, zstandard
        sys.path.insert(0, {SRC!r})
        from pathlib import Path
        from weenv.node.data.cache import ChunkCache
        from weenv.store.file import FileStore
        from weenv.errors import DigestMismatchError
        root = Path(sys.argv[1])
        store = FileStore(root / "store")
        ref, _ = store.put_chunk(os.urandom(1 << 20))
        bomb = zstandard.ZstdCompressor(level=1, write_content_size=True).compress(bytes(1 << 30))
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            ChunkCache(root / "cache", store).put_frame(ref, bomb)
        except DigestMismatchError:
            pass
        print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
    """)
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, check=True)
    grew_mib = int(out.stdout.split()[-1])
    assert grew_mib < 256, f"checking one bad 64 KiB frame grew the RSS by {grew_mib} MiB"


class _CountingStore(FileStore):
    """A real FileStore counting its chunk reads (``reads``)."""

    def __init__(self, root):
        super().__init__(root)
        self.reads = 0

    def _get(self, space, digest, max_bytes=None):
        if space == "chunks":
            self.reads += 1
        return super()._get(space, digest, max_bytes)


def test_a_demand_read_takes_a_frame_a_pack_brought(tmp_path):
    """A demand read of a chunk whose frame a streaming pack holds decodes that
    frame instead of asking the store (counted as prefetched: its bytes came in
    the pack); a bad frame is dropped and the store asked, the right bytes served."""
    store = _CountingStore(tmp_path / "store")
    plains = [os.urandom(MiB) for _ in range(2)]
    refs = [store.put_chunk(p)[0] for p in plains]
    frame0 = store._get("chunks", refs[0].digest)
    frames = {refs[0].digest: frame0, refs[1].digest: frame0}
    store.reads = 0
    cache = ChunkCache(tmp_path / "cache", store, max_bytes=1 << 30)
    cache.frames = frames.pop
    assert cache.read(refs[0], 0, MiB) == plains[0]
    assert store.reads == 0
    s = cache.stats()
    assert s.chunks_fetched == 1 and s.chunks_prefetched == 1 and cache.bytes_fetched == refs[0].stored_size
    assert cache.read(refs[1], 0, MiB) == plains[1]  # its frame is chunk 0's: the store's copy is served
    assert store.reads == 1 and not frames


def test_frame_for_takes_a_received_frame_once(tmp_path):
    """:meth:`Prefetcher.frame_for` hands out a frame a pack stream received and
    no worker took, once; the worker that comes to it then skips it (TAKEN)."""
    from weenv.node.data.replay import TAKEN, PackStream

    store, cache, pf, refs, plains = _prefetcher(tmp_path, n=2)
    try:
        data, frames = build_pack(plains)
        pack = PrefetchPack(digest=store.put_pack(data), frames=frames)
        stream = PackStream(pack, (pack.digest, tuple(r.digest for r in refs)))
        first = data[: frames[0]]
        with pf._lock:
            pf._streams[stream.key] = stream
            stream.frames[0], stream.buffered, stream.received = first, frames[0], 1
        assert pf.frame_for(refs[1].digest) is None  # not received yet
        assert pf.frame_for(refs[0].digest) == first and stream.buffered == 0
        assert pf.frame_for(refs[0].digest) is None
        with pf._lock:
            assert stream.take(0) is TAKEN
            del pf._streams[stream.key]
    finally:
        pf.close()


def test_a_reader_waits_for_a_frame_being_checked(tmp_path):
    """A reader asking for a chunk while a pack's frame of it is being decoded
    and checked waits for that check (~0.1 s for 128 MiB here) instead of
    fetching the chunk from the store again."""
    store = _CountingStore(tmp_path / "store")
    plain = os.urandom(128 * MiB)
    ref, _ = store.put_chunk(plain)
    frame = store._get("chunks", ref.digest)
    store.reads = 0
    cache = ChunkCache(tmp_path / "cache", store, max_bytes=1 << 30)
    putting = threading.Thread(target=cache.put_frame, args=(ref, frame))
    putting.start()
    time.sleep(0.01)
    assert cache.read(ref, 0, 16) == plain[:16]
    putting.join()
    assert store.reads == 0 and cache.chunks_fetched == 1


def test_a_demand_read_waits_for_a_frame_the_stream_brings_soon(tmp_path, monkeypatch):
    """A demand read of a chunk whose frame a streaming pack has not received
    yet waits for it instead of asking the store (no store read; counted as
    prefetched), and the worker that comes to that position skips it; a frame
    that does not come within PACK_WAIT_S, or one too far behind in the
    pack, is fetched from the store (the right bytes either way)."""
    import weenv.node.data.prefetch as prefetch
    from weenv.node.data.replay import TAKEN, PackStream

    store, cache, pf, refs, plains = _prefetcher(tmp_path, n=3)
    monkeypatch.setattr(prefetch, "PACK_WAIT_AHEAD_BYTES", 3 * MiB)  # these chunks are random: ~1 MiB a frame
    store = _CountingStore(tmp_path / "store")
    cache = ChunkCache(tmp_path / "cache", store, max_bytes=1 << 30)
    cache.frames = pf.frame_for
    try:
        data, frames = build_pack(plains)
        pack = PrefetchPack(digest=store.put_pack(data), frames=frames)
        stream = PackStream(pack, (pack.digest, tuple(r.digest for r in refs)))
        offsets = [sum(frames[:i]) for i in range(len(frames))]
        with pf._lock:
            pf._streams[stream.key] = stream
        store.reads = 0
        got = {}
        reader = threading.Thread(target=lambda: got.setdefault("data", cache.read(refs[1], 0, MiB)))
        monkeypatch.setattr(prefetch, "PACK_WAIT_S", 30.0)  # however slow this machine, the read waits for it
        reader.start()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with pf._lock:
                if stream.claimed:
                    break
            time.sleep(0.005)
        with pf._lock:
            assert stream.claimed == {1}  # waiting for it
        with pf._lock:  # the pack's reader receives frames 0 and 1
            for i in (0, 1):
                stream.frames[i] = data[offsets[i] : offsets[i] + frames[i]]
                stream.buffered += frames[i]
            stream.received = 2
            pf._lock.notify_all()
        reader.join(10)
        assert got["data"] == plains[1] and store.reads == 0
        assert cache.stats().chunks_prefetched == 1
        with pf._lock:
            assert 1 not in stream.frames and stream.claimed == set() and stream.take(1) is TAKEN

        monkeypatch.setattr(prefetch, "PACK_WAIT_S", 0.05)  # frame 2 never comes: the store's after the wait
        t = time.monotonic()
        assert cache.read(refs[2], 0, MiB) == plains[2] and store.reads == 1
        assert 0.04 < time.monotonic() - t < 5
        with pf._lock:
            assert stream.claimed == set()

        monkeypatch.setattr(prefetch, "PACK_WAIT_S", 30.0)  # a wait would show (and not be a loaded machine's 40 ms)
        monkeypatch.setattr(prefetch, "PACK_WAIT_AHEAD_BYTES", 1)  # too far behind: at once from the store
        cache.clear()
        with pf._lock:
            stream.received, stream.frames = 0, {}
        t = time.monotonic()
        assert cache.read(refs[1], 0, MiB) == plains[1] and store.reads == 2
        assert time.monotonic() - t < 10
        with pf._lock:
            del pf._streams[stream.key]
    finally:
        pf.close()


class _PackStore(_CountingStore):
    """A real FileStore counting its pack reads (``streams``); with ``end``
    cleared, a pack's reader waits after its last piece (every frame received,
    the stream still reading) until ``end`` is set."""

    def __init__(self, root):
        super().__init__(root)
        self.streams = 0
        self.end = threading.Event()
        self.end.set()

    def stream_pack(self, digest, size=None):
        self.streams += 1
        yield from super().stream_pack(digest, size)
        self.end.wait(30)


class _HeldPuts(ChunkCache):
    """A real chunk cache whose :meth:`put_frame` waits for ``release``: the
    frames the workers took stay in their hands (``putting``: how many)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.release = threading.Event()
        self.putting = 0

    def put_frame(self, chunk, frame):
        with self._lock:
            self.putting += 1
        self.release.wait(30)
        return super().put_frame(chunk, frame)


def _held(tmp_path, plains, frames_of=None):
    """(store, cache, prefetcher with 2 workers, refs, pack): ``plains`` stored,
    the pack of ``frames_of`` (default ``plains``) stored, puts held."""
    store = _PackStore(tmp_path / "store")
    refs = [store.put_chunk(p)[0] for p in plains]
    data, frames = build_pack(frames_of or plains)
    pack = PrefetchPack(digest=store.put_pack(data), frames=frames)
    store.reads = 0
    cache = _HeldPuts(tmp_path / "cache", store, max_bytes=1 << 30)
    return store, cache, Prefetcher(cache, store, _NoLazy(), workers=2), refs, pack


def _until(what, pf, timeout=30.0):
    deadline = time.monotonic() + timeout
    while True:
        with pf._lock:
            if what():
                return
        assert time.monotonic() < deadline, "the prefetcher never got there"
        time.sleep(0.005)


def test_a_job_arriving_while_the_frames_are_cached_joins_the_stream(tmp_path):
    """The pack read whole, its frames still being cached (two in the
    workers' hands, four buffered): a job of the same pack starting then
    joins that stream (the pack is read once, tests/test_cache.py's four
    concurrent cold starts); a job once the stream settled (every frame cached)
    after the chunks were dropped reads the pack again: nothing is skipped."""
    plains = [os.urandom(MiB) for _ in range(6)]
    store, cache, pf, refs, pack = _held(tmp_path, plains)
    try:
        a = _job(pf, refs, pack)
        _until(lambda: a.stream.ended and cache.putting == 2, pf)  # the reader is done, the puts are held
        b = pf._start_job("b", [("sha256:" + "0" * 64, r) for r in refs], groups=None, pack=pack)
        cache.release.set()
        assert a.done.wait(30) and b.done.wait(30)
        assert store.streams == 1 and b.stream is a.stream
        assert [cache.path(r.digest).read_bytes() for r in refs] == plains and store.reads == 0
        with pf._lock:
            assert pf._streams == {}  # settled

        cache.clear()
        c = pf._start_job("c", [("sha256:" + "0" * 64, r) for r in refs], groups=None, pack=pack)
        assert c.done.wait(30) and c.stream is not a.stream and store.streams == 2
        assert [cache.path(r.digest).read_bytes() for r in refs] == plains and store.reads == 0
    finally:
        cache.release.set()
        pf.close()


def test_a_chunk_a_joined_job_skipped_is_fetched_when_its_taker_fails(tmp_path):
    """Two jobs of one pack: the first one's workers hold frames 0 and 1
    (frame 1 is bad) when the first job is cancelled, so nobody caches chunk 1
    from the pack; the second job, which could not take those frames, fetches
    chunk 1 itself once the taker is done, and caches the rest from the pack."""
    plains = [os.urandom(MiB) for _ in range(4)]
    store, cache, pf, refs, pack = _held(tmp_path, plains, frames_of=[plains[0], plains[0], *plains[2:]])
    store.end.clear()
    try:
        a = _job(pf, refs, pack)
        _until(lambda: a.stream.received == 4 and cache.putting == 2, pf)  # still reading
        b = pf._start_job("b", [("sha256:" + "0" * 64, r) for r in refs], groups=None, pack=pack)
        assert b.stream is a.stream
        pf.cancel("e")
        cache.release.set()
        store.end.set()
        assert a.done.wait(30) and b.done.wait(30) and a.cancelled
        assert [i for i, r in enumerate(refs) if not cache.has(r.digest)] == []  # none lost
        assert [cache.path(r.digest).read_bytes() for r in refs] == plains
        assert store.reads == 1 and b.fetched == [1] and store.streams == 1
    finally:
        cache.release.set()
        store.end.set()
        pf.close()
