"""The environment tax: seconds a rollout spends in environment operations.

Pure logic, no I/O, shared by the SDK's meter (:mod:`weenv.sdk.meter`), the
node daemon (``weenv_env_seconds_total{phase}``, :mod:`weenv.server.tax`) and
``weenv stats --tax``.

Phases (:data:`PHASES`) of an environment's operations, as the API's routes
name them (:func:`phase_of`):

==========  =================================================================
create      ``POST /v1/environments`` and ``/environments/batch``: the create
            and every wait in it (admission, store, mounts, runc, first command)
exec        commands and processes: the time of a command's call *beyond the
            command's own run time* (the node reports that: ``duration_s`` of
            its end event), so a 10 s test run costs its overhead only
files       ``/environments/{id}/files...``: uploads, downloads, stat, list, ...
destroy     ``DELETE /v1/environments/{id}``
other       the rest naming one environment: its info, timeout, priority
==========  =================================================================

A :class:`Tally` adds them up per environment.  An environment's *rollout
time* is its span as the client saw it: from the start of its create call to
the end of its destroy call (or the tally's end, if it was not destroyed).
Within that span, ``env_s`` (the phases) + ``command_s`` (commands' own run
time, while the client waited on them) + ``other_s`` (the rest: the model's
think time, the harness's own work) = the span.  ``share`` = ``env_s`` /
``rollout_s``: the fraction of the rollout workers' time the environment took
(the definition of ``weenv bench rollout``'s ``env_share``).  Seconds are
monotonic-clock seconds.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator

PHASES = ("create", "exec", "files", "destroy", "other")
Phase = Literal["create", "exec", "files", "destroy", "other"]
API_PREFIX = "/v1"
MAX_BATCH_NAME = 256
MAX_BATCHES = 1000
"""Batches a node keeps (the newest; older ones are dropped)."""


def phase_of(method: str, path: str) -> tuple[str | None, str | None]:
    """``(phase, environment id)`` of an API request (``path`` with or without
    the ``/v1`` prefix, without its query); ``(None, None)`` for a request that
    is no environment's operation (templates, stats, the node)."""
    if path.startswith(API_PREFIX + "/"):
        path = path[len(API_PREFIX) :]
    parts = [p for p in path.split("/") if p]
    if not parts or parts[0] != "environments":
        return None, None
    if len(parts) == 1:
        return ("create", None) if method == "POST" else (None, None)
    if len(parts) == 2 and parts[1] == "batch":
        return ("create", None) if method == "POST" else (None, None)
    env_id = parts[1]
    if len(parts) == 2:
        return ("destroy" if method == "DELETE" else "other"), env_id
    if parts[2] in ("commands", "processes"):
        return "exec", env_id
    if parts[2] == "files":
        return "files", env_id
    return "other", env_id


def _zero() -> dict[str, float]:
    return dict.fromkeys(PHASES, 0.0)


@dataclass
class EnvTally:
    """One environment's seconds, by phase.  ``node``: where it runs (the
    daemon's address as the SDK reached it)."""

    env_id: str
    node: str | None = None
    phases: dict[str, float] = field(default_factory=_zero)
    command_s: float = 0.0
    started: float | None = None
    """Monotonic time its create call started."""
    ended: float | None = None
    """Monotonic time its destroy call ended."""

    @property
    def env_s(self) -> float:
        return sum(self.phases.values())

    def span(self, now: float) -> float:
        """Its rollout time: create call start to destroy end (or ``now``); 0 if its create was not seen."""
        if self.started is None:
            return 0.0
        return max(0.0, (self.ended if self.ended is not None else now) - self.started)


