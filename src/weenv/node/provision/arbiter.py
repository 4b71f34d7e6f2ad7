"""Fitting every environment's wants into the node: pure decisions, no I/O.

:func:`arbitrate` takes each environment's :class:`Claim` (what it has, what
its policy wants, its priority) and the node's budget and returns the grants,
the environments to freeze or thaw, whether new environments may be admitted,
and the events to log.  Invariants it keeps (tested in ``tests/test_provisioner.py``):

- the sum of granted CPU quotas (reservations when the CFS quota is the
  ceiling, see :mod:`~weenv.node.provision.policy`) is at most ``cpu_budget`` (capacity ×
  overcommit); lowerings are always granted; raises are granted by priority
  (then smallest first), partly if only part fits;
- the sum of granted memory limits is at most ``memory_budget`` whenever the
  current limits allow it (a limit above usage cannot be taken back by force:
  the kernel refuses a lowering below what it cannot reclaim);
- when memory growth cannot be granted or the host runs short, the node acts
  by policy rather than leaving the choice to the kernel's OOM killer, in this
  order: **stop admitting**; **freeze** the lowest-priority environments that
  need memory they cannot get (a frozen environment neither grows nor runs;
  it keeps its memory and is thawed, highest priority first, once its want
  fits) and, when the host's available memory is below the critical
  watermark, the lowest-priority running environment; **refuse growth** to
  the others (on cgroup v1 with the OOM killer disabled below the ceiling,
  they wait at their limit instead of being killed).

Borg (Verma et al., EuroSys 2015, §5.5) admits work against *reservations*
(observed usage plus margin) rather than limits and reclaims the difference;
admission here does the same with the elastic quotas (:func:`admits`), and
also bounds the node's predicted CPU peak, in which bursts of different
environments overlap rarely (:func:`predicted_cpu_peak`).
"""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass, field

from weenv.errors import InvalidInputError


@dataclass(frozen=True)
class Claim:
    env_id: str
    priority: int
    cpu_quota: float
    cpu_want: float
    cpu_floor: float
    memory_limit: int
    memory_want: int
    memory_pressure: bool
    working_set: int
    frozen: bool


@dataclass(frozen=True)
class Budget:
    cpu: float
    """Cores: capacity × overcommit."""
    memory: int
    """Bytes: capacity × overcommit."""
    memory_capacity: int
    memory_available: int
    """Host ``MemAvailable`` now."""
    low_watermark: float
    """Share of capacity under which admission stops."""
    critical_watermark: float
    """Share of capacity under which the lowest-priority environment is frozen."""
    disk: int | None = None
    """Bytes of declared disk limits the node holds: its disk's size × overcommit (None: not counted)."""


@dataclass
class Decision:
    cpu: dict[str, float] = field(default_factory=dict)
    memory: dict[str, int] = field(default_factory=dict)
    freeze: list[str] = field(default_factory=list)
    thaw: list[str] = field(default_factory=list)
    admitting: bool = True
    events: list[tuple[str | None, str, str]] = field(default_factory=list)
    """``(env_id, kind, message)``."""


def _by_priority(claims: list[Claim], extra) -> list[Claim]:
    return sorted(claims, key=lambda c: (-c.priority, extra(c), c.env_id))


def _fit_cpu(claims: list[Claim], budget: float) -> dict[str, float]:
    base = {c.env_id: min(c.cpu_quota, c.cpu_want) for c in claims}
    total = sum(base.values())
    if total > budget:  # over already (the budget shrank): scale above the floors
        floors = sum(c.cpu_floor for c in claims)
        k = max(0.0, budget - floors) / max(total - floors, 1e-9)
        return {c.env_id: c.cpu_floor + (base[c.env_id] - c.cpu_floor) * min(1.0, k) for c in claims}
    left = budget - total
    grants = dict(base)
    for c in _by_priority([c for c in claims if c.cpu_want > base[c.env_id]], lambda c: c.cpu_want - c.cpu_quota):
        extra = min(c.cpu_want - base[c.env_id], left)
        grants[c.env_id] += extra
        left -= extra
    return grants


