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
