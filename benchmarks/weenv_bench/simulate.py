"""``weenv bench provision --simulate``: recorded usage traces replayed through
the real provisioner on a modelled node of C cores and M GiB.

**Traces** (:func:`parse_traces`): per environment, per sample (``interval_s``
apart, 1 s as the static node samples them), the cores it used and its working
set (bytes), as ``weenv bench provision`` records them in its JSON
(``traces``: the *static* run's are the demand, each environment having had its
declared cores, uncontended).  A trace with a gap (two samples more than 1.5 ×
``interval_s`` apart), a negative or non-finite value, or samples of unequal
lengths is an :class:`~weenv.errors.InvalidInputError`.

**What runs for real**: :class:`~weenv.node.provision.Provisioner` (admission,
policy, arbiter, usage profiles, its :meth:`~weenv.node.provision.Provisioner.poll`
loop), imported, on :class:`SimCgroup` cgroups, a :class:`Clock` advanced step
by step (nothing sleeps) and a modelled ``/proc/meminfo``.

**What is modelled**: the node.  Each sample of a trace is an environment's
script for ``interval_s`` of wall time: its CPU work (cores × ``interval_s``
core-seconds) runs first at up to its CFS quota (a command runs flat out), then
it idles for the rest of the sample (the agent thinks), so a contended burst
lasts longer and pushes the rest of its trace later (a closed loop, as an
agent waits for its command).  Every step (``step_s``, 0.1 s) the cores are
shared max-min fairly (CFS's equal weights) among the environments running
work.  A *burst* is a run of samples above :data:`BUSY_SHARE` of the declared
cores; its *slowdown* is the time its work took over the time it takes alone.
Memory: an environment whose working set exceeds its limit waits (cgroup v1
with the OOM killer disabled below the ceiling, as the node sets it) until the
controller raises the limit (an urgent pass, as the node's 0.1 s check does);
beyond its declared memory it is OOM-killed (counted; the sample's memory
capped there).  A frozen environment makes no progress.  **Background load**
(:func:`parse_background`): the cores the real machine's other work used, per
second of the run (``weenv bench provision`` records it per mode: the host's
busy cores in ``/proc/stat`` minus its environments' own CPU, so the other
tenants of a shared machine and the node's own process).  Each step it
competes for the cores as ``ceil(b)`` tasks of ``b / ceil(b)`` cores each
(``b`` cores busy need at least that many tasks; CFS shares the cores
max-min fairly among them and the environments' groups), so what it used
beside idle environments is not taken from a burst that needs a core.

As in the real benchmark a scheduler asks for more environments every second
(one per 8 cores at once: a trainer asks a large node for more) up to
``max_envs``, for ``duration_s``; environment ``i`` replays trace ``i mod n``
from its own offset, looped.  Elastic admission starts from the template's
usage profile learned from the traces (:func:`~weenv.node.provision.profiles.summarize`),
as the real run's elastic node starts from the profile its static run taught.

Cost: O(steps × environments) for the node, O(passes × environments) for the
controller (its admission is incremental: see
:class:`~weenv.node.provision.arbiter.CpuWindow`); a 64-core node for 300 s
takes seconds.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass, field

from weenv.errors import CapacityError, InvalidInputError, LimitRefusedError
from weenv.formats.manifest import Resources
from weenv.node.cgroups import Pressure, Usage
from weenv.node.provision import ProvisionConfig, Provisioner
from weenv.node.provision.profiles import TemplateProfiles, summarize

GIB = 1 << 30
BUSY_SHARE = 0.1
"""A sample using more than this share of the declared cores is part of a
burst.  At 0.2 the short bursts were not counted: a ``compile`` of ``weenv
bench provision`` (0.13-0.19 s of one core) lands in one 1-s sample as 0.13-0.19
cores, so a recorded run's replay counted 22 bursts where the real run timed 36
(12 of 18 in static), and left out the kind whose slowdowns set the real p95;
at 0.1 it counts 33 of 36.  The light commands (``cat``, ``grep``: milliseconds)
stay below 0.05."""
QUIET_CORES = 0.5
"""Background (cores busy outside the environments) below which a burst ran on a quiet machine."""
MIN_QUIET_BURSTS = 10
"""Quiet static bursts a calibration needs to take its noise from them (:func:`node_spread`)."""
TEMPLATE = "sha256:" + "5" * 64
MAX_TRACE_POINTS = 1 << 20
"""Samples per trace at most (a day at 0.1 s); more is refused unread."""


@dataclass(frozen=True)
class Trace:
    """One environment's recorded usage."""

    interval_s: float
    """Seconds between samples."""
    cpu: tuple[float, ...]
    """Cores used on average over each sample."""
    working_set: tuple[int, ...]
    """Bytes at each sample."""


