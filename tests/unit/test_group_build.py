"""Group builds: what is refused before anything is built, and the inode count
of a source tree."""

from __future__ import annotations

import os

import pytest

from weenv.errors import InvalidInputError
from weenv.packaging.erofs import count_inodes
from weenv.packaging.group import build_group


def test_count_inodes_counts_hardlinks_once(tmp_path):
    root = tmp_path / "r"
    (root / "d").mkdir(parents=True)
    (root / "f").write_bytes(b"f")
    os.link(root / "f", root / "d" / "f2")
    os.symlink("f", root / "l")
    os.mkfifo(root / "p")
    assert count_inodes(root) == 5  # root, d, f (twice), l, p


@pytest.mark.parametrize("kind", ["missing", "file"])
def test_build_rejects_bad_source(kind, store, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    src = tmp_path / "src"
    if kind == "file":
        src.write_bytes(b"not a dir")
    with pytest.raises(InvalidInputError, match="does not exist" if kind == "missing" else "not a directory"):
        build_group(src, store, name="g", workdir=work)
    assert list(work.iterdir()) == []
    assert list(store.list_chunks()) == [] and store.list_refs("groups") == {}
