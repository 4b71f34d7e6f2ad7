"""Models of elastic provisioning: its configuration and what it reports.

Shared by the controller, the node, the HTTP server and its client, as the
node's other models are (:mod:`weenv.api.models`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from weenv.config import settings
from weenv.node.provision.profiles import HALF_LIFE_S, MIN_OBSERVED_S, STARTUP_S

MIB = 1 << 20


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ProvisionConfig(_Model):
    """How the node sizes environments.  Times in seconds, memory in bytes, CPU in cores.

    Defaults are chosen for agent environments that idle for seconds and burst
    for seconds to minutes; the sources of each rule are in
    :mod:`weenv.node.provision.policy`.  ``from_env`` reads
    ``WEENV_PROVISION_MODE``, ``WEENV_PROVISION_INTERVAL``,
    ``WEENV_CPU_OVERCOMMIT``, ``WEENV_MEMORY_OVERCOMMIT``, ``WEENV_CPU_QUOTA_AT``,
    ``WEENV_ADMISSION``, ``WEENV_ADMISSION_SIGMAS``, ``WEENV_ADMISSION_WAIT`` and ``WEENV_RECLAIM``.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    mode: Literal["elastic", "static", "off"] = "elastic"
    """``elastic``: quotas follow usage, admission by usage; ``static``: each
    environment keeps its declared resources and is admitted by them; ``off``:
    no admission check, no adjustment."""
    interval_s: float = Field(default=1.0, gt=0)
    """Time between two passes of the controller."""
    check_interval_s: float = Field(default=0.1, gt=0)
    """Between passes, every this long, a cheap check (two files per
    environment) starts a pass at once when tasks wait at their memory limit
    (v1) or, with ``cpu_quota_at="reservation"``, when the last check's
    periods were throttled at least ``cpu_throttle_trigger``: raising is
    urgent, lowering waits for the regular pass."""

    cpu_window_s: float = Field(default=30.0, gt=0)
    """Recent usage the CPU percentile is taken over."""
    cpu_percentile: float = Field(default=95.0, gt=0, le=100)
    cpu_headroom: float = Field(default=0.3, ge=0)
    """Quota = percentile × (1 + headroom), and at least percentile + ``cpu_min_headroom``."""
    cpu_min_headroom: float = Field(default=0.1, ge=0)
    cpu_floor: float = Field(default=0.1, gt=0)
    cpu_initial: float = Field(default=0.5, gt=0)
    """Quota of a new environment before anything is observed (capped at its
    ceiling and at what is free; a new environment needs only its floor free)."""
    cpu_throttle_trigger: float = Field(default=0.05, ge=0, le=1)
    """Share of an interval's periods throttled that raises the quota at once."""
    cpu_raise_factor: float = Field(default=2.0, ge=1)
    cpu_cooldown_s: float = Field(default=10.0, ge=0)
    """No lowering until this long after the last raise."""
    cpu_down_step: float = Field(default=0.2, gt=0, le=1)
    """A lowering takes at most this share of the quota per pass."""

    memory_half_life_s: float = Field(default=60.0, gt=0)
    """Half-life of the decayed peak of the working set."""
    memory_headroom: float = Field(default=0.2, ge=0)
    memory_min_headroom: int = Field(default=64 * MIB, ge=0)
    memory_floor: int = Field(default=64 * MIB, gt=0)
    memory_initial: int = Field(default=256 * MIB, gt=0)
    memory_raise_at: float = Field(default=0.85, gt=0, le=1)
    """Working set at this share of the limit raises it at once."""
    memory_raise_factor: float = Field(default=1.5, ge=1)
    memory_hold_s: float = Field(default=30.0, ge=0)
    """No lowering until this long after the last raise or pressure."""
    memory_down_step: float = Field(default=0.1, gt=0, le=1)
    """A lowering takes at most this share of the limit per pass."""
    reclaim: bool = True
    """Idle memory reclaimed (``WEENV_RECLAIM``, default on): an environment
    using less than ``memory_idle_cpu`` cores for ``memory_idle_after_s`` is
    idle (its agent waits for the model), and each pass asks the kernel to
    reclaim ``memory_idle_step`` of its memory above its working set plus
    ``memory_min_headroom`` (:meth:`~weenv.node.cgroups.Cgroup.reclaim`:
    v2 ``memory.reclaim``; v1 its limit lowered and put back at once), so
    the page cache it does not touch goes back to the host.  Its limit is
    not lowered for it: when it bursts again nothing waits for the
    controller, and no task within its limit is OOM-killed.  (A limit that
    followed the working set down, as this first did, fell under pooled and
    provisioned environments of the test suite.)  What it reclaimed, the
    pages it needed again (refaults) and the seconds it waited for memory
    are in its :class:`EnvironmentProvision`."""
    memory_idle_after_s: float = Field(default=5.0, ge=0)
    memory_idle_cpu: float = Field(default=0.05, ge=0)
    memory_idle_step: float = Field(default=0.25, gt=0, le=1)
    oom_wait: bool = True
    """Below its ceiling an environment that reaches its limit waits for the
    controller instead of being OOM-killed (cgroup v1 ``oom_kill_disable``)."""

    cpu_quota_at: Literal["ceiling", "reservation"] = "ceiling"
    """What the CFS quota of an elastic environment is.  ``ceiling`` (default):
    its declared cores, always, so a burst never waits for the controller; the
    elastic value (percentile + headroom, raised at once, lowered slowly) is
    then its *reservation*: what admission and the arbiter count against
    capacity × ``cpu_overcommit``, while contended cores are split by CFS
    weights (equal).  ``reservation``: the elastic value is written as the CFS
    quota, so a burst after idle runs at the idle quota until a pass raises it
    (measured in ``weenv bench provision``: p95 burst slowdown 12.5× against
    the unloaded run on 2 cores, most of it waiting for quota)."""

    cpu_capacity: float | None = Field(default=None, gt=0)
    """Cores the node gives environments (default: all online CPUs)."""
    memory_capacity: int | None = Field(default=None, gt=0)
    """Bytes the node gives environments (default: MemTotal minus ``memory_reserve``)."""
    memory_reserve: int = Field(default=1 << 30, ge=0)
    cpu_overcommit: float = Field(default=4.0, gt=0)
    """CPU is compressible (a quota short of demand throttles, never kills), so
    the sum of CPU quotas may exceed the cores; memory is not (default 1)."""
    memory_overcommit: float = Field(default=1.0, gt=0)
    disk_overcommit: float = Field(default=4.0, gt=0)
    """The sum of the environments' declared disk limits (``disk_bytes``, hard
    quotas) stays within the node disk's size × this (:mod:`weenv.node.disk`).
    Above 1 the disk is thin-provisioned, as cloud block storage is: default 4,
    since a rollout writes a small share of its declared disk, and a node of
    10 GiB environments on a 60 GiB disk would otherwise hold six.  The host is
    guarded either way (the node disk is an image of a fixed size); environments
    filling it together get ``ENOSPC`` before their own limits.  At 1 an
    environment always gets the bytes it declared."""
    memory_low_watermark: float = Field(default=0.10, ge=0, le=1)
    """Host MemAvailable below this share of capacity: stop admitting."""
    memory_critical_watermark: float = Field(default=0.05, ge=0, le=1)
    """Host MemAvailable below this share: freeze the lowest-priority environment."""
    history: int = Field(default=900, gt=0)
    """Samples kept per environment."""
    profile_startup_s: float = Field(default=STARTUP_S, ge=0)
    """Seconds of an environment's start left out of the usage profile it
    teaches its template (:data:`~weenv.node.provision.profiles.STARTUP_S`)."""
    profile_half_life_s: float = Field(default=HALF_LIFE_S, gt=0)
    """What environments taught their template's usage profile weighs half as much this long
    after; a profile that weighs less than ``profile_min_observed_s`` is forgotten
    (:data:`~weenv.node.provision.profiles.HALF_LIFE_S`)."""
    profile_min_observed_s: float = Field(default=MIN_OBSERVED_S, gt=0)
    """An environment observed for less after its start teaches its template nothing
    (:data:`~weenv.node.provision.profiles.MIN_OBSERVED_S`)."""

    admission: Literal["burst", "peak", "reservations", "static"] = "burst"
    """How a new environment is admitted in ``elastic`` mode.

    ``burst`` (default) admits by a **latency objective**: at most
    ``admission_burst_risk`` (2 %) of bursts may meet other environments'
    bursts beyond the node's cores, so that a burst's p95 latency stays that
    of the burst alone, as under static provisioning (``weenv bench
    provision`` measures it: ``p95_slowdown_vs_static``, goal at most 1.05).
    Each environment counts as busy at its declared cores a share of the
    time (its duty cycle): from its own usage over ``admission_window_s``
    once it has ``admission_min_history_s`` of it, else from its
    **template's usage profile** (:mod:`~weenv.node.provision.profiles`:
    learned from the environments that ran the template, after their
    start-up, on this node or, through the store, on another), else as busy
    as the node's environments of its template with a history are on
    average; the probability that a burst of any of them meets others using
    more than the remaining cores is
    :func:`~weenv.node.provision.arbiter.burst_contention`.  Environments
    whose declared cores fit the node's cores together never meet
    contention: they are always admitted (risk 0).  A new environment known
    by none of these (an unknown template, nothing of it running long
    enough) is admitted as ``reservations`` admits it: the burst model
    refuses only on evidence (issue 19: counted as busy
    ``admission_prior_duty`` of the time, on 2 cores a third 1-core
    environment, or a second 2-core one, was refused with nothing known);
    others known by none count as busy as the known ones are on average.
    The sum of reservations stays within capacity × ``cpu_overcommit`` too.

    ``reservations`` admits while the reservations held fit capacity ×
    ``cpu_overcommit`` (idle environments weigh their floor, however they
    burst: no latency objective).  ``peak``: the node's predicted CPU peak
    with the new environment, Σ mean + ``admission_sigmas`` × √(Σ variance)
    of each environment's per-pass usage (the N-sigma predictor of Bashir et
    al., EuroSys 2021), capped at the sum of ceilings, within
    ``cpu_capacity`` × ``admission_cpu_share``.  ``static``
    (``WEENV_ADMISSION=static``, for comparison): sets ``mode="static"``,
    each environment admitted by and held at its declared resources."""
    admission_sigmas: float = Field(default=2.0, ge=0)
    admission_window_s: float = Field(default=300.0, gt=0)
    admission_min_history_s: float = Field(default=20.0, ge=0)
    admission_prior_duty: float = Field(default=0.25, ge=0, le=1)
    """``admission="peak"``: an environment known by nothing counts as busy at
    its declared cores this share of the time."""
    admission_cpu_share: float = Field(default=1.0, gt=0)
    admission_burst_risk: float = Field(default=0.02, gt=0, le=1)
    """``admission="burst"``: the largest share of bursts allowed to meet
    contention (below 5 % for a p95 burst latency near the unloaded one)."""
    admission_wait_s: float = Field(default=20.0, ge=0, le=3600)
    """``admission="burst"``: how long a create the latency objective refuses
    waits for room before :class:`~weenv.errors.CapacityError`, as a create
    on E2B or Modal waits for capacity rather than failing.  It is admitted
    as soon as the objective holds: after each controller pass and each
    environment that ends, the risk is computed again, and the running
    environments' own usage replaces their template's profile once they have
    ``admission_min_history_s`` (20 s) of it (a profile that predicted too
    much is then corrected).  0: refuse at once.  Only creates wait (a
    resume, a reset or an adoption is judged at once).  Refusals by memory, disk or the
    reservations do not wait: those are resources held, not predictions."""

    @model_validator(mode="after")
    def _static_admission(self) -> ProvisionConfig:
        if self.admission == "static" and self.mode == "elastic":
            self.mode = "static"
        return self

    @classmethod
    def from_env(cls) -> ProvisionConfig:
        keys = {
            "mode": "WEENV_PROVISION_MODE",
            "interval_s": "WEENV_PROVISION_INTERVAL",
            "cpu_overcommit": "WEENV_CPU_OVERCOMMIT",
            "memory_overcommit": "WEENV_MEMORY_OVERCOMMIT",
            "disk_overcommit": "WEENV_DISK_OVERCOMMIT",
            "cpu_quota_at": "WEENV_CPU_QUOTA_AT",
            "admission": "WEENV_ADMISSION",
            "admission_sigmas": "WEENV_ADMISSION_SIGMAS",
            "admission_wait_s": "WEENV_ADMISSION_WAIT",
            "reclaim": "WEENV_RECLAIM",
        }
        from pydantic import ValidationError

        from weenv.errors import InvalidInputError

        given = settings().provision.model_dump()
        try:
            return cls(**given)
        except ValidationError as exc:
            err = exc.errors()[0]
            field = str(err["loc"][0]) if err.get("loc") else ""
            var = keys.get(field, field)
            raise InvalidInputError(f"bad {var}={given.get(field)!r} in the environment: {err['msg']}") from None


