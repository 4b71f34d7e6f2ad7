"""Concurrent writers, rollbacks, gc and a killed writer on one store, with real
processes (``python -m weenv import`` / ``gc``), each ending with
:func:`~weenv.store.check.check_store` passing and every published template's
files read back (each group's image assembled from the store, mounted, every
file read and compared).

A layer whose download breaks or stalls: the image is an OCI layout whose
last layer blob is a FIFO.  The importer opens it after it has stored and
published (by digest) its lower groups, and blocks there until the test
writes the blob into the FIFO: all of it (the import goes on), or half of it
then EOF (a download cut short: the import fails and rolls back).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from registry_fixture import new_repository, oci_registry  # noqa: F401 (a fixture, for oci:// stores)
from s3_fixture import new_prefix
from test_import import _entry, _write_layout
from weenv.formats.manifest import parse_template_manifest
from weenv.host.mounts import erofs_spec, mount, umount
from weenv.packaging.group import assemble_image, load_group
from weenv.store import Store, open_store
from weenv.store.check import check_store

MIB = 1 << 20


def _layers(seed: str) -> list[list[tuple]]:
    """Two big shared layers (the same bytes in every image) and a top layer of ``seed``'s own."""
    shared = [[_entry(f"big{i}", data=hashlib.shake_256(f"shared {i}".encode()).digest(3 * MIB))] for i in range(2)]
    top = [_entry(f"top-{seed}", data=hashlib.shake_256(seed.encode()).digest(MIB + 17))]
    return [*shared, top]


def _expected(seed: str) -> dict[str, bytes]:
    return {info.name: data for layer in _layers(seed) for info, data in layer}


class StalledLayout:
    """An OCI layout of :func:`_layers` whose layer ``layer`` (default the
    last) blob is a FIFO."""

    def __init__(self, root: Path, seed: str, layer: int = -1):
        self.path = _write_layout(root, _layers(seed))
        index = json.loads((root / "index.json").read_text())
        manifest = json.loads((root / "blobs" / "sha256" / index["manifests"][0]["digest"].split(":")[1]).read_text())
        self.blob = root / "blobs" / "sha256" / manifest["layers"][layer]["digest"].split(":")[1]
        self.data = self.blob.read_bytes()
        self.blob.unlink()
        os.mkfifo(self.blob)

    def wait_for_reader(self, proc: subprocess.Popen, timeout: float = 120) -> int:
        """Block until the importer has opened the last layer (its lower groups
        are stored and published by digest); the FIFO's write end."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return os.open(self.blob, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:  # ENXIO: no reader yet
                if proc.poll() is not None:
                    raise AssertionError(f"the import ended early: {_output(proc)}") from None
                if time.monotonic() > deadline:
                    raise AssertionError("the import never opened its last layer") from None
                time.sleep(0.05)

    def feed(self, fd: int, *, cut: bool) -> None:
        """Write the blob (``cut``: its first half) into the FIFO and close it."""
        os.set_blocking(fd, True)
        data = self.data[: len(self.data) // 2] if cut else self.data
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        except BrokenPipeError:
            pass
        finally:
            os.close(fd)


def _weenv(*args: str, env: dict[str, str], **kwargs) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "weenv", *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kwargs
    )


def _output(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=300)
    return out.decode(errors="replace")


def _finish(proc: subprocess.Popen) -> tuple[int, str]:
    out = _output(proc)
    return proc.returncode, out


def _env(paths, store_url: str, **extra: str) -> dict[str, str]:
    return {**os.environ, "WEENV_HOME": str(paths.home), "WEENV_STORE": store_url, **extra}


def _store_url(kind: str, request, paths) -> str:
    """A fresh store of ``kind``: ``file`` (in the test's home), ``s3`` (a new prefix of the
    session's SeaweedFS) or ``oci`` (a new repository of the session's loopback registry)."""
    if kind == "file":
        return f"file://{paths.home / 'store'}"
    if kind == "s3":
        return request.getfixturevalue("s3_server").url(new_prefix("faults"))
    return request.getfixturevalue("oci_registry").url(new_repository("weenv/faults"))


def read_back(store: Store, work: Path) -> dict[str, dict[str, bytes]]:
    """Every published template's files: ``{template: {path: bytes}}`` (its
    groups assembled from the store, every chunk checked, mounted bottom to
    top, the top one's file winning)."""
    found = {}
    for name, digest in store.list_refs("templates").items():
        template = parse_template_manifest(store.get_manifest(digest))
        files: dict[str, bytes] = {}
        for k, g in enumerate(template.groups):
            image, target = work / f"{name}.{k}.img", work / f"{name}.{k}.mnt"
            target.mkdir(parents=True)
            assemble_image(store, load_group(store, g), image)
            mount(erofs_spec(image, target))
            try:
                for dirpath, _dirs, names in os.walk(target):
                    for n in names:
                        p = Path(dirpath) / n
                        if p.is_file() and not p.is_symlink():
                            files[str(p.relative_to(target))] = p.read_bytes()
            finally:
                umount(target)
            image.unlink()
        found[name] = files
    return found


