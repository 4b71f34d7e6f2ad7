"""Prefetch packs under bad input and bad timing: malformed frame lists, frames
declaring huge plaintexts, stalled streams, more templates than pack readers,
a cache bound below the pack.

Node-level tests create environments; the frame-list checks, which drive a
:class:`Prefetcher` directly over a FileStore, are in ``tests/unit/test_pack_frames.py``."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from test_cache import CountingStore, _read_some, _record_profile, _wait_cached, private_store  # noqa: F401
from weenv.formats.manifest import RuntimeConfig
from weenv.node.node import Node
from weenv.packaging.group import build_group
from weenv.packaging.profile import load_profile
from weenv.packaging.template import create_template, load_template
from weenv.store.file import FileStore

MiB = 1 << 20
SRC = str(Path(__file__).resolve().parents[1] / "src")


# --- a stalled stream -----------------------------------------------------------------------
class StallingStore(CountingStore):
    """A pack stream that sends its first MiB, then stalls until ``release`` is set
    (a registry or a network file system that stops answering)."""

    def __init__(self, root, **kw):
        super().__init__(root, **kw)
        self.release = threading.Event()
        self.stalled = threading.Event()

    def stream_pack(self, digest, size=None):
        inner = super().stream_pack(digest, size)

        def gen():
            data = b"".join(inner)
            yield data[:MiB]
            self.stalled.set()
            self.release.wait(120)
            yield data[MiB:]

        return gen()


def test_close_while_a_pack_stream_is_stalled(tmp_path, paths, private_store, leak_check):  # noqa: F811
    """Node.close while a pack's reader is blocked in a store read that does not
    return: close does not wait for it (it waited 30 s), and the reader ends
    as soon as that read returns (an oci:// store's read timeout)."""
    store = CountingStore(private_store)
    with Node(paths, store=store, prefetch_record_s=30) as n:
        _record_profile(n)
    subprocess.run(["rm", "-rf", str(paths.chunk_cache), str(paths.node / "images")], check=True)
    stalling = StallingStore(private_store)
    n = Node(paths, store=stalling).start()
    try:
        env = n.create("task")
        assert stalling.stalled.wait(30)
        r = n.exec(env.id, ["cat", "/workspace/hello.py"])  # demand reads still work
        assert r.stdout == b"print('hello from the task')\n"
    finally:
        t0 = time.monotonic()
        n.close()
        took = time.monotonic() - t0
        stalling.release.set()
    assert took < 5, f"Node.close took {took:.1f} s"
    deadline = time.monotonic() + 10
    while [t for t in threading.enumerate() if t.name == "weenv-prefetch-pack"]:
        assert time.monotonic() < deadline, "the pack reader outlived its read"
        time.sleep(0.05)


# --- node level -----------------------------------------------------------------------------
def _templates(store: FileStore, tmp_path: Path, count: int) -> list[str]:
    names = []
    for i in range(count):
        src = tmp_path / f"t{i}"
        (src / "workspace").mkdir(parents=True)
        (src / "workspace" / "hello.py").write_text("print('hello from the task')\n")
        (src / "workspace" / "big.bin").write_bytes(os.urandom(3 * MiB))
        (src / "workspace" / "id").write_text(f"{i}\n")
        build_group(src, store, name=f"g{i}")
        create_template(store, f"t{i}", ["base", f"g{i}"], runtime=RuntimeConfig(working_dir="/workspace"))
        names.append(f"t{i}")
    return names


class GcBeforeProfileStore(CountingStore):
    """A real FileStore where ``weenv gc`` of another home (another node sharing
    the store) runs right before the first prefetch profile is published: its
    pack stored, the profile naming it not yet."""

    def __init__(self, root, env: dict[str, str]):
        super().__init__(root)
        self.env = env
        self.gc: tuple[int, str] | None = None

    def set_ref(self, kind, name, digest):
        if kind == "prefetch" and self.gc is None:
            r = subprocess.run(
                [sys.executable, "-m", "weenv", "gc"], env=self.env, capture_output=True, text=True, timeout=300
            )
            self.gc = (r.returncode, r.stdout + r.stderr)
        return super().set_ref(kind, name, digest)


def test_gc_between_a_pack_and_its_profile_keeps_the_pack(tmp_path, paths, private_store, leak_check):  # noqa: F811
    """A gc of another home runs after a node stored a prefetch pack and before
    it published the profile naming it: the pack stays (the publication's write
    lease names it), so the published profile's pack is in the store and a
    cold start streams it.  (Before, the gc deleted the pack under the profile.)"""
    env = {
        **os.environ,
        "WEENV_HOME": str(tmp_path / "other-home"),
        "WEENV_CACHE": str(tmp_path / "other-cache"),
        "WEENV_STORE": f"file://{private_store}",
    }
    store = GcBeforeProfileStore(private_store, env)
    with Node(paths, store=store, prefetch_record_s=30) as n:
        _record_profile(n)
        assert store.gc is not None and store.gc[0] == 0, store.gc
        profile = load_profile(store, load_template(store, "task")[0])
        assert profile is not None and profile.pack is not None
        assert store.has_pack(profile.pack.digest), store.gc
        n.drop_caches()
        store.order.clear()
        env = n.create("task")
        _read_some(n, env.id)
        _wait_cached(n, profile.refs)
        assert f"pack:{profile.pack.digest}" in store.order
        n.destroy(env.id)


def test_many_templates_cold_at_once(tmp_path, paths, private_store, leak_check):  # noqa: F811
    """Seven templates with packs cold-start at once on 4 workers (3 have no
    stream slot); every environment reads correct content, every job ends,
    close leaves no prefetch thread."""
    store = CountingStore(private_store)
    names = _templates(store, tmp_path, 7)
    with Node(paths, store=store, prefetch_record_s=30) as n:
        for name in names:
            env = n.create(name)
            _read_some(n, env.id)
            n.destroy(env.id)
        n.prefetch.wait_published()
        profiles = [load_profile(store, load_template(store, name)[0]) for name in names]
        assert all(p is not None and p.pack is not None for p in profiles)
        n.drop_caches()
        store.order.clear()
        envs, errors = {}, []

        def start(name):
            try:
                envs[name] = n.create(name)
            except Exception as exc:
                errors.append(exc)

        threads = [threading.Thread(target=start, args=(name,)) for name in names]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        for i, name in enumerate(names):
            r = n.exec(envs[name].id, ["sh", "-c", "cat id; md5sum big.bin; python3 -c 'print(1)'"])
            assert r.exit_code == 0 and r.stdout.startswith(f"{i}\n".encode()), r
        for p in profiles:
            _wait_cached(n, p.refs)
        packs = sum(1 for x in store.order if x.startswith("pack:"))
        print(f"\n{packs} packs streamed for {len(names)} templates")
        for name in names:
            n.destroy(envs[name].id)
    left = [t.name for t in threading.enumerate() if t.name.startswith("weenv-prefetch")]
    assert not left, left


def test_cache_bound_below_the_pack(tmp_path, paths, private_store, leak_check):  # noqa: F811
    """A node cache bound of 3 MiB, below the profile's pack: the job stops at
    its budget, reads stay correct."""
    store = CountingStore(private_store)
    with Node(paths, store=store, prefetch_record_s=30) as n:
        _record_profile(n)
    digest = load_template(store, "task")[0]
    profile = load_profile(store, digest)
    assert profile.pack is not None and profile.pack.size > 3 * MiB
    subprocess.run(["rm", "-rf", str(paths.chunk_cache), str(paths.node / "images")], check=True)
    with Node(paths, store=CountingStore(private_store), cache_bytes=3 * MiB) as n:
        env = n.create("task")
        job = n.prefetch.job(env.id)
        _read_some(n, env.id)
        assert job is None or job.done.wait(30)
        assert n.cache.bytes_cached <= 3 * MiB
        n.destroy(env.id)


def test_drop_caches_right_after_destroy_keeps_the_bound(tmp_path, paths, private_store, leak_check):  # noqa: F811
    """drop_caches just after destroy: a prefetch worker of the cancelled job
    still fetching lands its chunk after ChunkCache.clear reset the byte
    count (clear's docstring forbids concurrent fetches); the count must
    still match what the cache holds."""
    store = CountingStore(private_store)
    with Node(paths, store=store, prefetch_record_s=30, prefetch_pack_bytes=0) as n:
        _record_profile(n)
    subprocess.run(["rm", "-rf", str(paths.chunk_cache), str(paths.node / "images")], check=True)
    slow = CountingStore(private_store, delay=0.5)
    with Node(paths, store=slow) as n:
        env = n.create("task", first_command=False)
        job = n.prefetch.job(env.id)
        assert job is not None
        time.sleep(0.2)
        n.destroy(env.id)
        n.drop_caches()
        time.sleep(1.5)  # the in-flight fetches land
        on_disk = (
            sum(p.stat().st_size for p in (paths.chunk_cache / "sha256").glob("*/*") if p.is_file())
            if (paths.chunk_cache / "sha256").exists()
            else 0
        )
        st = n.cache.stats()
        assert st.bytes_cached == on_disk, f"cache counts {st.bytes_cached} bytes, holds {on_disk} on disk"


def test_destroy_while_a_pack_stream_is_stalled(tmp_path, paths, private_store, leak_check):  # noqa: F811
    """Destroying the environment whose pack stream stalls: destroy returns at
    once and the job ends (the reader is left until its next piece)."""
    store = CountingStore(private_store)
    with Node(paths, store=store, prefetch_record_s=30) as n:
        _record_profile(n)
    subprocess.run(["rm", "-rf", str(paths.chunk_cache), str(paths.node / "images")], check=True)
    stalling = StallingStore(private_store)
    with Node(paths, store=stalling) as n:
        env = n.create("task")
        assert stalling.stalled.wait(30)
        job = n.prefetch.job(env.id)
        t0 = time.monotonic()
        n.destroy(env.id)
        assert time.monotonic() - t0 < 5
        assert job is None or job.done.wait(5)
        stalling.release.set()  # let the reader see nobody wants it
