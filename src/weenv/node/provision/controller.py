"""The provisioner: a thread of the node that reads every environment's cgroup,
asks the policy and the arbiter, and writes quotas back (Linux only).

Each pass (every ``interval_s``, default 1 s, or at once when a check every
``check_interval_s`` (0.1 s) finds tasks waiting at a memory limit or, with
``cpu_quota_at="reservation"``, throttled: raises are urgent, lowerings are not):

1. read each environment's cgroup (:class:`~weenv.node.cgroups.Usage`) and
   turn the difference from the previous reading into an
   :class:`~weenv.node.provision.policy.Observation`;
2. ask its :class:`~weenv.node.provision.policy.EnvPolicy` what it wants;
3. fit all wants into the node (:func:`~weenv.node.provision.arbiter.arbitrate`);
4. write the grants (the CPU reservation, and the CFS quota: the declared
   ceiling, written once, with ``cpu_quota_at="ceiling"`` (default), the
   reservation itself with ``"reservation"``; the memory limit: below the ceiling the OOM killer
   is disabled so that a task at the limit waits for the next pass), freeze
   and thaw, and record a :class:`~weenv.node.provision.models.UsagePoint`.

Lifetime of an environment: :meth:`Provisioner.reserve` (admission; its
initial reservation counts against the node from then on), :meth:`attach` once its
cgroup exists (writes the initial limits), :meth:`detach` before its cgroup is
removed.  While the environment is paused (the cgroup freezer,
:mod:`weenv.node.state.pause`) it is not controlled (:meth:`pause` to :meth:`resume`)
but stays reserved: a frozen environment still holds its memory, so its memory
limit (what it may hold: at most that is resident while it cannot run) and its
disk limit count against admission and against the memory the arbiter grants
the others; its CPU reservation does not (it uses none).  Every write to an environment happens under its lock after checking
it is still attached, and cgroup writes never create a group, so an
environment destroyed in the middle of a pass loses at most that write
(:class:`~weenv.errors.NotFoundError`, ignored) and leaves nothing behind.
A failing environment never stops the loop: the error becomes an event.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

from weenv.errors import BusyError, CapacityError, ClosedError, InvalidInputError, NotFoundError, WeenvError
from weenv.formats.manifest import Resources
from weenv.node.cgroups import Cgroup, open_cgroups
from weenv.node.provision.arbiter import (
    Budget,
    CpuMoments,
    admits,
    burst_contention,
    predicted_cpu_peak,
)
from weenv.node.provision.models import (
    EnvironmentProvision,
    NodeTotals,
    ProvisionConfig,
    ProvisionEvent,
    ProvisionStats,
    UsagePoint,
)
from weenv.node.provision.passes import ProvisionPass, _Event, _Tracked
from weenv.node.provision.policy import EnvPolicy
from weenv.node.provision.profiles import TemplateProfiles, summarize

log = logging.getLogger(__name__)


class Clock(Protocol):
    """What the provisioner reads the time from (the :mod:`time` module, or a simulation's)."""

    def time(self) -> float: ...

    def monotonic(self) -> float: ...


def meminfo() -> dict[str, int]:
    """``/proc/meminfo`` in bytes."""
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts:
                out[key] = int(parts[0]) * (1024 if len(parts) > 1 else 1)
    return out


def _pooled(known: list[tuple[float, float]]) -> float:
    """The duty of ``known`` (ceiling, duty) pairs together: busy core-time over ceiling core-time."""
    return sum(c * d for c, d in known) / sum(c for c, _ in known)


class Provisioner(ProvisionPass):
    """Elastic (or static) provisioning of one node's environments.

    ``open_cgroup``: path -> :class:`~weenv.node.cgroups.Cgroup` (default:
    :func:`~weenv.node.cgroups.open_cgroups`, detecting v1/v2).  ``profiles``:
    the templates' usage profiles (default: kept in memory only), read at
    admission and updated when an environment is detached.  Thread-safe;
    :meth:`start` runs the loop in a daemon thread, :meth:`close` stops it
    (idempotent).  :meth:`tick` runs one pass synchronously (tests, tools).
    """

    def __init__(
        self,
        config: ProvisionConfig | None = None,
        open_cgroup: Callable[[str], Cgroup] = open_cgroups,
        profiles: TemplateProfiles | None = None,
        *,
        clock: Clock | None = None,
        host_memory: Callable[[], dict[str, int]] = meminfo,
    ):
        self.config = config or ProvisionConfig()
        self.profiles = profiles if profiles is not None else TemplateProfiles()
        self._open = open_cgroup
        self.clock: Clock = clock or time
        """``time()`` (Unix seconds, in the history) and ``monotonic()`` (the
        policy's clock): the :mod:`time` module, or a simulated clock."""
        self._meminfo = host_memory
        self._envs: dict[str, _Tracked] = {}
        self._lock = threading.Lock()
        self._tick_lock = threading.Lock()
        self._events: deque[_Event] = deque(maxlen=500)
        self._admitting = True
        self._short: set[str] = set()
        self._stop = threading.Event()
        self._cancel_waits = threading.Event()
        self._room = threading.Condition()
        """Notified after each pass and each environment that ends: creates waiting for room check again."""
        self._thread: threading.Thread | None = None
        self.passes = 0
        self._due = self.clock.monotonic() + self.config.interval_s
        """Monotonic seconds when the next regular pass is due."""
        mem = host_memory()
        self.cpu_capacity = self.config.cpu_capacity or float(os.cpu_count() or 1)
        self.memory_capacity = self.config.memory_capacity or max(
            1 << 30, mem.get("MemTotal", 0) - self.config.memory_reserve
        )
        self.disk_capacity: int | None = None
        """Bytes of the node's disk for environments (the node sets it once its disk is open; None: not counted)."""
        self._disk_held: dict[str, int] = {}
        """Bytes of the node's disk held outside any environment, by key (:meth:`hold_disk`)."""

    # --- lifetime ----------------------------------------------------------------------
    def start(self) -> Provisioner:
        if self.config.mode == "off" or (self._thread and self._thread.is_alive()):
            return self
        self._stop.clear()
        self._cancel_waits.clear()
        self._thread = threading.Thread(target=self._run, name="weenv-provisioner", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self.cancel_waits()
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        self.profiles.close()

    def _run(self) -> None:
        check = min(self.config.check_interval_s, self.config.interval_s)
        self._due = self.clock.monotonic() + self.config.interval_s
        while not self._stop.wait(min(check, max(0.0, self._due - self.clock.monotonic()))):
            try:
                self.poll()
            except Exception as exc:  # the loop must survive anything one pass meets
                log.exception("provisioner pass failed")
                self._event(None, "error", f"pass failed: {exc!r}")

    def poll(self) -> bool:
        """One check of the loop (every ``check_interval_s``): a pass (:meth:`tick`)
        when ``interval_s`` has gone by since the last or a raise is urgent;
        returns whether one ran.  The thread of :meth:`start` calls it; a
        simulation calls it at each step of its clock."""
        if self.clock.monotonic() < self._due and not self._urgent():
            return False
        self.tick()
        self._due = self.clock.monotonic() + self.config.interval_s
        self._wake()  # creates waiting for room judge the new usage
        return True

    def _urgent(self) -> bool:
        """Whether an environment needs a raise now: tasks wait at its memory
        limit (unless its growth was already refused), or (the CFS quota being
        the reservation, below the ceiling) its periods since the previous
        check were throttled.  Reads two files per
        environment; any error is left to the next pass."""
        if self.config.mode != "elastic":
            return False
        cpu = self.config.cpu_quota_at == "reservation"
        with self._lock:
            envs = [t for t in self._envs.values() if t.attached and not t.frozen]
        urgent = False
        for t in envs:
            try:
                p = t.cgroup.pressure()
            except WeenvError:
                continue
            prev, t.last_pressure = t.last_pressure, p
            if p.memory_under_oom and t.memory_limit < t.policy.memory_ceiling and t.env_id not in self._short:
                urgent = True
            elif cpu and prev is not None and t.cpu_reservation < t.policy.cpu_ceiling:
                periods = p.cpu_periods - prev.cpu_periods
                throttled = p.cpu_throttled_periods - prev.cpu_throttled_periods
                if periods > 0 and throttled / periods >= max(self.config.cpu_throttle_trigger, 1e-9):
                    urgent = True
        return urgent

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # --- environments ------------------------------------------------------------------
    @property
    def admitting(self) -> bool:
        """False while the arbiter has stopped admitting (memory short); creates are refused then."""
        return self._admitting

    def reserve(
        self, env_id: str, resources: Resources, *, priority: int = 0, template: str | None = None, wait: bool = False
    ) -> None:
        """Admit a new environment (its initial quota counts from now on).

        ``template``: its template's digest; when the node knows that
        template's usage profile (:attr:`profiles`), the environment is sized
        and admitted from it at once (its initial reservation: the profile's
        p95 usage plus the policy's headroom; its memory limit: the profile's
        peak working set plus headroom; its bursts: the profile's duty cycle
        and burst size), else from its declared resources.

        Raises :class:`InvalidInputError` when it declares more cores or memory
        than the node has, :class:`CapacityError` when the node cannot hold it
        now: in ``elastic`` mode by the admission of ``config.admission``
        (``burst``: the share of bursts meeting contention within
        ``admission_burst_risk``), the reservations held now (which follow
        observed usage) plus its initial one, the memory limits held (each at
        least what its template's known peak needs:
        :meth:`~weenv.node.provision.policy.EnvPolicy.memory_held`) plus its
        own, and the host's available memory;
        in ``static`` mode by declared resources.  In both, the declared disk
        limits (``disk_bytes``) must fit the node's disk (:attr:`disk_capacity`
        × ``disk_overcommit``).  With ``wait`` (a new environment's create), one
        the latency objective alone refuses (``burst``) waits up to
        ``admission_wait_s`` for room first, judged
        again after each pass and each environment that ends; it gets
        :class:`ClosedError` if the node closes meanwhile (:meth:`cancel_waits`).
        """
        cfg = self.config
        if cfg.mode != "off" and (
            resources.cpus > self.cpu_capacity + 1e-9 or resources.memory_bytes > self.memory_capacity
        ):
            raise InvalidInputError(
                f"the environment declares {resources.cpus:g} cores and {resources.memory_bytes >> 20} MiB; "
                f"the node has {self.cpu_capacity:g} cores and {self.memory_capacity >> 20} MiB for environments"
            )
        profile = self.profiles.get(template) if template is not None and cfg.mode != "off" else None
        policy = EnvPolicy(cfg, resources.cpus, resources.memory_bytes, self.clock.monotonic())
        if profile is not None and cfg.mode == "elastic":
            policy.start_from(profile.cpu_p95, profile.memory_peak)
        t = _Tracked(env_id, resources, priority, policy, template, profile)
        if cfg.mode == "static":
            policy.cpu_quota, policy.memory_limit = resources.cpus, resources.memory_bytes
        t.initial_cpu, t.initial_memory = policy.cpu_quota, policy.memory_limit
        waited, deadline = False, time.monotonic() + (cfg.admission_wait_s if wait else 0.0)  # the caller's time
        while True:
            with self._lock:
                if env_id in self._envs:
                    raise BusyError(f"environment {env_id} is already provisioned")
                why, predicted = self._refusal(t, resources) if cfg.mode != "off" else (None, False)
                if not why:
                    self._envs[env_id] = t
                    if waited:
                        self._event(env_id, "admission", "admitted after waiting for room")
                    return
            left = deadline - time.monotonic()
            if not predicted or left <= 0 or self._cancel_waits.is_set():
                break
            if not waited:
                self._event(env_id, "admission", f"waiting up to {cfg.admission_wait_s:g} s for room: {why}")
                waited = True
            with self._room:  # notified after each pass and each environment that ends
                self._room.wait(min(left, cfg.interval_s))
        if self._cancel_waits.is_set() and waited:
            raise ClosedError("node is closing")
        after = f" (after waiting {cfg.admission_wait_s:g} s for room)" if waited else ""
        self._event(env_id, "admission", f"refused: {why}{after}")
        raise CapacityError(f"cannot admit a new environment: {why}{after}")

    def _refusal(self, t: _Tracked, resources: Resources) -> tuple[str | None, bool]:
        """Why the node cannot hold ``t`` now (None: it can), and whether the
        latency objective alone refuses it (a prediction: worth waiting for);
        sets ``t``'s initial quota and limit to what is free (under ``_lock``)."""
        cfg, policy = self.config, t.policy
        budget = self._budget()
        cpu_sum = sum(e.cpu_reservation for e in self._envs.values())
        memory_sum = sum(e.policy.memory_held() for e in self._envs.values())
        if cfg.mode == "elastic":  # start with what is free, at least the floor
            policy.cpu_quota = max(policy.cpu_floor, min(t.initial_cpu, budget.cpu - cpu_sum))
            policy.memory_limit = max(policy.memory_floor, min(t.initial_memory, budget.memory - memory_sum))
        peak = risk = None
        running = [e for e in self._envs.values() if not e.paused]  # a paused one uses no CPU
        if cfg.mode == "elastic" and cfg.admission == "peak":
            peak = self.predicted_cpu_peak(running, t)
        if cfg.mode == "elastic" and cfg.admission == "burst":
            risk = self.burst_risk(running, t)
        check = dict(
            cpu_sum=cpu_sum,
            memory_sum=memory_sum,
            cpu_new=policy.cpu_quota,
            memory_new=policy.memory_held(),
            budget=budget,
            admitting=self._admitting,
            cpu_peak=peak,
            cpu_peak_budget=self.cpu_capacity * cfg.admission_cpu_share,
            disk_sum=self._disk_sum(),
            disk_new=resources.disk_bytes,
        )
        why = admits(**check, burst_risk=risk, burst_risk_budget=cfg.admission_burst_risk)
        return why, why is not None and risk is not None and admits(**check) is None

    def cancel_waits(self) -> None:
        """Creates waiting for room (``admission_wait_s``) end now with
        :class:`ClosedError`, and later ones do not wait (the node closes)."""
        self._cancel_waits.set()
        self._wake()

    def _wake(self) -> None:
        """Creates waiting for room check again."""
        with self._room:
            self._room.notify_all()

    def _disk_sum(self) -> int:
        """Bytes of the node's disk counted now (under ``_lock``): declared limits, and what is held."""
        return sum(e.resources.disk_bytes for e in self._envs.values()) + sum(self._disk_held.values())

    def hold_disk(self, key: str, nbytes: int, what: str) -> None:
        """Count ``nbytes`` of the node's disk that no environment's limit covers
        (a snapshot's capture kept on the node: the extents it pins) under
        ``key`` (a key held already is replaced), against the node's disk
        (:attr:`disk_capacity` × ``disk_overcommit``) with the environments'
        declared limits: creates and other holds see them.  ``what``: the
        thing held, for the error.  Raises :class:`CapacityError` if they would
        not fit (nothing is counted then)."""
        with self._lock:
            budget = self._budget().disk
            held = self._disk_sum() - self._disk_held.get(key, 0)
            if self.config.mode != "off" and budget is not None and held + nbytes > budget:
                why = (
                    f"{what} holds {nbytes / (1 << 20):.1f} MiB: with the environments' disk limits and "
                    f"the snapshots kept on this node ({held / (1 << 30):.2f} GiB) it passes the node's "
                    f"{budget / (1 << 30):.2f} GiB disk (delete snapshots, or set WEENV_DISK_BYTES / "
                    f"WEENV_DISK_OVERCOMMIT)"
                )
                self._event(None, "admission", f"refused: {why}")
                raise CapacityError(f"cannot keep it: {why}")
            self._disk_held[key] = nbytes

    def free_disk(self, key: str) -> None:
        """Stop counting what :meth:`hold_disk` held under ``key`` (unknown keys are ignored)."""
        with self._lock:
            self._disk_held.pop(key, None)

    def attach(self, env_id: str, cgroup_path: str) -> None:
        """Start controlling ``env_id`` whose cgroup (``cgroup_path``, runc's
        ``linux.cgroupsPath``) now exists: write its initial limits."""
        t = self._get(env_id)
        cg = self._open(cgroup_path)
        with t.lock:
            if t.detached:
                return
            t.cgroup = cg
            if self.config.mode == "elastic":
                self._apply(t, t.policy.cpu_quota, t.policy.memory_limit, self.clock.monotonic(), initial=True)
            t.last = cg.usage()
            t.attached = True

    def detach(self, env_id: str) -> None:
        """Stop controlling ``env_id`` (before its cgroup is removed): waits for
        a write in progress, thaws it if this provisioner froze it.  Unknown
        ids are ignored."""
        t = self._untrack(env_id, remove=True)
        if t is None:
            return
        with t.lock:
            t.detached = True
            self._release(t)
        self._learn(t)
        self._wake()

    def _untrack(self, env_id: str, *, remove: bool) -> _Tracked | None:
        """``env_id``'s record (None if unknown), no longer short of memory; ``remove``: forgotten."""
        with self._lock:
            self._short.discard(env_id)
            return self._envs.pop(env_id, None) if remove else self._envs.get(env_id)

    @staticmethod
    def _release(t: _Tracked) -> None:
        """No longer control ``t`` (under ``t.lock``): thawed if this provisioner froze it."""
        t.attached = False
        if t.frozen and t.cgroup is not None:
            try:
                t.cgroup.thaw()
            except WeenvError:
                pass
        t.frozen = False

    def pause(self, env_id: str) -> None:
        """Stop controlling ``env_id``, which its user pauses now (the caller
        freezes it next), keeping its reservation (see the module doc): its
        memory limit and disk limit go on counting, its CPU does not, and its
        quotas are not changed until :meth:`resume`.  Thaws it if this
        provisioner had frozen it.  Unknown ids are ignored."""
        t = self._untrack(env_id, remove=False)
        if t is None:
            return
        with t.lock:
            t.paused = True
            self._release(t)
        self._wake()  # its CPU counts no more

    def resume(self, env_id: str, cgroup_path: str, resources: Resources, *, priority: int = 0) -> None:
        """Control the paused ``env_id`` again (it is thawed next).  It was
        counted all along, so this admits nothing, unless it is not provisioned
        (its provisioning failed, or it was adopted paused by a node that could
        not reserve it): then it is reserved and attached as a new one
        (:meth:`reserve`'s :class:`CapacityError` if the node is full now)."""
        with self._lock:
            t = self._envs.get(env_id)
        if t is None:
            self.reserve(env_id, resources, priority=priority)
            self.attach(env_id, cgroup_path)
            return
        with t.lock:
            t.paused = False
            attached_before = t.cgroup is not None
            if attached_before:
                try:
                    t.last = t.cgroup.usage()  # its next observation starts from now, not from the pause
                except WeenvError:
                    pass
                t.attached = not t.detached
        if not attached_before:
            self.attach(env_id, cgroup_path)

    def _learn(self, t: _Tracked) -> None:
        """Add what ``t`` did to its template's usage profile (when it ran long enough)."""
        if t.template is None or not t.history:
            return
        try:
            seen = summarize(
                t.template,
                t.resources.cpus,
                [h.cpu_used for h in t.history],
                [h.working_set for h in t.history],
                self.config.interval_s,
                startup_s=self.config.profile_startup_s,
                min_observed_s=self.config.profile_min_observed_s,
            )
            if seen is not None:
                self.profiles.record(seen)
        except (WeenvError, OSError, ValueError) as exc:  # a profile is a hint: never fail a destroy
            self._event(t.env_id, "error", f"usage profile of {t.template} not recorded: {exc}")

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds each attached environment has used so far (its cgroup
        read now; an unreadable one is left out): what a benchmark subtracts
        from the host's busy CPU to find the load of everything else."""
        with self._lock:
            envs = [t for t in self._envs.values() if t.attached and t.cgroup is not None]
        out = {}
        for t in envs:
            try:
                out[t.env_id] = t.cgroup.usage().cpu_usage_s
            except WeenvError:
                continue
        return out

    def set_priority(self, env_id: str, priority: int) -> None:
        """Higher priority: raised first, frozen last."""
        self._get(env_id).priority = priority

    def _get(self, env_id: str) -> _Tracked:
        with self._lock:
            t = self._envs.get(env_id)
        if t is None:
            raise NotFoundError(f"environment {env_id!r} is not provisioned")
        return t

    # --- node ---------------------------------------------------------------------------
    def _budget(self) -> Budget:
        cfg = self.config
        return Budget(
            cpu=self.cpu_capacity * cfg.cpu_overcommit,
            memory=int(self.memory_capacity * cfg.memory_overcommit),
            memory_capacity=self.memory_capacity,
            memory_available=self._meminfo().get("MemAvailable", self.memory_capacity),
            low_watermark=cfg.memory_low_watermark,
            critical_watermark=cfg.memory_critical_watermark,
            disk=None if self.disk_capacity is None else int(self.disk_capacity * cfg.disk_overcommit),
        )

    def predicted_cpu_peak(self, envs: list[_Tracked], new: _Tracked | None = None) -> float:
        """Cores: the predicted CPU peak of ``envs`` (plus a ``new`` environment's,
        from its template's profile or the prior)."""
        cfg, now = self.config, self.clock.time()
        moments = [t.cpu_moments(cfg, now) for t in envs + ([new] if new is not None else [])]
        return predicted_cpu_peak(moments, cfg.admission_sigmas)

    def burst_risk(self, envs: list[_Tracked], new: _Tracked | None = None) -> float:
        """The share of bursts that would meet contention among ``envs`` (plus a
        ``new`` environment): see ``ProvisionConfig.admission`` (``burst``).

        Each counts as busy at its declared cores (its ceiling) a share of the
        time, its *duty*: its mean usage over its ceiling, from its own history
        when it has ``admission_min_history_s`` of it, else from its template's
        usage profile, else from the history of the node's environments of its
        template (their pooled duty).  A ``new`` environment known by none of
        these is not judged here (0.0: the reservations admit it, as
        ``admission="reservations"`` would); others known by none count as
        busy as the known ones are on average.  A profile's burst counts at the
        ceiling too (its mean usage kept), as its history will once it has one,
        so the loads are few sizes and the computation stays small on large
        nodes (:func:`~weenv.node.provision.arbiter.burst_contention`)."""
        cfg, now = self.config, self.clock.time()
        everyone = envs + ([new] if new is not None else [])
        duty: dict[int, float | None] = {}
        seen: dict[str | None, list[tuple[float, float]]] = {}  # template -> (ceiling, duty) of those with history
        for t in everyone:
            m = t.observed_moments(cfg, now)
            d = None
            if m is not None:
                d = min(1.0, m.mean / t.resources.cpus)
                seen.setdefault(t.template, []).append((t.resources.cpus, d))
            elif t.profile is not None:
                d = min(1.0, t.profile.cpu_mean / t.resources.cpus)
            duty[id(t)] = d
        for t in everyone:  # no history nor profile: as busy as its template's others with a history
            if duty[id(t)] is None and t.template is not None and t.template in seen:
                duty[id(t)] = _pooled(seen[t.template])
        if new is not None and duty[id(new)] is None:
            return 0.0
        known = [(t.resources.cpus, duty[id(t)]) for t in everyone if duty[id(t)] is not None]
        pooled = _pooled(known)  # the new one is known: never empty
        moments = [CpuMoments.prior(t.resources.cpus, pooled if duty[id(t)] is None else duty[id(t)]) for t in everyone]
        return burst_contention(moments, self.cpu_capacity * cfg.admission_cpu_share)

    def _event(self, env_id: str | None, kind: str, message: str) -> None:
        self._events.append(_Event(self.clock.time(), env_id, kind, message))
        log.info("provision %s %s: %s", kind, env_id or "node", message)

    def events(self) -> list[ProvisionEvent]:
        return [ProvisionEvent(**e._asdict()) for e in list(self._events)]

    def stats(self, env_id: str | None = None, *, history: bool = True) -> ProvisionStats:
        """Node totals, each environment's quota, usage and history (or only
        ``env_id``'s: :class:`NotFoundError` if unknown), and recent events."""
        with self._lock:
            envs = list(self._envs.values())
        if env_id is not None:
            envs = [t for t in envs if t.env_id == env_id]
            if not envs:
                raise NotFoundError(f"environment {env_id!r} is not provisioned")
        static = self.config.mode != "elastic"
        out = []
        for t in envs:
            u = t.last
            out.append(
                EnvironmentProvision(
                    id=t.env_id,
                    priority=t.priority,
                    cpu_ceiling=t.resources.cpus,
                    memory_ceiling=t.resources.memory_bytes,
                    pids_limit=t.resources.pids,
                    cpu_quota=t.cpu_quota(self.config),
                    cpu_reservation=t.cpu_reservation,
                    memory_limit=t.resources.memory_bytes if static else t.memory_limit,
                    frozen=t.frozen,
                    oom_kills=u.oom_kills if u else 0,
                    throttled_s=u.cpu_throttled_s if u else 0.0,
                    throttled_periods=u.cpu_throttled_periods if u else 0,
                    memory_refused=t.refused,
                    history=[UsagePoint(**p._asdict()) for p in list(t.history)] if history else [],
                )
            )
        b = self._budget()
        everything = list(self._envs.values())
        totals = NodeTotals(
            cpu_capacity=self.cpu_capacity,
            memory_capacity=self.memory_capacity,
            cpu_budget=b.cpu,
            memory_budget=b.memory,
            cpu_quota_sum=sum(t.cpu_quota(self.config) for t in everything),
            cpu_reservation_sum=sum(t.cpu_reservation for t in everything),
            cpu_peak_predicted=self.predicted_cpu_peak([t for t in everything if not t.paused]),
            memory_limit_sum=sum(t.memory_limit for t in everything),
            cpu_used=sum(t.last_obs.cpu_cores for t in everything if t.last_obs),
            working_set=sum(t.last.memory_working_set for t in everything if t.last),
            memory_available=b.memory_available,
            admitting=self._admitting,
            environments=len(everything),
            frozen=sum(t.frozen for t in everything),
            paused=sum(t.paused for t in everything),
            disk_held=sum(self._disk_held.values()),
        )
        events = [
            ProvisionEvent(**e._asdict()) for e in list(self._events) if env_id is None or e.env_id in (None, env_id)
        ]
        return ProvisionStats(
            mode=self.config.mode, interval_s=self.config.interval_s, totals=totals, environments=out, events=events
        )
