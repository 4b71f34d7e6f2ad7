"""Cgroup v2's file formats, read and written on a directory laid out as the
kernel lays out a v2 group, and the cgroup layout detected from mountinfo."""

from __future__ import annotations

from pathlib import Path

import pytest

from weenv.errors import NotFoundError
from weenv.node.cgroups import CgroupV2, LimitRefusedError, open_cgroups, parse_mountinfo

MIB = 1 << 20


def _v2_tree(tmp_path: Path) -> Path:
    """A cgroup2 root offering cpu/memory/pids and a group ``weenv-x`` with
    the files and contents a kernel (6.x) shows for one."""
    root = tmp_path / "cgroup"
    g = root / "weenv-x"
    g.mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpuset cpu io memory hugetlb pids rdma misc\n")
    (root / "cgroup.subtree_control").write_text("cpu memory pids\n")
    files = {
        "cgroup.controllers": "cpu memory pids\n",
        "cgroup.procs": "101\n102\n",
        "cgroup.freeze": "0\n",
        "cgroup.events": "populated 1\nfrozen 0\n",
        "cpu.stat": "usage_usec 2500000\nuser_usec 2000000\nsystem_usec 500000\nnr_periods 40\n"
        "nr_throttled 7\nthrottled_usec 350000\nnr_bursts 0\nburst_usec 0\n",
        "cpu.max": "max 100000\n",
        "memory.current": str(300 * MIB) + "\n",
        "memory.peak": str(320 * MIB) + "\n",
        "memory.max": "max\n",
        "memory.high": "max\n",
        "memory.reclaim": "",
        "memory.stat": f"anon {200 * MIB}\nfile {100 * MIB}\nactive_file {40 * MIB}\n"
        f"inactive_file {60 * MIB}\nshmem 0\n",
        "memory.events": "low 0\nhigh 0\nmax 12\noom 2\noom_kill 1\noom_group_kill 0\n",
        "pids.current": "9\n",
        "pids.max": "max\n",
        "pids.events": "max 3\n",
    }
    for name, text in files.items():
        (g / name).write_text(text)
    return root


def test_v2_reads_the_kernel_formats(tmp_path):
    g = CgroupV2("/weenv-x", _v2_tree(tmp_path))
    assert g.controllers() == {"cpu", "memory", "pids", "cpuacct", "freezer"}
    assert g.procs() == [101, 102]
    u = g.usage()
    assert (u.cpu_usage_s, u.cpu_periods, u.cpu_throttled_periods, u.cpu_throttled_s) == (2.5, 40, 7, 0.35)
    assert (u.memory_usage, u.memory_working_set, u.memory_peak) == (300 * MIB, 240 * MIB, 320 * MIB)
    assert (u.memory_failcnt, u.oom_kills, u.pids_current, u.pids_failcnt) == (12, 1, 9, 3)
    lim = g.limits()
    assert (lim.cpu_quota, lim.cpu_period_us, lim.memory_limit, lim.pids_limit, lim.frozen) == (
        None,
        100000,
        None,
        None,
        False,
    )


def test_v2_writes_the_kernel_formats(tmp_path):
    root = _v2_tree(tmp_path)
    d = root / "weenv-x"
    g = CgroupV2("/weenv-x", root)
    g.set_cpu(1.5, period_us=50_000)
    assert (d / "cpu.max").read_text() == "75000 50000"
    assert g.limits().cpu_quota == 1.5
    g.set_cpu(None)
    assert (d / "cpu.max").read_text() == "max 100000"
    g.set_pids_limit(64)
    assert (d / "pids.max").read_text() == "64"
    g.set_memory_limit(512 * MIB)  # above memory.current: written as is
    assert (d / "memory.max").read_text() == str(512 * MIB)
    # Below memory.current: reclaim is asked for the difference; memory.current
    # does not move in a plain directory, so the lowering is refused, limit unchanged.
    with pytest.raises(LimitRefusedError):
        g.set_memory_limit(100 * MIB)
    assert (d / "memory.reclaim").read_text() == str(200 * MIB)
    assert (d / "memory.max").read_text() == str(512 * MIB)
    g.set_memory_limit(None)
    assert (d / "memory.max").read_text() == "max"
    assert g.set_oom_killer(False) is False
    g._set_frozen(True)
    assert (d / "cgroup.freeze").read_text() == "1" and g.limits().frozen


HYBRID = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
33 31 0:30 / /sys/fs/cgroup/cpuacct rw,relatime - cgroup cgroup rw,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
37 31 0:34 / /sys/fs/cgroup/freezer rw,relatime - cgroup cgroup rw,freezer
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""


PURE_V2 = """\
25 30 0:23 / /sys rw,nosuid,nodev,noexec,relatime shared:7 - sysfs sysfs rw
26 25 0:24 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:8 - cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot
"""


COMOUNTED_V1 = """\
32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
36 31 0:33 /docker/abc /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
"""


def test_detection_from_mountinfo():
    hybrid = parse_mountinfo(HYBRID)
    assert hybrid.version == 1 and hybrid.v2 == Path("/sys/fs/cgroup/unified")
    assert set(hybrid.v1) == {"cpu", "cpuacct", "memory", "freezer", "pids"}
    pure = parse_mountinfo(PURE_V2)
    assert pure.version == 2 and pure.v2 == Path("/sys/fs/cgroup") and pure.v1 == {}
    assert isinstance(open_cgroups("/weenv-x", layout=pure), CgroupV2)
    co = parse_mountinfo(COMOUNTED_V1)
    assert co.v1["cpu"] == co.v1["cpuacct"] == Path("/sys/fs/cgroup/cpu,cpuacct")
    assert "pids" not in co.v1  # not the hierarchy's root: skipped
    g = open_cgroups("/weenv-x", layout=co)
    assert g.directories() == [Path("/sys/fs/cgroup/cpu,cpuacct/weenv-x"), Path("/sys/fs/cgroup/memory/weenv-x")]
    with pytest.raises(NotFoundError):
        open_cgroups("/weenv-x", layout=co, version=2)