def assert_store_sound(store: Store, work: Path, expected: dict[str, dict[str, bytes]]) -> None:
    """The store check passes and the published templates are exactly ``expected``, file for file."""
    report = check_store(store)
    assert report.ok, report.problems
    got = read_back(store, work)
    assert sorted(got) == sorted(expected)
    for name, files in expected.items():
        assert {p: hashlib.sha256(d).hexdigest() for p, d in got[name].items()} == {
            p: hashlib.sha256(d).hexdigest() for p, d in files.items()
        }, name


@pytest.mark.parametrize("kind,layer", [("file", 0), ("file", 1), ("file", 2), ("s3", 2), ("oci", 2)])
def test_a_failed_import_keeps_the_chunks_a_concurrent_import_published(kind, layer, request, paths, tmp_path):
    """Import ``a`` stores its groups below layer ``layer``, then that layer
    breaks off while import ``b`` of an image sharing the two lower layers runs
    start to end: ``b`` finds the chunks ``a`` stored and publishes a template
    naming them.  ``a``'s rollback must not delete them.  (Before leases it
    did: ``b``'s template then read EIO.)  Two processes, one store: ``file://``,
    ``s3://`` and ``oci://`` (two nodes' importers)."""
    store_url = _store_url(kind, request, paths)
    env = _env(paths, store_url)
    stalled = StalledLayout(tmp_path / "a", "a", layer)
    a = _weenv("import", str(stalled.path), "--name", "a", env=env)
    fifo = stalled.wait_for_reader(a)
    try:
        b_layout = _write_layout(tmp_path / "b", _layers("b"))
        b = _weenv("import", str(b_layout), "--name", "b", env=env)
        code, out = _finish(b)
        assert code == 0, out
    finally:
        stalled.feed(fifo, cut=True)
    code, out = _finish(a)
    assert code != 0 and "truncated" in out, out
    store = open_store(store_url)
    assert store.list_refs("leases") == {}
    assert_store_sound(store, tmp_path / "read", {"b": _expected("b")})


@pytest.mark.parametrize("kind", ["file", "oci"])
def test_gc_during_an_import_keeps_what_the_import_stored(kind, request, paths, tmp_path):
    """``weenv gc`` runs while an import has stored and published (by digest)
    its lower groups but not yet its template: gc keeps them (the import's
    lease names them), the import then finishes, and its template reads back.
    (Before leases gc deleted the group manifests and the import failed with
    ``no manifest``.)  On ``file://`` and ``oci://`` (where a deleted manifest
    or chunk is gone from the tags at once, and only the store check tells)."""
    store_url = _store_url(kind, request, paths)
    env = _env(paths, store_url)
    old = _write_layout(tmp_path / "old", [[_entry("old", data=b"unreferenced " * 1000)]])
    code, out = _finish(_weenv("import", str(old), "--name", "old", env=env))
    assert code == 0, out
    store = open_store(store_url)
    store.delete_ref("templates", "old")  # garbage now: gc must still remove it
    garbage = set(store.list_manifests())

    stalled = StalledLayout(tmp_path / "a", "a")
    a = _weenv("import", str(stalled.path), "--name", "a", env=env)
    fifo = stalled.wait_for_reader(a)
    try:
        code, out = _finish(_weenv("gc", env=env))
        assert code == 0, out
        assert not garbage & set(store.list_manifests())  # gc did collect the real garbage
    finally:
        stalled.feed(fifo, cut=False)
    code, out = _finish(a)
    assert code == 0, out
    code, out = _finish(_weenv("gc", env=env))
    assert code == 0, out
    assert_store_sound(store, tmp_path / "read", {"a": _expected("a")})


