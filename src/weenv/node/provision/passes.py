"""One pass of the :class:`~weenv.node.provision.controller.Provisioner`'s loop:
each environment's usage read, its policy asked, the node's budget shared out
and the limits set (:class:`ProvisionPass`, a part of the provisioner)."""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import deque
from typing import NamedTuple

from weenv.errors import NotFoundError, WeenvError
from weenv.formats.manifest import Resources
from weenv.node.cgroups import Cgroup, LimitRefusedError, Pressure, Usage
from weenv.node.provision.arbiter import (
    Claim,
    CpuMoments,
    CpuWindow,
    arbitrate,
)
from weenv.node.provision.models import (
    ProvisionConfig,
)
from weenv.node.provision.policy import EnvPolicy, Observation
from weenv.node.provision.profiles import UsageProfile

log = logging.getLogger(__name__)


class _Point(NamedTuple):
    """A :class:`UsagePoint` as the loop keeps it (a tuple: it records one per
    environment per pass; the model is built when :meth:`Provisioner.stats` asks)."""

    t: float
    cpu_used: float
    throttled: float
    cpu_quota: float | None
    cpu_reservation: float | None
    memory_usage: int
    working_set: int
    memory_limit: int | None
    pids: int
    frozen: bool


class _Event(NamedTuple):
    t: float
    env_id: str | None
    kind: str
    message: str


class _Tracked:
    def __init__(
        self,
        env_id: str,
        resources: Resources,
        priority: int,
        policy: EnvPolicy,
        template: str | None = None,
        profile: UsageProfile | None = None,
    ):
        self.env_id = env_id
        self.template = template
        self.profile = profile
        """Its template's usage profile when it was admitted (None: unknown template)."""
        self.resources = resources
        self.priority = priority
        self.policy = policy
        self.initial_cpu = policy.cpu_quota
        self.initial_memory = policy.memory_limit
        """What it would start with (cores, bytes) before admission caps them at what is free."""
        self.cgroup: Cgroup | None = None
        self.lock = threading.Lock()
        self.attached = False
        self.detached = False
        self.last: Usage | None = None
        self.last_obs: Observation | None = None
        self.last_pressure: Pressure | None = None
        self.want = None
        self.frozen = False
        self.paused = False
        """Paused by its user (:meth:`Provisioner.pause`): not controlled, its memory still counted."""
        self.oom_killer: bool | None = None
        self.refused = 0
        self.history: deque[_Point] = deque(maxlen=policy.cfg.history)
        self.window = CpuWindow(policy.cfg.admission_window_s)
        """Its per-pass CPU usage (cores, at most its ceiling) over the admission window, summed as it comes."""

    @property
    def cpu_reservation(self) -> float:
        """What admission and the arbiter count (the policy's elastic value; 0 while paused)."""
        return 0.0 if self.paused else self.policy.cpu_quota

    def cpu_quota(self, cfg: ProvisionConfig) -> float:
        """The CFS quota this environment has (cores)."""
        if cfg.mode != "elastic":
            return self.resources.cpus
        return self.policy.cpu_ceiling if cfg.cpu_quota_at == "ceiling" else self.policy.cpu_quota

    @property
    def memory_limit(self) -> int:
        return self.policy.memory_limit

    def cpu_moments(self, cfg: ProvisionConfig, now: float) -> CpuMoments:
        """Its per-pass CPU usage over the admission window (``now``: Unix
        time), or the prior while it has less than the minimum history."""
        seen = self.observed_moments(cfg, now)
        if seen is not None:
            return seen
        if self.profile is not None:
            return profile_moments(self.profile, self.resources.cpus)
        return CpuMoments.prior(self.resources.cpus, cfg.admission_prior_duty)

    def observed_moments(self, cfg: ProvisionConfig, now: float) -> CpuMoments | None:
        """Its per-pass CPU usage over the admission window, or None while it
        has less than ``admission_min_history_s`` of history."""
        return self.window.moments(now, cfg.admission_min_history_s)


def profile_moments(profile: UsageProfile, ceiling: float) -> CpuMoments:
    """A template profile's CPU as on/off usage: busy at its burst size (at most
    ``ceiling``, cores) its duty cycle of the time."""
    burst = min(profile.cpu_burst, ceiling) or ceiling
    return CpuMoments.prior(burst, profile.cpu_duty)


