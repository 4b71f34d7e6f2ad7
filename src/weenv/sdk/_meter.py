"""``weenv.meter()``: the environment tax of a rollout batch, measured by the SDK.

::

    with weenv.meter("iteration-12") as tally:     # or: async with weenv.meter(...)
        run_rollouts()                             # any SDK calls, in any thread or task
    print(tally.share, tally.phases, tally.wall_s) # a weenv.formats.tax.Tally

While a meter is open, every SDK call of this process (both faces, and so the
adapters of :mod:`weenv.adapters`) adds the seconds its caller waited to the
phase :func:`weenv.formats.tax.phase_of` gives its request, for the environment it
names; a command's own run time (the node's ``duration_s``) is counted apart,
as ``command_s``.  Time in the caller's own callbacks (``on_stdout``,
``on_ready``) is left out.  Meters are process-wide: two open at once both
count every call.  With ``report=True`` the tally is posted to each daemon
whose environments it counted (``POST /v1/tax``, that daemon's environments
only) every ``report_every`` seconds while the meter is open (so the
dashboard's tax chart moves during an iteration; a daemon keeps the newest
post of a batch) and once more on exit, closed; ``weenv stats --tax`` shows
it.  A report that fails is logged, never raised.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from weenv.formats.tax import Tally, phase_of

log = logging.getLogger(__name__)

_active: list[Tally] = []
_lock = threading.Lock()
REPORT_TIMEOUT_S = 5.0
REPORT_EVERY_S = 5.0
"""Seconds between the posts of an open meter's tally (``meter(report_every=...)``)."""


def metering() -> bool:
    """Whether a meter is open (the SDK skips its bookkeeping otherwise)."""
    return bool(_active)


def _tallies() -> list[Tally]:
    with _lock:
        return list(_active)


def record_call(
    config: Any,
    method: str,
    path: str,
    started: float,
    waited: float,
    *,
    outcome: Any = None,
    error: BaseException | None = None,
) -> None:
    """Count one SDK operation: its first request ``method`` ``path``, begun at
    monotonic ``started``, the caller waited ``waited`` seconds (callbacks left
    out); ``outcome`` its result (an ``EnvironmentInfo``, a ``CommandResult``...)
    or ``error`` what it raised.  ``config``: the connection's settings."""
    tallies = _tallies()
    if not tallies:
        return
    from weenv.api.models import EnvironmentInfo
    from weenv.sdk._core import CommandResult

    phase, env_id = phase_of(method, path.split("?", 1)[0])
    if phase is None:
        return
    node = config.where
    now = started + waited
    if path.split("?", 1)[0].rstrip("/").endswith("/environments/batch"):
        if error is None:
            return  # counted per environment as each was ready (note_created)
        env_id = None
    command = 0.0
    result = outcome if outcome is not None else getattr(error, "result", None)
    if phase == "exec" and isinstance(result, CommandResult):
        command = min(waited, max(0.0, result.duration_s))
    if phase == "create" and isinstance(outcome, EnvironmentInfo):
        env_id = outcome.id
    for t in tallies:
        t.nodes.setdefault(node, config)
        t.record(phase, waited - command, env_id=env_id, node=node, command_s=command)
        if env_id is not None and phase == "create":
            t.begin(env_id, started, node=node)
        elif env_id is not None and phase == "destroy":
            t.end(env_id, now)


def note_created(config: Any, env_id: str, started: float) -> None:
    """An environment of a batch create is ready now; the batch began at monotonic ``started``."""
    tallies = _tallies()
    if not tallies:
        return
    waited = time.monotonic() - started
    for t in tallies:
        t.nodes.setdefault(config.where, config)
        t.record("create", waited, env_id=env_id, node=config.where)
        t.begin(env_id, started, node=config.where)


def note_begun(config: Any, env_ids: list[str], started: float) -> None:
    """Environments one call made (a fork's children) exist since monotonic
    ``started``: their spans begin then (the call's seconds are counted once,
    as that call's)."""
    for t in _tallies():
        t.nodes.setdefault(config.where, config)
        for env_id in env_ids:
            t.begin(env_id, started, node=config.where)


class meter:  # noqa: N801 - used as weenv.meter(), a context manager like contextlib's
    """Measure the environment tax of the SDK calls made inside (see the module
    docstring); ``name``: the batch's name in reports (default: its start time);
    ``report``: post the tally to the daemons it counted, every ``report_every``
    seconds while open (None or 0: only at exit) and at exit."""

    def __init__(self, name: str | None = None, *, report: bool = True, report_every: float | None = REPORT_EVERY_S):
        if report_every is not None and not (report_every >= 0):
            raise ValueError(f"report_every must be a number of seconds >= 0 (or None), not {report_every!r}")
        self.tally = Tally(name)
        self.report = report
        self.report_every = report_every or None
        self._stop = threading.Event()
        self._reporter: threading.Thread | None = None

    def _open(self) -> Tally:
        self.tally = Tally(self.tally.name)
        with _lock:
            _active.append(self.tally)
        if self.report and self.report_every:
            self._stop = threading.Event()
            self._reporter = threading.Thread(target=self._report_periodically, name="weenv-meter", daemon=True)
            self._reporter.start()
        return self.tally

    def _report_periodically(self) -> None:
        """Post the open tally every ``report_every`` seconds (in a thread of
        its own, for both faces: a post never holds the caller's event loop)."""
        while not self._stop.wait(self.report_every):
            for where, config in list(self.tally.nodes.items()):
                _post(config, self.tally.batch(where))

    def _close(self) -> Tally:
        with _lock:
            if self.tally in _active:
                _active.remove(self.tally)
        self._stop.set()
        if self._reporter is not None:  # its post in flight lands before the closing one
            self._reporter.join()
            self._reporter = None
        return self.tally.close()

    def __enter__(self) -> Tally:
        return self._open()

    def __exit__(self, *exc) -> None:
        self._close()
        if self.report:
            for where, config in self.tally.nodes.items():
                _post(config, self.tally.batch(where))

    async def __aenter__(self) -> Tally:
        return self._open()

    async def __aexit__(self, *exc) -> None:
        self._close()
        if self.report:
            for where, config in self.tally.nodes.items():
                await _apost(config, self.tally.batch(where))


def _post(config: Any, batch) -> None:
    import httpx

    try:
        transport = {"transport": httpx.HTTPTransport(uds=config.socket)} if config.socket else {}
        with httpx.Client(
            base_url=config.base_url, headers=config.headers, timeout=REPORT_TIMEOUT_S, **transport
        ) as http:
            r = http.post("/tax", content=batch.model_dump_json(), headers={"content-type": "application/json"})
            r.raise_for_status()
    except httpx.HTTPError as exc:
        log.warning("could not report the batch %s to the weenv daemon at %s: %s", batch.name, config.where, exc)


async def _apost(config: Any, batch) -> None:
    import httpx

    try:
        transport = {"transport": httpx.AsyncHTTPTransport(uds=config.socket)} if config.socket else {}
        async with httpx.AsyncClient(
            base_url=config.base_url, headers=config.headers, timeout=REPORT_TIMEOUT_S, **transport
        ) as http:
            r = await http.post("/tax", content=batch.model_dump_json(), headers={"content-type": "application/json"})
            r.raise_for_status()
    except httpx.HTTPError as exc:
        log.warning("could not report the batch %s to the weenv daemon at %s: %s", batch.name, config.where, exc)