class UsagePoint(_Model):
    """One pass of the controller over one environment."""

    t: float
    """Unix time, seconds."""
    cpu_used: float
    """Cores used on average since the previous pass."""
    cpu_quota: float | None
    """CFS quota written (cores)."""
    cpu_reservation: float | None = None
    """What admission and the arbiter count for it (cores; the elastic value)."""
    throttled: float
    """Share of the interval's CFS periods that were throttled."""
    memory_usage: int
    working_set: int
    memory_limit: int | None
    pids: int
    frozen: bool = False


class EnvironmentProvision(_Model):
    id: str
    priority: int
    cpu_ceiling: float
    memory_ceiling: int
    pids_limit: int
    cpu_quota: float | None
    """CFS quota written (cores)."""
    cpu_reservation: float | None = None
    """What admission and the arbiter count for it (cores)."""
    memory_limit: int | None
    frozen: bool
    oom_kills: int
    throttled_s: float
    """Seconds its tasks were throttled (the kernel's ``throttled_time`` /
    ``throttled_usec``).  The kernel accounts it apart from the throttled
    periods, when a throttled group is let run again, and not at all for a
    group throttled with no task queued (the kernel patch "sched: don't account
    throttle time for empty groups"), so it can stay 0 while periods were
    throttled: not the signal the controller acts on, see ``throttled_periods``."""
    throttled_periods: int = 0
    """CFS periods in which its quota ran out (``nr_throttled``): what the
    controller reacts to (``cpu_throttle_trigger`` of a pass's periods)."""
    memory_refused: int
    """Lowerings the kernel refused (usage could not be reclaimed)."""
    memory_reclaimed: int = 0
    """Bytes reclaimed while it was idle (``ProvisionConfig.reclaim``)."""
    memory_refaults: int = 0
    """Pages evicted and needed again since it started (what reclaim cost it)."""
    memory_stall_s: float = 0.0
    """Seconds its tasks waited for memory since it started: at its limit (v1, seen by the
    controller's checks) or in memory pressure (v2 PSI)."""
    history: list[UsagePoint] = Field(default_factory=list)


