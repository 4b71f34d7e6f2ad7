"""Many creates at once on one node (issue 4, item 6).

- Concurrent creates of one cold template share its group mounts: each group is
  mounted once (counted in /proc/mounts while the creates run) and every chunk
  is fetched from the store once.
- A store fetch that takes long (a slow or stuck store) holds up only what needs
  its bytes: a create of another template, already cached, goes ahead.

Real FUSE, EROFS, overlay and runc.  The stores are real FileStores (a hard-linked
copy of the session's shared store plus groups built here); :class:`GatedStore`
counts chunk fetches and can hold the fetches of chosen chunks at a gate, as a
store across a network that stopped answering would.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from weenv.formats.manifest import RuntimeConfig
from weenv.node.data.fuse.session import MAX_BACKGROUND
from weenv.node.node import Node
from weenv.node.provision import ProvisionConfig
from weenv.packaging.group import build_group, load_group
from weenv.packaging.profile import REF_KIND
from weenv.packaging.template import create_template, load_template
from weenv.store.file import FileStore

MiB = 1 << 20
CREATES = 32
SLOW_FILE_MIB = 48
"""Size of the slow group's data file: more 1 MiB chunks than LazyFS answers at once."""
BOUND_S = 60.0
"""What counts as "not blocked": far above a create's time on a busy 2-core machine."""


class GatedStore(FileStore):
    """A real FileStore that counts chunk reads and holds reads of the chunks in
    ``gated`` until :attr:`gate` is set (``delay`` seconds added to every chunk read)."""

    def __init__(self, root, delay: float = 0.0):
        super().__init__(root)
        self.delay = delay
        self.gated: set[str] = set()
        self.gate = threading.Event()
        self.reads: Counter[str] = Counter()
        self.held = 0
        """Reads waiting at the gate now."""
        self._count = threading.Lock()

    def _get(self, space: str, digest: str, max_bytes: int | None = None) -> bytes:
        if space == "chunks":
            with self._count:
                self.reads[digest] += 1
            if digest in self.gated and not self.gate.is_set():
                with self._count:
                    self.held += 1
                try:
                    self.gate.wait(BOUND_S * 2)
                finally:
                    with self._count:
                        self.held -= 1
            if self.delay:
                time.sleep(self.delay)
        return super()._get(space, digest, max_bytes)

    def wait_held(self, n: int, timeout: float = BOUND_S) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._count:
                if self.held >= n:
                    return True
            time.sleep(0.01)
        return False


@pytest.fixture(scope="module")
def store_root(tmp_path_factory, shared_store) -> Path:
    """The shared store (template ``task``: base + task) plus template ``slow``:
    base + group ``slow`` (one file of :data:`SLOW_FILE_MIB` random MiB)."""
    tmp = tmp_path_factory.mktemp("concurrency")
    root = tmp / "store"
    subprocess.run(["cp", "-al", str(shared_store.root), str(root)], check=True)
    subprocess.run(
        ["rm", "-rf", str(root / "refs" / REF_KIND), str(root / "packs")], check=True
    )  # profiles other tests recorded
    store = FileStore(root)
    tree = tmp / "slow"
    (tree / "data").mkdir(parents=True)
    (tree / "data" / "big.bin").write_bytes(os.urandom(SLOW_FILE_MIB * MiB))
    build_group(tree, store, name="slow", chunk_size=MiB, workdir=tmp)
    create_template(store, "slow", ["base", "slow"], runtime=RuntimeConfig(working_dir="/data"))
    return root


def group_manifests(store, template: str):
    _d, t = load_template(store, template)
    return [(g, load_group(store, g)) for g in t.groups]


class MountWatch:
    """Samples /proc/mounts in a thread: every EROFS mount point seen under
    ``root`` and the most mounts any one group had at once."""

    def __init__(self, root: Path):
        self.root = str(root) + "/"
        self.seen: set[str] = set()
        self.most: Counter[str] = Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            now: Counter[str] = Counter()
            with open("/proc/mounts") as f:
                for line in f:
                    _src, point, fstype = line.split()[:3]
                    if fstype == "erofs" and point.startswith(self.root):
                        group = point[len(self.root) :].split(".")[0]
                        now[group] += 1
                        self.seen.add(point)
            for group, n in now.items():
                self.most[group] = max(self.most[group], n)
            self._stop.wait(0.001)

    def __enter__(self) -> MountWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def destroy_all(node: Node, ids) -> None:
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(node.destroy, ids))