def test_a_killed_writers_leftovers_are_collected_after_its_lease_expires(paths, tmp_path):
    """An import killed with SIGKILL mid-publish (its lower groups stored, its
    template not): gc keeps what it stored while its lease lives, and removes
    all of it (chunks, manifests, the lease record) once the lease expired
    unrenewed."""
    lease_s = 8.0
    store_url = f"file://{paths.home / 'store'}"
    env = _env(paths, store_url, WEENV_STORE_LEASE_S=str(lease_s))
    kept = _write_layout(tmp_path / "kept", [[_entry("kept", data=b"published " * 1000)]])
    code, out = _finish(_weenv("import", str(kept), "--name", "kept", env=env))
    assert code == 0, out
    store = open_store(store_url)
    published = (set(store.list_chunks()), set(store.list_manifests()))

    stalled = StalledLayout(tmp_path / "a", "a")
    a = _weenv("import", str(stalled.path), "--name", "a", env=env)
    fifo = stalled.wait_for_reader(a)
    os.kill(a.pid, signal.SIGKILL)
    killed_at = time.time()
    a.wait()
    os.close(fifo)
    left = (set(store.list_chunks()) - published[0], set(store.list_manifests()) - published[1])
    assert left[0] and left[1], "the killed import had stored nothing"
    code, out = _finish(_weenv("gc", env=env))
    assert code == 0, out
    assert time.time() < killed_at + lease_s, "gc ran too late to tell"
    assert left[0] <= set(store.list_chunks()) and left[1] <= set(store.list_manifests())  # not before
    time.sleep(max(0.0, killed_at + lease_s + 0.5 - time.time()))
    code, out = _finish(_weenv("gc", env=env))
    assert code == 0, out
    assert (set(store.list_chunks()), set(store.list_manifests())) == published
    assert store.list_refs("leases") == {}
    assert_store_sound(store, tmp_path / "read", {"kept": {"kept": b"published " * 1000}})


def test_store_check_command_exits_non_zero_on_a_missing_chunk(paths, tmp_path):
    """``weenv store check``: 0 on a sound store; 1 and one line naming the
    chunk and its group once a chunk a template needs is gone."""
    store_url = f"file://{paths.home / 'store'}"
    env = _env(paths, store_url)
    layout = _write_layout(tmp_path / "t", [[_entry("f", data=b"checked " * 1000)]])
    code, out = _finish(_weenv("import", str(layout), "--name", "t", env=env))
    assert code == 0, out
    code, out = _finish(_weenv("store", "check", env=env))
    assert code == 0 and "problems: 0" in out, out
    store = open_store(store_url)
    gone = sorted(store.list_chunks())[0]
    store.delete_chunk(gone)
    code, out = _finish(_weenv("store", "check", env=env))
    assert code == 1 and f"missing chunk {gone} (chunk of group t.0" in out and "problems: 1" in out, out


def test_two_nodes_import_the_same_image_into_one_s3_store(s3_server, paths, tmp_path):
    """Two importers (as on two nodes: two processes, two homes) import one
    image at once into one ``s3://`` store, under two names: both succeed,
    the store check passes and both templates read back whole."""
    store_url = s3_server.url(new_prefix("faults"))
    layout = _write_layout(tmp_path / "image", _layers("same"))
    procs = []
    for node in ("n1", "n2"):
        home = tmp_path / node
        home.mkdir()
        env = {**os.environ, "WEENV_HOME": str(home), "WEENV_STORE": store_url}
        procs.append(_weenv("import", str(layout), "--name", f"t-{node}", env=env))
    for p in procs:
        code, out = _finish(p)
        assert code == 0, out
    store = open_store(store_url)
    assert store.list_refs("leases") == {}
    assert_store_sound(store, tmp_path / "read", {"t-n1": _expected("same"), "t-n2": _expected("same")})