class ProvisionEvent(_Model):
    t: float
    env_id: str | None = None
    kind: str
    """``raise``, ``lower``, ``refused``, ``freeze``, ``thaw``, ``admission``, ``shortage``, ``gone``, ``error``."""
    message: str


class NodeTotals(_Model):
    cpu_capacity: float
    memory_capacity: int
    cpu_budget: float
    """Capacity × overcommit: the sum of reservations stays within it."""
    memory_budget: int
    cpu_quota_sum: float
    """Sum of CFS quotas written; with ``cpu_quota_at="ceiling"`` it may exceed
    the budget (a quota caps an environment, it reserves nothing)."""
    cpu_reservation_sum: float = 0.0
    """Sum of reservations (elastic values), within ``cpu_budget``."""
    cpu_peak_predicted: float = 0.0
    """The node's predicted CPU peak (cores) from its environments' usage,
    which ``admission="peak"`` keeps within capacity (see
    :func:`~weenv.node.provision.arbiter.predicted_cpu_peak`)."""
    memory_limit_sum: int
    cpu_used: float
    working_set: int
    memory_available: int
    """Host ``MemAvailable``."""
    admitting: bool
    environments: int
    frozen: int
    paused: int = 0
    """Environments paused by their users: their memory and disk limits count, their CPU does not."""
    disk_held: int = 0
    """Bytes of the node's disk held outside the environments' limits (snapshots' captures), counted in admission."""


class ProvisionStats(_Model):
    mode: str
    interval_s: float
    totals: NodeTotals
    environments: list[EnvironmentProvision]
    events: list[ProvisionEvent]