def parse_traces(data: object) -> list[Trace]:
    """Traces from a JSON value ``{env_id: {"interval_s": s, "t": [...],
    "cpu": [...], "working_set": [...]}}`` (``t``: seconds, increasing by about
    ``interval_s``).  Raises :class:`InvalidInputError`, naming the environment
    and the sample, for a gap, a negative or non-finite value, unequal
    lengths, a trace of fewer than 2 or more than :data:`MAX_TRACE_POINTS`
    samples, or no trace at all."""
    if not isinstance(data, dict) or not data:
        raise InvalidInputError("no usage trace to replay (expected {env_id: {interval_s, t, cpu, working_set}})")
    out = []
    for env_id, tr in data.items():
        if not isinstance(tr, dict) or not {"interval_s", "t", "cpu", "working_set"} <= tr.keys():
            raise InvalidInputError(f"trace of {env_id}: needs interval_s, t, cpu and working_set")
        dt, t, cpu, ws = tr["interval_s"], tr["t"], tr["cpu"], tr["working_set"]
        if not (_number(dt) and dt > 0):
            raise InvalidInputError(f"trace of {env_id}: interval_s {dt!r} is not a positive number")
        if not all(isinstance(x, list) for x in (t, cpu, ws)) or not len(t) == len(cpu) == len(ws):
            raise InvalidInputError(f"trace of {env_id}: t, cpu and working_set must be lists of one length")
        if not 2 <= len(t) <= MAX_TRACE_POINTS:
            raise InvalidInputError(f"trace of {env_id}: {len(t)} samples (2 to {MAX_TRACE_POINTS})")
        for i, (a, c, w) in enumerate(zip(t, cpu, ws)):
            if not (_number(a) and _number(c) and _number(w)) or c < 0 or w < 0:
                raise InvalidInputError(
                    f"trace of {env_id}: sample {i} has a negative or non-finite value "
                    f"(t {a!r}, cpu {c!r}, working_set {w!r})"
                )
            if i and not 0 < a - t[i - 1] <= 1.5 * dt:
                raise InvalidInputError(
                    f"trace of {env_id}: a gap of {a - t[i - 1]:.2f} s before sample {i} (samples are {dt:g} s apart)"
                )
        out.append(Trace(float(dt), tuple(float(c) for c in cpu), tuple(int(w) for w in ws)))
    return out


MAX_BACKGROUND_POINTS = 1 << 20
"""Samples of background load at most (12 days at 1 s)."""


def parse_background(data: object, cores: float) -> tuple[float, list[float]] | None:
    """Background load from a JSON value ``{"interval_s": s, "cores": [...]}``
    (cores busy outside the environments, per sample from the run's start), or
    None for None.  Each sample is capped at ``cores``.  Raises
    :class:`InvalidInputError` for a non-positive interval, a negative or
    non-finite sample, or more than :data:`MAX_BACKGROUND_POINTS` samples."""
    if data is None:
        return None
    if not isinstance(data, dict) or not _number(data.get("interval_s")) or data["interval_s"] <= 0:
        raise InvalidInputError("background load needs a positive interval_s and a list of cores")
    xs = data.get("cores")
    if not isinstance(xs, list) or len(xs) > MAX_BACKGROUND_POINTS:
        raise InvalidInputError(f"background load: cores must be a list of at most {MAX_BACKGROUND_POINTS} samples")
    for i, x in enumerate(xs):
        if not _number(x) or x < 0:
            raise InvalidInputError(f"background load: sample {i} ({x!r}) is negative or not a finite number")
    return float(data["interval_s"]), [min(float(x), cores) for x in xs]


