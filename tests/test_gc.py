"""Garbage collection of the store and the node chunk cache, and the dedupe report."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from weenv.errors import DaemonError, InvalidInputError
from weenv.formats.manifest import RuntimeConfig
from weenv.node.data.cache import ChunkCache
from weenv.packaging.buildcache import store_lock
from weenv.packaging.gc import collect, dedupe_report
from weenv.packaging.group import assemble_image, build_group, load_group
from weenv.packaging.profile import PrefetchPack, PrefetchProfile, build_pack, load_profile, publish_profile
from weenv.packaging.template import create_template, load_template
from weenv.packaging.update import update_component
from weenv.server import daemon


def _tree(root: Path, files: dict[str, bytes]) -> Path:
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


def _chunks(store, digest):
    return {c.digest for c in load_group(store, digest).chunks}


def _all_intact(store, tmp_path):
    """Every template ref loads, and every group of it assembles from the store."""
    for name in store.list_refs("templates"):
        _, t = load_template(store, name)
        for g in t.groups:
            assemble_image(store, load_group(store, g), tmp_path / "check.img")


@pytest.fixture
def populated(store, tmp_path):
    """Templates t1, t2 sharing base; a group no template uses; t1 updated once (its
    first version and its first task group are now unreferenced)."""
    base = build_group(_tree(tmp_path / "base", {"big.bin": os.urandom(3 << 20)}), store, name="base")
    t1a = build_group(_tree(tmp_path / "t1a", {"w/a": os.urandom(1 << 20)}), store, name="task1")
    t2 = build_group(_tree(tmp_path / "t2", {"w/b": os.urandom(1 << 20)}), store, name="task2")
    loose = build_group(_tree(tmp_path / "loose", {"x": os.urandom(1 << 20)}), store, name="loose")
    old_t1, _ = create_template(store, "t1", ["base", "task1"])
    create_template(store, "t2", ["base", "task2"])
    store.set_ref("buildcache", "ab" * 32, loose.digest)
    store.set_ref("buildcache", "cd" * 32, base.digest)
    return {"base": base, "task1_old": t1a, "task2": t2, "loose": loose, "t1_old": old_t1}


def test_gc_keeps_referenced_and_removes_unreferenced(populated, store, paths, tmp_path):
    p = populated
    upd = update_component(store, "t1", "task1", _tree(tmp_path / "t1b", {"w/a2": os.urandom(1 << 20)}), paths=paths)
    doomed_chunks = (_chunks(store, p["task1_old"].digest) | _chunks(store, p["loose"].digest)) - _chunks(
        store, upd.group_digest
    )
    # the node chunk cache holds chunks of kept and of doomed groups
    cache = ChunkCache(paths.chunk_cache, store)
    for g in (p["base"].digest, p["task1_old"].digest, p["loose"].digest):
        for c in load_group(store, g).chunks:
            cache.ensure(c)

    manifests = set(store.list_manifests())
    dry = collect(store, paths, in_use=[], dry_run=True)
    assert set(store.list_manifests()) == manifests  # nothing removed
    assert sorted(dry.manifests_removed) == sorted([p["t1_old"], p["task1_old"].digest, p["loose"].digest])

    r = collect(store, paths, in_use=[])
    assert sorted(r.manifests_removed) == sorted(dry.manifests_removed)
    assert r.chunks_removed == len(doomed_chunks) and r.bytes_freed > 2 << 20
    assert sorted(r.refs_removed) == sorted(["groups/loose", "buildcache/" + "ab" * 32])
    assert set(store.list_chunks()).isdisjoint(doomed_chunks)
    assert store.list_refs("buildcache") == {"cd" * 32: p["base"].digest}
    assert r.cache_chunks_removed == len(doomed_chunks) and r.cache_bytes_freed >= 2 << 20
    assert set(cache.cached_digests()) == _chunks(store, p["base"].digest)
    _all_intact(store, tmp_path)
    # a second run finds nothing
    again = collect(store, paths, in_use=[])
    assert (again.manifests_removed, again.chunks_removed, again.cache_chunks_removed) == ([], 0, 0)


def test_gc_keeps_the_packs_of_kept_profiles(populated, store, paths, tmp_path):
    """A prefetch profile's pack lives as long as its template; packs of removed
    templates' profiles, and packs no profile names, go."""
    p = populated
    packs = {}
    for name, template in (("t2", store.get_ref("templates", "t2")), ("t1_old", p["t1_old"])):
        _, t = load_template(store, template)
        refs = [load_group(store, t.groups[0]).chunks[0], load_group(store, t.groups[1]).chunks[0]]  # task: its own
        data, frames = build_pack(store.get_chunk(r.digest) for r in refs)
        packs[name] = PrefetchPack(digest=store.put_pack(data), frames=frames)
        publish_profile(
            store,
            PrefetchProfile(
                template=template, groups=t.groups, chunks=[(0, 0), (1, 0)], refs=refs, pack=packs[name], window_s=1.0
            ),
        )
    assert packs["t2"] != packs["t1_old"]
    loose = store.put_pack(b"no profile names this")
    update_component(store, "t1", "task1", _tree(tmp_path / "t1b", {"w/a2": os.urandom(1 << 20)}), paths=paths)

    r = collect(store, paths, in_use=[])
    assert r.packs_removed == 2
    assert sorted(store.list_packs()) == [packs["t2"].digest]
    assert not store.has_pack(loose) and not store.has_pack(packs["t1_old"].digest)
    assert load_profile(store, store.get_ref("templates", "t2")).pack == packs["t2"]