def arbitrate(claims: list[Claim], budget: Budget) -> Decision:
    """Grants, freezes, thaws and admission for one pass (see the module doc)."""
    d = Decision()
    d.cpu = _fit_cpu(claims, budget.cpu)

    base = {c.env_id: min(c.memory_limit, c.memory_want) for c in claims}
    left = budget.memory - sum(base.values())
    d.memory = dict(base)
    short: list[Claim] = []
    growers = [c for c in claims if c.memory_want > base[c.env_id]]
    for c in _by_priority(growers, lambda c: c.memory_want - c.memory_limit):
        extra = max(0, min(c.memory_want - base[c.env_id], left))
        d.memory[c.env_id] += extra
        left -= extra
        if d.memory[c.env_id] < c.memory_want and c.memory_pressure:
            short.append(c)

    critical = budget.memory_available < budget.critical_watermark * budget.memory_capacity
    low = budget.memory_available < budget.low_watermark * budget.memory_capacity
    if short or low:
        d.admitting = False
        why = (
            f"growth of {', '.join(c.env_id for c in short)} does not fit"
            if short
            else f"host memory available {budget.memory_available >> 20} MiB is below the low watermark"
        )
        d.events.append((None, "shortage", f"memory short: {why}; admission stopped"))

    running = [c for c in claims if not c.frozen]
    if short:
        top = max(c.priority for c in running) if running else 0
        for c in short:
            if c.priority < top and not c.frozen:
                d.freeze.append(c.env_id)
                d.events.append(
                    (
                        c.env_id,
                        "freeze",
                        f"frozen: needs {c.memory_want >> 20} MiB, "
                        f"granted {d.memory[c.env_id] >> 20} MiB, priority {c.priority} < {top}",
                    )
                )
            elif not c.frozen:
                d.events.append(
                    (
                        c.env_id,
                        "refused",
                        f"growth refused: wants {c.memory_want >> 20} MiB, granted {d.memory[c.env_id] >> 20} MiB",
                    )
                )
    if critical and running:
        victim = min(running, key=lambda c: (c.priority, -c.working_set, c.env_id))
        if victim.env_id not in d.freeze:
            d.freeze.append(victim.env_id)
            d.events.append(
                (
                    victim.env_id,
                    "freeze",
                    f"frozen: host memory available "
                    f"{budget.memory_available >> 20} MiB is below the critical watermark",
                )
            )

    if not low:  # thaw, highest priority first, those whose memory now fits
        short_ids = {c.env_id for c in short}
        for c in _by_priority([c for c in claims if c.frozen], lambda c: c.memory_want):
            if c.env_id not in short_ids and d.memory[c.env_id] >= c.memory_want:
                d.thaw.append(c.env_id)
                d.events.append((c.env_id, "thaw", "thawed: its memory fits again"))
                break  # one per pass: let the node settle
    return d


@dataclass(frozen=True)
class CpuMoments:
    """One environment's CPU usage as a random variable: per-pass cores used."""

    mean: float
    """Cores."""
    variance: float
    """Cores squared."""
    peak: float
    """Cores: the most it used in the window (observed), or its ceiling (prior)."""

    @classmethod
    def of(cls, samples: list[float]) -> CpuMoments:
        """From per-pass usage samples (cores, at least one, else
        :class:`InvalidInputError`); the population variance.  Samples that are
        not finite are left out and negative ones count as 0 (a NaN would make
        the predicted peak NaN, which every admission check lets through)."""
        if not samples:
            raise InvalidInputError("CPU moments need at least one usage sample")
        samples = [max(0.0, x) for x in samples if math.isfinite(x)]
        if not samples:
            return cls(0.0, 0.0, 0.0)
        n = len(samples)
        mean = sum(samples) / n
        return cls(mean, sum((x - mean) ** 2 for x in samples) / n, max(samples))

    @classmethod
    def prior(cls, ceiling: float, duty: float) -> CpuMoments:
        """Busy at its ceiling ``duty`` of the time, idle otherwise (Bernoulli)."""
        return cls(ceiling * duty, ceiling**2 * duty * (1 - duty), ceiling)