def _number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def traces_of(history: dict[str, list[dict]], interval_s: float) -> dict[str, dict]:
    """The ``traces`` JSON of one mode from its environments' provisioner
    history (points with ``t``, ``cpu_used``, ``working_set``); environments
    with fewer than 2 points are left out."""
    return {
        env_id: {
            "interval_s": interval_s,
            "t": [round(p["t"], 3) for p in pts],
            "cpu": [round(p["cpu_used"], 4) for p in pts],
            "working_set": [p["working_set"] for p in pts],
        }
        for env_id, pts in history.items()
        if len(pts) >= 2
    }


class Clock:
    """Simulated seconds: ``time`` and ``monotonic`` both read :attr:`now`."""

    def __init__(self, now: float = 1_000_000.0):
        self.now = now

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now


@dataclass
class SimEnv:
    """One modelled environment replaying ``trace`` from sample ``pos``."""

    trace: Trace
    declared: Resources
    pos: int
    quota: float = 0.0
    """Cores (its CFS quota)."""
    limit: int = 1 << 62
    frozen: bool = False
    cpu_s: float = 0.0
    oom_kills: int = 0
    waiting: bool = False
    work: float = 0.0
    """Core-seconds of the current sample still to run."""
    idle: float = 0.0
    """Seconds of the current sample's idle part still to pass."""
    ws: int = 0
    busy: bool = False
    burst_alone: float = 0.0
    """Seconds the current burst's work takes alone (at the declared cores)."""
    burst_took: float = 0.0
    slowdowns: list[float] = field(default_factory=list)

    phase: float = 0.0
    """Seconds idle before its first sample (environments' samples do not start together)."""

    def __post_init__(self) -> None:
        self.quota = self.declared.cpus
        self.ws = min(self.trace.working_set[self.pos % len(self.trace.cpu)], self.declared.memory_bytes)
        self.pos -= 1  # its first sample starts when the phase has passed
        self.idle = self.phase

    def _sample(self) -> None:
        tr, ceiling = self.trace, self.declared.cpus
        i = self.pos % len(tr.cpu)
        c = min(tr.cpu[i], ceiling)
        self.work = c * tr.interval_s
        self.idle = tr.interval_s - self.work / ceiling
        busy = c > BUSY_SHARE * ceiling
        if not busy and self.busy and self.burst_alone > 0:
            self.slowdowns.append(self.burst_took / self.burst_alone)
            self.burst_alone = self.burst_took = 0.0
        self.busy = busy
        if busy:
            self.burst_alone += self.work / ceiling
        self.ws = tr.working_set[i]
        if self.ws > self.declared.memory_bytes:
            self.oom_kills += 1
            self.ws = self.declared.memory_bytes

    def rate(self) -> float:
        """Cores it runs at when it has work and nothing contends."""
        return min(self.quota, self.declared.cpus)

    def demand(self, dt: float) -> float:
        """Cores it can use over the next ``dt`` seconds (its work may end sooner)."""
        self.waiting = self.ws > self.limit
        if self.frozen or self.waiting or self.work <= 0:
            return 0.0
        return min(self.rate(), self.work / dt)

    def advance(self, wanted: float, granted: float, dt: float) -> None:
        """Let ``dt`` seconds pass with ``granted`` of the ``wanted`` cores
        (:meth:`demand`): given all, its work runs at :meth:`rate` (and may end
        within the step); given less, it runs the whole step at ``granted``."""
        if self.frozen or self.waiting:
            if self.busy:
                self.burst_took += dt
            return
        left = dt
        if self.work > 0 and wanted > 0:
            used = min(self.work, granted * dt)
            spent = used / self.rate() if granted >= wanted * (1 - 1e-9) else dt
            self.work -= used
            self.cpu_s += used
            if self.busy:
                self.burst_took += spent
            left -= spent
            if self.work > 1e-9:
                return
            self.work = 0.0
        self.idle -= left
        if self.idle <= 1e-9:
            self.pos += 1
            self._sample()

    def working_set(self) -> int:
        return min(self.ws, self.limit)


