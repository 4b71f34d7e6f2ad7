"""The provisioner keeps a paused environment's memory counted (issue 16 review, finding 8):
in admission, and in what its elastic pass grants the others, on cgroups faked in memory."""

from __future__ import annotations

import time

import pytest

from weenv.errors import CapacityError
from weenv.formats.manifest import Resources
from weenv.node.cgroups.base import Pressure, Usage
from weenv.node.provision import ProvisionConfig, Provisioner

MIB = 1 << 20


class FakeCgroup:
    """What the provisioner reads and writes of a cgroup; ``working_set`` is set by the test."""

    def __init__(self):
        self.working_set = 0
        self.memory_limit: int | None = None
        self.writes = 0

    def usage(self) -> Usage:
        ws = self.working_set
        return Usage(
            at=time.monotonic(),
            cpu_usage_s=0.0,
            cpu_periods=0,
            cpu_throttled_periods=0,
            cpu_throttled_s=0.0,
            memory_usage=ws,
            memory_working_set=ws,
            memory_peak=ws,
            memory_failcnt=0,
            memory_under_oom=False,
            oom_kills=0,
            pids_current=1,
            pids_failcnt=0,
        )

    def pressure(self) -> Pressure:
        return Pressure(cpu_periods=0, cpu_throttled_periods=0, memory_under_oom=False)

    def set_cpu(self, quota, period_us=100_000):
        self.writes += 1

    def set_memory_limit(self, limit):
        self.memory_limit = limit
        self.writes += 1

    def set_oom_killer(self, enabled):
        return True

    def set_pids_limit(self, limit):
        pass

    def freeze(self, timeout=10.0):
        pass

    def thaw(self):
        pass


@pytest.fixture
def provisioner():
    groups: dict[str, FakeCgroup] = {}
    cfg = ProvisionConfig(
        mode="elastic",
        memory_capacity=1024 * MIB,
        memory_overcommit=1.0,
        memory_initial=256 * MIB,
        memory_low_watermark=0.0,
        memory_critical_watermark=0.0,
    )
    p = Provisioner(cfg, open_cgroup=lambda path: groups.setdefault(path, FakeCgroup()))
    p.groups = groups
    return p


def _add(p: Provisioner, env_id: str) -> FakeCgroup:
    p.reserve(env_id, Resources(cpus=0.1, memory_bytes=1024 * MIB))
    p.attach(env_id, f"/{env_id}")
    return p.groups[f"/{env_id}"]


def test_a_paused_environment_keeps_its_memory_in_admission_and_from_the_others(provisioner):
    p = provisioner
    a, b, _c = _add(p, "a"), _add(p, "b"), _add(p, "c")
    _add(p, "d")  # 4 x 256 MiB: the node's 1 GiB
    p.pause("b")
    p.pause("c")
    with pytest.raises(CapacityError, match="memory limits would reach"):  # b and c hold theirs, frozen
        _add(p, "e")
    assert p.stats().totals.paused == 2
    p.detach("d")
    writes = b.writes
    a.working_set = 1000 * MIB  # a grows: into what d left, not into what the paused b and c hold
    for _ in range(3):
        p.tick()
    assert b.writes == writes and b.memory_limit == 256 * MIB  # not resized while paused
    assert 256 * MIB < a.memory_limit <= 512 * MIB, a.memory_limit >> 20
    p.resume("b", "/b", Resources(cpus=0.1, memory_bytes=1024 * MIB))  # counted all along: nothing to admit
    assert p.stats().totals.paused == 1 and p.stats("b").environments[0].memory_limit == 256 * MIB
