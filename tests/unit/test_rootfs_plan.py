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
