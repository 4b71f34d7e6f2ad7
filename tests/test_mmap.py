"""``mmap`` of lazily loaded files inside an environment (issue 4, "done when").

A program that maps a file of a group whose chunks are not on the node yet
takes its page faults through EROFS and LazyFS: the bytes must be right, and a
fetch that fails under a fault must reach the program as an error (SIGBUS, or
EIO for read(2)) in bounded time, never a hang, while the node keeps serving.

The mapping is made by python3 *inside* the environment.  Never map a lazily
loaded file from the daemon's (or this test's) own Python process: the fault
would be taken while holding the GIL, which LazyFS's FUSE thread needs to
answer it (see :mod:`weenv.node.data.lazyfs`).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import threading
import time

import pytest

from weenv.errors import StoreUnavailableError
from weenv.formats.manifest import RuntimeConfig
from weenv.node.node import Node
from weenv.node.provision import ProvisionConfig
from weenv.packaging.group import assemble_image, build_group, load_group
from weenv.packaging.profile import REF_KIND
from weenv.packaging.template import create_template
from weenv.store.file import FileStore

MiB = 1 << 20
FILE = "/data/mapped.bin"
FILE_MIB = 12
BOUND_S = 60.0
"""A failed fetch must show in the program well before this (seconds)."""
SIGBUS_EXIT = 128 + 7

# Maps FILE, touches its pages from the end backwards a page in 16 (faults in
# no readahead order), then hashes the whole mapping.
MMAP_SHA256 = f"""
import hashlib, mmap
with open({FILE!r}, "rb") as f:
    m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
for i in range(len(m) - 1, -1, -16 * mmap.PAGESIZE):
    m[i]
print(hashlib.sha256(m).hexdigest(), flush=True)
"""


class FailingStore(FileStore):
    """A real FileStore whose reads of the chunks in ``failing`` fail: at once
    (``mode="raise"``, an unreachable store) or after ``delay`` seconds (``"timeout"``,
    a store that stops answering until its client's timeout)."""

    def __init__(self, root, mode: str = "raise", delay: float = 1.0):
        super().__init__(root)
        self.mode, self.delay = mode, delay
        self.failing: set[str] = set()
        self.failed = 0
        self._lock = threading.Lock()

    def _get(self, space: str, digest: str, max_bytes: int | None = None) -> bytes:
        if space == "chunks" and digest in self.failing:
            with self._lock:
                self.failed += 1
            if self.mode == "timeout":
                time.sleep(self.delay)
            raise StoreUnavailableError(f"{self.url}: chunk {digest} unreachable ({self.mode})")
        return super()._get(space, digest, max_bytes)


@pytest.fixture(scope="module")
def mapped(tmp_path_factory, shared_store):
    """(store root, source file bytes, chunk digests wholly inside the file):
    the shared store plus template ``mapped`` = base + group ``mapped``
    (``/data/mapped.bin``, :data:`FILE_MIB` random MiB)."""
    tmp = tmp_path_factory.mktemp("mmap")
    root = tmp / "store"
    subprocess.run(["cp", "-al", str(shared_store.root), str(root)], check=True)
    subprocess.run(["rm", "-rf", str(root / "refs" / REF_KIND), str(root / "packs")], check=True)
    store = FileStore(root)
    tree = tmp / "mapped"
    (tree / "data").mkdir(parents=True)
    data = os.urandom(FILE_MIB * MiB)
    (tree / FILE.lstrip("/")).write_bytes(data)
    build_group(tree, store, name="mapped", chunk_size=MiB, workdir=tmp)
    create_template(store, "mapped", ["base", "mapped"], runtime=RuntimeConfig(working_dir="/data"))
    group = load_group(store, store.get_ref("groups", "mapped"))
    image = tmp / "mapped.img"
    assemble_image(store, group, image)
    offset = image.read_bytes().find(data[:4096])
    assert offset >= 0
    first, last = -(-offset // MiB), (offset + len(data)) // MiB  # chunks wholly inside the file
    inside = [c.digest for c in group.chunks[first:last]]
    assert len(inside) >= FILE_MIB - 2
    return root, data, inside


def mmap_sha256(node: Node, env_id: str):
    t0 = time.perf_counter()
    r = node.exec(env_id, ["python3", "-c", MMAP_SHA256], timeout=BOUND_S * 2)
    return r, time.perf_counter() - t0


def test_mmap_of_a_lazily_loaded_file_reads_right(mapped, paths, leak_check):
    root, data, _inside = mapped
    store = FailingStore(root)
    with Node(paths, store=store, provisioning=ProvisionConfig(mode="off")) as node:
        info = node.create("mapped")
        fetched = node.cache.bytes_fetched
        r, took = mmap_sha256(node, info.id)
        assert (r.exit_code, r.stdout.decode().strip()) == (0, hashlib.sha256(data).hexdigest()), r.stderr
        assert node.cache.bytes_fetched - fetched >= len(data)  # the pages came through LazyFS, now
        print(f"\nmmap + sha256 of a cold {FILE_MIB} MiB file inside: {took:.2f} s")
        node.destroy(info.id)


@pytest.mark.parametrize("failure", ["raise", "timeout", "removed"])
def test_a_failed_fetch_under_mmap_is_an_error_in_the_program(failure, mapped, paths, tmp_path, leak_check):
    """The file's chunks cannot be fetched (the store raises, answers only after
    a delay and then fails, or lost their files): the program dies of SIGBUS
    (or fails with EIO) in bounded time, prints no hash, and the node goes on:
    the same environment and a new one run commands, and once the store is
    healed the same mapping reads right."""
    root, data, inside = mapped
    if failure == "removed":  # a copy of the store of our own, to remove chunk files from
        own = tmp_path / "store"
        subprocess.run(["cp", "-al", str(root), str(own)], check=True)
        root = own
    store = FailingStore(root, mode="timeout" if failure == "timeout" else "raise", delay=1.0)
    with Node(paths, store=store, provisioning=ProvisionConfig(mode="off")) as node:
        # no prefetch: the first test's profile lists the file's chunks, and a replay
        # would fetch them (the store works until told otherwise) before the mmap
        info = node.create("mapped", prefetch=False)
        moved = []
        if failure == "removed":
            for digest in inside:
                path = store._path("chunks", digest)
                moved.append((path, path.with_name(path.name + ".gone")))
                os.rename(*moved[-1])
        else:
            store.failing = set(inside)
        r, took = mmap_sha256(node, info.id)
        print(
            f"\n{failure}: exit {r.exit_code} after {took:.2f} s, {store.failed} store reads failed; "
            f"stderr {r.stderr.decode(errors='replace').strip()[-200:]!r}"
        )
        assert not r.timed_out and took < BOUND_S
        assert r.stdout == b""  # never a hash of wrong bytes
        assert r.exit_code == SIGBUS_EXIT or (r.exit_code != 0 and b"Input/output error" in r.stderr)

        # the node keeps serving: this environment, and a new one
        assert node.exec(info.id, ["python3", "-c", "print(6 * 7)"]).stdout == b"42\n"
        other = node.create("task")
        assert node.exec(other.id, ["python3", "hello.py"]).stdout == b"hello from the task\n"
        node.destroy(other.id)

        # healed: no page was left poisoned
        store.failing = set()
        for pair in moved:
            os.rename(pair[1], pair[0])
        r, _took = mmap_sha256(node, info.id)
        assert (r.exit_code, r.stdout.decode().strip()) == (0, hashlib.sha256(data).hexdigest()), r.stderr
        node.destroy(info.id)
