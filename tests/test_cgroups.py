"""The Cgroup behaviour suite, run against every backend in ``BACKENDS`` on real cgroups.

Each test makes its own group ``/weenv-test-<hex>`` and real processes in it.
On this hybrid host v1 has every controller; the cgroup2 mount
(``/sys/fs/cgroup/unified``) offers none of cpu, memory, pids (they are bound to
the v1 hierarchies), so v2 runs only what its core provides (CPU time, freeze)
and the rest skips with that reason.  v2's file formats are also checked below
against a directory laid out as the kernel lays out a v2 group.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from weenv.errors import InvalidInputError, NotFoundError
from weenv.node.cgroups import (
    Cgroup,
    CgroupV2,
    LimitRefusedError,
    detect,
    open_cgroups,
    parse_mountinfo,
)

MIB = 1 << 20


class V1:
    name = "v1"

    def open(self, path: str) -> Cgroup:
        if not detect().v1:
            pytest.skip("no cgroup v1 hierarchies on this host")
        return open_cgroups(path, version=1)


class V2:
    name = "v2"

    def open(self, path: str) -> Cgroup:
        if detect().v2 is None:
            pytest.skip("no cgroup2 mount on this host")
        return open_cgroups(path, version=2)


BACKENDS = [V1(), V2()]


@pytest.fixture(params=BACKENDS, ids=lambda b: b.name)
def cg(request):
    g = request.param.open(f"/weenv-test-{secrets.token_hex(4)}")
    g.create()
    procs: list[subprocess.Popen] = []
    g.spawned = procs
    try:
        yield g
    finally:
        for p in procs:
            p.kill()
            p.wait()
        if g.exists():
            try:
                g.thaw()
            except Exception:
                pass
            for _ in range(100):
                try:
                    for pid in g.procs():
                        os.kill(pid, signal.SIGKILL)
                    g.remove()
                    break
                except Exception:
                    time.sleep(0.05)
        assert not g.exists()


def need(g: Cgroup, controller: str) -> None:
    if controller not in g.controllers():
        pytest.skip(f"the {controller} controller is not available to cgroup v{g.version} on this host")


def spawn(g: Cgroup, code: str) -> subprocess.Popen:
    """A Python process moved into ``g`` before it runs ``code``."""
    p = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.readline()\n" + code],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    g.spawned.append(p)
    g.add_process(p.pid)
    p.stdin.write(b"go\n")
    p.stdin.flush()
    return p


BUSY = "import time\nwhile time.process_time() < {s}: pass\n"  # {s} seconds of CPU
ALLOC = (
    "import time\nb = bytearray({n})\n"
    "for i in range(0, len(b), 4096): b[i] = 1\n"
    "print('done', flush=True)\ntime.sleep({hold})\n"
)


def wait_for(cond, timeout=10.0, step=0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(step)
    return False


# --- lifetime and errors --------------------------------------------------------------------
def test_create_remove_and_a_gone_group_stays_gone(cg):
    assert cg.exists() and cg.procs() == []
    cg.remove()
    assert not cg.exists()
    with pytest.raises(NotFoundError):
        cg.usage()
    with pytest.raises(NotFoundError):
        cg.set_cpu(0.5)
    with pytest.raises(NotFoundError):
        cg.thaw()
    assert not cg.exists()  # writing never recreates the group


def test_bad_input(cg):
    with pytest.raises(InvalidInputError):
        open_cgroups("weenv-relative")
    with pytest.raises(InvalidInputError):
        open_cgroups("/weenv/../etc")
    with pytest.raises(InvalidInputError):
        cg.set_cpu(0)
    with pytest.raises(InvalidInputError):
        cg.set_cpu(0.5, period_us=10)


# --- CPU ------------------------------------------------------------------------------------
def test_cpu_time_is_counted(cg):
    p = spawn(cg, BUSY.format(s=0.6))
    assert p.wait(timeout=30) == 0
    assert cg.usage().cpu_usage_s >= 0.4


def test_cpu_quota_throttles(cg):
    need(cg, "cpu")
    cg.set_cpu(0.2)
    lim = cg.limits()
    assert lim.cpu_quota == pytest.approx(0.2) and lim.cpu_period_us == 100_000
    t0 = time.monotonic()
    p = spawn(cg, BUSY.format(s=0.3))
    assert p.wait(timeout=30) == 0
    wall = time.monotonic() - t0
    u = cg.usage()
    assert wall >= 0.3 / 0.2 - 0.2  # 0.3 s of CPU at 0.2 cores takes ~1.5 s
    assert u.cpu_throttled_periods > 0 and u.cpu_throttled_s > 0 and u.cpu_periods >= u.cpu_throttled_periods
    cg.set_cpu(None, period_us=50_000)
    assert cg.limits().cpu_quota is None and cg.limits().cpu_period_us == 50_000


# --- memory ---------------------------------------------------------------------------------
def test_memory_usage_and_refused_lowering(cg):
    need(cg, "memory")
    cg.set_memory_limit(512 * MIB)
    p = spawn(cg, ALLOC.format(n=64 * MIB, hold=30))
    assert p.stdout.readline() == b"done\n"
    u = cg.usage()
    assert u.memory_usage >= 64 * MIB and u.memory_peak >= u.memory_usage
    assert 64 * MIB <= u.memory_working_set <= u.memory_usage
    with pytest.raises(LimitRefusedError):
        cg.set_memory_limit(16 * MIB)  # anonymous memory, no swap: cannot be reclaimed
    assert cg.limits().memory_limit == 512 * MIB
    assert p.poll() is None  # refusing did not kill anything
    cg.set_memory_limit(128 * MIB)  # above usage: fine
    assert cg.limits().memory_limit == 128 * MIB


def test_memory_limit_oom_kills_and_counts(cg):
    need(cg, "memory")
    cg.set_memory_limit(48 * MIB)
    p = spawn(cg, ALLOC.format(n=128 * MIB, hold=0))
    assert p.wait(timeout=30) == -signal.SIGKILL
    u = cg.usage()
    assert u.oom_kills >= 1 and u.memory_failcnt > 0


def test_oom_killer_disabled_waits_for_a_higher_limit(cg):
    need(cg, "memory")
    if not cg.set_oom_killer(False):
        pytest.skip(f"cgroup v{cg.version} cannot disable the OOM killer")
    assert cg.limits().oom_killer is False
    cg.set_memory_limit(48 * MIB)
    p = spawn(cg, ALLOC.format(n=96 * MIB, hold=0))
    assert wait_for(lambda: cg.usage().memory_under_oom)
    assert p.poll() is None
    cg.set_memory_limit(256 * MIB)
    assert p.wait(timeout=30) == 0 and p.stdout.read() == b"done\n"
    assert cg.usage().oom_kills == 0
    cg.set_oom_killer(True)
    assert cg.limits().oom_killer is True


# --- pids -----------------------------------------------------------------------------------
def test_pids_limit_refuses_forks(cg):
    need(cg, "pids")
    cg.set_pids_limit(4)
    assert cg.limits().pids_limit == 4
    code = (
        "import os, time\nkids = 0\n"
        "for _ in range(10):\n"
        "    try:\n        pid = os.fork()\n    except BlockingIOError:\n        continue\n"
        "    if pid == 0:\n        time.sleep(5); os._exit(0)\n"
        "    kids += 1\n"
        "print(kids, flush=True)\ntime.sleep(5)\n"
    )
    p = spawn(cg, code)
    assert int(p.stdout.readline()) == 3  # 4 tasks: the parent and 3 children
    u = cg.usage()
    assert u.pids_current == 4 and u.pids_failcnt >= 7
    cg.set_pids_limit(None)
    assert cg.limits().pids_limit is None


# --- freezing -------------------------------------------------------------------------------
def test_freeze_and_thaw(cg):
    need(cg, "freezer")
    p = spawn(cg, BUSY.format(s=30))
    assert wait_for(lambda: cg.usage().cpu_usage_s > 0.05)
    cg.freeze()
    assert cg.limits().frozen
    a = cg.usage().cpu_usage_s
    time.sleep(0.3)
    assert cg.usage().cpu_usage_s - a < 0.01
    cg.thaw()
    assert not cg.limits().frozen
    assert wait_for(lambda: cg.usage().cpu_usage_s - a > 0.1)
    assert p.poll() is None


# --- v2 file formats, on a directory laid out as the kernel does ----------------------------
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
    }  # fmt: skip
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
    assert (lim.cpu_quota, lim.cpu_period_us, lim.memory_limit, lim.pids_limit, lim.frozen) == (None, 100000, None, None, False)


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


# --- detection ------------------------------------------------------------------------------
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