class SimCgroup:
    """What the provisioner reads and writes, for one :class:`SimEnv`."""

    def __init__(self, env: SimEnv, clock: Clock):
        self.env, self.clock = env, clock

    def usage(self) -> Usage:
        e = self.env
        ws = e.working_set()
        return Usage(
            at=self.clock.now,
            cpu_usage_s=e.cpu_s,
            cpu_periods=0,
            cpu_throttled_periods=0,
            cpu_throttled_s=0.0,
            memory_usage=ws,
            memory_working_set=ws,
            memory_peak=ws,
            memory_failcnt=0,
            memory_under_oom=e.ws > e.limit,
            oom_kills=e.oom_kills,
            pids_current=1,
            pids_failcnt=0,
        )

    def pressure(self) -> Pressure:
        return Pressure(0, 0, self.env.ws > self.env.limit)

    def set_cpu(self, quota: float | None) -> None:
        self.env.quota = self.env.declared.cpus if quota is None else quota

    def set_memory_limit(self, limit: int | None) -> None:
        limit = 1 << 62 if limit is None else int(limit)
        if limit < self.env.working_set():  # the kernel cannot reclaim a working set
            raise LimitRefusedError(f"memory limit {limit} below the working set")
        self.env.limit = limit

    def reclaim(self, nbytes: int) -> None:
        """Nothing to take: a modelled environment's memory is its working set."""

    def set_oom_killer(self, enabled: bool) -> bool:
        return True

    def set_pids_limit(self, limit: int | None) -> None:
        pass

    def freeze(self) -> None:
        self.env.frozen = True

    def thaw(self) -> None:
        self.env.frozen = False


def share(demands: list[float], cores: float) -> list[float]:
    """Max-min fair shares of ``cores`` among ``demands`` (cores each, ≥ 0):
    the smallest demands are met first, the rest split what is left equally."""
    grants = [0.0] * len(demands)
    todo = sorted((d, i) for i, d in enumerate(demands) if d > 0)
    left, n = cores, len(todo)
    for d, i in todo:
        g = min(d, left / n)
        grants[i] = g
        left -= g
        n -= 1
    return grants


def profiles_from(traces: list[Trace], declared: Resources, template: str = TEMPLATE) -> TemplateProfiles:
    """The template's usage profile as the environments that recorded ``traces``
    taught it (in memory)."""
    profiles = TemplateProfiles()
    for tr in traces:
        seen = summarize(template, declared.cpus, list(tr.cpu), list(tr.working_set), tr.interval_s)
        if seen is not None:
            profiles.record(seen)
    return profiles


