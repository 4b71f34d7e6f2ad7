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

import dataclasses
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import NamedTuple, Protocol

from weenv.errors import BusyError, CapacityError, ClosedError, InvalidInputError, NotFoundError, WeenvError
from weenv.formats.manifest import Resources
from weenv.node.cgroups import Cgroup, LimitRefusedError, Pressure, Usage, open_cgroups
from weenv.node.provision.arbiter import (
    Budget,
    Claim,
    CpuMoments,
    CpuWindow,
    admits,
    arbitrate,
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
from weenv.node.provision.outliers import outlier_reason
from weenv.node.provision.policy import EnvPolicy, Observation
from weenv.node.provision.profiles import OUTLIER_SHARE, TemplateProfiles, UsageProfile, summarize
from weenv.node.provision.refusals import OBJECTIVES, held_by

log = logging.getLogger(__name__)
RECLAIM_MIN_BYTES = 4 << 20
"""Less than this above what an idle environment may keep is not worth a reclaim."""


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
        self.first: Usage | None = None
        """Its cgroup's counters when it was attached."""
        self.reclaimed = 0
        """Bytes reclaimed while it was idle."""
        self.stall_s = 0.0
        """Seconds the checks saw its tasks waiting at its memory limit (v1)."""
        self.checked = 0.0
        """Monotonic seconds of the last check (:meth:`Provisioner._urgent`)."""
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


def _pooled(known: list[tuple[float, float]]) -> float:
    """The duty of ``known`` (ceiling, duty) pairs together: busy core-time over ceiling core-time."""
    return sum(c * d for c, d in known) / sum(c for c, _ in known)


def profile_moments(profile: UsageProfile, ceiling: float) -> CpuMoments:
    """A template profile's CPU as on/off usage: busy at its burst size (at most
    ``ceiling``, cores) its duty cycle of the time."""
    burst = min(profile.cpu_burst, ceiling) or ceiling
    return CpuMoments.prior(burst, profile.cpu_duty)


class Provisioner:
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
        self.profiles.half_life_s = self.config.profile_half_life_s
        self.profiles.min_weight_s = self.config.profile_min_observed_s
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
            now = self.clock.monotonic()
            if p.memory_under_oom and prev is not None:  # v1: its tasks wait at the limit (v2 counts it itself)
                t.stall_s += min(now - t.checked, self.config.interval_s)
            t.checked = now
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
        profile = (
            self.profiles.get(template, now=self.clock.time()) if template is not None and cfg.mode != "off" else None
        )
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
        refusal = admits(**check, burst_risk=risk, burst_risk_budget=cfg.admission_burst_risk)
        if refusal is None:
            return None, False
        why = f"{OBJECTIVES[refusal.objective]} refused it: {refusal}; {self._holders(refusal.objective, t)}"
        return why, risk is not None and admits(**check) is None

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
            t.last = t.first = cg.usage()
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
            if seen is None:
                return
            u = t.last
            outlier = outlier_reason(
                [h.cpu_used for h in t.history],
                t.resources.cpus,
                self.config.interval_s,
                oom_kills=u.oom_kills if u else 0,
                pids_refused=u.pids_failcnt if u else 0,
                startup_s=self.config.profile_startup_s,
            )
            merged = self.profiles.record(seen, outlier=outlier is not None)
            if outlier is not None:
                taught = (
                    f"weighed at most {OUTLIER_SHARE:.0%} of its profile"
                    if merged is not None
                    else "nothing (no profile of normal environments to weigh it against)"
                )
                self._event(t.env_id, "profile", f"an outlier ({outlier}): taught its template {taught}")
        except (WeenvError, OSError, ValueError) as exc:  # a profile is a hint: never fail a destroy
            self._event(t.env_id, "error", f"usage profile of {t.template} not recorded: {exc}")

    def reset_profile(self, template: str) -> bool:
        """Forget ``template``'s usage profile (:meth:`TemplateProfiles.reset`):
        new environments of it, and those running that were admitted from it,
        are judged from then on by their own usage, else as the unknown are;
        return whether it had one."""
        had = self.profiles.reset(template)
        with self._lock:
            for t in self._envs.values():
                if t.template == template:
                    t.profile = None
                    t.policy.known_peak = 0
        self._event(None, "profile", f"usage profile of {template} reset" + ("" if had else " (it had none)"))
        self._wake()  # creates waiting for room judge without it
        return had

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
                        self._reclaim(t)
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

    def _reclaim(self, t: _Tracked) -> None:
        """Ask the kernel for ``memory_idle_step`` of what an idle ``t`` holds
        above what its policy lets it keep (:attr:`Want.reclaim_to`), its limit
        unchanged, and count what went (under ``t.lock``)."""
        w, u = t.want, t.last
        if w is None or w.reclaim_to is None or u is None or t.frozen:
            return
        excess = u.memory_usage - w.reclaim_to
        if excess < RECLAIM_MIN_BYTES:
            return
        t.cgroup.reclaim(max(RECLAIM_MIN_BYTES, int(excess * self.config.memory_idle_step)))
        t.reclaimed += max(0, u.memory_usage - t.cgroup.usage().memory_usage)

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
        duty = {k: d for k, (d, _why) in self._duties(everyone, now).items()}
        if new is not None and duty[id(new)] is None:
            return 0.0
        known = [(t.resources.cpus, duty[id(t)]) for t in everyone if duty[id(t)] is not None]
        pooled = _pooled(known)  # the new one is known: never empty
        moments = [CpuMoments.prior(t.resources.cpus, pooled if duty[id(t)] is None else duty[id(t)]) for t in everyone]
        return burst_contention(moments, self.cpu_capacity * cfg.admission_cpu_share)

    def _duties(self, everyone: list[_Tracked], now: float) -> dict[int, tuple[float | None, str]]:
        """Each one's duty (by ``id``) as :meth:`burst_risk` counts it, and where it comes from
        (None: known by nothing)."""
        cfg = self.config
        out: dict[int, tuple[float | None, str]] = {}
        seen: dict[str | None, list[tuple[float, float]]] = {}  # template -> (ceiling, duty) of those with history
        for t in everyone:
            m = t.observed_moments(cfg, now)
            if m is not None:
                d = min(1.0, m.mean / t.resources.cpus)
                seen.setdefault(t.template, []).append((t.resources.cpus, d))
                out[id(t)] = (d, "its own usage")
            elif t.profile is not None:
                out[id(t)] = (min(1.0, t.profile.cpu_mean / t.resources.cpus), "its template's usage profile")
            else:
                out[id(t)] = (None, "nothing known")
        for t in everyone:  # no history nor profile: as busy as its template's others with a history
            if out[id(t)][0] is None and t.template is not None and t.template in seen:
                out[id(t)] = (_pooled(seen[t.template]), "its template's others running")
        return out

    def _holders(self, objective: str, new: _Tracked) -> str:
        """The environments holding what ``objective`` counts against ``new``, most first (under ``_lock``)."""
        envs = [e for e in self._envs.values() if not (e.paused and objective in ("burst", "peak"))]
        rows: list[tuple[float, str]] = []
        if objective in ("burst", "peak"):
            duties = self._duties([*envs, new], self.clock.time())
            known = [(e.resources.cpus, d) for e in [*envs, new] for d, _ in [duties[id(e)]] if d is not None]
            for e in envs:
                d, why = duties[id(e)]
                if d is None and known:
                    d, why = _pooled(known), "nothing known: as busy as the known ones on average"
                busy = "" if d is None else f", busy {d:.0%} of the time"
                cores = f"{e.resources.cpus:g} core{'' if e.resources.cpus == 1 else 's'}"
                rows.append((e.resources.cpus * (d or 0.0), f"{e.env_id} ({cores}{busy}: {why})"))
        elif objective == "cpu":
            rows = [(e.cpu_reservation, f"{e.env_id} ({e.cpu_reservation:.2f} cores reserved)") for e in envs]
        elif objective == "memory":
            rows = [(e.policy.memory_held(), f"{e.env_id} ({e.policy.memory_held() >> 20} MiB)") for e in envs]
        elif objective == "host":
            used = {e.env_id: e.last.memory_working_set if e.last else 0 for e in envs}
            rows = [(n, f"{k} ({n >> 20} MiB used)") for k, n in used.items()]
        elif objective == "disk":
            rows = [(e.resources.disk_bytes, f"{e.env_id} ({e.resources.disk_bytes >> 20} MiB)") for e in envs]
            rows += [(n, f"{k} ({n >> 20} MiB kept)") for k, n in self._disk_held.items()]
        elif objective == "shortage":
            rows = [(1.0, f"{e.env_id} (its memory growth does not fit)") for e in envs if e.env_id in self._short]
        return held_by(objective, rows)

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
                    memory_reclaimed=t.reclaimed,
                    memory_refaults=u.memory_refaults - t.first.memory_refaults if u and t.first else 0,
                    memory_stall_s=t.stall_s + (u.memory_stall_s - t.first.memory_stall_s if u and t.first else 0.0),
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
