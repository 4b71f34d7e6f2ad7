"""The Cgroup behaviour suite, run against every backend in ``BACKENDS`` on real cgroups.

Each test makes its own group ``/weenv-test-<hex>`` and real processes in it.
On this hybrid host v1 has every controller; the cgroup2 mount
(``/sys/fs/cgroup/unified``) offers none of cpu, memory, pids (they are bound to
the v1 hierarchies), so v2 runs only what its core provides (CPU time, freeze)
and the rest skips with that reason.  v2's file formats (on a directory laid out
as the kernel lays out a v2 group) and the detection from mountinfo are checked
in ``tests/unit/test_cgroup_formats.py``.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time

import pytest

from weenv.errors import InvalidInputError, NotFoundError
from weenv.node.cgroups import (
    Cgroup,
    LimitRefusedError,
    detect,
    open_cgroups,
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
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
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
