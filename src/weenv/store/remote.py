"""What the remote stores (``oci://``, ``s3://``) share: their timeout and retry
options, and one operation run under a deadline with retries and the circuit
breaker (:mod:`weenv.store.breaker`)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, Field

from weenv.errors import StoreUnavailableError
from weenv.store.breaker import CircuitBreaker

MAX_BACKOFF = 2.0
"""Most seconds between two attempts."""

T = TypeVar("T")


class RemoteOptions(BaseModel):
    """Timeouts and retries of a remote store."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    connect_timeout: float = Field(default=3.0, gt=0)
    """Seconds to open a TCP (and TLS) connection."""
    read_timeout: float = Field(default=10.0, gt=0)
    """Seconds to wait for any bytes of an answer (each read of a body too)."""
    timeout: float = Field(default=30.0, gt=0)
    """Deadline in seconds of one store operation, retries and backoff included."""
    retries: int = Field(default=4, ge=0)
    """Retries after a connection error, timeout, 429 or 5xx."""
    backoff: float = Field(default=0.1, ge=0)
    """Seconds before the first retry; doubles each retry (at most 2 s), with jitter."""
    probe_interval: float = Field(default=2.0, ge=0)
    """Seconds between probes of a store that an operation gave up on; until
    one is answered, operations fail at once instead of waiting out their own
    timeout (:mod:`weenv.store.breaker`; 0: no breaker, every operation tries)."""
    probe_timeout: float = Field(default=2.0, gt=0)
    """Seconds a probe (one cheap request, no retry) waits for its answer."""


class Retry(Exception):
    """A failure worth another attempt (connection, timeout, 429, 5xx)."""


def call_with_retries(
    what: str,
    where: str,
    attempt: Callable[[float], T],
    options: RemoteOptions,
    breaker: CircuitBreaker,
    on_retry: Callable[[], object],
) -> T:
    """``attempt(deadline)`` (``deadline``: a ``time.monotonic()`` time), repeated on
    :class:`Retry` with backoff until ``options.retries`` or the deadline
    (``options.timeout`` from now) runs out; then :class:`StoreUnavailableError`
    ``"{what} at {where} failed: ..."`` (caused by what caused the last
    :class:`Retry`, if anything did), and ``breaker`` opens.  While it is open:
    that error at once.  ``on_retry()`` is called before each retry (a counter)."""
    breaker.check(what)
    start = time.monotonic()
    deadline = start + options.timeout
    tries = 0
    while True:
        try:
            result = attempt(deadline)
        except Retry as exc:
            tries += 1
            delay = min(options.backoff * 2 ** (tries - 1), MAX_BACKOFF) * random.uniform(0.5, 1.0)
            if tries > options.retries or time.monotonic() + delay >= deadline:
                breaker.failed(str(exc))
                raise StoreUnavailableError(
                    f"{what} at {where} failed: {exc} "
                    f"({tries} attempt{'s' if tries > 1 else ''} in {time.monotonic() - start:.1f} s)"
                ) from exc.__cause__
            on_retry()
            time.sleep(delay)
        else:
            breaker.succeeded()  # the store answered
            return result
