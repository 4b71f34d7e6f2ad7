"""The local-directory store (``file://``) and what opens a store from a URL, on
temporary directories.  The Store behaviour suite itself runs in
``tests/test_store.py`` against every backend."""

from __future__ import annotations

import pytest

from weenv.errors import InvalidInputError
from weenv.store import open_store
from weenv.store.file import FileStore, atomic_write


def test_atomic_write_failure_leaves_no_temporary_file(tmp_path):
    target = tmp_path / "d" / "blob"
    target.mkdir(parents=True)  # rename(2) of a file over a directory fails
    with pytest.raises(IsADirectoryError):
        atomic_write(target, b"data")
    assert sorted(p.name for p in target.parent.iterdir()) == ["blob"]
    atomic_write(tmp_path / "d" / "ok", b"data")
    assert (tmp_path / "d" / "ok").read_bytes() == b"data"
    assert sorted(p.name for p in target.parent.iterdir()) == ["blob", "ok"]


def test_open_store(tmp_path):
    s = open_store(f"file://{tmp_path}/s1")
    assert isinstance(s, FileStore) and s.root == tmp_path / "s1" and s.url == f"file://{tmp_path}/s1"
    assert isinstance(open_store(str(tmp_path / "s2")), FileStore)
    for url in ("relative/path", "ftp://host/x", "nosuch://x"):
        with pytest.raises(InvalidInputError):
            open_store(url)


def test_file_store_delete_ref(store):
    digest = "sha256:" + "0" * 64
    store.set_ref("buildcache", "ab" * 32, digest)
    assert store.get_ref("buildcache", "ab" * 32) == digest
    store.delete_ref("buildcache", "ab" * 32)
    store.delete_ref("buildcache", "ab" * 32)  # absent: fine
    assert store.list_refs("buildcache") == {}
    with pytest.raises(InvalidInputError):
        store.delete_ref("nonsense", "x")


def _swap_from(root: str, digest: str, start, results) -> None:
    """One racing writer (its own process and store object): wait for the start, then swap."""
    from weenv.errors import BusyError

    store = FileStore(root)
    start.wait()
    try:
        store.swap_ref("templates", "t", digest, expected=None)
        results.put(digest)
    except BusyError:
        results.put(None)


def test_file_store_swap_ref_lets_exactly_one_of_racing_processes_win(tmp_path):
    # Before refs/.lock the check and the write were two steps: several writers
    # that all read "nothing" all wrote, and the last one silently won.
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    start, results = ctx.Event(), ctx.Queue()
    digests = [f"sha256:{i:064x}" for i in range(1, 13)]
    procs = [ctx.Process(target=_swap_from, args=(str(tmp_path), d, start, results)) for d in digests]
    for p in procs:
        p.start()
    start.set()
    outcomes = [results.get(timeout=30) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    winners = [d for d in outcomes if d is not None]
    assert len(winners) == 1
    assert FileStore(tmp_path).get_ref("templates", "t") == winners[0]


def test_file_store_delete_ref_with_expected_keeps_a_ref_moved_meanwhile(store):
    a, b = "sha256:" + "a" * 64, "sha256:" + "b" * 64
    store.set_ref("groups", "g", b)  # moved from a to b since the caller read it
    store.delete_ref("groups", "g", expected=a)
    assert store.get_ref("groups", "g") == b
    store.delete_ref("groups", "g", expected=b)
    assert store.ref_or_none("groups", "g") is None
    assert store.list_refs("groups") == {}  # the lock file is no ref
