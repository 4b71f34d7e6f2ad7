"""An upload whose temporary file cannot be made gives its reservation back
(it kept the announced bytes counted: later uploads were refused for them)."""

from __future__ import annotations

import pytest

from weenv.server.e2b.uploads import Uploads


def test_a_writer_that_cannot_open_its_file_releases_its_reservation(tmp_path):
    u = Uploads(tmp_path / "uploads", secret=b"s", max_total=1000)
    (tmp_path / "uploads").rmdir()  # its temporary file cannot be made now
    with pytest.raises(FileNotFoundError):
        u.writer("t", "a" * 64, 800)
    assert u._bytes == 0