class CpuWindow:
    """Per-pass CPU usage samples (cores) of the last ``window_s`` seconds, with
    their count, sum, sum of squares and maximum kept as samples come and go,
    so the moments cost O(1) however long the window (admission asks every
    environment's at every create).  Thread-safe."""

    def __init__(self, window_s: float):
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque()  # (t, cores)
        self._top: deque[tuple[float, float]] = deque()  # decreasing cores: the window's maximum first
        self._sum = self._squares = 0.0
        self._lock = threading.Lock()

    def add(self, t: float, cores: float) -> None:
        """Add the sample ``cores`` taken at ``t`` (seconds, not decreasing);
        non-finite samples are left out, negative ones count as 0 (as :meth:`CpuMoments.of`)."""
        if not math.isfinite(cores):
            return
        cores = max(0.0, cores)
        with self._lock:
            self._samples.append((t, cores))
            self._sum += cores
            self._squares += cores * cores
            while self._top and self._top[-1][1] <= cores:
                self._top.pop()
            self._top.append((t, cores))
            self._expire(t)

    def _expire(self, now: float) -> None:
        start = now - self.window_s
        while self._samples and self._samples[0][0] < start:
            _, x = self._samples.popleft()
            self._sum -= x
            self._squares -= x * x
        while self._top and self._top[0][0] < start:
            self._top.popleft()
        if not self._samples:
            self._sum = self._squares = 0.0

    def moments(self, now: float, min_span_s: float) -> CpuMoments | None:
        """The window's moments at ``now`` (population variance), or None while
        its samples span less than ``min_span_s`` seconds."""
        with self._lock:
            self._expire(now)
            if not self._samples or now - self._samples[0][0] < min_span_s:
                return None
            n = len(self._samples)
            mean = max(0.0, self._sum / n)
            return CpuMoments(mean, max(0.0, self._squares / n - mean * mean), self._top[0][1])


def predicted_cpu_peak(envs: list[CpuMoments], sigmas: float) -> float:
    """The node's CPU peak (cores) predicted from its environments' usage:
    Σ mean + ``sigmas`` × √(Σ variance), capped at Σ peak.  Independent
    bursts rarely all coincide, so the peak of the sum grows like √n, not n:
    the N-sigma predictor, bounded by the sum of the individual peaks (the
    "max" predictor), of Bashir et al., "Take it to the limit: peak
    prediction-driven resource overcommitment in datacenters" (EuroSys 2021)."""
    if not envs:
        return 0.0
    mean = sum(e.mean for e in envs)
    spread = sigmas * sum(e.variance for e in envs) ** 0.5
    return min(sum(e.peak for e in envs), mean + spread)


