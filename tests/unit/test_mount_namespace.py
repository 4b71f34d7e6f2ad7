"""Which mounts a program run alone (weenv.host.mountns) keeps: those on the way
to the paths it needs; every other one is detached at the top of its subtree."""

from __future__ import annotations

from weenv.host.mountns import ALWAYS_KEPT, foreign_roots, needed_paths

MOUNTINFO = """\
27 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw
22 27 0:21 / /proc rw,relatime shared:2 - proc proc rw
23 27 0:22 / /sys rw,relatime - sysfs sysfs rw
24 27 0:6 / /dev rw,relatime - devtmpfs devtmpfs rw
25 24 0:23 / /dev/shm rw,relatime - tmpfs tmpfs rw
40 25 0:33 / /dev/shm rw,relatime - tmpfs tmpfs rw
26 24 0:24 / /dev/pts rw,relatime - devpts devpts rw
30 27 0:40 / /tmp rw,relatime - tmpfs tmpfs rw
31 30 0:41 / /tmp/other\\040home/node/lazy rw - fuse.weenv weenv rw
32 30 7:3 / /tmp/other\\040home/node/groups/abc ro - erofs /tmp/other\\040home/node/lazy/abc.img ro
33 32 0:42 / /tmp/other\\040home/node/groups/abc/proc rw - proc proc rw
34 30 7:1 / /tmp/mine/node/envs rw - btrfs /dev/loop1 rw
35 27 0:50 / /usr rw,relatime - ext4 /dev/vdb rw
36 35 0:51 / /usr/local/share rw,relatime - tmpfs tmpfs rw
"""


def test_mounts_on_the_way_to_a_kept_path_stay_and_the_others_go_at_their_top():
    keep = ["/proc", "/dev", "/usr", "/usr/sbin/mkfs.btrfs", "/tmp/mine/node/disk.img"]
    assert foreign_roots(MOUNTINFO, keep) == [
        "/sys",
        "/dev/shm",  # once per round: the top one of the two stacked there goes first
        "/dev/pts",
        "/tmp/other home/node/lazy",
        "/tmp/other home/node/groups/abc",  # its /proc below goes with it
        "/tmp/mine/node/envs",  # beside the image, not on its way
        "/usr/local/share",
    ]


def test_a_kept_directory_keeps_the_mounts_below_it_out():
    assert "/tmp/mine/node/envs" not in foreign_roots(MOUNTINFO, ["/tmp/mine/node/envs/x"])
    assert foreign_roots(MOUNTINFO, ["/"]) == ["/proc", "/sys", "/dev", "/tmp", "/usr"]


def test_the_program_and_what_every_program_needs_are_kept(tmp_path):
    image = tmp_path / "disk.img"
    paths = needed_paths(["/usr/sbin/mkfs.btrfs", "-q", str(image)], [image])
    assert paths[-1] == str(image.resolve())
    assert len(paths) == len(ALWAYS_KEPT) + 2 and all(p.startswith("/") for p in paths)