class Tally:
    """The environment tax of one rollout batch: what :func:`weenv.meter`
    returns.  Thread-safe: rollouts may run in threads or tasks at once.

    ``record`` adds seconds of one operation; ``begin`` / ``end`` mark an
    environment's span; ``close`` ends the batch.  The figures (``wall_s``,
    ``rollout_s``, ``phases``, ``env_s``, ``command_s``, ``other_s``,
    ``share``) are read at any time, final once closed."""

    def __init__(self, name: str | None = None, *, clock=time.monotonic, started_at: float | None = None):
        self.name = name or time.strftime("batch-%Y%m%d-%H%M%S")
        self._clock = clock
        self.started = clock()
        self.started_at = time.time() if started_at is None else started_at
        """Unix time the batch began."""
        self.ended: float | None = None
        self.environments: dict[str, EnvTally] = {}
        self.unattributed = _zero()
        """Seconds of operations naming no environment that exists (a create that failed)."""
        self.nodes: dict[str, object] = {}
        """Daemon address -> what the SDK reached it with (its connection settings), for reports."""
        self._lock = threading.Lock()

    # --- recording ---------------------------------------------------------------------
    def _env(self, env_id: str, node: str | None) -> EnvTally:
        e = self.environments.get(env_id)
        if e is None:
            e = self.environments[env_id] = EnvTally(env_id, node)
        elif e.node is None:
            e.node = node
        return e

    def record(
        self, phase: str, seconds: float, *, env_id: str | None = None, node: str | None = None, command_s: float = 0.0
    ) -> None:
        """Add ``seconds`` (of the client's wait, beyond ``command_s``: the
        commands' own run time in it) of ``phase`` to environment ``env_id``
        (None: unattributed).  Negative or non-finite values count as 0."""
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}: want one of {', '.join(PHASES)}")
        seconds, command_s = _seconds(seconds), _seconds(command_s)
        with self._lock:
            if env_id is None:
                self.unattributed[phase] += seconds + command_s
                return
            e = self._env(env_id, node)
            e.phases[phase] += seconds
            e.command_s += command_s

    def begin(self, env_id: str, at: float, *, node: str | None = None) -> None:
        """Environment ``env_id``'s span starts at ``at`` (its create call's start; the earliest wins)."""
        with self._lock:
            e = self._env(env_id, node)
            e.started = at if e.started is None else min(e.started, at)

    def end(self, env_id: str, at: float) -> None:
        """Environment ``env_id``'s span ends at ``at`` (its destroy call's end)."""
        with self._lock:
            e = self._env(env_id, None)
            e.ended = at if e.ended is None else max(e.ended, at)

    def close(self, at: float | None = None) -> Tally:
        with self._lock:
            if self.ended is None:
                self.ended = self._clock() if at is None else at
        return self

    # --- figures -------------------------------------------------------------------------
    def _now(self) -> float:
        return self.ended if self.ended is not None else self._clock()

    @property
    def wall_s(self) -> float:
        """The batch's wall time (the meter's ``with`` block)."""
        return max(0.0, self._now() - self.started)

    @property
    def phases(self) -> dict[str, float]:
        with self._lock:
            total = dict(self.unattributed)
            for e in self.environments.values():
                for p, s in e.phases.items():
                    total[p] += s
        return total

    @property
    def env_s(self) -> float:
        return sum(self.phases.values())

    @property
    def command_s(self) -> float:
        with self._lock:
            return sum(e.command_s for e in self.environments.values())

    @property
    def rollout_s(self) -> float:
        """Sum of the environments' spans, plus the unattributed seconds (each a
        rollout that waited for an environment it did not get)."""
        now = self._now()
        with self._lock:
            return sum(e.span(now) for e in self.environments.values()) + sum(self.unattributed.values())

    @property
    def other_s(self) -> float:
        """Rollout time in neither environment operations nor commands (think time, the harness's own)."""
        return max(0.0, self.rollout_s - self.env_s - self.command_s)

    @property
    def share(self) -> float:
        """``env_s`` / ``rollout_s`` (0 with no rollout time)."""
        rollout = self.rollout_s
        return self.env_s / rollout if rollout > 0 else 0.0

    def batch(self, node: str | None = None) -> TaxBatch:
        """This tally as a :class:`TaxBatch` (what a node keeps), of every
        environment, or only of those on ``node`` (unattributed seconds count
        with every node's)."""
        now = self._now()
        with self._lock:
            envs = [e for e in self.environments.values() if node is None or e.node == node]
            phases = dict(self.unattributed)
            for e in envs:
                for p, s in e.phases.items():
                    phases[p] += s
            command = sum(e.command_s for e in envs)
            rollout = sum(e.span(now) for e in envs) + sum(self.unattributed.values())
        env = sum(phases.values())
        return TaxBatch(
            name=self.name,
            started_at=self.started_at,
            wall_s=self.wall_s,
            rollout_s=rollout,
            environments=len(envs),
            phases=phases,
            command_s=command,
            other_s=max(0.0, rollout - env - command),
            share=min(1.0, env / rollout) if rollout > 0 else 0.0,
        )

    def __repr__(self) -> str:
        return (
            f"Tally({self.name!r}, wall_s={self.wall_s:.3f}, rollout_s={self.rollout_s:.3f}, "
            f"env_s={self.env_s:.3f}, share={self.share:.1%})"
        )


def _seconds(v: float) -> float:
    return v if isinstance(v, (int, float)) and math.isfinite(v) and v > 0 else 0.0


# --- wire models -----------------------------------------------------------------------
Seconds = Annotated[float, Field(ge=0, le=1e9, allow_inf_nan=False)]
LAST_UNIX_TIME = 253402300799.0
"""9999-12-31T23:59:59Z: the last second a date of four digits can show."""


class TaxBatch(BaseModel):
    """One rollout batch's tax, as the SDK's meter reports it to a node
    (``POST /v1/tax``) and ``GET /v1/tax`` returns it.  Seconds; ``share`` in [0, 1]."""

    model_config = ConfigDict(extra="forbid")

    name: Annotated[str, StringConstraints(min_length=1, max_length=MAX_BATCH_NAME)]
    started_at: float = Field(ge=0, le=LAST_UNIX_TIME, allow_inf_nan=False)
    """Unix time the batch began (before year 10000: pages format it as a date)."""
    wall_s: Seconds
    rollout_s: Seconds
    environments: int = Field(ge=0, le=1 << 20)
    phases: dict[Phase, Seconds]
    command_s: Seconds
    other_s: Seconds
    share: float = Field(ge=0, le=1, allow_inf_nan=False)

    @field_validator("phases")
    @classmethod
    def _all_phases(cls, v: dict[str, float]) -> dict[str, float]:
        return {p: v.get(p, 0.0) for p in PHASES}


class TaxReport(BaseModel):
    """``GET /v1/tax``: the node's own measure of its API calls since it
    started (``node``: seconds by phase; ``requests``: calls by phase), and the
    batches the SDK reported (oldest first, at most :data:`MAX_BATCHES`)."""

    model_config = ConfigDict(extra="forbid")

    node: dict[Phase, float]
    requests: dict[Phase, int]
    batches: list[TaxBatch]