class ProvisionPass:
    """:meth:`tick` and its steps; a part of :class:`~weenv.node.provision.controller.Provisioner`."""

    # --- one pass ----------------------------------------------------------------------
    def tick(self) -> None:
        """One pass over every attached environment (see the module doc)."""
        if self.config.mode == "off":
            return
        with self._tick_lock:
            with self._lock:
                envs = [t for t in self._envs.values() if t.attached]
                paused_memory = sum(t.memory_limit for t in self._envs.values() if t.paused)
            claims = []
            for t in envs:
                claim = self._observe(t)
                if claim is not None:
                    claims.append(claim)
            self.passes += 1
            if self.config.mode != "elastic":
                return
            budget = self._budget()  # the paused hold their memory: the others share the rest
            d = arbitrate(claims, dataclasses.replace(budget, memory=budget.memory - paused_memory))
            if d.admitting != self._admitting:
                self._event(None, "admission", "admission resumed" if d.admitting else "admission stopped")
                self._admitting = d.admitting
            for env_id, kind, msg in d.events:
                if kind == "refused":
                    if env_id in self._short:
                        continue
                    self._short.add(env_id)
                if kind != "shortage":
                    self._event(env_id, kind, msg)
            self._short &= {c.env_id for c in claims if d.memory[c.env_id] < c.memory_want and c.memory_pressure}
            now = self.clock.monotonic()
            by_id = {t.env_id: t for t in envs}
            for c in claims:
                t = by_id[c.env_id]
                with t.lock:
                    if not t.attached:
                        continue
                    try:
                        self._apply(t, d.cpu[c.env_id], d.memory[c.env_id], now)
                        if c.env_id in d.freeze and not t.frozen:
                            t.cgroup.freeze()
                            t.frozen = True
                        elif c.env_id in d.thaw and t.frozen:
                            t.cgroup.thaw()
                            t.frozen = False
                    except NotFoundError:
                        self._gone(t)
                    except WeenvError as exc:
                        self._event(t.env_id, "error", str(exc))
                    self._record(t)

    def _observe(self, t: _Tracked) -> Claim | None:
        with t.lock:
            if not t.attached:
                return None
            try:
                u = t.cgroup.usage()
            except NotFoundError:
                self._gone(t)
                return None
            except WeenvError as exc:
                self._event(t.env_id, "error", str(exc))
                return None
            o = Observation.between(t.last, u)
            t.last, t.last_obs = u, o
            if o.oom_kills_delta:
                self._event(
                    t.env_id,
                    "oom_kill",
                    f"{o.oom_kills_delta} process(es) OOM-killed at "
                    f"{t.memory_limit >> 20} MiB (ceiling {t.policy.memory_ceiling >> 20} MiB)",
                )
            if self.config.mode != "elastic":
                self._record(t)
                return None
            w = t.policy.observe(o)
            t.want = w
            return Claim(
                env_id=t.env_id,
                priority=t.priority,
                cpu_quota=t.cpu_reservation,
                cpu_want=w.cpu_quota,
                cpu_floor=t.policy.cpu_floor,
                memory_limit=t.memory_limit,
                memory_want=w.memory_limit,
                memory_pressure=w.memory_pressure,
                working_set=o.working_set,
                frozen=t.frozen,
            )

    def _apply(self, t: _Tracked, cpu: float, memory: int, now: float, *, initial: bool = False) -> None:
        """Write ``cpu`` cores and ``memory`` bytes to ``t``'s cgroup (under ``t.lock``).
        Raises :class:`NotFoundError` if the cgroup is gone."""
        cg, p = t.cgroup, t.policy
        old_cpu, old_mem = (t.resources.cpus, t.resources.memory_bytes) if initial else (p.cpu_quota, p.memory_limit)
        at_ceiling = self.config.cpu_quota_at == "ceiling"
        if initial or abs(cpu - old_cpu) > 1e-3:
            if initial or not at_ceiling:  # at the ceiling the CFS quota is written once
                cg.set_cpu(p.cpu_ceiling if at_ceiling else cpu)
            if not initial:
                what = "cpu reservation" if at_ceiling else "cpu"
                self._event(t.env_id, "raise" if cpu > old_cpu else "lower", f"{what} {old_cpu:.2f} -> {cpu:.2f} cores")
        else:
            cpu = old_cpu
        if memory > old_mem:  # raise the limit before re-enabling the OOM killer at the ceiling
            cg.set_memory_limit(memory)
            if not initial:
                self._event(t.env_id, "raise", f"memory {old_mem >> 20} -> {memory >> 20} MiB")
        killer = not (self.config.oom_wait and memory < p.memory_ceiling)
        if t.oom_killer != killer:  # v2 cannot disable it: set_oom_killer answers False
            t.oom_killer = killer if cg.set_oom_killer(killer) else True
        if memory < old_mem:
            try:
                cg.set_memory_limit(memory)
                if not initial:
                    self._event(t.env_id, "lower", f"memory {old_mem >> 20} -> {memory >> 20} MiB")
            except LimitRefusedError:
                t.refused += 1
                p.refused(now)
                if initial:
                    memory = old_mem
                else:
                    self._event(t.env_id, "refused", f"memory stays {old_mem >> 20} MiB (kernel busy)")
                    memory = old_mem
        if initial:
            cg.set_pids_limit(t.resources.pids)
            p.cpu_quota, p.memory_limit = cpu, memory
        else:
            p.applied(cpu, memory, now)

    def _record(self, t: _Tracked) -> None:
        o, u = t.last_obs, t.last
        if o is None or u is None:
            return
        static = self.config.mode != "elastic"
        now = self.clock.time()
        t.window.add(now, min(o.cpu_cores, t.resources.cpus))
        t.history.append(
            _Point(
                t=now,
                cpu_used=o.cpu_cores,
                throttled=o.throttled,
                cpu_quota=t.cpu_quota(self.config),
                cpu_reservation=t.cpu_reservation,
                memory_usage=u.memory_usage,
                working_set=u.memory_working_set,
                memory_limit=t.resources.memory_bytes if static else t.memory_limit,
                pids=u.pids_current,
                frozen=t.frozen,
            )
        )

    def _gone(self, t: _Tracked) -> None:
        t.attached = False
        self._event(t.env_id, "gone", "its cgroup disappeared; no longer controlled")
