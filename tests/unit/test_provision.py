"""Elastic provisioning's pure parts: the per-environment policy (what quota and
limit an environment's usage asks for) and the arbiter (what the node grants,
admits, freezes), on synthetic observations."""

from __future__ import annotations

import random

import pytest

from weenv.node.provision import ProvisionConfig
from weenv.node.provision.arbiter import (
    Budget,
    Claim,
    CpuMoments,
    admits,
    arbitrate,
    burst_contention,
    predicted_cpu_peak,
)
from weenv.node.provision.policy import EnvPolicy, Observation, percentile

MIB = 1 << 20
GIB = 1 << 30


def obs(at, cpu=0.0, throttled=0.0, ws=0, usage=None, failcnt=0, under_oom=False, dt=1.0):
    return Observation(
        at=at,
        dt=dt,
        cpu_cores=cpu,
        throttled=throttled,
        memory_usage=ws if usage is None else usage,
        working_set=ws,
        failcnt_delta=failcnt,
        under_oom=under_oom,
        oom_kills_delta=0,
        pids=1,
    )


def step(p: EnvPolicy, o: Observation):
    w = p.observe(o)
    p.applied(w.cpu_quota, w.memory_limit, o.at)
    return w


# --- policy -----------------------------------------------------------------------------------
def test_percentile_nearest_rank():
    assert percentile([], 95) == 0
    assert percentile([3, 1, 2], 50) == 2
    assert percentile(list(range(1, 101)), 95) == 95
    assert percentile([5], 99) == 5


def test_cpu_raised_at_once_on_throttling_and_lowered_slowly_after_cooldown():
    cfg = ProvisionConfig(cpu_initial=0.5, cpu_cooldown_s=10, cpu_window_s=30)
    p = EnvPolicy(cfg, cpu_ceiling=2.0, memory_ceiling=GIB, now=0)
    assert p.cpu_quota == 0.5
    w = step(p, obs(1, cpu=0.5, throttled=0.8))
    assert (w.cpu_quota, w.cpu_reason) == (1.0, "throttled")
    w = step(p, obs(2, cpu=1.0, throttled=0.6))
    assert w.cpu_quota == 2.0  # the ceiling
    w = step(p, obs(3, cpu=2.0, throttled=0.9))
    assert w.cpu_quota == 2.0 and w.cpu_reason == "stay"
    # idle: nothing happens during the cool-down, then at most 20 % per pass
    quotas = [step(p, obs(t, cpu=0.01)).cpu_quota for t in range(4, 13)]
    assert quotas == [2.0] * 9
    quotas = [step(p, obs(t, cpu=0.01)).cpu_quota for t in range(13, 60)]
    assert all(b >= a * 0.8 - 1e-9 for a, b in zip([2.0] + quotas, quotas))
    # p95 of the 30 s window still holds the burst until it leaves the window
    assert quotas[10] >= 1.0
    assert quotas[-1] == pytest.approx(0.01 + cfg.cpu_min_headroom)  # idle usage + headroom


def test_cpu_target_is_a_high_percentile_plus_headroom():
    cfg = ProvisionConfig(cpu_initial=0.1, cpu_cooldown_s=0)
    p = EnvPolicy(cfg, cpu_ceiling=4.0, memory_ceiling=GIB, now=0)
    for t in range(1, 21):  # 19 samples at 0.2 cores, one at 1.0
        step(p, obs(t, cpu=1.0 if t == 10 else 0.2))
    assert p.cpu_target() == pytest.approx(max(0.2 * 1.3, 0.3))  # p95 of 20 samples is the 19th: 0.2
    step(p, obs(21, cpu=1.0))  # now 2 of 21 are high: p95 (rank 20) is 1.0
    assert p.cpu_target() == pytest.approx(1.3)


