"""``weenv bench provision --simulate``: recorded usage traces replayed through
the real provisioner on a modelled node of C cores and M GiB.

**Traces** (:func:`load_traces`): per environment, per controller pass, the
cores it used and its working set (bytes), ``interval_s`` apart, as ``weenv
bench provision`` records them (each mode's ``history``; the *static* run's
are the demand: each environment had its declared core).  A trace with a gap
(two points more than 2 × ``interval_s`` apart), a negative or non-finite
value is an :class:`~weenv.errors.InvalidInputError`.

**What runs for real**: :class:`~weenv.node.provision.Provisioner` (its
admission, policy and arbiter, imported), on simulated cgroups
(:class:`SimCgroup`) and a simulated clock and ``/proc/meminfo``.  **What is
modelled**: the node.  Every step (one trace interval) each environment asks
its trace's current CPU demand; the cores are shared max-min fairly (CFS's
equal weights) within each one's CFS quota; a step's demand not served is
carried over, so a contended burst lasts longer (its *slowdown*: simulated
steps over trace steps, for each run of busy points, > 20 % of the ceiling).
Memory: an environment whose working set exceeds its limit waits (cgroup v1
with the OOM killer disabled below the ceiling, as the node sets it) until the
controller raises it; above its declared ceiling it counts an OOM kill.

As in the real benchmark, a scheduler asks for one more environment every
second (up to ``max_envs``) for ``duration_s``; each new one replays the next
trace (round robin, each looped).  Reported per mode: ``envs`` (most held),
``p95_burst_slowdown``, ``bursts_slowed_over_10pct``, ``oom_kills``.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from unittest import mock

from weenv.errors import CapacityError, InvalidInputError
from weenv.formats.manifest import Resources
from weenv.node.cgroups import Pressure, Usage
from weenv.node.provision import ProvisionConfig, Provisioner
from weenv.node.provision import controller as _controller
from weenv.node.provision.profiles import TemplateProfiles

GIB = 1 << 30
BUSY_SHARE = 0.2


@dataclass(frozen=True)
class Trace:
    cpu: list[float]
    """Cores used per step."""
    working_set: list[int]
    """Bytes per step."""


def load_traces(history: dict[str, list[dict]], interval_s: float) -> list[Trace]:
    """Traces from a mode's ``history`` (env id -> points with ``t``, ``cpu_used``,
    ``working_set``); raises :class:`InvalidInputError` for a gap, a negative or
    non-finite value, or no trace at all."""
    out = []
    for env_id, points in history.items():
        if len(points) < 2:
            continue
        for a, b in zip(points, points[1:]):
            if not b["t"] - a["t"] <= 2 * interval_s + 0.5:
                raise InvalidInputError(f"trace of {env_id} has a gap of {b['t'] - a['t']:.1f} s at t={a['t']:.0f}")
        for p in points:
            cpu, ws = p["cpu_used"], p["working_set"]
            if not (isinstance(cpu, (int, float)) and math.isfinite(cpu) and cpu >= 0 and ws >= 0):
                raise InvalidInputError(f"trace of {env_id} has a bad point: cpu {cpu!r}, working set {ws!r}")
        out.append(Trace([float(p["cpu_used"]) for p in points], [int(p["working_set"]) for p in points]))
    if not out:
        raise InvalidInputError("no usage trace to replay")
    return out


class Clock:
    def __init__(self):
        self.now = 1_000_000.0

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


@dataclass
class SimEnv:
    trace: Trace
    ceiling: float
    memory_ceiling: int
    pos: int = 0
    left: float = -1.0
    """Core-steps of the current trace point still to run (-1: not started)."""
    cpu_s: float = 0.0
    quota: float = 1.0
    limit: int = 1 << 40
    waiting: bool = False
    oom_kills: int = 0
    steps_in_burst: int = 0
    burst_len: int = 0
    slowdowns: list[float] = field(default_factory=list)

    def demand(self) -> float:
        if self.left < 0:
            self.left = self.trace.cpu[self.pos % len(self.trace.cpu)]
        ws = self.trace.working_set[self.pos % len(self.trace.working_set)]
        if ws > self.memory_ceiling:
            self.oom_kills += 1
            self.left = 0.0
        self.waiting = ws > self.limit
        return 0.0 if self.waiting else min(self.left, self.quota)

    def working_set(self) -> int:
        return min(self.trace.working_set[self.pos % len(self.trace.working_set)], self.limit)

    def run(self, granted: float) -> None:
        busy = self.trace.cpu[self.pos % len(self.trace.cpu)] > BUSY_SHARE * self.ceiling
        self.cpu_s += granted
        if busy or self.waiting:
            self.steps_in_burst += 1
        if self.waiting:
            return
        self.left -= granted
        if self.left > 1e-6:
            return
        self.left = -1.0
        self.pos += 1
        if busy:
            self.burst_len += 1
        if busy and self.trace.cpu[self.pos % len(self.trace.cpu)] <= BUSY_SHARE * self.ceiling:
            self.slowdowns.append(self.steps_in_burst / max(1, self.burst_len))
            self.steps_in_burst = self.burst_len = 0


class SimCgroup:
    """What the provisioner reads and writes, for one :class:`SimEnv`."""

    def __init__(self, env: SimEnv, clock: Clock):
        self.env, self.clock = env, clock

    def usage(self) -> Usage:
        e = self.env
        ws = e.working_set()
        return Usage(at=self.clock.now, cpu_usage_s=e.cpu_s, cpu_periods=0, cpu_throttled_periods=0,
                     cpu_throttled_s=0.0, memory_usage=ws, memory_working_set=ws, memory_peak=ws,
                     memory_failcnt=0, memory_under_oom=e.waiting, oom_kills=e.oom_kills, pids_current=1,
                     pids_failcnt=0)  # fmt: skip

    def pressure(self) -> Pressure:
        return Pressure(0, 0, self.env.waiting)

    def set_cpu(self, quota: float | None) -> None:
        self.env.quota = self.env.ceiling if quota is None else quota

    def set_memory_limit(self, limit: int | None) -> None:
        self.env.limit = 1 << 50 if limit is None else int(limit)

    def set_oom_killer(self, enabled: bool) -> bool:
        return True

    def set_pids_limit(self, limit: int | None) -> None:
        pass

    def freeze(self) -> None:
        pass

    def thaw(self) -> None:
        pass


def share(demands: list[float], cores: float) -> list[float]:
    """Max-min fair shares of ``cores`` among ``demands`` (cores each)."""
    grants = [0.0] * len(demands)
    left, todo = cores, [i for i, d in enumerate(demands) if d > 0]
    while todo and left > 1e-9:
        each = left / len(todo)
        done = [i for i in todo if demands[i] - grants[i] <= each]
        if not done:
            for i in todo:
                grants[i] += each
            break
        for i in done:
            left -= demands[i] - grants[i]
            grants[i] = demands[i]
        todo = [i for i in todo if i not in done]
    return grants


@contextmanager
def _simulated(clock: Clock, envs: list[SimEnv], memory: int):
    def meminfo() -> dict[str, int]:
        used = sum(e.working_set() for e in envs)
        return {"MemTotal": memory, "MemAvailable": max(0, memory - used)}

    with mock.patch.object(_controller, "time", clock), mock.patch.object(_controller, "meminfo", meminfo):
        yield


def simulate(traces: list[Trace], *, cores: float, memory: int, config: ProvisionConfig, declared: Resources,
             max_envs: int, duration_s: float, interval_s: float, template: str = "sha256:" + "0" * 64,
             profiles: TemplateProfiles | None = None) -> dict:  # fmt: skip
    """Replay ``traces`` on a node of ``cores`` and ``memory`` bytes; see the module doc."""
    clock = Clock()
    envs: list[SimEnv] = []
    cfg = config.model_copy(update={"cpu_capacity": float(cores), "memory_capacity": int(memory),
                                    "interval_s": interval_s})  # fmt: skip
    with _simulated(clock, envs, memory):
        prov = Provisioner(cfg, open_cgroup=None, profiles=profiles or TemplateProfiles())
        steps = int(duration_s / interval_s)
        admit_every = max(1, round(1.0 / interval_s))
        per_admit = max(1, round(cores / 8))  # a trainer asks a large node for more at once
        held = 0
        for step in range(steps):
            for _ in range(per_admit if step % admit_every == 0 else 0):
                if len(envs) >= max_envs:
                    break
                env_id = f"sim{len(envs)}"
                try:
                    prov.reserve(env_id, declared, template=template)
                except CapacityError:
                    break
                e = SimEnv(traces[len(envs) % len(traces)], declared.cpus, declared.memory_bytes)
                e.pos = (len(envs) * 7) % len(e.trace.cpu)  # traces start at different points
                envs.append(e)
                prov._open = lambda _path, e=e: SimCgroup(e, clock)
                prov.attach(env_id, f"/{env_id}")
                if cfg.mode != "elastic":
                    e.quota, e.limit = declared.cpus, declared.memory_bytes
                held = max(held, len(envs))
            grants = share([e.demand() for e in envs], cores)
            for e, g in zip(envs, grants):
                e.run(g)
            clock.sleep(interval_s)
            prov.tick()
        for i in range(len(envs)):
            prov.detach(f"sim{i}")
    slow = [s for e in envs for s in e.slowdowns]
    return {
        "envs": held,
        "p95_burst_slowdown": _p95(slow),
        "bursts": len(slow),
        "bursts_slowed_over_10pct": (sum(s > 1.1 for s in slow) / len(slow)) if slow else 0.0,
        "oom_kills": sum(e.oom_kills for e in envs),
    }


def _p95(values: list[float]) -> float | None:
    s = sorted(values)
    return s[min(len(s) - 1, int(0.95 * len(s)))] if s else None


def compare(traces: list[Trace], *, cores: float, memory: int, elastic: ProvisionConfig, declared: Resources,
            max_envs: int, duration_s: float, interval_s: float) -> dict:  # fmt: skip
    """Static and elastic side by side on one modelled node; the summary's fields."""
    static = simulate(traces, cores=cores, memory=memory, config=ProvisionConfig(mode="static", cpu_overcommit=1.0),
                      declared=declared, max_envs=max_envs, duration_s=duration_s, interval_s=interval_s)  # fmt: skip
    el = simulate(traces, cores=cores, memory=memory, config=elastic, declared=declared, max_envs=max_envs,
                  duration_s=duration_s, interval_s=interval_s)  # fmt: skip
    return {
        "cores": cores, "memory_gib": memory / GIB, "static": static, "elastic": el,
        "density_ratio": el["envs"] / static["envs"] if static["envs"] else None,
        "p95_burst_slowdown": {"static": static["p95_burst_slowdown"], "elastic": el["p95_burst_slowdown"]},
        "bursts_slowed_over_10pct": el["bursts_slowed_over_10pct"],
        "oom_kills": el["oom_kills"],
    }  # fmt: skip


def calibration_error(sim: dict, real: dict) -> float:
    """The largest relative error of the simulated elastic density and p95
    burst slowdown against the real run's (``real``: its summary)."""
    errs = []
    if real.get("elastic_envs"):
        errs.append(abs(sim["elastic"]["envs"] - real["elastic_envs"]) / real["elastic_envs"])
    r = (real.get("p95_burst_slowdown") or {}).get("elastic")
    s = sim["elastic"]["p95_burst_slowdown"]
    if r and s:
        errs.append(abs(s - r) / r)
    return max(errs) if errs else math.nan


__all__ = ["Trace", "calibration_error", "compare", "load_traces", "share", "simulate"]
