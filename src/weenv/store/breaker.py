"""A circuit breaker with probes, for a remote store (:class:`weenv.store.oci.OciStore`).

States::

    closed ──(an operation gave up: unreachable, timed out, 5xx after retries)──► open
    open ──(every ``interval`` s, one probe in a thread of its own)──► closed if it answered
    open ──(any operation that was already under way succeeds)──► closed

*Closed*: operations run.  *Open*: every new operation fails at once with
:class:`~weenv.errors.StoreUnavailableError` saying since when and why the
store is down, instead of waiting out its own timeout; one probe at a time (a
cheap request with a short timeout of its own) runs every ``interval``
seconds, in the breaker's thread, never in a caller's: the probe is the
half-open state, and its success closes the breaker.

What a lazy reader inside an environment sees: the first read that finds the
store down waits for that read's deadline (the store's ``timeout``; reads
already under way then wait theirs), and gets ``EIO``; while the breaker is
open, every read of a chunk not on the node gets ``EIO`` at once (the kernel's
own retries of a failed read too), and reads of cached chunks go on as
usual.  Once the store answers again, the next probe (at most ``interval``
plus the probe's timeout later) closes the breaker and reads fetch again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from weenv.errors import StoreUnavailableError

log = logging.getLogger(__name__)


class CircuitBreaker:
    """The breaker of the store at ``url``.  ``probe()`` returns if the store
    answers and raises otherwise (within its own short timeout); ``interval``:
    seconds between probes while open (0: no breaker, every operation tries).
    Thread-safe; :meth:`close` stops a probe thread."""

    def __init__(self, url: str, probe: Callable[[], object], interval: float):
        self.url = url
        self.probe = probe
        self.interval = interval
        self._lock = threading.Lock()
        self._opened_at: float | None = None  # monotonic time it opened (None: closed)
        self._reason = ""
        self._prober: threading.Thread | None = None
        self._stop = threading.Event()
        self.probes = 0
        """Probes sent since the breaker was made."""

    @property
    def is_open(self) -> bool:
        return self._opened_at is not None

    def check(self, what: str) -> None:
        """Raise :class:`StoreUnavailableError` for operation ``what`` if the breaker is open."""
        opened_at, reason = self._opened_at, self._reason
        if opened_at is not None:
            raise StoreUnavailableError(
                f"{what} at {self.url} not tried: the store has not answered for "
                f"{time.monotonic() - opened_at:.1f} s ({reason}); probing it every {self.interval:g} s"
            )

    def failed(self, reason: str) -> None:
        """An operation gave up on the store: open (and start probing)."""
        if self.interval <= 0:
            return
        with self._lock:
            if self._opened_at is None:
                self._opened_at = time.monotonic()
                log.warning("store %s is down (%s): failing fast, probing every %g s", self.url, reason, self.interval)
            self._reason = reason
            if self._stop.is_set() or self._prober is not None:  # one prober, which sees it open
                return
            self._prober = threading.Thread(target=self._probe_loop, name="weenv-store-probe", daemon=True)
            self._prober.start()

    def succeeded(self) -> None:
        """The store answered an operation: close."""
        if self._opened_at is None:
            return
        with self._lock:
            if self._opened_at is not None:
                log.info("store %s answers again after %.1f s", self.url, time.monotonic() - self._opened_at)
            self._opened_at = None

    def _probe_loop(self) -> None:
        try:
            while not self._stop.wait(self.interval):
                with self._lock:
                    if self._opened_at is None:  # an operation closed it
                        self._prober = None
                        return
                    self.probes += 1
                try:
                    self.probe()
                except Exception as exc:  # still down
                    with self._lock:
                        self._reason = str(exc) or type(exc).__name__
                    continue
                with self._lock:
                    if self._opened_at is not None:
                        log.info("store %s answers again after %.1f s", self.url, time.monotonic() - self._opened_at)
                    self._opened_at = None
                    self._prober = None
                return
        finally:
            with self._lock:
                if self._prober is threading.current_thread():
                    self._prober = None

    def close(self) -> None:
        """Stop probing (idempotent); a probe under way ends within its own timeout."""
        self._stop.set()
        with self._lock:
            prober = self._prober
        if prober is not None and prober is not threading.current_thread():
            prober.join(timeout=0.1)