def test_memory_raised_at_once_near_the_limit_and_lowered_after_hold_in_steps():
    # never idle here (its CPU is not observed): idle reclaim is tested apart
    cfg = ProvisionConfig(memory_initial=256 * MIB, memory_hold_s=30, memory_half_life_s=10, memory_idle_after_s=1e9)
    p = EnvPolicy(cfg, cpu_ceiling=1.0, memory_ceiling=4 * GIB, now=0)
    w = step(p, obs(1, ws=100 * MIB))
    assert w.memory_limit == 256 * MIB and not w.memory_pressure  # 100 MiB * 1.2 < 164 MiB < 256
    w = step(p, obs(2, ws=230 * MIB))  # 90 % of the limit: pressure
    assert w.memory_pressure and w.memory_reason == "raise" and w.memory_limit == 384 * MIB
    w = step(p, obs(3, ws=240 * MIB, failcnt=5))  # failcnt with ws above half the limit
    assert w.memory_pressure and w.memory_limit == 576 * MIB
    w = step(p, obs(4, ws=100 * MIB, usage=570 * MIB, failcnt=3))  # page cache reclaim: no pressure
    assert not w.memory_pressure and w.memory_limit == 576 * MIB
    w = step(p, obs(5, ws=50 * MIB, under_oom=True))  # tasks waiting at the limit
    assert w.memory_pressure and w.memory_limit == 864 * MIB
    # idle at 50 MiB: held for 30 s after the last pressure, then 10 % per pass
    limits = [step(p, obs(t, ws=50 * MIB)).memory_limit for t in range(6, 35)]
    assert set(limits) == {864 * MIB}
    limits = [step(p, obs(t, ws=50 * MIB)).memory_limit for t in range(35, 120)]
    assert limits[0] == int(864 * MIB * 0.9)
    assert all(b >= int(a * 0.9) for a, b in zip(limits, limits[1:]))
    assert limits[-1] == 114 * MIB  # 50 MiB + 64 MiB headroom
    # a refused lowering: stay, and hold again
    p.memory_limit = 400 * MIB
    p.refused(200)
    assert [step(p, obs(t, ws=50 * MIB)).memory_limit for t in range(201, 229)] == [400 * MIB] * 28
    assert step(p, obs(231, ws=50 * MIB)).memory_limit == 360 * MIB


def test_floor_and_ceiling_bound_everything():
    cfg = ProvisionConfig(
        cpu_floor=0.2,
        memory_floor=128 * MIB,
        cpu_cooldown_s=0,
        memory_hold_s=0,
        cpu_min_headroom=0,
        memory_min_headroom=0,
        memory_half_life_s=1,
    )
    p = EnvPolicy(cfg, cpu_ceiling=1.0, memory_ceiling=512 * MIB, now=0)
    for t in range(1, 50):
        w = step(p, obs(t, cpu=0 if t > 5 else 3.0, throttled=1.0 if t <= 5 else 0, ws=(10 if t > 5 else 900) * MIB))
        assert 0.2 <= w.cpu_quota <= 1.0 and 128 * MIB <= w.memory_limit <= 512 * MIB
    assert (w.cpu_quota, w.memory_limit) == (0.2, 128 * MIB)
    tiny = EnvPolicy(cfg, cpu_ceiling=0.1, memory_ceiling=64 * MIB, now=0)  # ceiling below the floor
    assert (tiny.cpu_quota, tiny.memory_limit) == (0.1, 64 * MIB)


# --- arbiter ----------------------------------------------------------------------------------
def budget(cpu=2.0, memory=4 * GIB, available=20 * GIB):
    return Budget(
        cpu=cpu,
        memory=memory,
        memory_capacity=memory,
        memory_available=available,
        low_watermark=0.1,
        critical_watermark=0.05,
    )


def claim(i, *, prio=0, cpu=0.5, cpu_want=0.5, mem=256 * MIB, mem_want=256 * MIB, pressure=False, frozen=False):
    return Claim(
        env_id=f"e{i}",
        priority=prio,
        cpu_quota=cpu,
        cpu_want=cpu_want,
        cpu_floor=0.1,
        memory_limit=mem,
        memory_want=mem_want,
        memory_pressure=pressure,
        working_set=mem // 2,
        frozen=frozen,
    )


