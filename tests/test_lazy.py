"""The node's lazy data path: chunk cache, LazyFS (FUSE), shared EROFS group mounts.

Real FUSE and EROFS mounts, real stores (a counting subclass of FileStore where
the number of store reads matters).  Every test stops LazyFS and unmounts in its
fixture's teardown; ``leak_check`` then fails it if a mount or FUSE connection
remains.  Measured numbers are printed (``pytest -s`` shows them).
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import zstandard

from weenv.errors import DigestMismatchError, MountError
from weenv.host.mounts import mounts_under
from weenv.node.data.cache import ChunkCache
from weenv.node.data.groups import GroupMounts, clear_stale
from weenv.node.data.lazyfs import LazyFS
from weenv.packaging.group import build_group
from weenv.store.file import FileStore

MiB = 1 << 20
BIG_FILES = 8
BIG_SIZE = 4 * MiB  # 8 x 4 MiB of random bytes: 32 MiB that zstd cannot shrink


class CountingStore(FileStore):
    """A real FileStore that counts get_chunk calls per digest, optionally slowed
    down (``delay`` seconds) to widen race windows, or held at ``gate`` until set."""

    def __init__(self, root, delay: float = 0.0):
        super().__init__(root)
        self.calls: Counter[str] = Counter()
        self.delay = delay
        self.gate: threading.Event | None = None
        self._count_lock = threading.Lock()

    def get_chunk(self, digest: str, **hints) -> bytes:
        with self._count_lock:
            self.calls[digest] += 1
        if self.gate is not None:
            self.gate.wait(30)
        if self.delay:
            time.sleep(self.delay)
        return super().get_chunk(digest, **hints)


def make_tree(root: Path) -> Path:
    src = root / "src"
    (src / "data").mkdir(parents=True)
    for i in range(BIG_FILES):
        (src / "data" / f"big{i}.bin").write_bytes(os.urandom(BIG_SIZE))
    (src / "etc").mkdir()
    (src / "etc" / "small.txt").write_text("a small file\n" * 10)
    return src


def build(tmp_path: Path, store: FileStore):
    src = make_tree(tmp_path)
    result = build_group(src, store, name="lazy-test", chunk_size=MiB, workdir=tmp_path)
    return src, result


def image_bytes(store: FileStore, manifest) -> bytes:
    return b"".join(store.get_chunk(c.digest) for c in manifest.chunks)


def corrupt(store: FileStore, digest: str, size: int) -> None:
    """Replace the chunk's frame by a valid zstd frame of other content."""
    frame = zstandard.ZstdCompressor().compress(os.urandom(size))
    store._path("chunks", digest).write_bytes(frame)


def drop_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def fuse_mounts() -> list[str]:
    with open("/proc/mounts") as f:
        return [line for line in f if line.split()[2].startswith("fuse.weenv")]


class LazyNode:
    """A chunk cache, a running LazyFS and GroupMounts under one WEENV_HOME."""

    def __init__(self, paths, store):
        self.cache = ChunkCache(paths.chunk_cache, store)
        self.fs = LazyFS(paths.lazy_mountpoint, self.cache)
        self.mounts = GroupMounts(paths.group_mounts, self.fs)

    def close(self):
        try:
            self.mounts.unmount_all()
        finally:
            self.fs.stop()


FUSE_CONNECTIONS = Path("/sys/fs/fuse/connections")


@pytest.fixture(scope="module")
def fusectl():
    """/sys/fs/fuse/connections lists live FUSE connections only while the fusectl
    file system is mounted there (systemd does it; this container does not).
    Module scope: mounted before any test's ``leak_check`` snapshot."""
    mounted_here = False
    if not any(line.split()[2] == "fusectl" for line in open("/proc/mounts")):
        subprocess.run(["mount", "-t", "fusectl", "fusectl", str(FUSE_CONNECTIONS)], check=True)
        mounted_here = True
    yield FUSE_CONNECTIONS
    if mounted_here:
        subprocess.run(["umount", str(FUSE_CONNECTIONS)], check=False)