def test_concurrent_cold_creates_mount_each_group_once(store_root, paths, leak_check):
    """32 creates of one template, released at once on a node with an empty
    cache: one EROFS mount per group, each chunk fetched once, all 32 run."""
    store = GatedStore(store_root, delay=0.01)  # a store a little slower than the local disk
    groups = group_manifests(store, "task")
    with Node(paths, store=store, provisioning=ProvisionConfig(mode="off")) as node:
        barrier = threading.Barrier(CREATES)

        def create(_i):
            barrier.wait()
            return node.create("task")

        t0 = time.perf_counter()
        with MountWatch(paths.group_mounts) as watch, ThreadPoolExecutor(CREATES) as pool:
            infos = list(pool.map(create, range(CREATES)))
        elapsed = time.perf_counter() - t0
        node.pool.drain()  # its environments hold the group mounts too
        try:
            points = [str(node.groups.path(g)) for g, _m in groups]
            assert watch.seen == set(points)  # no other mount ever appeared (no second or failed one)
            assert all(watch.most[p.rsplit("/", 1)[1]] == 1 for p in points)
            erofs = [
                p
                for line in open("/proc/mounts")
                if (f := line.split())[2] == "erofs" and (p := f[1]).startswith(str(paths.group_mounts))
            ]
            assert sorted(erofs) == sorted(points)
            assert node.groups.mounted() == {g: CREATES for g, _m in groups}
            assert max(store.reads.values()) == 1  # single-flight fetches: no chunk read twice

            def run(info):
                return node.exec(info.id, ["python3", "hello.py"], timeout=120)

            with ThreadPoolExecutor(8) as pool:
                results = list(pool.map(run, infos))
            assert [(r.exit_code, r.stdout) for r in results] == [(0, b"hello from the task\n")] * CREATES
            assert len({i.id for i in infos}) == CREATES
            print(
                f"\n{CREATES} concurrent cold creates: {elapsed:.2f} s; per create p50 "
                f"{sorted(i.timing.total_s for i in infos)[CREATES // 2]:.3f} s; "
                f"{sum(store.reads.values())} chunks fetched"
            )
        finally:
            destroy_all(node, [i.id for i in infos])