def test_gc_spares_what_a_running_environment_uses(debian_root, store, paths, tmp_path, leak_check):
    build_group(debian_root, store, name="base")
    old_task = build_group(_tree(tmp_path / "v1", {"workspace/v": b"one\n"}), store, name="task")
    old_t, _ = create_template(store, "t", ["base", "task"], runtime=RuntimeConfig(working_dir="/workspace"))
    daemon.start_background(paths)
    try:
        with daemon.connect(paths, autostart=False) as client:
            env = client.create("t")
            update_component(store, "t", "task", _tree(tmp_path / "v2", {"workspace/v": b"two\n"}), paths=paths)
            r = collect(store, paths, in_use=lambda: daemon.running_templates(paths))  # asks the daemon
            assert r.manifests_removed == []
            assert sorted(r.kept_for_running) == sorted([old_t, old_task.digest])
            assert store.has_manifest(old_task.digest)
            assert all(store.has_chunk(c) for c in _chunks(store, old_task.digest))
            assert client.exec(env.id, ["cat", "v"]).stdout == b"one\n"
            client.destroy(env.id)
            time.sleep(0.5)  # the daemon publishes the template's prefetch profile in the background
            profile = store.list_refs("prefetch").get(old_t.split(":", 1)[1])  # weenv.node.data.prefetch
            r = collect(store, paths, in_use=lambda: daemon.running_templates(paths))
            assert sorted(r.manifests_removed) == sorted([old_t, old_task.digest] + ([profile] if profile else []))
            env = client.create("t")
            assert client.exec(env.id, ["cat", "v"]).stdout == b"two\n"
            client.destroy(env.id)
    finally:
        daemon.stop(paths)


def test_a_snapshot_is_kept_while_named_or_running_and_collected_after(debian_root, store, paths, tmp_path, leak_check):
    """A snapshot (the environment's capture published as one more group on its
    template's) is kept by gc while its ref names it, and while an environment
    created from it runs after its ref is deleted; once neither holds it, gc
    removes its template manifest, its capture group and the chunks only it
    held, and leaves the template it was taken of whole."""
    from weenv.node.state.snapshot import delete_snapshot

    build_group(debian_root, store, name="base")
    build_group(_tree(tmp_path / "task", {"workspace/v": b"task\n"}), store, name="task")
    create_template(store, "t", ["base", "task"], runtime=RuntimeConfig(working_dir="/workspace"))

    def collect_when_free():
        """gc, once the daemon's background publishes (a destroyed environment's prefetch profile) let it."""
        deadline = time.monotonic() + 30
        while True:
            try:
                return collect(store, paths, in_use=lambda: daemon.running_templates(paths))
            except InvalidInputError as exc:
                if "a build is running" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    daemon.start_background(paths)
    try:
        with daemon.connect(paths, autostart=False) as client:
            env = client.create("t")
            written = os.urandom(3 << 20)  # chunks no other group has
            client.write_file(env.id, "/workspace/state.bin", written)
            snap = client.snapshot(env.id, "snap1")
            client.destroy(env.id)
            capture = _chunks(store, snap.group)
            template_chunks = set().union(*(_chunks(store, g) for g in load_template(store, "t")[1].groups))
            own = capture - template_chunks
            assert own and store.list_refs("templates")["snap1"] == snap.digest

            r = collect_when_free()  # named by its ref: kept
            assert snap.digest not in r.manifests_removed and snap.group not in r.manifests_removed
            assert store.has_manifest(snap.digest) and all(store.has_chunk(c) for c in capture)

            child = client.create("snap1")  # running from it, then its ref deleted: kept for the child
            delete_snapshot(store, "snap1")
            r = collect_when_free()
            assert snap.digest in r.kept_for_running and snap.group in r.kept_for_running
            assert store.has_manifest(snap.group) and all(store.has_chunk(c) for c in own)
            assert client.read_file(child.id, "/workspace/state.bin") == written
            client.destroy(child.id)

            r = collect_when_free()  # nothing holds it: collected
            assert snap.digest in r.manifests_removed and snap.group in r.manifests_removed
            assert not store.has_manifest(snap.digest) and not store.has_manifest(snap.group)
            assert not [c for c in own if store.has_chunk(c)], "chunks only the snapshot held are left"
            assert all(store.has_chunk(c) for c in template_chunks)
            _all_intact(store, tmp_path)
            again = client.create("t")  # the template it was taken of still starts
            assert client.exec(again.id, ["cat", "v"]).stdout == b"task\n"
            client.destroy(again.id)
    finally:
        daemon.stop(paths)