def _put_lease_ref(store: Store, name: str, data: bytes, *, corrupt: bool = False) -> None:
    """Ref ``leases/NAME`` at a blob of ``data`` (``corrupt``: stored under another digest), as any
    machine sharing the store can write one."""
    digest = hashlib.sha256(b"not these bytes" if corrupt else data).hexdigest()
    store._put("manifests", f"sha256:{digest}", data)
    store.set_ref("leases", name, f"sha256:{digest}")


@pytest.mark.parametrize("kind", ["file", "s3"])
def test_hostile_lease_records_neither_stop_nor_hang_writers_and_gc(kind, request, paths, tmp_path):
    """Lease records another machine wrote into the shared store: past the
    manifest limit, other bytes than their digest, JSON nested too deep,
    not UTF-8, and a delete lease that expires in a far future naming a chunk
    the import needs.  The import ends (the last with a clear error naming
    the lease, not a wait for ever), gc removes the damaged records, and the
    store check passes.  (Before: the first three made every import and gc
    fail, the last made the import wait for ever.)"""
    from weenv.store.lease import LEASE_MEDIA_TYPE

    store_url = _store_url(kind, request, paths)
    env = _env(paths, store_url, WEENV_STORE_LEASE_S="3")
    store = open_store(store_url)
    _put_lease_ref(store, "delete-huge", b" " * (17 << 20))
    _put_lease_ref(store, "delete-corrupt", b"{}", corrupt=True)
    _put_lease_ref(store, "delete-deep", b"[" * 200_000 + b"]" * 200_000)
    _put_lease_ref(store, "write-binary", b"\xff\xfe\x80{")
    layout = _write_layout(tmp_path / "a", [[_entry("f", data=b"leased " * 1000)]])
    code, out = _finish(_weenv("import", str(layout), "--name", "a", env=env))
    assert code == 0, out
    assert "is skipped" in out, out

    held = _write_layout(tmp_path / "b", [[_entry("f", data=b"held " * 1000)]])
    scratch = f"file://{tmp_path / 'scratch'}"  # the same import elsewhere: the chunks it will need
    code, out = _finish(_weenv("import", str(held), "--name", "b", env=_env(paths, scratch)))
    assert code == 0, out
    chunk = min(open_store(scratch).list_chunks())
    forever = {
        "media_type": LEASE_MEDIA_TYPE,
        "id": "delete-forever",
        "purpose": "delete",
        "holder": "elsewhere:1",
        "what": "by hand",
        "expires": 1e300,
        "digests": [chunk],
    }
    _put_lease_ref(store, "delete-forever", json.dumps(forever).encode())
    started = time.monotonic()
    code, out = _finish(_weenv("import", str(held), "--name", "b", env=env))
    assert code != 0 and "delete-forever (by hand, elsewhere:1" in out and "leases/ID" in out, out
    assert time.monotonic() - started < 60
    store.delete_ref("leases", "delete-forever")

    code, out = _finish(_weenv("gc", env=env))
    assert code == 0, out
    assert store.list_refs("leases") == {}
    assert_store_sound(store, tmp_path / "read", {"a": {"f": b"leased " * 1000}})


def _imported(paths, tmp_path: Path, name: str, files: dict[str, bytes]) -> tuple[dict[str, str], Store]:
    """A file:// store in ``paths``' home with template ``name`` of one layer of ``files``
    imported by ``weenv import``; the environment for ``weenv`` and the store."""
    store_url = f"file://{paths.home / 'store'}"
    env = _env(paths, store_url)
    layout = _write_layout(tmp_path / name, [[_entry(n, data=d) for n, d in files.items()]])
    code, out = _finish(_weenv("import", str(layout), "--name", name, env=env))
    assert code == 0, out
    return env, open_store(store_url)


def _gc_while_it_stores(
    proc: subprocess.Popen, chunks: Path, before: set[str], env: dict[str, str], timeout: float = 120
) -> None:
    """SIGSTOP writer ``proc`` as soon as a chunk not in ``before`` appears
    under ``chunks`` (a file:// store's), run ``weenv gc`` (``env``), SIGCONT
    it and check that it then publishes."""
    deadline = time.monotonic() + timeout
    while not {p.name for p in chunks.rglob("*") if p.is_file() and not p.name.startswith(".tmp-")} - before:
        assert proc.poll() is None, _output(proc)
        assert time.monotonic() < deadline, "it stored no chunk"
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        code, out = _finish(_weenv("gc", env=env))
        assert code == 0, out
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    code, out = _finish(proc)
    assert code == 0, out