def test_arbiter_keeps_the_sum_of_quotas_within_the_budget():
    rng = random.Random(5)
    for _ in range(500):
        b = budget(cpu=rng.uniform(1, 8), memory=rng.randint(1, 16) * GIB)
        claims = []
        for i in range(rng.randint(1, 30)):
            cpu = rng.uniform(0.1, 1.0)
            claims.append(
                claim(
                    i,
                    prio=rng.randint(0, 2),
                    cpu=cpu,
                    cpu_want=rng.uniform(0.1, 4),
                    mem=rng.randint(64, 512) * MIB,
                    mem_want=rng.randint(64, 2048) * MIB,
                    pressure=rng.random() < 0.5,
                )
            )
        if sum(c.cpu_floor for c in claims) > b.cpu:
            continue
        d = arbitrate(claims, b)
        assert sum(d.cpu.values()) <= b.cpu + 1e-6
        held = sum(min(c.memory_limit, c.memory_want) for c in claims)
        assert sum(d.memory.values()) <= max(b.memory, held)
        for c in claims:  # lowerings always granted; nobody below its floor or above its want
            assert c.cpu_floor - 1e-9 <= d.cpu[c.env_id] <= max(c.cpu_want, c.cpu_floor) + 1e-9
            assert d.memory[c.env_id] <= max(c.memory_want, c.memory_limit)
            if c.memory_want <= c.memory_limit:
                assert d.memory[c.env_id] == c.memory_want


def test_arbiter_grants_by_priority_then_freezes_the_lowest_and_refuses_growth():
    b = budget(cpu=1.0, memory=1 * GIB)
    claims = [
        claim(0, prio=0, cpu_want=1.0, mem=300 * MIB, mem_want=600 * MIB, pressure=True),
        claim(1, prio=1, cpu_want=1.0, mem=300 * MIB, mem_want=600 * MIB, pressure=True),
    ]
    d = arbitrate(claims, b)
    assert d.cpu["e1"] == pytest.approx(0.5) and d.cpu["e0"] == pytest.approx(0.5)  # no room: both stay
    assert d.memory["e1"] == 600 * MIB and d.memory["e0"] == 1 * GIB - 600 * MIB  # what is left
    assert d.freeze == ["e0"] and not d.admitting
    assert any(k == "freeze" and e == "e0" for e, k, _ in d.events)
    # equal priorities: nobody is frozen, growth is refused
    d = arbitrate(
        [
            claim(0, mem=300 * MIB, mem_want=900 * MIB, pressure=True),
            claim(1, mem=300 * MIB, mem_want=900 * MIB, pressure=True),
        ],
        b,
    )
    assert d.freeze == [] and not d.admitting
    assert sorted(e for e, k, _ in d.events if k == "refused") == ["e0", "e1"]
    # the frozen one is thawed once its memory fits, and admission resumes
    d = arbitrate(
        [
            claim(0, mem=300 * MIB, mem_want=400 * MIB, pressure=True, frozen=True),
            claim(1, prio=1, mem=200 * MIB, mem_want=200 * MIB),
        ],
        b,
    )
    assert d.thaw == ["e0"] and d.admitting and d.memory["e0"] == 400 * MIB


def test_arbiter_freezes_the_lowest_priority_when_the_host_is_critical():
    d = arbitrate([claim(0, prio=2), claim(1, prio=0), claim(2, prio=1)], budget(available=100 * MIB))
    assert d.freeze == ["e1"] and not d.admitting


