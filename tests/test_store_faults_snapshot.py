"""gc during a snapshot publish: a running environment's capture is published
(its chunks, its group manifest, its template manifest, then its ref) while
``weenv gc`` of another home (another node sharing the store) runs, in a
process of its own, at the two points where what the publish stored is named
by no ref yet.  The publish's write lease must keep all of it: the store check
passes and the snapshot starts on a fresh node with its files."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

from test_cache import private_store  # noqa: F401 (a fixture)
from weenv.config import Paths
from weenv.node.node import Node
from weenv.store.check import check_store
from weenv.store.file import FileStore

MIB = 1 << 20


class GcMidPublishStore(FileStore):
    """A ``file://`` store that, once :attr:`armed`, runs ``weenv gc`` (``env``:
    another home) and waits for it at two points of a publish: right after the
    first chunk is stored (no manifest names it yet), and right before a
    ``templates/`` ref is set (chunks and manifests stored, no ref).  Before
    each gc it stores a chunk nothing names (garbage, to show the gc collects).
    :attr:`gcs`: per point, the gc's exit code, output and whether that
    garbage went."""

    def __init__(self, root, env: dict[str, str]):
        super().__init__(root)
        self.env = env
        self.armed = False
        self.gcs: dict[str, tuple[int, str, bool]] = {}
        self._lock = threading.Lock()

    def _gc_once(self, point: str) -> None:
        with self._lock:  # the chunk sink's workers store chunks in parallel: one gc per point
            if not self.armed or point in self.gcs:
                return
            self.gcs[point] = (-1, "running", False)
        garbage, _ = super().put_chunk(os.urandom(4096))
        r = subprocess.run([sys.executable, "-m", "weenv", "gc"], env=self.env, capture_output=True, text=True,
                           timeout=300)  # fmt: skip
        self.gcs[point] = (r.returncode, r.stdout + r.stderr, not self.has_chunk(garbage.digest))

    def _put(self, space, digest, data):
        super()._put(space, digest, data)
        if space == "chunks":
            self._gc_once("after its first chunk")

    def swap_ref(self, kind, name, digest, *, expected):
        if kind == "templates":
            self._gc_once("before its ref")
        return super().swap_ref(kind, name, digest, expected=expected)


def test_gc_during_a_snapshot_publish_keeps_what_the_publish_stored(paths, private_store, tmp_path, leak_check):
    """An environment writes 3 MiB of its own (chunks no other group has) and
    is snapshotted; gc of another home runs after the publish stored its first
    chunk and again before it sets its ref, and collects real garbage both
    times.  The publish succeeds, the store check passes, and the snapshot
    starts on a fresh home (its chunks read from the store) with its files.
    (Without the publish's lease, gc deleted the chunks and manifests the
    snapshot's template then named.)"""
    other = tmp_path / "other-home"
    other.mkdir()
    env = {**os.environ, "WEENV_HOME": str(other), "WEENV_STORE": f"file://{private_store}"}
    store = GcMidPublishStore(private_store, env)
    with Node(paths, store=store, pool_size=0) as n:
        e = n.create("task")
        r = n.exec(e.id, ["sh", "-c", f"head -c {3 * MIB} /dev/urandom > state.bin && sha256sum state.bin"])
        assert r.exit_code == 0, r.stderr
        written = r.stdout
        store.armed = True
        n.snapshot(e.id, "snap")
        store.armed = False
        n.destroy(e.id)
    assert {p: (code, collected) for p, (code, _, collected) in store.gcs.items()} == {
        "after its first chunk": (0, True),
        "before its ref": (0, True),
    }, store.gcs
    report = check_store(store)
    assert report.ok, report.problems
    fresh = Paths(tmp_path / "home2", paths.cache, store.url)
    with Node(fresh, store=FileStore(private_store), pool_size=0) as second:
        e = second.create("snap")
        r = second.exec(e.id, ["sha256sum", "state.bin"])
        assert (r.exit_code, r.stdout) == (0, written), r.stderr
        second.destroy(e.id)