def test_gc_from_another_home_during_an_update_keeps_what_the_update_stored(paths, tmp_path):
    """``weenv update`` stops (SIGSTOP) once it has stored the first chunks of
    its new group; ``weenv gc`` from another home (another node: this home's
    store lock does not hold it) runs meanwhile; the update goes on and
    publishes.  The new template reads back whole.  (Before, the update held
    no lease: gc deleted those chunks and the update published a template
    naming them.)"""
    env, store = _imported(paths, tmp_path, "t", {"f": b"first " * 1000})
    tree = tmp_path / "tree"
    tree.mkdir()
    expected = {f"f{i}": hashlib.shake_256(f"update {i}".encode()).digest(MIB) for i in range(64)}
    for name, data in expected.items():
        (tree / name).write_bytes(data)
    chunks = paths.home / "store" / "chunks"
    before = {p.name for p in chunks.rglob("*") if p.is_file()}
    up = _weenv("update", "t", "--component", "t.0", "--from-dir", str(tree), env=env)
    other = tmp_path / "other-home"
    other.mkdir()
    _gc_while_it_stores(up, chunks, before, {**env, "WEENV_HOME": str(other)})
    assert_store_sound(store, tmp_path / "read", {"t": expected})


def test_gc_during_a_template_copy_keeps_what_the_copy_stored(paths, tmp_path):
    """A template copy between stores (:func:`~weenv.packaging.transfer.copy_template`,
    in a process of its own) stops (SIGSTOP) once it has copied its first
    chunks; ``weenv gc`` of the destination runs meanwhile; the copy goes on
    and publishes.  The copy reads back whole.  (Before, the copy held no
    lease: gc deleted those chunks, and a chunk it had found present was not
    named anywhere either.)"""
    src_url, dst_url = f"file://{tmp_path / 'src'}", f"file://{paths.home / 'store'}"
    expected = {f"f{i}": hashlib.shake_256(f"copy {i}".encode()).digest(MIB) for i in range(64)}
    layout = _write_layout(tmp_path / "t", [[_entry(n, data=d) for n, d in expected.items()]])
    code, out = _finish(_weenv("import", str(layout), "--name", "t", env=_env(paths, src_url)))
    assert code == 0, out
    chunks = paths.home / "store" / "chunks"
    chunks.mkdir(parents=True)
    copy = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from weenv.store import open_store; "
            "from weenv.packaging.transfer import copy_template; "
            "copy_template(open_store(sys.argv[1]), open_store(sys.argv[2]), 't', parallel=1)",
            src_url,
            dst_url,
        ],
        env=_env(paths, dst_url),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    _gc_while_it_stores(copy, chunks, set(), _env(paths, dst_url))
    assert_store_sound(open_store(dst_url), tmp_path / "read", {"t": expected})


def test_an_import_paused_past_its_lease_refuses_to_publish(paths, tmp_path):
    """An import paused (SIGSTOP) longer than its lease, after it stored its
    lower groups; gc runs meanwhile and removes them (the lease expired); the
    import is resumed and its last layer arrives: it must fail, not publish a
    template naming what gc removed, and the store check passes."""
    lease_s = 4.0
    store_url = f"file://{paths.home / 'store'}"
    env = _env(paths, store_url, WEENV_STORE_LEASE_S=str(lease_s))
    stalled = StalledLayout(tmp_path / "a", "a")
    a = _weenv("import", str(stalled.path), "--name", "a", env=env)
    fifo = stalled.wait_for_reader(a)
    os.kill(a.pid, signal.SIGSTOP)
    try:
        time.sleep(lease_s + 1)
        store = open_store(store_url)
        stored = set(store.list_chunks())
        code, out = _finish(_weenv("gc", env=env))
        assert code == 0, out
        assert not stored & set(store.list_chunks()), "gc kept what an expired lease named"
    finally:
        os.kill(a.pid, signal.SIGCONT)
        stalled.feed(fifo, cut=False)
    code, out = _finish(a)
    assert code != 0 and "was lost" in out, out
    assert store.list_refs("templates") == {}
    assert_store_sound(store, tmp_path / "read", {})