def burst_contention(envs: list[CpuMoments], capacity: float, *, overlap: float = 2.0) -> float:
    """The probability (0..1) that a burst meets contention: the largest, over
    the environments ``i``, chance that while ``i`` bursts the others' bursts
    use more than ``capacity`` minus ``i``'s own burst cores.

    Each environment is on/off: busy at its ceiling (``peak`` of its
    :class:`CpuMoments`, the prior's ceiling or the most it used) a share
    ``mean / peak`` of the time (its *duty*), idle otherwise; environments are
    independent.  Two on/off processes with busy periods of similar length
    ``b`` and duties ``d`` overlap when one starts within ``b`` of the other's
    start, so another environment ``j`` is busy at some moment of ``i``'s burst
    with probability about ``overlap`` × ``d_j`` (2: the interval-overlap
    window is two bursts long).  The count of busy others is then a
    Poisson-binomial variable, computed exactly (a convolution over the
    environments, loads rounded to 0.01 core).

    The N-sigma predictor (:func:`predicted_cpu_peak`, Bashir et al.,
    EuroSys 2021) bounds the share of *time* the node is over its cores; a
    burst's latency depends on the share of *bursts* that meet others, which
    is larger (bursts overlap exactly when bursts happen): of 1-core
    environments busy 10 % of the time, 5 fit on 2 cores under a 2-sigma
    peak, while 3 already make 4 % of bursts share a core and 4 make 10 %.  Bounding this
    probability by ``admission_burst_risk`` is the admission of a latency
    objective: a p95 burst slowdown near 1 needs it well below 5 %.
    """
    if len(envs) < 2:
        return 0.0
    cents = [round(min(e.peak, capacity) * 100) for e in envs]  # loads in 0.01 core, as before
    duty = [min(1.0, overlap * e.mean / e.peak) if e.peak > 0 else 0.0 for e in envs]
    # The others' load is counted in quanta of the loads' common divisor (exact), coarsened
    # to at most MAX_LOAD_BINS quanta below the capacity, loads rounded up (conservative).
    step = math.gcd(*[c for c, q in zip(cents, duty) if c > 0 and q > 0] or [1])
    step = max(step, math.ceil(capacity * 100 / MAX_LOAD_BINS))
    quanta = [-(-c // step) for c in cents]
    worst = 0.0
    # The worst burst of a given size is the one of least duty (the others it meets are the most
    # likely busy): one environment per size is enough, the exact maximum over all of them.
    least: dict[int, int] = {}
    for i, c in enumerate(cents):
        if c not in least or duty[i] < duty[least[c]]:
            least[c] = i
    for i in least.values():
        room = max(-1, math.floor((capacity - cents[i] / 100 + 1e-9) * 100 / step + 1e-9))
        if room < 0:  # its burst alone exceeds the cores (cannot happen within the capacity)
            return 1.0
        dist = [1.0] + [0.0] * (room + 1)  # others' load in quanta -> probability; dist[room + 1]: beyond
        for j in range(len(envs)):
            if j != i and duty[j] > 0.0 and quanta[j] > 0:
                _add_on_off(dist, quanta[j], duty[j], room)
        worst = max(worst, dist[room + 1])
    return worst


MAX_LOAD_BINS = 2048
"""Quanta of load :func:`burst_contention` counts below a node's capacity
(one per 0.01 core up to 20 cores; coarser above, loads rounded up)."""


def _add_on_off(dist: list[float], load: int, q: float, room: int) -> None:
    """Convolve ``dist`` (load in quanta -> probability, ``dist[room + 1]`` all
    loads beyond ``room``) in place with one environment busy at ``load``
    quanta with probability ``q``."""
    p = 1.0 - q
    dist[room + 1] += q * sum(dist[max(0, room - load + 1) : room + 1])
    for k in range(room, load - 1, -1):
        dist[k] = dist[k] * p + dist[k - load] * q
    for k in range(min(load, room + 1)):
        dist[k] *= p


class Refusal(str):
    """Why admission refuses (the text), and which ``objective`` refused:
    ``disk``, ``shortage``, ``cpu`` (the reservations), ``peak``, ``burst``
    (the latency objective), ``memory`` (the limits) or ``host`` (its available memory)."""

    objective: str

    def __new__(cls, objective: str, text: str) -> Refusal:
        r = super().__new__(cls, text)
        r.objective = objective
        return r


def admits(
    *,
    cpu_sum: float,
    memory_sum: int,
    cpu_new: float,
    memory_new: int,
    budget: Budget,
    admitting: bool,
    cpu_peak: float | None = None,
    cpu_peak_budget: float | None = None,
    burst_risk: float | None = None,
    burst_risk_budget: float | None = None,
    disk_sum: int = 0,
    disk_new: int = 0,
) -> Refusal | None:
    """Why a new environment asking ``cpu_new`` cores and ``memory_new`` bytes
    cannot be admitted now, or None if it can.  ``cpu_sum`` / ``memory_sum``:
    the quotas and limits held now (elastic: following observed usage;
    static: the declared resources).  ``cpu_peak``: the node's predicted CPU
    peak with the new environment (:func:`predicted_cpu_peak`), checked
    against ``cpu_peak_budget`` cores when both are given.  ``burst_risk``:
    the probability that a burst meets contention with the new environment
    (:func:`burst_contention`), checked against ``burst_risk_budget``.
    ``disk_sum`` / ``disk_new``: declared disk limits (bytes) held now and
    asked, checked against ``budget.disk``."""
    if budget.disk is not None and disk_sum + disk_new > budget.disk:
        return Refusal(
            "disk",
            f"disk limits would reach {(disk_sum + disk_new) / (1 << 30):.1f} GiB "
            f"of the node's {budget.disk / (1 << 30):.1f} GiB disk "
            f"(declare a smaller disk_bytes, or set WEENV_DISK_BYTES / WEENV_DISK_OVERCOMMIT)",
        )
    if not admitting:
        return Refusal("shortage", "memory is short on this node (admission stopped)")
    if cpu_sum + cpu_new > budget.cpu + 1e-9:
        return Refusal("cpu", f"CPU quotas would reach {cpu_sum + cpu_new:.2f} of {budget.cpu:.2f} cores")
    if cpu_peak is not None and cpu_peak_budget is not None and cpu_peak > cpu_peak_budget + 1e-9:
        return Refusal(
            "peak",
            f"the predicted CPU peak (bursts overlapping) would reach {cpu_peak:.2f} of {cpu_peak_budget:.2f} cores",
        )
    if burst_risk is not None and burst_risk_budget is not None and burst_risk > burst_risk_budget + 1e-12:
        return Refusal(
            "burst", f"{burst_risk:.1%} of bursts would meet others beyond the cores (at most {burst_risk_budget:.1%})"
        )
    if memory_sum + memory_new > budget.memory:
        return Refusal(
            "memory", f"memory limits would reach {(memory_sum + memory_new) >> 20} MiB of {budget.memory >> 20} MiB"
        )
    if budget.memory_available - memory_new < budget.low_watermark * budget.memory_capacity:
        return Refusal("host", f"host memory available is {budget.memory_available >> 20} MiB")
    return None
