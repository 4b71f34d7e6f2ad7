"""Usage profiles per template: how environments of one template use CPU and
memory, learned from those that ran it, kept on the node and published beside
the template (issue 19).

Environments of one template behave alike (the same task repository, the same
test suite), so the first environment of a known template is admitted and
sized from its template's profile at once, instead of from its declared
resources until it has a history of its own (Autopilot sizes a new task from
its job's history: Rzadca et al., EuroSys 2020, §3).

- the profile (:class:`UsageProfile`): CPU duty cycle and burst size, the p95
  of per-pass usage, memory working set and peak, decayed (half-life
  :data:`HALF_LIFE_S`) over the environments that ran the template;
- what one environment can teach is bounded: at most :data:`ENV_SHARE` of a
  profile it joins, and an *outlier* (OOM-killed, forks refused at its pids
  limit, or busy until it ended: a fork bomb, a memory bomb, a runaway loop,
  :mod:`~weenv.node.provision.outliers`) at most :data:`OUTLIER_SHARE`, and
  nothing when the profile has no normal environment yet: one abnormal
  environment cannot lock its template out of a node;
- a profile's weight decays with its age, and one that weighs less than
  :data:`MIN_OBSERVED_S` is forgotten; :meth:`TemplateProfiles.reset` forgets
  one at once (``weenv template profile --reset NAME``);
- on the node: ``<node home>/usage/<hex of the template digest>.json``, written
  atomically when an environment is detached (survives a daemon restart);
- in the store: canonical JSON as a manifest, the ref ``usage/<hex>`` pointing
  at it (as the prefetch profile: :mod:`weenv.packaging.profile`), published in
  a background thread.

Every read is bounded before it happens (:data:`MAX_USAGE_PROFILE_BYTES`: a
file's size is checked with ``stat``, a stored manifest's by the store's own
limit, then this one) and validated (:func:`parse_profile`): malformed JSON,
a profile of another template, non-finite or negative values are an
:class:`~weenv.errors.InvalidInputError`.  The node logs such a profile and
starts the template from its declared resources.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from weenv.errors import InvalidInputError, NotFoundError, WeenvError
from weenv.formats.manifest import MAX_CPUS, MAX_MEMORY_BYTES, Digest, canonical_json
from weenv.store.base import Store
from weenv.store.file import atomic_write

log = logging.getLogger(__name__)

REF_KIND = "usage"
MEDIA_TYPE = "application/vnd.weenv.usage.v1+json"
MAX_USAGE_PROFILE_BYTES = 64 << 10
"""A profile is a few hundred bytes; anything larger is refused unread."""
HALF_LIFE_S = 24 * 3600.0
"""What an environment taught weighs half as much a day later."""
MIN_OBSERVED_S = 5.0
"""An environment observed for less (seconds of history after its start-up) teaches nothing
(the default of ``ProvisionConfig.profile_min_observed_s``)."""
STARTUP_S = 2.0
"""The default of ``ProvisionConfig.profile_startup_s``: seconds of an environment's history left out of its profile: its start
(the exec agent, the create's first command) is not how it uses the node
afterwards, and an environment that lives a few seconds (a probe, a test) is
mostly start-up: counted, it taught its template a duty cycle of its start
alone, and burst admission then refused environments of that template on an
idle node."""
BUSY_SHARE = 0.2
"""A pass using more than this share of the environment's ceiling counts as busy."""
ENV_SHARE = 0.5
"""The largest share of a profile one environment's merge may take."""
OUTLIER_SHARE = 0.05
"""The largest share of a profile an outlier's merge may take."""


class UsageProfile(BaseModel):
    """How environments of ``template`` used CPU (cores) and memory (bytes)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    schema_version: Literal[1] = 1
    media_type: Literal["application/vnd.weenv.usage.v1+json"] = MEDIA_TYPE
    template: Digest
    cpu_duty: float = Field(ge=0, le=1)
    """Share of time busy: mean usage / ``cpu_burst``."""
    cpu_burst: float = Field(ge=0, le=MAX_CPUS)
    """Cores used while busy (mean of the busy passes)."""
    cpu_p95: float = Field(ge=0, le=MAX_CPUS)
    """p95 of per-pass usage (cores): what the policy's reservation follows."""
    memory_working_set: int = Field(ge=0, le=MAX_MEMORY_BYTES)
    """Mean working set (usage minus inactive file pages)."""
    memory_peak: int = Field(ge=0, le=MAX_MEMORY_BYTES)
    """Largest working set."""
    seconds: float = Field(gt=0)
    """Observed seconds behind the profile, decayed: its weight in a merge."""
    environments: int = Field(ge=1)
    updated: float = Field(ge=0)
    """Unix time of the last merge."""
    outliers: int = Field(default=0, ge=0)
    """Of ``environments``, those merged as outliers (each weighed at most :data:`OUTLIER_SHARE`)."""

    @model_validator(mode="after")
    def _consistent(self) -> UsageProfile:
        if self.memory_peak < self.memory_working_set:
            raise ValueError(f"memory_peak {self.memory_peak} below memory_working_set {self.memory_working_set}")
        return self

    @property
    def cpu_mean(self) -> float:
        return self.cpu_duty * self.cpu_burst

    def weight(self, now: float, half_life_s: float = HALF_LIFE_S) -> float:
        """Its observed seconds decayed to ``now`` (Unix time): its weight in a merge."""
        return self.seconds * 0.5 ** (max(0.0, now - self.updated) / half_life_s)

    def merged(self, new: UsageProfile, *, outlier: bool = False, half_life_s: float = HALF_LIFE_S) -> UsageProfile:
        """This profile decayed to ``new.updated`` and ``new`` added, weighted by observed seconds,
        its share at most :data:`ENV_SHARE` (an ``outlier``'s: :data:`OUTLIER_SHARE`); the peak is
        the larger of ``new``'s and the weighted one (memory running out kills), unless ``outlier``."""
        if new.template != self.template:
            raise InvalidInputError(f"usage profile of {new.template} merged into {self.template}'s")
        w0 = self.weight(new.updated, half_life_s)
        k = min(new.seconds / (w0 + new.seconds), OUTLIER_SHARE if outlier else ENV_SHARE)
        w1 = w0 * k / (1 - k)  # the new one's weight, bounded

        def mix(a: float, b: float) -> float:
            return a + (b - a) * k

        burst = mix(self.cpu_burst, new.cpu_burst)
        mean = mix(self.cpu_mean, new.cpu_mean)
        ws = int(mix(self.memory_working_set, new.memory_working_set))
        return UsageProfile(
            template=self.template,
            cpu_duty=min(1.0, mean / burst) if burst > 0 else 0.0,
            cpu_burst=burst,
            cpu_p95=mix(self.cpu_p95, new.cpu_p95),
            memory_working_set=ws,
            memory_peak=max(ws, int(mix(self.memory_peak, new.memory_peak)), 0 if outlier else new.memory_peak),
            seconds=w0 + w1,
            environments=self.environments + new.environments,
            updated=new.updated,
            outliers=self.outliers + new.outliers + (new.environments if outlier else 0),
        )


def summarize(
    template: str,
    cpu_ceiling: float,
    cpu: list[float],
    working_sets: list[int],
    interval_s: float,
    *,
    now: float | None = None,
    startup_s: float = STARTUP_S,
    min_observed_s: float = MIN_OBSERVED_S,
) -> UsageProfile | None:
    """One environment's profile from its per-pass CPU usage (cores) and working
    sets (bytes), ``interval_s`` apart, from its start: the CPU of its first
    ``startup_s`` seconds is left out (its memory is not: a peak there
    is one the next will need too); None if observed less than
    ``min_observed_s`` after them.  Non-finite or negative samples are an
    :class:`InvalidInputError`."""
    cpu = cpu[math.ceil(startup_s / interval_s - 1e-9) :]  # memory keeps its start: a peak there is one it needs
    if len(cpu) * interval_s < min_observed_s or not working_sets:
        return None
    if any(not math.isfinite(x) or x < 0 for x in cpu) or any(w < 0 for w in working_sets):
        raise InvalidInputError("usage samples must be finite and non-negative")
    from weenv.node.provision.policy import percentile

    cpu = [min(x, cpu_ceiling) for x in cpu]
    busy = [x for x in cpu if x > BUSY_SHARE * cpu_ceiling]
    mean = sum(cpu) / len(cpu)
    burst = sum(busy) / len(busy) if busy else max(cpu)
    return UsageProfile(
        template=template,
        cpu_duty=min(1.0, mean / burst) if burst > 0 else 0.0,
        cpu_burst=burst,
        cpu_p95=percentile(cpu, 95),
        memory_working_set=int(sum(working_sets) / len(working_sets)),
        memory_peak=max(working_sets),
        seconds=len(cpu) * interval_s,
        environments=1,
        updated=time.time() if now is None else now,
    )


def parse_profile(data: bytes, template: str) -> UsageProfile:
    """``data`` (JSON) as the usage profile of ``template``; raises
    :class:`InvalidInputError` if larger than :data:`MAX_USAGE_PROFILE_BYTES`,
    malformed, out of range, or another template's."""
    if len(data) > MAX_USAGE_PROFILE_BYTES:
        raise InvalidInputError(f"usage profile of {len(data)} bytes, more than {MAX_USAGE_PROFILE_BYTES}")
    try:
        profile = UsageProfile.model_validate_json(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(x) for x in err.get("loc", ())) or "profile"
        raise InvalidInputError(f"bad usage profile of {template}: {where}: {err['msg']}") from None
    if profile.template != template:
        raise InvalidInputError(f"usage profile of {profile.template} where {template}'s was expected")
    return profile


def ref_name(template: str) -> str:
    return template.split(":", 1)[1]


def load_published(store: Store, template: str) -> UsageProfile | None:
    """The profile published for ``template`` in ``store``, or None if none is.
    Raises :class:`InvalidInputError` for a bad one (see :func:`parse_profile`)
    and the store's errors."""
    try:
        digest = store.get_ref(REF_KIND, ref_name(template))
        data = store.get_manifest(digest)  # bounded by the store's manifest limit before it is read
    except NotFoundError:
        return None
    return parse_profile(data, template)


def publish(store: Store, profile: UsageProfile) -> str:
    """Store ``profile`` and point ``usage/<hex>`` at it; return its digest."""
    digest = store.put_manifest(canonical_json(profile))
    store.set_ref(REF_KIND, ref_name(profile.template), digest)
    return digest


class TemplateProfiles:
    """The node's usage profiles: in memory, in ``directory`` (None: memory only)
    and published to ``store`` (None: not published).  Thread-safe."""

    def __init__(self, directory: Path | None = None, store: Store | None = None, *, half_life_s: float = HALF_LIFE_S):
        self.directory = directory
        self.store = store
        self.half_life_s = half_life_s
        """How fast what environments taught fades (a profile's weight halves in this many seconds)."""
        self.min_weight_s = MIN_OBSERVED_S
        """A profile weighing less (decayed seconds) is forgotten."""
        self._lock = threading.Lock()
        self._known: dict[str, UsageProfile | None] = {}  # template digest -> profile (None: looked up, none)
        self._publishers: list[threading.Thread] = []

    def _path(self, template: str) -> Path:
        return self.directory / f"{ref_name(template)}.json"

    def _read_local(self, template: str) -> UsageProfile | None:
        if self.directory is None:
            return None
        path = self._path(template)
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return None
        if size > MAX_USAGE_PROFILE_BYTES:
            raise InvalidInputError(f"{path}: usage profile of {size} bytes, more than {MAX_USAGE_PROFILE_BYTES}")
        with open(path, "rb") as f:
            return parse_profile(f.read(MAX_USAGE_PROFILE_BYTES + 1), template)

    def get(self, template: str, *, now: float | None = None) -> UsageProfile | None:
        """``template``'s profile: this node's, else the store's (looked up once
        per process), else None.  A bad profile is logged and counts as none,
        and so does one whose weight at ``now`` (default: the time now) has
        decayed below :attr:`min_weight_s`."""
        profile = self._get(template)
        now = time.time() if now is None else now
        if profile is not None and profile.weight(now, self.half_life_s) < self.min_weight_s - 1e-9:
            return None
        return profile

    def _get(self, template: str) -> UsageProfile | None:
        with self._lock:
            if template in self._known:
                return self._known[template]
        profile = None
        for where, read in (("node", self._read_local), ("store", self._read_store)):
            try:
                profile = read(template)
            except (InvalidInputError, WeenvError, OSError) as exc:
                log.warning("usage profile of %s on the %s unreadable: %s", template, where, exc)
                continue
            if profile is not None:
                break
        with self._lock:
            return self._known.setdefault(template, profile)

    def _read_store(self, template: str) -> UsageProfile | None:
        return None if self.store is None else load_published(self.store, template)

    def record(self, new: UsageProfile, *, outlier: bool = False) -> UsageProfile | None:
        """Merge one environment's ``new`` profile into its template's, keep it
        on the node and publish it (in the background); return the merged one.
        An ``outlier`` weighs at most :data:`OUTLIER_SHARE` and teaches nothing
        to a template with no profile yet (None is returned then)."""
        old = self.get(new.template, now=new.updated)
        if old is None and outlier:
            return None
        merged = old.merged(new, outlier=outlier, half_life_s=self.half_life_s) if old is not None else new
        with self._lock:
            self._known[new.template] = merged
            if self.directory is not None:
                self.directory.mkdir(parents=True, exist_ok=True)
                atomic_write(self._path(new.template), canonical_json(merged), durable=False)
            if self.store is not None:
                self._publishers = [t for t in self._publishers if t.is_alive()]
                t = threading.Thread(target=self._publish, args=(merged,), name="weenv-usage-publish", daemon=True)
                t.start()
                self._publishers.append(t)
        return merged

    def reset(self, template: str) -> bool:
        """Forget ``template``'s profile: in memory, on the node and in the store
        (after the publications under way, which would bring it back); return
        whether there was one.  Raises the store's errors."""
        self.close()
        had = self._get(template) is not None
        with self._lock:
            self._known[template] = None
            if self.directory is not None:
                try:
                    self._path(template).unlink()
                    had = True
                except FileNotFoundError:
                    pass
        if self.store is not None and self.store.ref_or_none(REF_KIND, ref_name(template)) is not None:
            self.store.delete_ref(REF_KIND, ref_name(template))
            had = True
        return had

    def _publish(self, profile: UsageProfile) -> None:
        try:
            publish(self.store, profile)
        except Exception as exc:  # publishing is a hint to other nodes; the node's copy stays
            log.warning("publishing the usage profile of %s: %s", profile.template, exc)

    def close(self) -> None:
        """Wait for publications under way (at most 10 s each)."""
        with self._lock:
            threads, self._publishers = self._publishers, []
        for t in threads:
            t.join(timeout=10)