def _call(fn, *args, **kwargs):
    """Run ``fn`` in a thread; (thread, box) with box["result"] or box["error"] when done."""
    box: dict = {}

    def target():
        try:
            box["result"] = fn(*args, **kwargs)
        except BaseException as exc:  # reported by the test
            box["error"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t, box


def test_a_stuck_fetch_holds_up_no_other_template(store_root, paths, leak_check):
    """While the store holds every fetch of group ``slow`` (a create of template
    ``slow`` mounting it, a second create of it waiting for that mount), a
    create of template ``task``, whose chunks are cached, starts and runs."""
    store = GatedStore(store_root)
    slow = dict(group_manifests(store, "slow"))
    slow_digest = [g for g in slow if g != store.get_ref("groups", "base")][0]
    store.gated = {c.digest for c in slow[slow_digest].chunks}
    with Node(paths, store=store, provisioning=ProvisionConfig(mode="off")) as node:
        warm = node.create("task")  # caches and mounts base and task
        node.destroy(warm.id)
        first = second = None
        try:
            first = _call(node.create, "slow")
            assert store.wait_held(1)  # its mount waits for the superblock's chunk
            second = _call(node.create, "slow")

            t0 = time.perf_counter()
            t, box = _call(create_and_run, node, "task", ["python3", "hello.py"])
            t.join(BOUND_S)
            took = time.perf_counter() - t0
            assert not t.is_alive(), "a create of a cached template waited for another template's fetch"
            assert "error" not in box, box.get("error")
            info, r = box["result"]
            assert r.stdout == b"hello from the task\n"
            assert node.stats().environments == 1 and [e.id for e in node.list()] == [info.id]
            assert first[0].is_alive() and second[0].is_alive()  # both still wait for the store
            superblock = slow[slow_digest].chunks[0].digest
            assert store.reads[superblock] == 1  # the second create waits for the first one's mount
            print(f"\ncreate + exec of a cached template while another's fetch is stuck: {took:.3f} s")
            node.destroy(info.id)
        finally:
            store.gate.set()
            for call in (first, second):
                if call is not None:
                    call[0].join(BOUND_S)
        infos = [call[1].get("result") for call in (first, second)]
        assert all(infos), [call[1].get("error") for call in (first, second)]
        assert sum(1 for _t, p in _erofs(paths) if slow_digest[7:] in p) == 1
        for info in infos:
            assert node.exec(info.id, ["sha256sum", "big.bin"], timeout=120).exit_code == 0
            node.destroy(info.id)


def create_and_run(node: Node, template: str, command: list[str]):
    info = node.create(template)
    return info, node.exec(info.id, command, timeout=120)


def _erofs(paths):
    from weenv.host.mounts import mounts_under

    return [(t, p) for t, p in mounts_under(paths.group_mounts) if t == "erofs"]


def test_many_stuck_reads_hold_up_no_cached_read(store_root, paths, leak_check):
    """More reads stuck on the store than LazyFS answers at once (one per chunk
    of a 48 MiB file, from 48 threads) do not hold up reads of chunks already in
    the node cache: a create of template ``task`` whose chunks are cached but
    whose groups are not mounted (so its mounts and first command read through
    FUSE) goes ahead."""
    store = GatedStore(store_root)
    slow = dict(group_manifests(store, "slow"))
    base_digest = store.get_ref("groups", "base")
    slow_digest = [g for g in slow if g != base_digest][0]
    with Node(paths, store=store, provisioning=ProvisionConfig(mode="off")) as node:
        warm = node.create("task")  # fetches what a start of "task" reads
        node.destroy(warm.id)
        node.groups.unmount_unused()  # chunks stay in the node cache; page cache gone with the mounts
        assert node.groups.mounted() == {}
        env = node.create(
            "slow", first_command=False, prefetch=False
        )  # mounts group slow (its metadata is fetched now)
        store.gated = {c.digest for c in slow[slow_digest].chunks if not node.cache.has(c.digest)}
        big = node.groups.path(slow_digest) / "data" / "big.bin"
        readers = []
        try:
            size = big.stat().st_size

            def read_at(offset):
                fd = os.open(big, os.O_RDONLY)
                try:
                    return len(os.pread(fd, 4096, offset))
                except OSError as exc:
                    return exc
                finally:
                    os.close(fd)

            pool = ThreadPoolExecutor(SLOW_FILE_MIB)
            readers = [pool.submit(read_at, off) for off in range(MiB // 2, size, MiB)]
            assert store.wait_held(min(len(store.gated), len(readers)) - 4)  # nearly all stuck at once

            t0 = time.perf_counter()
            t, box = _call(create_and_run, node, "task", ["python3", "hello.py"])
            t.join(BOUND_S)
            took = time.perf_counter() - t0
            assert not t.is_alive(), f"{store.held} stuck store reads held up reads served from the node cache"
            assert "error" not in box, box.get("error")
            info, r = box["result"]
            assert r.stdout == b"hello from the task\n"
            print(f"\ncreate + exec through FUSE from the cache with {store.held} reads stuck: {took:.3f} s")
            node.destroy(info.id)
        finally:
            store.gate.set()
            if readers:
                pool.shutdown(wait=True)
        assert all(f.result() == 4096 for f in readers)
        node.destroy(env.id)


def test_a_cold_template_mounts_its_groups_in_parallel(store_root, paths, leak_check):
    """The groups of a cold template wait for their superblocks' fetches at the
    same time, not one after another (both fetches are held by the store at once)."""
    store = GatedStore(store_root)
    groups = group_manifests(store, "slow")
    store.gated = {m.chunks[0].digest for _g, m in groups}
    with Node(paths, store=store, provisioning=ProvisionConfig(mode="off")) as node:
        call = _call(node.create, "slow", first_command=False, prefetch=False)  # only the mounts fetch
        try:
            assert store.wait_held(len(groups), timeout=BOUND_S), f"{store.held} of {len(groups)} fetches at once"
        finally:
            store.gate.set()
            call[0].join(BOUND_S)
        assert "error" not in call[1], call[1].get("error")
        node.destroy(call[1]["result"].id)


def test_threads_return_to_the_baseline_after_a_burst(node):
    """Issue 13, finding 16: a burst of create/exec/destroy cycles (8 at once)
    leaves no thread behind (each create's first command had a 60 s timeout
    timer that a fast pump missed to cancel: one thread per create for a minute)."""

    def cycle(_):
        e = node.create("task")
        node.exec(e.id, ["true"], timeout=30)
        node.destroy(e.id)

    def others() -> int:  # FUSE read workers are a bounded pool of their own (checked below)
        return sum(not t.name.startswith("weenv-lazyfs-w") for t in threading.enumerate())

    cycle(0)  # the node's own threads (pool, provisioner, pipe sink) are up
    baseline = others()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(cycle, range(120)))
    deadline = time.monotonic() + 3
    while others() > baseline + 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    left = Counter(t.name.rstrip("0123456789") for t in threading.enumerate())
    assert others() <= baseline + 3, f"{others()} threads (baseline {baseline}): {left}"
    assert left["weenv-lazyfs-w"] <= MAX_BACKGROUND
