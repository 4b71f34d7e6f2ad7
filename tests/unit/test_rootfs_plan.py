"""The snapshotter's mount plan (weenv.node.snapshotter.rootfs_mounts): data,
computed without touching the system (mounting it is weenv.host.mounts')."""

from __future__ import annotations

from pathlib import Path

import pytest

from weenv.errors import MountError
from weenv.host.mounts import MS_NODEV, MS_NOSUID
from weenv.node.snapshotter import rootfs_mounts


def test_one_overlay_over_the_groups_top_first(tmp_path):
    env_dir = tmp_path / "envs" / "abc"
    (spec,) = rootfs_mounts(env_dir, [Path("/g/base"), Path("/g/task")])
    assert (spec.fstype, spec.target) == ("overlay", str(env_dir / "rootfs"))
    assert spec.flags == MS_NOSUID | MS_NODEV
    options = dict(o.split("=", 1) for o in spec.options.split(","))
    assert options["lowerdir"] == "/g/task:/g/base"  # overlayfs wants the top one first
    assert Path(options["upperdir"]).parent == Path(options["workdir"]).parent  # one subvolume: copy-up renames
    assert Path(options["upperdir"]).is_relative_to(env_dir)
    assert not env_dir.exists()  # a plan: nothing made


def test_a_home_path_with_separators_is_escaped(tmp_path):
    env_dir = tmp_path / "a,b:c"
    (spec,) = rootfs_mounts(env_dir, [Path("/g/x")])
    assert "a\\,b\\:c" in spec.options


def test_no_groups_is_refused(tmp_path):
    with pytest.raises(MountError):
        rootfs_mounts(tmp_path, [])


def test_the_rootfs_made_ahead_is_beside_over_the_spare(tmp_path):
    """A reset's container made ahead (weenv.node.state.reset) gets its own overlay,
    ``rootfs.next`` over the spare subvolume, the same lowers and flags."""
    from weenv.node.disk import SPARE

    env_dir = tmp_path / "envs" / "abc"
    (own,) = rootfs_mounts(env_dir, [Path("/g/base"), Path("/g/task")])
    (ahead,) = rootfs_mounts(env_dir, [Path("/g/base"), Path("/g/task")], ahead=True)
    assert ahead.target == str(env_dir / "rootfs.next") and ahead.flags == own.flags
    options = dict(o.split("=", 1) for o in ahead.options.split(","))
    assert options["lowerdir"] == "/g/task:/g/base"
    assert (
        Path(options["upperdir"]) == env_dir / SPARE / "upper" and Path(options["workdir"]) == env_dir / SPARE / "work"
    )


def test_container_ids_made_ahead_count_on():
    from weenv.node.state.reset import next_container_id

    assert next_container_id("abc", "weenv-abc") == "weenv-abc.1"
    assert next_container_id("abc", "weenv-abc.1") == "weenv-abc.2"
    assert next_container_id("abc", "weenv-abc.41") == "weenv-abc.42"
    assert next_container_id("abc", "weenv-abcd") == "weenv-abc.1"  # not its own: start again