@pytest.fixture
def counting_store(paths) -> CountingStore:
    return CountingStore(paths.home / "store")


@pytest.fixture
def lazy(paths, counting_store, leak_check):
    n = LazyNode(paths, counting_store)
    n.fs.start()
    try:
        yield n
    finally:
        n.close()


def test_lazy_fetch(tmp_path, counting_store, lazy):
    src, res = build(tmp_path, counting_store)
    n_chunks = len(res.manifest.chunks)
    mp = lazy.mounts.acquire(res.digest, res.manifest)
    after_mount = lazy.cache.chunks_fetched

    assert (mp / "etc" / "small.txt").read_text() == (src / "etc" / "small.txt").read_text()
    names = sorted(p.name for p in (mp / "data").iterdir())
    assert names == [f"big{i}.bin" for i in range(BIG_FILES)]
    small = lazy.cache.stats()
    fraction = small.chunks_fetched / n_chunks
    print(
        f"\nimage {res.manifest.image_size / MiB:.1f} MiB in {n_chunks} chunks; mount fetched "
        f"{after_mount}; small file + listing fetched {small.chunks_fetched} chunks "
        f"({fraction:.1%}), {small.bytes_fetched} stored bytes"
    )
    assert fraction < 0.10

    # A big file: its chunks are fetched, the bytes are the source's.
    t0 = time.monotonic()
    data = (mp / "data" / "big3.bin").read_bytes()
    cold = time.monotonic() - t0
    assert data == (src / "data" / "big3.bin").read_bytes()
    big = lazy.cache.stats()
    assert BIG_SIZE // MiB <= big.chunks_fetched - small.chunks_fetched <= BIG_SIZE // MiB + 2
    assert big.bytes_fetched == sum(c.stored_size for c in res.manifest.chunks if lazy.cache.has(c.digest))

    # Warm (chunk cache, through FUSE) and hot (page cache) reads of the same file.
    path = mp / "data" / "big3.bin"
    drop_page_cache(path)
    reads0 = lazy.fs.stats(res.digest).reads
    t0 = time.monotonic()
    assert path.read_bytes() == data
    warm = time.monotonic() - t0
    reads1 = lazy.fs.stats(res.digest).reads
    t0 = time.monotonic()
    assert path.read_bytes() == data
    hot = time.monotonic() - t0
    assert lazy.fs.stats(res.digest).reads == reads1  # served by the page cache
    assert lazy.cache.chunks_fetched == big.chunks_fetched  # nothing fetched again
    mib = BIG_SIZE / MiB
    print(
        f"4 MiB file: cold {mib / cold:.0f} MiB/s (fetch), warm {mib / warm:.0f} MiB/s "
        f"({reads1 - reads0} FUSE reads), hot {mib / hot:.0f} MiB/s (page cache)"
    )

    # Everything else is byte-identical too, and the access order starts at the superblock.
    for i in range(BIG_FILES):
        assert (mp / "data" / f"big{i}.bin").read_bytes() == (src / "data" / f"big{i}.bin").read_bytes()
    stats = lazy.fs.stats(res.digest)
    assert stats.first_read[0] == 0
    assert sorted(stats.first_read) == list(range(n_chunks))  # every chunk read once by now
    assert max(counting_store.calls.values()) == 1
    lazy.mounts.release(res.digest)