def test_gc_refuses_when_it_cannot_tell_what_runs(populated, store, paths):
    # a daemon that is alive but does not answer: its pidfile names a live process
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        paths.run.mkdir(parents=True, exist_ok=True)
        paths.pidfile.write_text(str(sleeper.pid))
        manifests = set(store.list_manifests())
        with pytest.raises(DaemonError, match="does not answer"):
            collect(store, paths, in_use=lambda: daemon.running_templates(paths))
        assert set(store.list_manifests()) == manifests
    finally:
        sleeper.kill()
        sleeper.wait()
        paths.pidfile.unlink()
    collect(store, paths, in_use=lambda: daemon.running_templates(paths), dry_run=True)  # a dead pid is no daemon


def test_gc_refuses_while_a_build_runs(populated, store, paths):
    with store_lock(paths, exclusive=False):
        with pytest.raises(InvalidInputError, match="a build is running"):
            collect(store, paths, in_use=[])
    assert collect(store, paths, in_use=[]).manifests_removed  # the loose group, once the build is over


def test_dedupe_report(store, tmp_path):
    base = os.urandom(4 << 20)
    build_group(_tree(tmp_path / "base", {"big.bin": base}), store, name="base")
    for i in range(4):
        build_group(_tree(tmp_path / f"task{i}", {f"w/{i}": os.urandom(1 << 20)}), store, name=f"task{i}")
        create_template(store, f"t{i}", ["base", f"task{i}"])
    r = dedupe_report(store)
    base_size = load_group(store, store.get_ref("groups", "base")).image_size
    task_sizes = [load_group(store, store.get_ref("groups", f"task{i}")).image_size for i in range(4)]
    assert (r.templates, r.groups) == (4, 5)
    assert r.logical_bytes == 4 * base_size + sum(task_sizes)
    assert r.group_bytes == base_size + sum(task_sizes)
    assert r.unique_bytes <= r.group_bytes and r.stored_bytes > 8 << 20  # random data does not compress
    assert r.dedupe_ratio == r.logical_bytes / r.unique_bytes > 2.4 and r.ratio > 2.4


def test_gc_spares_what_is_leased_or_younger_than_its_grace_period(store, paths, monkeypatch):
    """An unreferenced chunk: kept while a live write lease names it, kept
    while younger than the grace period (``WEENV_GC_GRACE_S``), removed when
    neither holds."""
    from weenv.store.lease import Lease

    ref, _ = store.put_chunk(b"not referenced by any template")
    with Lease(store, digests=[ref.digest]):
        assert collect(store, paths, in_use=[]).chunks_removed == 0
    assert store.has_chunk(ref.digest)
    monkeypatch.setenv("WEENV_GC_GRACE_S", "3600")
    assert collect(store, paths, in_use=[]).chunks_removed == 0
    assert store.has_chunk(ref.digest)
    os.utime(store._path("chunks", ref.digest), (time.time() - 7200, time.time() - 7200))  # stored 2 h ago
    assert collect(store, paths, in_use=[]).chunks_removed == 1
    assert not store.has_chunk(ref.digest)
    assert store.list_refs("leases") == {} and list(store.list_manifests()) == []
