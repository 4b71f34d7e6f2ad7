"""The node's side of the environment tax (:mod:`weenv.formats.tax`).

- :class:`EnvSeconds`, an ASGI middleware, times every ``/v1`` request that
  is an environment operation, from its arrival to the last byte of its answer
  (or the client's leaving), by the phase :func:`weenv.formats.tax.phase_of` gives it;
  for commands it leaves out the command's own run time (the part of the
  request during which the command ran: a handler names the command in
  ``scope["weenv.command"]``).  Requests refused for their key (401) are not
  counted.  These are ``weenv_env_seconds_total{phase}`` in ``/v1/metrics``:
  what the node itself measured, summed over every client.
- :class:`TaxBook` keeps those sums and the batches that SDK meters report
  (``POST /v1/tax``: the client's view, with its wall time and the rollouts'
  spans; the newest :data:`~weenv.formats.tax.MAX_BATCHES`, in memory: a daemon
  restart forgets them).  An open meter posts its batch again and again (same
  name and start): the newest post replaces the one before.  ``GET /v1/tax`` and ``weenv stats --tax`` show both.
"""

from __future__ import annotations

import collections
import threading
import time

from weenv.formats.tax import API_PREFIX, MAX_BATCHES, PHASES, TaxBatch, TaxReport, phase_of

COMMAND_KEY = "weenv.command"
"""The ASGI scope key where a command handler puts the command's process
(anything with ``started_at``, Unix seconds, and ``duration_s``, None while it runs)."""


class TaxBook:
    """The node's environment-operation seconds by phase, and reported batches.  Thread-safe."""

    def __init__(self, max_batches: int = MAX_BATCHES):
        self._lock = threading.Lock()
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.requests = dict.fromkeys(PHASES, 0)
        self._batches: collections.deque[TaxBatch] = collections.deque(maxlen=max_batches)

    def add(self, phase: str, seconds: float) -> None:
        with self._lock:
            self.seconds[phase] += max(0.0, seconds)
            self.requests[phase] += 1

    def report_batch(self, batch: TaxBatch) -> None:
        with self._lock:
            for i, b in enumerate(self._batches):
                if b.name == batch.name and b.started_at == batch.started_at:
                    self._batches[i] = batch  # an open meter's newer tally of the same batch
                    return
            self._batches.append(batch)

    def report(self) -> TaxReport:
        with self._lock:
            return TaxReport(node=dict(self.seconds), requests=dict(self.requests), batches=list(self._batches))


def command_overlap(process, start: float, end: float) -> float:
    """Seconds of [``start``, ``end``] (Unix time) during which ``process`` ran."""
    started = getattr(process, "started_at", None)
    if started is None:
        return 0.0
    duration = getattr(process, "duration_s", None)
    finished = end if duration is None else started + duration
    return max(0.0, min(end, finished) - max(start, started))


class EnvSeconds:
    """ASGI middleware adding each environment operation's seconds to ``book``."""

    def __init__(self, app, book: TaxBook):
        self.app = app
        self.book = book

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope.get("path", "").startswith(API_PREFIX + "/"):
            return await self.app(scope, receive, send)
        phase, _env = phase_of(scope["method"], scope["path"])
        if phase is None:
            return await self.app(scope, receive, send)
        t0, wall0 = time.monotonic(), time.time()
        state = {"status": 0, "done": False}

        def done() -> None:
            if state["done"]:
                return
            state["done"] = True
            if state["status"] == 401:
                return
            elapsed = time.monotonic() - t0
            process = scope.get(COMMAND_KEY)
            ran = command_overlap(process, wall0, wall0 + elapsed) if process is not None else 0.0
            self.book.add(phase, elapsed - min(ran, elapsed))

        async def timed_send(message):
            if message["type"] == "http.response.start":
                state["status"] = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                done()

        try:
            await self.app(scope, receive, timed_send)
        finally:
            done()  # the client left, or the app failed