def test_admission_by_held_quotas_and_free_memory():
    b = budget(cpu=2.0, memory=4 * GIB)
    assert admits(cpu_sum=1.5, memory_sum=GIB, cpu_new=0.5, memory_new=GIB, budget=b, admitting=True) is None
    assert "CPU" in admits(cpu_sum=1.6, memory_sum=GIB, cpu_new=0.5, memory_new=GIB, budget=b, admitting=True)
    assert "memory" in admits(cpu_sum=0, memory_sum=7 * GIB // 2, cpu_new=0.1, memory_new=GIB, budget=b, admitting=True)
    assert "short" in admits(cpu_sum=0, memory_sum=0, cpu_new=0.1, memory_new=MIB, budget=b, admitting=False)


def test_predicted_peak_grows_like_the_root_of_independent_bursts():
    bursty = CpuMoments.prior(1.0, 0.25)  # 1 core busy a quarter of the time
    assert (bursty.mean, bursty.variance) == (0.25, pytest.approx(0.1875))
    assert predicted_cpu_peak([], 2.0) == 0.0
    assert predicted_cpu_peak([bursty], 2.0) == 1.0  # capped: one environment uses at most its ceiling
    # n of them: 0.25 n + 2 sqrt(0.1875 n): 4 -> 2.73, 16 -> 7.46 (against 4 and 16 at their ceilings)
    assert predicted_cpu_peak([bursty] * 4, 2.0) == pytest.approx(1.0 + 2 * 0.75**0.5)
    assert predicted_cpu_peak([bursty] * 16, 2.0) == pytest.approx(4.0 + 2 * 3**0.5)
    steady = CpuMoments.of([0.5, 0.5, 0.5])  # no variance: the mean is its peak
    assert predicted_cpu_peak([steady] * 3, 2.0) == pytest.approx(1.5)
    idle = CpuMoments.of([0.0, 0.01, 0.0])  # bounded by what each used at most
    assert predicted_cpu_peak([idle, idle, bursty], 2.0) == pytest.approx(1.02)
    b = budget(cpu=8.0, memory=4 * GIB)
    args = dict(cpu_sum=0.5, memory_sum=GIB, cpu_new=0.1, memory_new=GIB, budget=b, admitting=True)
    assert admits(**args, cpu_peak=1.9, cpu_peak_budget=2.0) is None
    assert "predicted CPU peak" in admits(**args, cpu_peak=2.1, cpu_peak_budget=2.0)


def test_burst_contention_is_the_share_of_bursts_meeting_others_beyond_the_cores():
    """Each environment busy at its ceiling ``mean / peak`` of the time; another
    is busy during a burst with twice that probability (the overlap window)."""
    tenth = CpuMoments.prior(1.0, 0.1)  # busy 10 %: during a burst of another, 20 %
    assert burst_contention([], 2.0) == 0.0
    assert burst_contention([tenth] * 2, 2.0) == 0.0  # two 1-core bursts fit 2 cores
    assert burst_contention([tenth] * 3, 2.0) == pytest.approx(0.2 * 0.2)  # both others busy
    assert burst_contention([tenth] * 4, 2.0) == pytest.approx(3 * 0.2**2 * 0.8 + 0.2**3)  # 2 of 3 others
    assert burst_contention([tenth] * 4, 2.0) > 0.05 > predicted_cpu_peak([tenth] * 4, 2.0) - 2.0  # peak: 1.6 cores
    idle = CpuMoments.of([0.0, 0.0, 0.0])
    assert burst_contention([tenth, tenth, idle, idle], 2.0) == 0.0  # idle ones never contend
    big = CpuMoments.prior(2.0, 0.1)  # a 2-core burst meets any other burst on 2 cores
    assert burst_contention([big, tenth], 2.0) == pytest.approx(0.2)
    always = CpuMoments.of([1.0, 1.0])  # busy all the time (duty 1)
    assert burst_contention([always] * 3, 2.0) == pytest.approx(1.0)
    b = budget(cpu=8.0, memory=4 * GIB)
    args = dict(cpu_sum=0.5, memory_sum=GIB, cpu_new=0.1, memory_new=GIB, budget=b, admitting=True)
    assert admits(**args, burst_risk=0.019, burst_risk_budget=0.02) is None
    assert "of bursts would meet others" in admits(**args, burst_risk=0.021, burst_risk_budget=0.02)


def test_idle_memory_is_reclaimed_with_its_limit_kept_and_reclaim_can_be_turned_off(monkeypatch):
    """An environment idle for ``memory_idle_after_s`` wants what is above its
    working set (plus the minimum headroom) reclaimed, its limit kept: its
    next burst finds its room and waits for nothing.  Busy again, or with
    ``reclaim`` off (``WEENV_RECLAIM=off``), it wants nothing reclaimed."""
    cfg = ProvisionConfig(memory_hold_s=30, memory_half_life_s=600, memory_idle_after_s=5)
    assert ProvisionConfig().reclaim and ProvisionConfig().memory_idle_after_s == 5.0  # on by default
    p = EnvPolicy(cfg, cpu_ceiling=1.0, memory_ceiling=2 * GIB, now=0)
    p.start_from(0.2, 800 * MIB)
    assert p.memory_limit == 960 * MIB
    w = step(p, obs(1, cpu=0.9, ws=800 * MIB))
    wants = []
    for t in range(2, 16):  # busy last at t=1: idle (5 s) from t=6 on
        w = step(p, obs(t, cpu=0.0, ws=100 * MIB))
        wants.append(w.reclaim_to)
        assert w.memory_limit == 960 * MIB  # the hold, the known peak: the limit stays
    assert wants[:4] == [None] * 4 and set(wants[4:]) == {164 * MIB}  # 100 MiB + 64 MiB headroom
    w = step(p, obs(16, cpu=1.0, ws=700 * MIB))  # bursts: within its limit, nothing to raise or reclaim
    assert w.reclaim_to is None and w.memory_limit == 960 * MIB and not w.memory_pressure
    off = EnvPolicy(cfg.model_copy(update={"reclaim": False}), cpu_ceiling=1.0, memory_ceiling=2 * GIB, now=0)
    assert all(step(off, obs(t, cpu=0.0, ws=100 * MIB)).reclaim_to is None for t in range(1, 16))
    monkeypatch.setenv("WEENV_RECLAIM", "off")
    assert ProvisionConfig.from_env().reclaim is False


def _contention_by_enumeration(envs: list[CpuMoments], capacity: float) -> float:
    """The same probability, by enumerating which of the others are busy (small n only)."""
    import itertools

    worst = 0.0
    for i, me in enumerate(envs):
        others = [e for j, e in enumerate(envs) if j != i]
        p_over = 0.0
        for busy in itertools.product((0, 1), repeat=len(others)):
            p, load = 1.0, 0.0
            for b, e in zip(busy, others):
                q = min(1.0, 2.0 * e.mean / e.peak) if e.peak > 0 else 0.0
                p *= q if b else 1 - q
                load += round(min(e.peak, capacity), 2) if b else 0.0
            if load > capacity - round(min(me.peak, capacity), 2) + 1e-9:
                p_over += p
        worst = max(worst, p_over)
    return worst if len(envs) >= 2 else 0.0


def test_burst_contention_equals_enumerating_every_busy_set():
    """One burst per size (the least busy one is the worst) and loads in quanta
    of their common divisor give the exact answer of enumerating every set of
    busy others, for mixed sizes and duties."""
    rng = random.Random(5)
    for _ in range(300):
        capacity = rng.choice([1.0, 2.0, 3.0, 4.0])
        envs = [
            CpuMoments.prior(min(capacity, rng.choice([0.5, 1.0, 1.5, 2.0, 0.87])), rng.random() * 0.6)
            for _ in range(rng.randint(0, 7))
        ]
        assert burst_contention(envs, capacity) == pytest.approx(_contention_by_enumeration(envs, capacity), abs=1e-12)


def test_burst_contention_of_hundreds_on_a_large_node_takes_milliseconds():
    import time

    envs = [CpuMoments.prior(1.0, 0.02 + 0.0001 * i) for i in range(500)]  # q 4-14 %: mean 45 others busy
    t = time.perf_counter()
    risk = burst_contention(envs, 64.0)
    assert time.perf_counter() - t < 0.5 and 0 < risk < 0.5


def test_the_cpu_window_keeps_the_moments_of_its_last_seconds():
    from weenv.node.provision.arbiter import CpuWindow

    w = CpuWindow(10.0)
    rng = random.Random(2)
    samples = []
    for i in range(200):
        x = rng.choice([0.0, 0.05, 1.0, rng.random()])
        w.add(i * 0.5, x)
        samples.append((i * 0.5, x))
        now = i * 0.5
        recent = [c for t, c in samples if t >= now - 10.0]
        m, ref = w.moments(now, 0.0), CpuMoments.of(recent)
        assert (m.mean, m.variance, m.peak) == pytest.approx((ref.mean, ref.variance, ref.peak), abs=1e-9)
    assert w.moments(99.5, 10.5) is None  # its samples span 10 s: less than asked
    w.add(100.0, float("nan"))  # left out, as CpuMoments.of leaves it
    assert w.moments(100.0, 0.0).peak <= 1.0