def test_single_flight_ensure(tmp_path, paths):
    store = CountingStore(paths.home / "store", delay=0.05)
    _src, res = build(tmp_path, store)
    cache = ChunkCache(tmp_path / "cache", store)
    chunk = res.manifest.chunks[5]
    barrier = threading.Barrier(16)
    results: list = [None] * 16

    def ensure(k: int) -> None:
        barrier.wait()
        try:
            results[k] = cache.ensure(chunk)
        except Exception as exc:  # noqa: BLE001 - collected for the asserts
            results[k] = exc

    threads = [threading.Thread(target=ensure, args=(k,)) for k in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.calls[chunk.digest] == 1
    assert all(r == cache.path(chunk.digest) for r in results)
    assert cache.stats().chunks_fetched == 1 and cache.bytes_fetched == chunk.stored_size
    assert cache.read(chunk, 100, 50) == store.get_chunk(chunk.digest)[100:150]

    # An error reaches every waiter, nothing is cached, and the next call asks again.
    bad = res.manifest.chunks[6]
    corrupt(store, bad.digest, bad.size)
    barrier.reset()
    results = [None] * 16
    chunk = bad
    threads = [threading.Thread(target=ensure, args=(k,)) for k in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.calls[bad.digest] == 1
    assert all(isinstance(r, DigestMismatchError) for r in results)
    assert not cache.has(bad.digest)
    assert cache.stats().fetch_errors == 1
    with pytest.raises(DigestMismatchError):
        cache.ensure(bad)
    assert store.calls[bad.digest] == 2
    assert cache.cached_digests() == [res.manifest.chunks[5].digest]
    cache.clear()
    assert cache.cached_digests() == [] and not cache.has(res.manifest.chunks[5].digest)


def test_single_flight_through_fuse(tmp_path, counting_store, lazy):
    _src, res = build(tmp_path, counting_store)
    counting_store.delay = 0.05
    image = lazy.fs.add_group(res.digest, res.manifest)
    expected = image_bytes(FileStore(counting_store.root), res.manifest)
    counting_store.calls.clear()
    off, size = 3 * MiB + 12345, 4 * MiB  # a cold region over 5 chunks
    barrier = threading.Barrier(12)
    out: list = [None] * 12

    def read(k: int) -> None:
        fd = os.open(image, os.O_RDONLY)
        try:
            barrier.wait()
            out[k] = os.pread(fd, size, off)
        finally:
            os.close(fd)

    threads = [threading.Thread(target=read, args=(k,)) for k in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(o == expected[off : off + size] for o in out)
    touched = {c.digest for c in res.manifest.chunks[off // MiB : (off + size - 1) // MiB + 1]}
    assert set(counting_store.calls) == touched
    assert all(v == 1 for v in counting_store.calls.values()), counting_store.calls
    assert os.stat(image).st_size == res.manifest.image_size
    assert lazy.fs.stats(res.digest).first_read == [3, 4, 5, 6, 7]
    lazy.fs.remove_group(res.digest)
    assert lazy.fs.groups() == []


THP_PROBE = r"""
import mmap, os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
m = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
m.madvise(mmap.MADV_HUGEPAGE)  # 2 MiB page-cache folios: one EROFS read split into two FUSE reads
off = int(sys.argv[2])
sys.stdout.buffer.write(m[off : off + 4096])
"""


def test_corrupt_chunk_gives_eio(tmp_path, counting_store, lazy):
    src, res = build(tmp_path, counting_store)
    image = image_bytes(counting_store, res.manifest)
    victim = (src / "data" / "big5.bin").read_bytes()
    start = image.find(victim[:4096])  # uncompressed EROFS: file data is contiguous
    assert start > 0 and image[start : start + BIG_SIZE] == victim
    # The bad chunk starts in the second half of a 2 MiB-aligned piece of the file
    # (a huge-page folio, probed below), not at the file's start.
    index = next(
        i
        for i in range(start // MiB + 1, len(res.manifest.chunks))
        if (i * MiB - start) % (2 * MiB) >= MiB and (i * MiB - start) // (2 * MiB) * (2 * MiB) + 2 * MiB <= BIG_SIZE
    )
    bad = res.manifest.chunks[index]
    bad_lo, bad_hi = index * MiB - start, (index + 1) * MiB - start  # in file offsets
    corrupt(counting_store, bad.digest, bad.size)

    mp = lazy.mounts.acquire(res.digest, res.manifest)
    path = mp / "data" / "big5.bin"

    # First, before anything of the file is cached: a 2 MiB huge-page folio whose second half reaches the bad chunk: the kernel
    # splits its read into two 1 MiB FUSE reads, the first succeeds, the second
    # fails.  Were that reported as a short read, EROFS would zero-fill the second
    # half and serve zeros.  Page at the start of the second half: SIGBUS, or the
    # right bytes if the kernel used small folios and it lies before the bad chunk.
    folio = bad_lo // (2 * MiB) * (2 * MiB)
    probe = folio + MiB
    out = subprocess.run([sys.executable, "-c", THP_PROBE, str(path), str(probe)], capture_output=True, timeout=60)
    print(
        f"\nmmap(MADV_HUGEPAGE) {bad_lo - probe} bytes before the bad chunk: rc={out.returncode}, {len(out.stdout)} bytes"
    )
    assert out.returncode == -signal.SIGBUS or out.stdout == victim[probe : probe + 4096]

    with pytest.raises(OSError) as info:
        path.read_bytes()
    assert info.value.errno == errno.EIO

    # Piece by piece: every byte returned is right (a read may stop short where
    # the bad range begins); the failing pieces are near the bad chunk.
    piece_size = 64 * 1024
    fd = os.open(path, os.O_RDONLY)
    failed = []
    try:
        for off in range(0, BIG_SIZE, piece_size):
            try:
                piece = os.pread(fd, piece_size, off)
            except OSError as exc:
                assert exc.errno == errno.EIO
                failed.append(off)
                continue
            assert piece == victim[off : off + len(piece)]
            if len(piece) < piece_size:
                failed.append(off)
    finally:
        os.close(fd)
    # (A failed read can take its whole folio down: up to 2 MiB either side.)
    assert failed and all(bad_lo - 2 * MiB <= off < bad_hi + 2 * MiB for off in failed), (bad_lo, failed)
    assert not lazy.cache.has(bad.digest)
    stats = lazy.fs.stats(res.digest)
    assert stats.errors > 0 and "DigestMismatchError" in stats.last_error

    for name in ("big4.bin", "big6.bin"):
        assert (mp / "data" / name).read_bytes() == (src / "data" / name).read_bytes()
    assert (mp / "etc" / "small.txt").read_text() == (src / "etc" / "small.txt").read_text()
    lazy.mounts.release(res.digest)
    assert lazy.mounts.unmount_unused() == [res.digest]


def test_corrupt_superblock_chunk_fails_acquire(tmp_path, counting_store, lazy):
    _src, res = build(tmp_path, counting_store)
    first = res.manifest.chunks[0]
    good_frame = counting_store._path("chunks", first.digest).read_bytes()
    corrupt(counting_store, first.digest, first.size)

    with pytest.raises(MountError) as info:
        lazy.mounts.acquire(res.digest, res.manifest)
    message = str(info.value)
    print(f"\nMountError: {message}")
    assert res.digest in message and "DigestMismatchError" in message
    target = lazy.mounts.path(res.digest)
    assert not target.exists()
    assert lazy.mounts.mounted() == {}
    assert lazy.fs.groups() == []
    assert not any("erofs" in line and str(target) in line for line in open("/proc/mounts"))
    assert not lazy.cache.has(first.digest)

    # Repaired store: the next acquire mounts.
    counting_store._path("chunks", first.digest).write_bytes(good_frame)
    assert lazy.mounts.acquire(res.digest, res.manifest) == target
    lazy.mounts.release(res.digest)


def test_shared_mounts(tmp_path, counting_store, lazy):
    src, res = build(tmp_path, counting_store)
    counting_store.delay = 0.02
    barrier = threading.Barrier(8)
    got: list = [None] * 8

    def acquire(k: int) -> None:
        barrier.wait()
        got[k] = lazy.mounts.acquire(res.digest, res.manifest)

    threads = [threading.Thread(target=acquire, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    target = lazy.mounts.path(res.digest)
    assert got == [target] * 8
    erofs = [line for line in open("/proc/mounts") if line.split()[2] == "erofs" and line.split()[1] == str(target)]
    assert len(erofs) == 1, erofs
    assert lazy.mounts.mounted() == {res.digest: 8}
    assert counting_store.calls[res.manifest.chunks[0].digest] == 1
    assert (target / "etc" / "small.txt").read_text() == (src / "etc" / "small.txt").read_text()

    for _ in range(8):
        lazy.mounts.release(res.digest)
    with pytest.raises(MountError):
        lazy.mounts.release(res.digest)
    assert lazy.mounts.mounted() == {res.digest: 0}  # kept for warm starts
    assert lazy.mounts.acquire(res.digest, res.manifest) == target
    assert lazy.mounts.mounted() == {res.digest: 1}

    lazy.mounts.unmount_all()  # still referenced: unmounted anyway (daemon stop)
    lazy.mounts.unmount_all()
    assert lazy.mounts.mounted() == {}
    assert not target.exists()
    assert not [line for line in open("/proc/mounts") if line.split()[2] == "erofs" and str(tmp_path) in line]
    assert lazy.fs.groups() == []


def test_stop_leaves_no_fuse_mount(fusectl, paths, store, leak_check):
    conns_before = set(os.listdir(fusectl))
    fs = LazyFS(paths.lazy_mountpoint, ChunkCache(paths.chunk_cache, store))
    fs.start()
    try:
        assert any(str(paths.lazy_mountpoint) in line for line in fuse_mounts())
        assert set(os.listdir(fusectl)) - conns_before
        other = LazyFS(paths.home / "other", ChunkCache(paths.chunk_cache, store))
        other.start()  # two file systems in one process are fine (no pyfuse3 globals)
        other.stop()
        with pytest.raises(MountError):
            other.start()  # a LazyFS runs once
        assert os.listdir(paths.lazy_mountpoint) == []
    finally:
        fs.stop()
    fs.stop()  # idempotent
    assert not any(str(paths.lazy_mountpoint) in line for line in fuse_mounts())
    assert set(os.listdir(fusectl)) == conns_before
    assert not fs.running


def test_stop_while_busy_does_not_hang(fusectl, tmp_path, paths, counting_store, leak_check):
    """A group still mounted and a read stuck in a fetch: stop() detaches, cancels
    the read after its timeout and returns; the stuck reader gets an error."""
    _src, res = build(tmp_path, counting_store)
    n = LazyNode(paths, counting_store)
    n.fs.start()
    try:
        mp = n.mounts.acquire(res.digest, res.manifest)
        counting_store.gate = threading.Event()  # every later fetch blocks
        errors: list = []

        def stuck_reader() -> None:
            try:
                (mp / "data" / "big1.bin").read_bytes()
            except OSError as exc:
                errors.append(exc)

        reader = threading.Thread(target=stuck_reader)
        reader.start()
        deadline = time.monotonic() + 10
        while len(counting_store.calls) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        t0 = time.monotonic()
        n.fs.stop(timeout=1.0)
        took = time.monotonic() - t0
        print(f"\nstop() with a mounted group and a stuck fetch: {took:.2f} s")
        assert took < 5 and not n.fs.running
        reader.join(10)
        assert not reader.is_alive() and errors, "the reader of a stopped LazyFS must fail, not hang"
        print(f"stuck reader got: {errors[0]!r}")
        assert not any(str(paths.lazy_mountpoint) in line for line in fuse_mounts())
    finally:
        if counting_store.gate is not None:
            counting_store.gate.set()
        n.close()


CRASHING_DAEMON = r"""
import os, sys
from weenv.node.data.cache import ChunkCache
from weenv.node.data.groups import GroupMounts
from weenv.node.data.lazyfs import LazyFS
from weenv.packaging.group import load_group
from weenv.store.file import FileStore
home, digest = sys.argv[1], sys.argv[2]
store = FileStore(home + "/store")
fs = LazyFS(home + "/node/lazy", ChunkCache(home + "/node/cache", store))
fs.start()
GroupMounts(home + "/node/groups", fs).acquire(digest, load_group(store, digest))
print("mounted", flush=True)
os._exit(0)  # a crash: no unmount, no stop
"""


def test_clear_stale_after_a_crash(tmp_path, paths, store, leak_check):
    src, res = build(tmp_path, store)
    out = subprocess.run(
        [sys.executable, "-c", CRASHING_DAEMON, str(paths.home), res.digest],
        capture_output=True,
        text=True,
        timeout=60,
    )
    n = LazyNode(paths, store)
    try:
        assert out.stdout.strip() == "mounted", out.stderr
        left = [point for _t, point in mounts_under(paths.node)]
        assert len(left) == 2, left  # the dead daemon's FUSE mount and the group on it
        with pytest.raises(MountError):
            n.fs.start()  # the mount point is taken
        assert sorted(clear_stale(paths.group_mounts, paths.lazy_mountpoint)) == sorted(left)
        assert list(paths.group_mounts.iterdir()) == []
        n.fs.start()
        mp = n.mounts.acquire(res.digest, res.manifest)
        assert (mp / "etc" / "small.txt").read_text() == (src / "etc" / "small.txt").read_text()
        n.mounts.release(res.digest)
    finally:
        n.close()
        clear_stale(paths.group_mounts, paths.lazy_mountpoint)  # if the test failed early


WITHDRAWN_REQUEST = r"""
import os, subprocess, sys, time
from weenv.node.data.cache import ChunkCache
from weenv.node.data.lazyfs import LazyFS
from weenv.store.file import FileStore
home = sys.argv[1]
fs = LazyFS(home + "/node/lazy", ChunkCache(home + "/node/cache", FileStore(home + "/store")))
fs.start()
try:
    # A caller of the file system, killed while its request waits to be read.
    child = subprocess.Popen([sys.executable, "-c",
                              "import os, time; time.sleep(0.5); os.stat(sys.argv[1])".replace("sys.argv[1]", repr(home + "/node/lazy/nothing"))])
    sys.setswitchinterval(100)  # this thread keeps the GIL: the FUSE thread, woken by the request, waits for it
    t = time.monotonic()
    while time.monotonic() - t < 1.0:  # pure Python: no I/O, the GIL is never released
        pass
    os.kill(child.pid, 9)  # (os.kill keeps the GIL) the kernel withdraws the unread LOOKUP
    t = time.monotonic()
    while time.monotonic() - t < 0.3:
        pass
    sys.setswitchinterval(0.005)
    time.sleep(0.1)  # the FUSE thread takes the GIL and reads /dev/fuse: nothing there any more
    child.wait()
    print("resumed", flush=True)
finally:
    fs.stop()
"""


def test_a_withdrawn_request_does_not_stall_the_daemon(paths, store, leak_check):
    """A request withdrawn by the kernel between poll and read (its caller
    killed) must not stall the daemon.  With pyfuse3, which read /dev/fuse
    holding the GIL, the read blocked and every other thread waited for the
    GIL forever (seen in CI: ``Node.close`` after a failed build step); weenv's
    own FUSE session reads with the GIL released."""
    try:
        out = subprocess.run(
            [sys.executable, "-c", WITHDRAWN_REQUEST, str(paths.home)], capture_output=True, text=True, timeout=60
        )
    except subprocess.TimeoutExpired:  # killed: its FUSE mount stays behind, dead
        clear_stale(paths.group_mounts, paths.lazy_mountpoint)
        pytest.fail("the daemon stalled after a FUSE request was withdrawn")
    assert out.returncode == 0 and out.stdout.strip() == "resumed", out.stderr
