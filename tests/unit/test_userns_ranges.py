"""Host id ranges of sudo environments (:func:`weenv.node.runtime.idmap.allocate`): disjoint, taken back, refused when full."""

from __future__ import annotations

import shutil

import pytest

from weenv.errors import CapacityError
from weenv.formats.manifest import RuntimeConfig, canonical_json
from weenv.node.runtime import idmap


def test_ranges_are_disjoint_released_and_reused(tmp_path):
    reg = tmp_path / "registry"
    dirs = [tmp_path / f"env{i}" for i in range(3)]
    for d in dirs:
        d.mkdir()
    ids = [idmap.allocate(d, reg) for d in dirs]
    assert ids == [idmap.RANGE_BASE + i * idmap.ID_RANGE for i in range(3)]
    assert [idmap.range_of(d) for d in dirs] == ids
    assert idmap.in_use(reg) == dict(zip(ids, dirs))
    idmap.release(dirs[1], reg)
    idmap.release(dirs[1], reg)  # idempotent
    assert idmap.range_of(dirs[1]) is None and ids[1] not in idmap.in_use(reg)
    again = tmp_path / "env3"
    again.mkdir()
    assert idmap.allocate(again, reg) == ids[1]  # the lowest free one


def test_a_dead_nodes_range_is_taken_back(tmp_path):
    """A record whose environment directory is gone (a node killed, its home removed) holds nothing."""
    reg, d = tmp_path / "registry", tmp_path / "env"
    d.mkdir()
    first = idmap.allocate(d, reg)
    shutil.rmtree(d)
    assert idmap.in_use(reg) == {}
    other = tmp_path / "other"
    other.mkdir()
    assert idmap.allocate(other, reg) == first


def test_full_host_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(idmap, "RANGE_SLOTS", 2)
    reg = tmp_path / "registry"
    for i in range(2):
        (tmp_path / f"e{i}").mkdir()
        idmap.allocate(tmp_path / f"e{i}", reg)
    (tmp_path / "e2").mkdir()
    with pytest.raises(CapacityError, match="id ranges"):
        idmap.allocate(tmp_path / "e2", reg)
    assert idmap.range_of(tmp_path / "e2") is None


def test_ranges_stay_clear_of_host_ids():
    top = idmap.RANGE_BASE + idmap.RANGE_SLOTS * idmap.ID_RANGE
    assert idmap.RANGE_BASE > 100000 + 65536 * 1000 and top < 2**32 - 1
    idmap.check_range(idmap.RANGE_BASE)
    idmap.check_range(top - idmap.ID_RANGE)


def test_sudo_left_out_of_manifests_unless_asked():
    assert b"sudo" not in canonical_json(RuntimeConfig())
    assert b'"sudo":true' in canonical_json(RuntimeConfig(sudo=True))
    assert RuntimeConfig.model_validate_json(canonical_json(RuntimeConfig(sudo=True))).sudo


def test_traversal_check_names_the_closed_directory(tmp_path):
    closed = tmp_path / "closed"
    (closed / "home").mkdir(parents=True)
    closed.chmod(0o700)
    with pytest.raises(Exception, match="o\\+x.*closed"):
        idmap.check_traversable(closed / "home" / "env")
