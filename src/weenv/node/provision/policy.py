"""What quota an environment should have, from what it used: pure decisions, no I/O.

:class:`EnvPolicy` keeps one environment's recent history and turns each new
:class:`Observation` (derived from two cgroup readings) into a wanted CPU quota
and memory limit.  The node's :mod:`~weenv.node.provision.arbiter` then fits
every environment's wants into the node; :mod:`~weenv.node.provision.controller`
does the reading and writing.

The rules and where they come from:

- **CPU quota from a high percentile of recent usage plus headroom.**  The
  Kubernetes Vertical Pod Autoscaler's recommender (``vertical-pod-autoscaler/
  pkg/recommender/logic/recommender.go``) sets the CPU target at the 90th
  percentile of a decaying usage histogram plus a 15 % safety margin; Google's
  Autopilot (Rzadca et al., "Autopilot: workload autoscaling at Google",
  EuroSys 2020, §3.1) uses the 95th (batch) / 98th (serving) percentile of a
  moving window.  Agent environments change within seconds, not days, so the
  window here is ``cpu_window_s`` (30 s) of exact samples, the percentile
  ``cpu_percentile`` (95) and the headroom 30 % (at least 0.1 core), above
  VPA's 15 % because a quota is enforced every 100 ms period, not averaged.
- **Raised at once when throttling appears.**  Usage measured under a quota
  cannot exceed it, so a percentile alone would never discover demand above
  the quota.  Throttled periods are that signal (Autopilot §3.1 and §5 report
  throttling as the cost of under-provisioning); the quota is multiplied by
  ``cpu_raise_factor`` (2) on the first pass that sees ``cpu_throttle_trigger``
  (5 %) of its periods throttled.
- **Lowered slowly, after a cool-down.**  Borg's reservations (Verma et al.,
  "Large-scale cluster management at Google with Borg", EuroSys 2015, §5.5)
  start at the limit, decay towards usage plus a safety margin only over
  300 s, and grow at once when usage exceeds them; VPA's updater only evicts
  for changes above 10 % and waits (``--min-replicas``, in-place resize
  cool-downs).  Here: nothing is lowered within ``cpu_cooldown_s`` (10 s) of a
  raise, then at most ``cpu_down_step`` (20 %) per pass.
- **Memory limit from the decayed peak of the working set plus headroom.**
  VPA's memory target is a percentile over per-interval *peaks* (its
  ``MemoryAggregationInterval``, 24 h) and its histogram decays with a
  half-life (24 h); Autopilot's memory recommender takes the maximum of the
  peaks in its window (§3.1), since running out of memory kills while running
  out of CPU only slows.  Here: peak = max(working set, previous peak × 2^(-dt /
  ``memory_half_life_s``)), limit = peak × 1.2, at least peak + 64 MiB.  The
  working set (usage minus inactive file pages, as cAdvisor and the kubelet's
  eviction count it) leaves out page cache the kernel can drop at the limit.
  While it is not idle, the limit stays at least at what its template's known
  peak (its usage profile) needs: admission holds that room anyway.
- **Raised at once near the limit or when the fail count moves.**  VPA bumps
  memory after an OOM kill (``OOMBumpUpRatio`` 1.2, ``OOMMinBumpUp`` 100 MB);
  acting before the kill is better, so the limit is multiplied by
  ``memory_raise_factor`` (1.5) when the working set reaches
  ``memory_raise_at`` (85 %) of it, when tasks wait at the limit (v1,
  OOM killer disabled) or when the fail count moves while the working set is
  above half of the limit (below that, failures are page-cache reclaim).
- **Lowered only after a hold time, in small steps; EBUSY means stay.**
  Borg's slow decay again: no lowering within ``memory_hold_s`` (30 s) of a
  raise or of pressure, then at most ``memory_down_step`` (10 %) per pass.  A
  lowering the kernel refuses (it could not reclaim) leaves the limit where it
  was and restarts the hold (:meth:`EnvPolicy.refused`).
- **The CFS quota is the ceiling; the elastic CPU value is a reservation**
  (``ProvisionConfig.cpu_quota_at="ceiling"``, the default).  CPU is
  compressible: a quota caps one environment but reserves nothing, so written
  as the CFS quota the elastic value only makes every burst after idle start
  throttled at the floor until a pass raises it (measured: p95 burst slowdown
  12.5x on 2 cores).  Instead, as Kubernetes does with requests and limits
  (the kubelet writes ``cpu.shares`` from the request and the CFS quota from
  the limit: ``pkg/kubelet/cm/helpers_linux.go``; VPA's
  ``controlledValues: RequestsOnly`` adjusts only the request) and as Borg
  does with reservations and limits (Verma et al. §5.5: the scheduler admits
  against reservations, tasks may use up to their limit), the CFS quota stays
  at the declared ceiling, contended cores are shared by CFS weight (equal),
  and the value computed here is what admission and the arbiter count against
  the node's capacity × overcommit.  ``"reservation"`` keeps the elastic value
  as the CFS quota (the rules above then throttle and unthrottle).  Memory is
  not compressible: its limit always follows the rules above.
- **Idle memory reclaimed, the limit kept** (``ProvisionConfig.reclaim``, on
  by default).  An environment that waits for its model holds page cache it
  will not touch for seconds; once it has used less than ``memory_idle_cpu``
  for ``memory_idle_after_s``, it wants what is above its working set plus
  ``memory_min_headroom`` reclaimed (:attr:`Want.reclaim_to`; the controller
  asks the kernel, ``memory_idle_step`` of it per pass), as Linux's proactive
  reclaim (``memory.reclaim``, used by Meta's Senpai and TMO, Weiner et al.,
  ASPLOS 2022) does without a limit.  Its limit follows the rules above, so a
  burst after idle finds its room and waits for nothing.
- **Floor and ceiling.**  Never below ``cpu_floor`` / ``memory_floor`` (capped
  at the ceiling), never above the environment's declared resources.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass

from weenv.node.cgroups import Usage
from weenv.node.provision.models import ProvisionConfig


@dataclass(frozen=True)
class Observation:
    """What happened in one environment between two cgroup readings."""

    at: float
    """Monotonic seconds of the later reading."""
    dt: float
    """Seconds between the readings."""
    cpu_cores: float
    """Average cores used."""
    throttled: float
    """Share of CFS periods throttled (0..1)."""
    memory_usage: int
    working_set: int
    failcnt_delta: int
    under_oom: bool
    oom_kills_delta: int
    pids: int

    @classmethod
    def between(cls, a: Usage, b: Usage) -> Observation:
        dt = max(b.at - a.at, 1e-6)
        periods = b.cpu_periods - a.cpu_periods
        throttled = (b.cpu_throttled_periods - a.cpu_throttled_periods) / periods if periods > 0 else 0.0
        return cls(
            at=b.at,
            dt=dt,
            cpu_cores=max(0.0, b.cpu_usage_s - a.cpu_usage_s) / dt,
            throttled=min(1.0, max(0.0, throttled)),
            memory_usage=b.memory_usage,
            working_set=b.memory_working_set,
            failcnt_delta=max(0, b.memory_failcnt - a.memory_failcnt),
            under_oom=b.memory_under_oom,
            oom_kills_delta=max(0, b.oom_kills - a.oom_kills),
            pids=b.pids_current,
        )


@dataclass(frozen=True)
class Want:
    """An environment's wanted quota and limit after one observation, and why."""

    cpu_quota: float
    memory_limit: int
    cpu_reason: str
    """``raise``, ``throttled``, ``lower``, ``stay`` (same for memory)."""
    memory_reason: str
    memory_pressure: bool
    """The working set is at the limit (growth refused would stall or kill it)."""
    reclaim_to: int | None = None
    """Idle: bytes its memory may be reclaimed down to (None: not idle, or reclaim off)."""


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile ``q`` (0..100] of ``values`` (0 if empty)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def clamp(x: float, lo: float, hi: float) -> float:
    return max(lo, min(hi, x))


