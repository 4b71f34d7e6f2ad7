"""The node cache's bound, persistence and repair; prefetch; direct mounts of complete groups.

Real FUSE, EROFS, runc environments and FileStores.  Tests that write to a
store (prefetch profiles) use a hard-linked copy of the session's shared store,
so the shared one never gains a profile other tests would replay.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import zstandard

from test_lazy import LazyNode, build, drop_page_cache
from weenv.errors import CapacityError, DigestMismatchError
from weenv.node.data.cache import ChunkCache
from weenv.node.node import Node
from weenv.packaging.group import load_group
from weenv.packaging.profile import REF_KIND, load_profile, ref_name
from weenv.packaging.template import load_template
from weenv.store.file import FileStore

MiB = 1 << 20


class CountingStore(FileStore):
    """A real FileStore that records get_chunk calls in order (``calls`` counts
    them), optionally slowed down by ``delay`` seconds per chunk (a store across
    a network); in ``order`` as well: get_manifest calls as ``manifest:DIGEST``
    when they return, and stream_pack calls as ``pack:DIGEST`` when they begin."""

    def __init__(self, root, delay: float = 0.0):
        super().__init__(root)
        self.delay = delay
        self.order: list[str] = []
        self._count_lock = threading.Lock()

    @property
    def calls(self) -> Counter:
        with self._count_lock:
            return Counter(x for x in self.order if not x.startswith("manifest:"))

    def get_chunk(self, digest: str, **hints) -> bytes:
        with self._count_lock:
            self.order.append(digest)
        if self.delay:
            time.sleep(self.delay)
        return super().get_chunk(digest, **hints)

    def get_manifest(self, digest: str) -> bytes:
        """Slowed by ``manifest_delay`` once set."""
        time.sleep(getattr(self, "manifest_delay", 0.0))
        try:
            return super().get_manifest(digest)
        finally:
            with self._count_lock:
                self.order.append("manifest:" + digest)

    def stream_pack(self, digest: str, size=None):
        with self._count_lock:
            self.order.append("pack:" + digest)
        return super().stream_pack(digest, size)


@pytest.fixture
def private_store(tmp_path, shared_store) -> Path:
    """A copy of the shared store (hard links: instant; writes replace files by rename)."""
    root = tmp_path / "store"
    subprocess.run(["cp", "-al", str(shared_store.root), str(root)], check=True)
    subprocess.run(
        ["rm", "-rf", str(root / "refs" / REF_KIND), str(root / "packs")], check=True
    )  # profiles other tests recorded
    return root


def cache_bytes_on_disk(root: Path) -> int:
    return sum(p.stat().st_size for p in (root / "sha256").glob("*/*"))


def template_groups(store, name="task"):
    digest, t = load_template(store, name)
    return digest, [(g, load_group(store, g)) for g in t.groups]


def proc_mounts() -> list[tuple[str, str, str]]:
    with open("/proc/mounts") as f:
        return [tuple(line.split()[:3]) for line in f]


# --- the bound -------------------------------------------------------------------------
def test_eviction_under_a_small_bound(tmp_path, paths, leak_check):
    """A 6 MiB cache under a 32 MiB group: every read is still correct, the
    cache never holds more than its bound, the least recently used chunks go."""
    store = CountingStore(paths.home / "store")
    src, res = build(tmp_path, store)
    n = LazyNode(paths, store)
    n.cache = ChunkCache(paths.chunk_cache, store, max_bytes=6 * MiB)
    n.fs.cache = n.cache
    n.fs.start()
    try:
        mnt = n.mounts.acquire(res.digest, res.manifest)
        for _round in range(2):
            for f in sorted((src / "data").iterdir()):
                assert (mnt / "data" / f.name).read_bytes() == f.read_bytes()
                assert cache_bytes_on_disk(paths.chunk_cache) <= 6 * MiB
                drop_page_cache(mnt / "data" / f.name)
        s = n.cache.stats()
        print(f"\nbound 6 MiB: {s.chunks_fetched} fetched, {s.chunks_evicted} evicted, {s.bytes_cached} cached")
        assert s.bytes_cached <= 6 * MiB and s.chunks_evicted > 0
        assert s.chunks_fetched > len(res.manifest.chunks)  # the second round refetched evicted chunks
        n.mounts.release(res.digest)
    finally:
        n.close()


def test_lru_order_and_restart_index(tmp_path, paths, store):
    """Eviction takes the least recently *used* chunk; a new cache on the same
    directory finds every chunk (no fetch) and keeps the bound."""
    refs = [store.put_chunk(os.urandom(MiB))[0] for _ in range(4)]
    cache = ChunkCache(paths.chunk_cache, store, max_bytes=3 * MiB)
    for r in refs[:3]:
        cache.ensure(r)
    cache.read(refs[0], 0, 10)  # refs[1] is now the least recently used
    cache.ensure(refs[3])
    assert [cache.has(r.digest) for r in refs] == [True, False, True, True]
    again = ChunkCache(paths.chunk_cache, store, max_bytes=3 * MiB)
    assert [again.has(r.digest) for r in refs] == [True, False, True, True]
    for r in (refs[0], refs[2], refs[3]):
        assert again.read(r, 0, MiB) == store.get_chunk(r.digest)
    assert again.chunks_fetched == 0
    smaller = ChunkCache(paths.chunk_cache, store, max_bytes=MiB)  # a lower bound after a restart
    assert smaller.stats().chunks_cached == 1 and cache_bytes_on_disk(paths.chunk_cache) <= MiB


def test_reads_count_as_hits_or_misses_prefetches_as_neither(paths, store):
    a, b = (store.put_chunk(os.urandom(4096))[0] for _ in range(2))
    cache = ChunkCache(paths.chunk_cache, store, max_bytes=MiB)
    cache.ensure(b, prefetch=True)
    cache.read(a, 0, 10)  # fetched: a miss
    cache.read(a, 10, 10)
    cache.read(b, 0, 10)  # prefetched before: a hit
    stats = cache.stats()
    assert (stats.reads_hit, stats.reads_missed, stats.chunks_prefetched) == (2, 1, 1)
    cache.reset_stats()
    assert (cache.stats().reads_hit, cache.stats().reads_missed) == (0, 0)


def test_full_disk_evicts_then_fails_clearly(tmp_path, paths, store, leak_check):
    """ENOSPC: the cache evicts and retries; with nothing left to evict the
    read fails at once with CapacityError (EIO through FUSE), never hangs."""
    root = tmp_path / "small"
    root.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(root)], check=True)
    try:
        refs = [store.put_chunk(os.urandom(MiB))[0] for _ in range(6)]
        cache = ChunkCache(root, store, max_bytes=1 << 30)  # the bound is not what stops it: the disk is
        for r in refs:
            assert cache.read(r, 0, MiB) == store.get_chunk(r.digest)
        assert cache.stats().chunks_evicted > 0
        cache.clear()
        subprocess.run(["mount", "-o", "remount,size=512k", str(root)], check=True)
        t = time.monotonic()
        with pytest.raises(CapacityError, match="full"):
            cache.read(refs[0], 0, 10)
        assert time.monotonic() - t < 5
        assert not list(root.rglob(".tmp-*"))
    finally:
        subprocess.run(["umount", str(root)], check=True)


# --- restarts --------------------------------------------------------------------------
def _read_some(node: Node, env_id: str) -> None:
    r = node.exec(
        env_id,
        ["sh", "-c", "cat /workspace/hello.py; head -c 1000000 /workspace/big.bin | md5sum; python3 -c 'print(1)'"],
    )
    assert r.exit_code == 0 and b"hello from the task" in r.stdout, r


def test_restart_without_refetching(tmp_path, paths, private_store, leak_check):
    """A node started on the home of a closed one fetches nothing for the same
    cold start; a truncated and a corrupted cached chunk are fetched again (once)
    instead of breaking their group (a truncated chunk 0 made it unmountable)."""
    shared_store = FileStore(private_store)
    store = CountingStore(private_store)
    with Node(paths, store=store) as n:
        env = n.create("task")
        _read_some(n, env.id)
        n.destroy(env.id)
        n.groups.wait_assembled()
        n.groups.remove_images()  # reads below go through FUSE and the cache
        first = sum(store.calls.values())
    assert first > 0

    store2 = CountingStore(private_store)
    with Node(paths, store=store2) as n:
        env = n.create("task")
        _read_some(n, env.id)
        assert sum(store2.calls.values()) == 0, store2.calls
        n.destroy(env.id)
        n.groups.wait_assembled()
        n.groups.remove_images()

    _digest, groups = template_groups(shared_store)
    base = groups[0][1]
    cache = ChunkCache(paths.chunk_cache, shared_store, max_bytes=1 << 40)
    chunk0 = base.chunks[0]
    chunk1 = next(c for c in base.chunks[1:] if cache.has(c.digest) and c.digest != chunk0.digest)
    assert cache.has(chunk0.digest)
    p0 = cache.path(chunk0.digest)
    p0.write_bytes(p0.read_bytes()[: chunk0.size // 2])  # truncated (a crash mid-copy, a full disk)
    p1 = cache.path(chunk1.digest)
    data = bytearray(p1.read_bytes())
    data[100] ^= 0xFF
    p1.write_bytes(bytes(data))  # same size, other bytes

    store3 = CountingStore(private_store)
    with Node(paths, store=store3) as n:
        env = n.create("task")
        _read_some(n, env.id)
        assert store3.calls == Counter({chunk0.digest: 1, chunk1.digest: 1})  # the same reads: only those two
        assert n.cache.stats().chunks_invalid == 2
    assert cache.path(chunk0.digest).read_bytes() == shared_store.get_chunk(chunk0.digest)


def test_drop_caches_makes_the_next_start_cold(tmp_path, paths, shared_store, leak_check):
    """After drop_caches a start fetches what the first start fetched: the
    kernel's cached pages of the group images (EROFS reads its metadata through
    them, and they outlive an unmount) are dropped too."""
    with Node(paths, store=shared_store) as n:
        fetched = []
        for _round in range(2):
            n.drop_caches()
            before = n.cache.chunks_fetched
            env = n.create("task", prefetch=False)
            _read_some(n, env.id)
            fetched.append(n.cache.chunks_fetched - before)
            n.destroy(env.id)
        assert fetched[0] > 0 and fetched[1] == fetched[0], fetched


# --- prefetch --------------------------------------------------------------------------
def test_prefetch_recorded_and_replayed(tmp_path, paths, private_store, leak_check):
    """The first start records its first reads into prefetch/<template hex>;
    a later cold start (empty cache, slow store) fetches that list in the
    background, in order, once each, while its own reads still work."""
    store = CountingStore(private_store)
    digest, groups = template_groups(store)
    with Node(paths, store=store, prefetch_record_s=30, prefetch_pack_bytes=0) as n:  # one by one: no pack
        env = n.create("task")
        _read_some(n, env.id)  # the first command: its end closes the window
        deadline = time.monotonic() + 10
        while n.prefetch.profile(digest) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        n.prefetch.wait_published()
        profile = load_profile(store, digest)
        assert profile is not None and store.get_ref(REF_KIND, ref_name(digest))
        assert profile.pack is None and list(store.list_packs()) == []
        recorded = n.lazyfs.first_reads([g for g, _m in groups])
        n.destroy(env.id)
    assert profile.groups == [g for g, _m in groups]
    assert len(profile.chunks) > 3
    # what the window saw, in order (the whole node's first reads, since it started cold)
    assert [(groups[gi][0], ci) for gi, ci in profile.chunks] == recorded[: len(profile.chunks)]
    # each group's superblock comes before its other chunks (cold groups are mounted in
    # parallel: one group's metadata may be read before another's superblock)
    firsts = {}
    for gi, ci in profile.chunks:
        firsts.setdefault(gi, ci)
    assert firsts == {gi: 0 for gi in range(len(groups))}, profile.chunks[:10]

    for d in (paths.chunk_cache, paths.node / "images"):
        subprocess.run(["rm", "-rf", str(d)], check=True)
    slow = CountingStore(private_store, delay=0.02)
    wanted = [groups[gi][1].chunks[ci] for gi, ci in profile.chunks]
    with Node(paths, store=slow, prefetch_workers=1) as n:
        t0 = time.perf_counter()
        env = n.create("task")
        job = n.prefetch.job(env.id)
        assert job is not None
        r = n.exec(env.id, ["cat", "/workspace/hello.py"])  # a read while prefetch runs
        assert r.stdout == b"print('hello from the task')\n"
        assert job.done.wait(120)
        elapsed = time.perf_counter() - t0
        assert not job.cancelled and job.errors == 0
        assert job.fetched == sorted(job.fetched)  # in profile order
        assert all(n.cache.has(c.digest) for c in wanted)
        calls = slow.calls
        assert all(calls[c.digest] == 1 for c in wanted)  # prefetch and demand never fetch twice
        s = n.cache.stats()
        print(
            f"\nprofile {len(wanted)} chunks; prefetched {s.chunks_prefetched}, demand "
            f"{s.chunks_fetched - s.chunks_prefetched}; profile done {elapsed:.2f} s after the create began"
        )
        assert 0 < s.chunks_prefetched <= len(job.fetched)  # a demand read may have joined a prefetch, or won
        _read_some(n, env.id)
        n.destroy(env.id)


def _record_profile(n: Node) -> None:
    """A first start of ``task`` on ``n`` (its first command closes the recording); wait until published."""
    env = n.create("task")
    _read_some(n, env.id)
    n.destroy(env.id)
    n.prefetch.wait_published()


def test_prefetch_starts_before_the_manifests_load(tmp_path, paths, private_store, leak_check):
    """A profile keeps its chunks' refs and the group manifests; a node that
    knows it starts a cold start's prefetch right after resolving the
    template, while the (slow) template manifest loads, reads no group
    manifest from the store, and the environment works."""
    store = CountingStore(private_store)
    digest, groups = template_groups(store)
    with Node(paths, store=store, prefetch_record_s=30) as n:
        _record_profile(n)
        profile = n.prefetch.profile(digest)
        assert profile.refs == [groups[gi][1].chunks[ci] for gi, ci in profile.chunks]
        assert load_profile(store, digest).refs == profile.refs  # published with them

        assert profile.pack is not None  # published with its pack

        assert set(profile.manifests) == {g for g, _m in groups}  # published carrying the group manifests

        n.drop_caches()  # cold: chunks and manifests gone, the profile known
        store.manifest_delay = 0.2
        store.order.clear()
        env = n.create("task")
        order = list(store.order)  # the group manifests came with the profile: only the template's is read
        assert [x for x in order if x.startswith("manifest:")] == ["manifest:" + digest], order
        assert order.index("pack:" + profile.pack.digest) < order.index("manifest:" + digest)
        assert n.exec(env.id, ["cat", "/workspace/hello.py"]).stdout == b"print('hello from the task')\n"
        job = n.prefetch.job(env.id)
        assert job is None or job.done.wait(60)
        assert all(n.cache.has(r.digest) for r in profile.refs)
        n.destroy(env.id)

    # a node that never started the template looks its profile up beside the manifests
    subprocess.run(
        ["rm", "-rf", str(paths.chunk_cache), str(paths.node / "images"), str(paths.node / "known")], check=True
    )  # its chunks, images and kept manifests and names
    fresh = CountingStore(private_store)
    fresh.manifest_delay = 0.2
    with Node(paths, store=fresh) as n:
        env = n.create("task")
        _pack_streamed_before_the_groups_loaded(fresh.order, profile, groups)
        assert n.exec(env.id, ["cat", "/workspace/hello.py"]).stdout == b"print('hello from the task')\n"
        n.destroy(env.id)


def _pack_streamed_before_the_groups_loaded(order: list[str], profile, groups) -> None:
    order = list(order)
    group_loads = [i for i, x in enumerate(order) if x in {"manifest:" + g for g, _m in groups}]
    assert len(group_loads) == len(groups)
    assert order.index("pack:" + profile.pack.digest) < group_loads[-1]  # streamed while the manifests loaded


def test_prefetch_pack(tmp_path, paths, private_store, leak_check):
    """The published profile comes with a pack of its chunks' frames, in
    profile order; a cold start on another node fetches the profile's chunks
    through that one stream, not chunk by chunk, and reads correct content."""
    store = CountingStore(private_store)
    digest, groups = template_groups(store)
    with Node(paths, store=store, prefetch_record_s=30) as n:
        _record_profile(n)
    profile = load_profile(store, digest)
    assert profile.pack is not None and store.has_pack(profile.pack.digest)
    data = b"".join(store.stream_pack(profile.pack.digest))
    assert len(data) == profile.pack.size and len(profile.pack.frames) == len(profile.refs)
    at = 0
    for ref, n_bytes in zip(profile.refs, profile.pack.frames):
        assert zstandard.ZstdDecompressor().decompress(data[at : at + n_bytes]) == store.get_chunk(ref.digest)
        at += n_bytes

    subprocess.run(["rm", "-rf", str(paths.chunk_cache), str(paths.node / "images")], check=True)
    slow = CountingStore(private_store, delay=0.05)  # a chunk on its own costs a round trip
    with Node(paths, store=slow) as n:
        env = n.create("task")
        _wait_cached(n, profile.refs)
        _read_some(n, env.id)
        assert slow.order.count("pack:" + profile.pack.digest) == 1
        from_store = sum(slow.calls[r.digest] for r in profile.refs)
        assert from_store <= 2  # the mounts' own first reads may come before the pack
        print(
            f"\npack {profile.pack.size} bytes: {len(profile.refs) - from_store} of {len(profile.refs)} "
            f"chunks from it, {from_store} on their own"
        )
        n.destroy(env.id)

        # concurrent cold starts of the template read its pack once
        n.drop_caches()
        slow.order.clear()
        envs = []
        threads = [threading.Thread(target=lambda: envs.append(n.create("task"))) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(envs) == 4
        _wait_cached(n, profile.refs)
        assert slow.order.count("pack:" + profile.pack.digest) == 1
        assert sum(slow.calls[r.digest] for r in profile.refs) <= 2
        for env in envs:
            _read_some(n, env.id)
            n.destroy(env.id)


def _wait_cached(n: Node, refs, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not n.cache.has_all(r.digest for r in refs):
        assert time.monotonic() < deadline, "the profile's chunks never all arrived"
        time.sleep(0.02)


def test_prefetch_pack_of_the_first_chunks(tmp_path, paths, private_store, leak_check):
    """A pack bounded below the profile's size holds its first chunks; the
    published profile loads on another node, whose cold start takes those from
    the pack and the rest one by one."""
    store = CountingStore(private_store)
    digest, groups = template_groups(store)
    with Node(paths, store=store, prefetch_record_s=30) as n:
        _record_profile(n)
        sizes = [r.size for r in n.prefetch.profile(digest).refs]
    assert len(sizes) > 3
    subprocess.run(
        [
            "rm",
            "-rf",
            str(private_store / "refs" / REF_KIND),
            str(private_store / "packs"),
            str(paths.chunk_cache),
            str(paths.node / "images"),
        ],
        check=True,
    )
    with Node(paths, store=store, prefetch_record_s=30, prefetch_pack_bytes=sum(sizes[:2])) as n:
        _record_profile(n)
    profile = load_profile(store, digest)  # what another node reads
    assert profile is not None and profile.pack is not None
    # this recording's order may differ from the first one's: the pack is the
    # longest prefix of *its* refs within the bound
    bound, packed = sum(sizes[:2]), 0
    while packed < len(profile.refs) and sum(r.size for r in profile.refs[: packed + 1]) <= bound:
        packed += 1
    assert 0 < packed < len(profile.refs) and len(profile.pack.frames) == packed

    with _cold_start_on_a_fresh_node(paths, private_store, profile) as (_n, fresh):
        assert fresh.order.count("pack:" + profile.pack.digest) == 1
        assert all(fresh.calls[r.digest] == 1 for r in profile.refs[packed:])


@contextlib.contextmanager
def _cold_start_on_a_fresh_node(paths, store_root: Path, profile):
    """A node with an empty cache on ``paths`` (a new CountingStore of
    ``store_root``) that created ``task`` and has ``profile``'s chunks cached:
    yields (node, store); the environment is destroyed after."""
    subprocess.run(["rm", "-rf", str(paths.chunk_cache), str(paths.node / "images")], check=True)
    fresh = CountingStore(store_root)
    with Node(paths, store=fresh) as n:
        env = n.create("task")
        _wait_cached(n, profile.refs)
        _read_some(n, env.id)
        yield n, fresh
        n.destroy(env.id)


def test_put_frame(tmp_path, paths):
    """A pack's frame takes the chunk's fetch slot only when no fetch of it
    runs (a chunk being fetched is left to that fetch, no waiting for it); a
    bad one raises and leaves nothing behind, and a reader that waited for it
    fetches the chunk itself."""
    store = CountingStore(paths.home / "store", delay=0.5)
    ref, _ = store.put_chunk(os.urandom(MiB))
    other, _ = store.put_chunk(os.urandom(MiB))
    frame = store._get("chunks", ref.digest)
    cache = ChunkCache(paths.chunk_cache, store)
    with pytest.raises(DigestMismatchError):
        cache.put_frame(ref, store._get("chunks", other.digest))
    assert not cache.has(ref.digest) and cache.chunks_fetched == 0
    reader = threading.Thread(target=cache.ensure, args=(ref,))
    reader.start()
    time.sleep(0.1)  # the reader's fetch runs (0.5 s)
    t0 = time.monotonic()
    assert cache.put_frame(ref, frame) is False
    assert time.monotonic() - t0 < 0.3
    reader.join()
    assert cache.has(ref.digest) and store.calls[ref.digest] == 1
    assert cache.put_frame(ref, frame) is False  # cached
    assert cache.put_frame(other, store._get("chunks", other.digest)) is True
    assert cache.path(other.digest).read_bytes() == store.get_chunk(other.digest)
    assert cache.chunks_fetched == 2 and store.calls[other.digest] == 1  # the frame, not a fetch

    # a reader arriving while a bad frame is being checked gets the chunk, not the frame's error
    third, _ = store.put_chunk(os.urandom(MiB))
    slow_bad = zstandard.ZstdCompressor().compress(bytes(128 * MiB))  # ~0.1 s to decode and hash
    errors = []
    checker = threading.Thread(
        target=lambda: errors.append(pytest.raises(DigestMismatchError, cache.put_frame, third, slow_bad))
    )
    checker.start()
    time.sleep(0.01)
    assert cache.read(third, 0, MiB) == store.get_chunk(third.digest)
    checker.join()
    assert len(errors) == 1


@pytest.mark.parametrize("damage", ["missing", "corrupt", "short"])
def test_prefetch_without_its_pack(tmp_path, paths, private_store, leak_check, damage):
    """A pack that is gone, holds other bytes, or is cut short: the replay
    fetches the chunks one by one instead, caches only verified content, and
    the environment works."""
    store = CountingStore(private_store)
    digest, groups = template_groups(store)
    with Node(paths, store=store, prefetch_record_s=30) as n:
        _record_profile(n)
    profile = load_profile(store, digest)
    pack_file = store._path("packs", profile.pack.digest)
    data = pack_file.read_bytes()
    if damage == "missing":
        store.delete_pack(profile.pack.digest)
    elif damage == "corrupt":  # the second frame's bytes replaced by the first one's
        a, b = profile.pack.frames[:2]
        pack_file.write_bytes(data[:a] + (data[:a] + os.urandom(b))[:b] + data[a + b :])
    else:
        pack_file.write_bytes(data[: len(data) // 2])

    with _cold_start_on_a_fresh_node(paths, private_store, profile) as (n, fresh):
        for r in profile.refs:  # every cached chunk is the right one
            assert n.cache.path(r.digest).read_bytes() == store.get_chunk(r.digest)
        one_by_one = [r for r in profile.refs if fresh.calls[r.digest]]
        if damage == "missing":
            assert len(one_by_one) == len(profile.refs)
        elif damage == "corrupt":
            assert profile.refs[1] in one_by_one and len(one_by_one) < len(profile.refs)
        else:
            assert 0 < len(one_by_one) < len(profile.refs)


def test_prefetch_stops_when_destroyed(tmp_path, paths, private_store, leak_check):
    store = CountingStore(private_store)
    digest, groups = template_groups(store)
    with Node(paths, store=store, prefetch_record_s=30, prefetch_pack_bytes=0) as n:  # one by one, slowly
        _record_profile(n)
    assert load_profile(store, digest) is not None
    subprocess.run(["rm", "-rf", str(paths.chunk_cache), str(paths.node / "images")], check=True)
    slow = CountingStore(private_store, delay=0.3)
    with Node(paths, store=slow, prefetch_workers=1) as n:
        env = n.create("task", first_command=False)
        job = n.prefetch.job(env.id)
        assert job is not None
        n.destroy(env.id)
        assert job.done.wait(5) and job.cancelled
        fetched = len(job.fetched)
        time.sleep(1)
        assert len(job.fetched) == fetched < len(job.chunks)


# --- off the lazy path -----------------------------------------------------------------
def test_direct_mount_once_complete(tmp_path, paths, shared_store, leak_check):
    """Once every chunk of a group is cached, new environments mount its
    assembled image directly (no FUSE); environments already running keep
    their lazy mount, which goes with its last user."""
    digest, groups = template_groups(shared_store)
    task_digest, task = groups[1]
    with Node(paths, store=shared_store, pool_size=0) as n:  # the pool's own case: tests/test_pool.py
        a = n.create("task")
        lazy_point = str(n.groups.path(task_digest))
        n.lazyfs.image_path(task_digest).read_bytes()  # every chunk of the task group into the cache
        assert n.cache.has_all(c.digest for c in task.chunks)
        b = n.create("task")  # finds the group complete: assembles its image in the background
        n.groups.wait_assembled()
        image = n.groups.image_path(task_digest)
        assert image.stat().st_size == task.image_size
        assert image.read_bytes() == b"".join(shared_store.get_chunk(c.digest) for c in task.chunks)
        c = n.create("task")
        direct_point = str(n.groups.direct_path(task_digest))
        mounts = {point: (source, fstype) for source, point, fstype in proc_mounts()}
        assert mounts[direct_point] == (str(image), "erofs")
        assert mounts[lazy_point][0].startswith(str(paths.lazy_mountpoint))  # a and b keep theirs
        assert n.groups.mounted_directly() == {task_digest: 1}
        for env in (a, b, c):
            assert n.exec(env.id, ["cat", "/workspace/hello.py"]).stdout == b"print('hello from the task')\n"
            assert n.exec(env.id, ["sh", "-c", "md5sum < /workspace/big.bin"]).exit_code == 0
        n.destroy(a.id)
        n.destroy(b.id)
        assert lazy_point not in {p for _s, p, _t in proc_mounts()}  # superseded, unused: gone
        assert task_digest not in n.lazyfs.groups()
        d = n.create("task")
        assert n.groups.mounted_directly() == {task_digest: 2}
        n.destroy(c.id)
        n.destroy(d.id)
    assert image.exists()  # kept for the next daemon