def simulate(
    traces: list[Trace],
    *,
    cores: float,
    memory: int,
    config: ProvisionConfig,
    declared: Resources,
    max_envs: int,
    duration_s: float,
    step_s: float = 0.1,
    learn: bool = True,
    background: tuple[float, list[float]] | None = None,
) -> dict:
    """Replay ``traces`` on a node of ``cores`` and ``memory`` bytes (see the
    module doc); returns ``envs`` (most held), ``mean_envs``, ``bursts``,
    ``slowdowns`` (each burst's), ``p95_burst_slowdown``,
    ``bursts_slowed_over_10pct`` (share), ``oom_kills``, ``refusals``.
    ``learn``: start the template from the traces' usage profile.
    ``background``: ``(interval_s, cores)`` of :func:`parse_background`,
    the cores other work takes from the node each step (after its last
    sample: none)."""
    if not traces:
        raise InvalidInputError("no usage trace to replay")
    if not (cores > 0 and memory > 0 and declared.cpus <= cores and declared.memory_bytes <= memory):
        raise InvalidInputError(
            f"a node of {cores:g} cores and {memory / GIB:.1f} GiB cannot hold environments "
            f"of {declared.cpus:g} cores and {declared.memory_bytes / GIB:.1f} GiB"
        )
    clock = Clock()
    envs: list[SimEnv] = []
    cfg = config.model_copy(update={"cpu_capacity": float(cores), "memory_capacity": int(memory)})

    def host_memory() -> dict[str, int]:
        return {"MemTotal": int(memory), "MemAvailable": max(0, int(memory) - sum(e.working_set() for e in envs))}

    profiles = profiles_from(traces, declared) if learn else TemplateProfiles()
    cgroups: dict[str, SimCgroup] = {}
    prov = Provisioner(cfg, open_cgroup=cgroups.__getitem__, profiles=profiles, clock=clock, host_memory=host_memory)
    per_admit = max(1, round(cores / 8))
    admit_every = max(1, round(1.0 / step_s))
    held, refusals = [], 0
    for step in range(int(round(duration_s / step_s))):
        if step % admit_every == 0:
            for _ in range(per_admit):
                if len(envs) >= max_envs:
                    break
                env_id = f"sim{len(envs)}"
                try:
                    prov.reserve(env_id, declared, template=TEMPLATE)
                except CapacityError:
                    refusals += 1
                    break
                tr = traces[len(envs) % len(traces)]
                e = SimEnv(
                    tr,
                    declared,
                    pos=(len(envs) // len(traces) * 37) % len(tr.cpu),
                    phase=(len(envs) * 0.618034) % 1.0 * tr.interval_s,
                )
                envs.append(e)
                cgroups[env_id] = SimCgroup(e, clock)
                prov.attach(env_id, env_id)
            held.append(len(envs))
        wants = [e.demand(step_s) for e in envs]
        others: list[float] = []
        if background is not None:
            k = int(step * step_s / background[0])
            b = background[1][k] if k < len(background[1]) else 0.0
            others = [b / math.ceil(b)] * math.ceil(b) if b > 0 else []
        for e, w, g in zip(envs, wants, share(wants + others, cores)):
            e.advance(w, g, step_s)
        clock.now += step_s
        prov.poll()
    for i in range(len(envs)):
        prov.detach(f"sim{i}")
    slow = [s for e in envs for s in e.slowdowns]
    return {
        "envs": len(envs),
        "mean_envs": statistics.fmean(held) if held else 0.0,
        "bursts": len(slow),
        "slowdowns": slow,
        "p95_burst_slowdown": p95(slow),
        "bursts_slowed_over_10pct": (sum(s > 1.1 for s in slow) / len(slow)) if slow else 0.0,
        "oom_kills": sum(e.oom_kills for e in envs),
        "refusals": refusals,
    }


def p95(values: list[float]) -> float | None:
    """Nearest-rank 95th percentile (None if empty)."""
    s = sorted(values)
    return s[min(len(s) - 1, int(0.95 * len(s)))] if s else None


def p95_draws(values: list[float], draws: int = 2000, *, seed: int = 0) -> list[float]:
    """The :func:`p95` of each of ``draws`` bootstrap resamples of ``values``
    (as many, drawn with replacement; seeded, so a run's JSON reproduces):
    the p95's spread by chance alone.  [] if ``values`` is empty."""
    if not values:
        return []
    rng = random.Random(seed)
    return [p95(rng.choices(values, k=len(values))) for _ in range(draws)]


def p95_interval(values: list[float], draws: int = 2000) -> list[float] | None:
    """The 10th and 90th percentiles of :func:`p95_draws` (None if ``values`` is empty)."""
    r = sorted(p95_draws(values, draws))
    return [r[int(0.1 * draws)], r[int(0.9 * draws)]] if r else None


def compare(
    traces: list[Trace],
    *,
    cores: float,
    memory: int,
    elastic: ProvisionConfig,
    declared: Resources,
    max_envs: int,
    duration_s: float,
    step_s: float = 0.1,
    background: dict[str, tuple[float, list[float]] | None] | None = None,
) -> dict:
    """Static and elastic side by side on one modelled node: the summary's
    ``sim`` fields for it (``density_ratio``, ``p95_burst_slowdown``,
    ``bursts_slowed_over_10pct``, ``oom_kills``: elastic's) and each mode's
    figures (without the per-burst list).  ``background``: per mode
    (``static``, ``elastic``), its background load (:func:`simulate`)."""
    bg = background or {}
    static = simulate(
        traces,
        cores=cores,
        memory=memory,
        config=ProvisionConfig(mode="static", cpu_overcommit=1.0),
        declared=declared,
        max_envs=max_envs,
        duration_s=duration_s,
        step_s=step_s,
        background=bg.get("static"),
    )
    el = simulate(
        traces,
        cores=cores,
        memory=memory,
        config=elastic,
        declared=declared,
        max_envs=max_envs,
        duration_s=duration_s,
        step_s=step_s,
        background=bg.get("elastic"),
    )
    brief = {m: {k: v for k, v in r.items() if k != "slowdowns"} for m, r in (("static", static), ("elastic", el))}
    return {
        "cores": cores,
        "memory_gib": memory / GIB,
        **brief,
        "density_ratio": el["envs"] / static["envs"] if static["envs"] else None,
        "p95_burst_slowdown": el["p95_burst_slowdown"],
        "p95_burst_slowdown_static": static["p95_burst_slowdown"],
        "bursts_slowed_over_10pct": el["bursts_slowed_over_10pct"],
        "oom_kills": el["oom_kills"],
        "_slowdowns": el["slowdowns"],
    }


def with_noise(slowdowns: list[float], noise: list[float], weights: list[int] | None = None) -> float | None:
    """The p95 of each modelled slowdown times each of a real run's uncontended
    slowdowns (``noise``, each counted ``weights[i]`` times, once without
    ``weights``): what contention costs composed with what the real machine
    adds alone (measurement, cold caches, other tenants), taken as
    independent."""
    if not slowdowns:
        return None
    if not noise:
        return p95(slowdowns)
    if weights is None:
        return p95([s * n for s in slowdowns for n in noise])
    return weighted_p95([(s * n, w) for s in slowdowns for n, w in zip(noise, weights)])


def weighted_p95(values: list[tuple[float, int]]) -> float | None:
    """The nearest-rank 95th percentile of ``(value, count)`` pairs: the
    smallest value above which less than 5 % of the count lies, as
    :func:`p95` of the values each repeated ``count`` times (None if the
    counts are all 0)."""
    total = sum(w for _, w in values)
    seen = 0
    for v, w in sorted(values):
        seen += w
        if w and 20 * seen > 19 * total:
            return v
    return None


def unloaded_spread(real: dict, *, cold: bool = False) -> list[float]:
    """Each unloaded repeated run of a burst over the median of its kind in its
    pass (``real["baseline_runs_s"]``: a list of ``{kind: [seconds]}``): what
    the machine adds to a burst with nothing else of the run beside it
    (measurement, caches); with ``cold``, the first runs in fresh
    environments (``KIND:cold``) too, over their own median; [] if the run
    has none."""
    out = []
    for p in real.get("baseline_runs_s") or []:
        for kind, xs in p.items():
            if (cold or not kind.endswith(":cold")) and xs:
                m = statistics.median(xs)
                out += [x / m for x in xs if m > 0]
    return out


def quiet_static_bursts(real: dict, cores: float) -> list[dict]:
    """The real static mode's bursts that met neither the machine's other load
    (``background`` below :data:`QUIET_CORES`) nor more of the run's bursts
    than ``cores`` (``concurrent``)."""
    return [
        b
        for b in real["static"].get("bursts", [])
        if b.get("background") is not None and b["background"] < QUIET_CORES and b.get("concurrent", 1) <= cores
    ]


def node_spread(real: dict, cores: float) -> list[float]:
    """The slowdowns of :func:`quiet_static_bursts`: what a running node adds
    to a burst that has its core, which the model (cores shared, the
    background replayed) leaves out: first bursts of a kind in a fresh
    environment (against the cold runs' median, a spread the unloaded
    repeated runs leave out), the node serving the other environments'
    commands, page cache.  [] with fewer than :data:`MIN_QUIET_BURSTS` of
    them (a static mode under other load throughout)."""
    quiet = [b["slowdown"] for b in quiet_static_bursts(real, cores)]
    return quiet if len(quiet) >= MIN_QUIET_BURSTS else []


def _cold(burst: dict) -> bool:
    return str(burst.get("base", "")).endswith(":cold")


def workload_noise(real: dict, cores: float, *, envs: int, bursts: int) -> tuple[list[float], list[int]]:
    """The noise of a burst that had its core in the running workload, for a
    mode predicted to hold ``envs`` environments and run ``bursts`` bursts:
    the slowdowns of :func:`quiet_static_bursts` (the only uncontended bursts
    measured in the workload: after seconds of thinking, beside the node
    serving the other environments; the unloaded runs repeat a burst back to
    back and spread less), with integer weights that give the first bursts of
    a kind in an environment (``KIND:cold``, each against the cold runs'
    median) the share they have in that mode: each environment runs as many
    as a static one did (every kind once), so of ``bursts`` bursts
    ``min(bursts, envs x cold per static environment)`` are cold.  Kinds
    need no weights: each environment cycles through them in both modes.
    Returns the slowdowns and their weights in the order of
    :func:`quiet_static_bursts`; without cold or warm quiet bursts (a run
    that did not tell them apart) all weigh 1; ([], []) with fewer than
    :data:`MIN_QUIET_BURSTS` quiet bursts."""
    quiet = quiet_static_bursts(real, cores)
    if len(quiet) < MIN_QUIET_BURSTS:
        return [], []
    slowdowns = [b["slowdown"] for b in quiet]
    cold = sum(map(_cold, quiet))
    warm = len(quiet) - cold
    static_envs = real["static"].get("envs") or 0
    if not cold or not warm or not static_envs or bursts <= 0:
        return slowdowns, [1] * len(quiet)
    per_env = sum(map(_cold, real["static"]["bursts"])) / static_envs
    n_cold = min(bursts, round(per_env * envs))
    # each cold one weighs n_cold / cold, each warm one (bursts - n_cold) / warm: over cold x warm
    return slowdowns, [n_cold * warm if _cold(b) else (bursts - n_cold) * cold for b in quiet]


def calibrate(
    traces: list[Trace],
    real: dict,
    *,
    cores: float,
    memory: int,
    elastic: ProvisionConfig,
    declared: Resources,
    max_envs: int,
    duration_s: float,
) -> dict:
    """Replay a real run's ``traces`` on a node of the real machine's size and
    predict that run's elastic density and p95 burst slowdown; ``real``: the
    run's ``static`` and ``elastic`` results (``envs``, ``p95_burst_slowdown``,
    ``bursts`` with ``slowdown``, and ``background``, the load of the
    machine's other work during the mode: :func:`parse_background`, replayed
    beside the traces).  The model's slowdowns (contention for the cores) are
    composed with the noise of a real burst that had its core
    (:func:`with_noise`): when a background was recorded, the static mode's
    quiet bursts, cold and warm weighted as the predicted elastic mode holds
    them (:func:`workload_noise`), or with fewer than
    :data:`MIN_QUIET_BURSTS` of them the unloaded runs' spread, repeated and
    first runs in fresh environments (:func:`unloaded_spread`); else all the
    static bursts' slowdowns, which then stand for the load too.  Errors of the
    predicted p95 on four recorded runs (``tests/unit/data``: the 420-s run of
    2026-12-04, s19, the loaded run, s14), this noise against the one before
    (the unloaded runs pooled with the quiet static bursts sample by sample, so
    the static bursts' share fell with a shorter run: 41 of 113 over 420 s, 16
    of 88 over 180 s): 0.065 against 0.124, 0.143 against 0.240, 0.106 and
    0.443 unchanged (too few quiet static bursts; no background recorded).
    Chosen leave-one-out (:mod:`weenv_bench.noise_choice`) among eight
    candidates (the unloaded runs alone, the pooled noise, the quiet static
    bursts alone or with first runs weighted, lognormal fits to them, whole or
    per kind), by the worst error on the three other runs: chosen in three of
    the four folds (left out, the 420-s run 0.065); with s19 left out a
    lognormal fit won on the 420-s run (0.011) and missed s19 by 0.197.  Two
    quick runs recorded after: s22b (a quiet machine) 0.083 (pooled 0.085), s22
    (its static mode under other load: the unloaded runs) 0.109.  A quiet
    static p95 of 16 bursts is their largest, so one slow burst sets it (an
    unrecorded run's 2.43 against a real 1.68).  The two modes' shares of first
    runs were alike in these runs (19 and 23 %, 50 and 48 %), so the weights
    moved the 420-s run's noise p95 only from 1.570 to 1.583 (the same errors
    as unweighted, on every run).  Returns the predicted and real figures,
    ``noise`` (which of the three, its size, its weighted p95 and the share of
    first runs it was weighted to) and ``calibration_error``: the larger
    relative error of the two; ``real.p95_interval`` is the real p95's 10-90 %
    bootstrap interval (:func:`p95_interval`): a p95 of some 35 bursts is their
    second largest, and one run's was 1.58 within [1.37, 2.49]."""
    background = {m: parse_background(real[m].get("background"), cores) for m in ("static", "elastic")}
    sim = compare(
        traces,
        cores=cores,
        memory=memory,
        elastic=elastic,
        declared=declared,
        max_envs=max_envs,
        duration_s=duration_s,
        background=background,
    )
    noise, weights, source = [], None, "static bursts"
    if background["elastic"]:
        noise, weights = workload_noise(real, cores, envs=sim["elastic"]["envs"], bursts=sim["elastic"]["bursts"])
        source = "quiet static bursts"
        if not noise:
            noise, weights, source = unloaded_spread(real, cold=True), None, "unloaded runs"
    if not noise:  # no background recorded: the static bursts' spread stands for the machine's
        noise, weights, source = [b["slowdown"] for b in real["static"].get("bursts", [])], None, "static bursts"
    predicted_p95 = with_noise(sim["_slowdowns"], noise, weights)
    counts = weights or [1] * len(noise)
    cold = sum(w for b, w in zip(quiet_static_bursts(real, cores), counts) if _cold(b)) if weights else None
    r_static, r_el = real["static"]["envs"], real["elastic"]["envs"]
    real_density = r_el / r_static if r_static else None
    errors = []
    if real_density and sim["density_ratio"] is not None:
        errors.append(abs(sim["density_ratio"] - real_density) / real_density)
    r_p95 = real["elastic"].get("p95_burst_slowdown")
    if r_p95 and predicted_p95:
        errors.append(abs(predicted_p95 - r_p95) / r_p95)
    return {
        "cores": cores,
        "memory_gib": memory / GIB,
        "predicted": {
            "density_ratio": sim["density_ratio"],
            "elastic_envs": sim["elastic"]["envs"],
            "p95_burst_slowdown": predicted_p95,
            "p95_burst_slowdown_model": sim["p95_burst_slowdown"],
            "bursts": sim["elastic"]["bursts"],
        },
        "real": {
            "density_ratio": real_density,
            "elastic_envs": r_el,
            "p95_burst_slowdown": r_p95,
            "bursts": len(real["elastic"].get("bursts", [])),
            "p95_interval": p95_interval([b["slowdown"] for b in real["elastic"].get("bursts", [])]),
        },
        "noise": {
            "from": source,
            "n": len(noise),
            "p95": weighted_p95(list(zip(noise, counts))),
            "cold_share": cold / sum(counts) if cold is not None and sum(counts) else None,
        },
        "background_cores": {m: statistics.fmean(b[1]) if b and b[1] else None for m, b in background.items()},
        "calibration_error": max(errors) if errors else None,
    }


NODE_SIZES = ((16, 64), (64, 256), (192, 768))
"""Modelled nodes: (cores, GiB), 4 GiB per core as general-purpose cloud machines have."""


def run_sizes(
    traces: list[Trace],
    *,
    elastic: ProvisionConfig,
    declared: Resources,
    duration_s: float = 300.0,
    sizes=NODE_SIZES,
    log=print,
) -> dict[str, dict]:
    """:func:`compare` for each of ``sizes``: ``{"<cores>": figures}``."""
    import time

    out = {}
    for cores, gib in sizes:
        t = time.monotonic()
        r = compare(
            traces,
            cores=cores,
            memory=gib * GIB,
            elastic=elastic,
            declared=declared,
            max_envs=cores * 16,
            duration_s=duration_s,
        )
        r.pop("_slowdowns")
        r["sim_seconds"] = round(time.monotonic() - t, 1)
        log(
            f"  simulated {cores} cores, {gib} GiB: static {r['static']['envs']}, elastic {r['elastic']['envs']} "
            f"(x{r['density_ratio']:.2f}), p95 burst slowdown {r['p95_burst_slowdown']}, "
            f"{r['bursts_slowed_over_10pct']:.1%} slowed > 10 %, {r['sim_seconds']} s"
        )
        out[str(cores)] = r
    return out


__all__ = [
    "Clock",
    "SimCgroup",
    "SimEnv",
    "Trace",
    "calibrate",
    "compare",
    "node_spread",
    "p95_draws",
    "p95_interval",
    "parse_background",
    "parse_traces",
    "quiet_static_bursts",
    "run_sizes",
    "share",
    "simulate",
    "traces_of",
    "weighted_p95",
    "with_noise",
    "workload_noise",
]