class EnvPolicy:
    """One environment's controller state.

    ``cpu_ceiling`` (cores) and ``memory_ceiling`` (bytes) are its declared
    resources; ``cpu_quota`` / ``memory_limit`` what is applied now (the
    caller updates them with :meth:`applied` after writing them).
    """

    def __init__(self, cfg: ProvisionConfig, cpu_ceiling: float, memory_ceiling: int, now: float):
        self.cfg = cfg
        self.cpu_ceiling = cpu_ceiling
        self.memory_ceiling = memory_ceiling
        self.cpu_floor = min(cfg.cpu_floor, cpu_ceiling)
        self.memory_floor = min(cfg.memory_floor, memory_ceiling)
        self.cpu_quota = clamp(cfg.cpu_initial, self.cpu_floor, cpu_ceiling)
        self.memory_limit = int(clamp(cfg.memory_initial, self.memory_floor, memory_ceiling))
        self.cpu_samples: deque[tuple[float, float]] = deque()
        self._cpu_sorted: list[float] = []
        """The window's samples in order: its percentile without sorting at every pass."""
        self.peak_ws = 0.0
        self.last_cpu_raise = now
        self.last_memory_raise = now
        self.last_memory_pressure = -math.inf
        self.busy_at = now
        """Monotonic seconds of the last observation above ``memory_idle_cpu``."""
        self.known_peak = 0
        """Bytes: its template's peak working set (0: unknown), what a raise after idle goes to."""
        self.reclaim_to: int | None = None
        """Bytes its memory may be reclaimed down to now (idle), else None."""

    def start_from(self, cpu_p95: float, memory_peak: int) -> None:
        """Size a new environment from its template's usage profile: the
        reservation its p95 usage would give (``cpu_p95`` cores) and the limit
        its peak working set would (``memory_peak`` bytes; also the decayed
        peak the limit then follows), within floor and ceiling."""
        cfg = self.cfg
        self.cpu_quota = clamp(
            max(cpu_p95 * (1 + cfg.cpu_headroom), cpu_p95 + cfg.cpu_min_headroom), self.cpu_floor, self.cpu_ceiling
        )
        self.peak_ws = float(min(memory_peak, self.memory_ceiling))
        self.known_peak = int(self.peak_ws)
        self.memory_limit = self.memory_target()

    # --- CPU --------------------------------------------------------------------------
    def cpu_target(self) -> float:
        """Percentile of the window plus headroom, within floor and ceiling."""
        ordered = self._cpu_sorted
        p = ordered[max(1, math.ceil(self.cfg.cpu_percentile / 100 * len(ordered))) - 1] if ordered else 0.0
        want = max(p * (1 + self.cfg.cpu_headroom), p + self.cfg.cpu_min_headroom)
        return clamp(want, self.cpu_floor, self.cpu_ceiling)

    def _cpu(self, o: Observation) -> tuple[float, str]:
        cfg = self.cfg
        self.cpu_samples.append((o.at, o.cpu_cores))
        bisect.insort(self._cpu_sorted, o.cpu_cores)
        while self.cpu_samples and self.cpu_samples[0][0] < o.at - cfg.cpu_window_s:
            _, old = self.cpu_samples.popleft()
            del self._cpu_sorted[bisect.bisect_left(self._cpu_sorted, old)]
        target, cur = self.cpu_target(), self.cpu_quota
        if o.throttled >= cfg.cpu_throttle_trigger and o.throttled > 0 and cur < self.cpu_ceiling:
            return clamp(max(target, cur * cfg.cpu_raise_factor), self.cpu_floor, self.cpu_ceiling), "throttled"
        if target > cur * 1.01:
            return target, "raise"
        if target < cur * 0.99 and o.at - self.last_cpu_raise >= cfg.cpu_cooldown_s:
            return max(target, cur * (1 - cfg.cpu_down_step)), "lower"
        return cur, "stay"

    # --- memory -----------------------------------------------------------------------
    def memory_target(self, *, idle: bool = False) -> int:
        """Bytes: the limit its decayed peak working set needs plus headroom,
        within floor and ceiling; unless ``idle``, at least the one its
        template's known peak needs.  Admission holds room for that peak
        anyway (:meth:`memory_held`), so a limit below it frees nothing for
        others while busy, and made each burst towards the peak wait at the
        limit for a pass (measured: the 600 MiB burst of ``weenv bench
        provision`` 1.10x slower at the median than static's, 1.24x at worst)."""
        cfg = self.cfg
        peak = self.peak_ws if idle else max(self.peak_ws, float(self.known_peak))
        want = max(peak * (1 + cfg.memory_headroom), peak + cfg.memory_min_headroom)
        return int(clamp(want, self.memory_floor, self.memory_ceiling))

    def memory_held(self) -> int:
        """Bytes admission counts for it: its limit now, or the limit its
        template's known peak needs when that is more (memory is not
        compressible: a limit decayed while it idles is raised again at its
        next burst, and admission must leave room for that raise)."""
        cfg, peak = self.cfg, self.known_peak
        if not peak:
            return self.memory_limit
        want = max(peak * (1 + cfg.memory_headroom), peak + cfg.memory_min_headroom)
        return max(self.memory_limit, int(clamp(want, self.memory_floor, self.memory_ceiling)))

    def _memory(self, o: Observation) -> tuple[int, str, bool]:
        cfg = self.cfg
        decay = 0.5 ** (o.dt / cfg.memory_half_life_s)
        if o.cpu_cores > cfg.memory_idle_cpu:
            self.busy_at = o.at
        idle = cfg.reclaim and o.at - self.busy_at >= cfg.memory_idle_after_s
        self.peak_ws = max(float(o.working_set), self.peak_ws * decay)
        target, cur = self.memory_target(), self.memory_limit
        pressure = (
            o.under_oom
            or o.working_set >= cfg.memory_raise_at * cur
            or (o.failcnt_delta > 0 and o.working_set >= 0.5 * cur)
        )
        # idle: what it does not touch now goes back to the host, its limit stays
        self.reclaim_to = o.working_set + cfg.memory_min_headroom if idle and not pressure else None
        if pressure:
            self.last_memory_pressure = o.at
            if cur < self.memory_ceiling:
                grown = max(
                    target,
                    cur * cfg.memory_raise_factor,
                    o.working_set * (1 + cfg.memory_headroom),
                    self.known_peak * (1 + cfg.memory_headroom),
                )
                return int(clamp(grown, self.memory_floor, self.memory_ceiling)), "raise", True
            return cur, "stay", True
        if target > cur:
            return target, "raise", False
        held = o.at - max(self.last_memory_raise, self.last_memory_pressure) >= cfg.memory_hold_s
        if target < cur and held:
            return max(target, int(cur * (1 - cfg.memory_down_step))), "lower", False
        return cur, "stay", False

    # --- one pass -----------------------------------------------------------------------
    def observe(self, o: Observation) -> Want:
        """Update the history with ``o`` and return what this environment wants."""
        cpu, cpu_reason = self._cpu(o)
        memory, memory_reason, pressure = self._memory(o)
        return Want(cpu, memory, cpu_reason, memory_reason, pressure, self.reclaim_to)

    def applied(self, cpu_quota: float, memory_limit: int, now: float) -> None:
        """Record the quota and limit actually written."""
        if cpu_quota > self.cpu_quota * 1.001:
            self.last_cpu_raise = now
        if memory_limit > self.memory_limit:
            self.last_memory_raise = now
        self.cpu_quota, self.memory_limit = cpu_quota, memory_limit

    def refused(self, now: float) -> None:
        """The kernel refused to lower the memory limit: stay, and hold again."""
        self.last_memory_pressure = now