_DELETER = """
import pathlib, sys, time
from weenv.store import open_store
from weenv.store.lease import delete_unused
from weenv.packaging.group import load_group
store, go = open_store(sys.argv[1]), pathlib.Path(sys.argv[2])
template, group = sys.argv[3:5]
chunks = [c.digest for c in load_group(store, group).chunks]

def reached():  # D3, after its lease (D1) and its read of the write leases (D2): wait for the test
    while not go.exists():
        time.sleep(0.05)
    return set()

print(delete_unused(store, {"manifests": [template, group], "chunks": chunks}, reached=reached, what="test gc"))
"""


def _wait_for_lease(store: Store, purpose: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not any(n.startswith(f"{purpose}-") for n in store.list_refs("leases")):
        assert proc.poll() is None, _output(proc)
        assert time.monotonic() < deadline, f"no {purpose} lease"
        time.sleep(0.02)


def test_a_build_whose_cached_group_a_gc_deletes_meanwhile_builds_it_again(paths, tmp_path):
    """A build finds its component's group in the build cache (all its chunks
    stored) while a gc (another process) that already read the write leases
    is about to delete that group, no template naming it: the build waits for
    that delete, then must build the component again, not publish a template
    naming what the gc deleted.  (Before, it looked for the chunks before its
    lease named them and never again: it failed, or published a template
    whose chunks were gone.)"""
    store_url = f"file://{paths.home / 'store'}"
    env = _env(paths, store_url)
    recipe = tmp_path / "recipe"
    (recipe / "base").mkdir(parents=True)
    data = hashlib.shake_256(b"cached group").digest(3 * MIB)
    (recipe / "base" / "data.bin").write_bytes(data)
    (recipe / "recipe.toml").write_text(
        '[template]\nname = "t"\n[[component]]\nname = "base"\n[[component.step]]\nkind = "from_dir"\npath = "base"\n'
    )
    code, out = _finish(_weenv("build", str(recipe / "recipe.toml"), env=env))
    assert code == 0, out
    store = open_store(store_url)
    group, template = store.get_ref("groups", "base"), store.get_ref("templates", "t")
    store.delete_ref("templates", "t")  # the cached group is garbage now
    go = tmp_path / "go"
    deleter = subprocess.Popen(
        [sys.executable, "-c", _DELETER, store_url, str(go), template, group],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        _wait_for_lease(store, "delete", deleter)
        build = _weenv("build", str(recipe / "recipe.toml"), env=env)
        _wait_for_lease(store, "write", build)
        time.sleep(1.0)  # it finds the group cached, names it and waits for the delete
    finally:
        go.touch()
    code, out = _finish(deleter)
    assert code == 0 and "removed=[" in out and group in out, out
    code, out = _finish(build)
    assert code == 0, out
    assert_store_sound(store, tmp_path / "read", {"t": {"data.bin": data}})


def test_gc_deletes_nothing_a_template_it_cannot_read_may_name(paths, tmp_path):
    """A template whose group manifest this weenv cannot read (a newer
    weenv's schema version, written by another node sharing the store): gc
    stops with a clear error and deletes nothing (before, it took the group
    for unreachable and deleted it and its chunks under a published template)."""
    env, store = _imported(paths, tmp_path, "t", {"f": b"future " * 1000})
    template = json.loads(store.get_manifest(store.get_ref("templates", "t")))
    group = json.loads(store.get_manifest(template["groups"][0]))
    group.update(schema_version=3, media_type="application/vnd.weenv.group.v3+json")
    template["groups"] = [store.put_manifest(json.dumps(group, sort_keys=True).encode())]
    store.set_ref("templates", "t", store.put_manifest(json.dumps(template, sort_keys=True).encode()))
    before = (set(store.list_chunks()), set(store.list_manifests()))
    code, out = _finish(_weenv("gc", env=env))
    assert code != 0 and "cannot be read" in out and template["groups"][0] in out, out
    assert (set(store.list_chunks()), set(store.list_manifests())) == before
