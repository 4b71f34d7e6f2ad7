"""The warm pool: environments created ahead, so a create only starts one.

A create spends most of its time in ``runc run`` (~25-30 ms on a 2-core VM:
namespaces, cgroup, the rootfs's mounts, the first process).  For a template
that was created at least twice within :attr:`WarmPool.idle_s`, the pool keeps
:attr:`WarmPool.size` environments of it *created but not started*: group
mounts taken, overlay rootfs mounted, bundle written, ``runc create`` done,
the first process waiting in runc's exec FIFO.  A create that matches one
(:class:`PoolKey`: same template digest, same resources asked, same
capabilities) takes it and runs ``runc start`` (~7 ms) instead.  Nothing of an
environment ever runs before a create takes it, and no environment is reused:
a pooled one is used once or removed.

This is the warm pool of serverless platforms (AWS Lambda's provisioned
concurrency, Modal's warm containers) with one difference: it fills itself
from observed creates, not from a setting per function.

Costs: per pooled environment, one waiting ``runc init`` (~10 MB RSS, ~2 MB
anonymous), a cgroup, a network namespace and an overlay mount.  One
background thread fills the pool; a fill costs what a create costs.

Removal: an entry goes when its key was not created for :attr:`WarmPool.idle_s`,
when more than :attr:`WarmPool.max_templates` keys have entries (the least
recently created goes), on :meth:`WarmPool.drain` (the node's ``drop_caches``)
and on :meth:`WarmPool.close`.  After a node process is killed, its pooled
environments have no ``env.json``: the next node removes them like any
half-created environment.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from weenv.errors import InvalidInputError

log = logging.getLogger(__name__)

DEFAULT_SIZE = 1
"""Environments kept ready per key."""
DEFAULT_MAX_TEMPLATES = 8
"""Keys with ready environments at once."""
DEFAULT_IDLE_S = 300.0
"""Seconds after a key's last create when its ready environments are removed."""
FAILURE_BACKOFF_S = 30.0
"""Seconds a key is not filled after its fill failed."""


@dataclass(frozen=True)
class PoolKey:
    """What a pooled environment must match to serve a create."""

    digest: str
    """The template digest."""
    resources: str | None
    """The create's resources as JSON, None for the template's own."""
    capabilities: tuple[str, ...]


@dataclass(eq=False)
class Pooled:
    """One environment created ahead: its container waits in ``runc create``'s state."""

    key: PoolKey
    env_id: str
    dir: Path
    lowers: list[Path]
    """Its overlay's group mount points, as the template lists its groups."""
    undo: contextlib.ExitStack
    """Removes it: container, cgroup, overlay, group references, directory."""
    created: float = field(default_factory=time.monotonic)


@dataclass
class PoolStats:
    ready: int = 0
    """Environments created ahead and waiting."""
    hits: int = 0
    """Creates that started a pooled environment."""
    misses: int = 0
    """Creates that found none (each created its environment itself)."""
    filled: int = 0
    failed: int = 0
    """Fills that raised (the key then waits :data:`FAILURE_BACKOFF_S`)."""
    removed: int = 0
    """Ready environments removed unused (idle, evicted, drained, closed)."""


class WarmPool:
    """Environments created ahead, by :class:`PoolKey`.  Thread-safe.

    ``prepare(key)``: create one environment for ``key`` without starting it
    (the node's; raises on failure, leaving nothing).  ``may_fill(ready)``:
    whether the node takes another environment now, with ``ready`` already
    waiting in the pool (False: no fill).
    """

    def __init__(
        self,
        prepare: Callable[[PoolKey], Pooled],
        *,
        size: int = DEFAULT_SIZE,
        max_templates: int = DEFAULT_MAX_TEMPLATES,
        idle_s: float = DEFAULT_IDLE_S,
        may_fill: Callable[[int], bool] = lambda ready: True,
    ):
        _check(size, max_templates, idle_s)
        self.size = size
        self.max_templates = max_templates
        self.idle_s = idle_s
        self._prepare = prepare
        self._may_fill = may_fill
        self._cond = threading.Condition()
        self._ready: dict[PoolKey, list[Pooled]] = {}
        self._inflight: dict[PoolKey, int] = {}
        self._claims: dict[PoolKey, int] = {}  # creates waiting for an environment being filled
        self._fills_done: dict[PoolKey, int] = {}  # fills of a key ended (added, failed or removed)
        self._active: dict[PoolKey, int] = {}  # creates of a key under way (between take and done)
        self._uses: OrderedDict[PoolKey, tuple[int, float]] = OrderedDict()  # creates, last (monotonic); LRU order
        self._backoff: dict[PoolKey, float] = {}
        self._generation = 0  # drain() bumps it: fills begun before are removed when they finish
        self._closed = False
        self._worker: threading.Thread | None = None
        self._stats = PoolStats()

    # --- the create's side -------------------------------------------------------------
    def take(self, key: PoolKey) -> Pooled | None:
        """A ready environment for ``key`` (the caller now owns it: start it or
        close its ``undo``), or None.

        With none ready but one being created for ``key`` and not yet claimed,
        it waits for that one: it began earlier than a new one would, so it is
        ready sooner (if its fill fails, None).

        Every take must be followed by :meth:`done` when the create ends: a
        key is filled only while none of its creates runs (between bursts,
        not against them)."""
        with self._cond:
            self._active[key] = self._active.get(key, 0) + 1
            if self.size and not self._ready.get(key) and self._inflight.get(key, 0) > self._claims.get(key, 0):
                self._claims[key] = self._claims.get(key, 0) + 1  # wait for the next fill of key to end
                done, generation = self._fills_done.get(key, 0), self._generation
                while (not self._ready.get(key) and self._fills_done.get(key, 0) == done
                       and generation == self._generation and not self._closed):
                    self._cond.wait()
                self._claims[key] -= 1
            ready = self._ready.get(key)
            pooled = ready.pop(0) if ready else None
            if ready is not None and not ready:
                del self._ready[key]
            if pooled is None:
                self._stats.misses += 1
            else:
                self._stats.hits += 1
            return pooled

    def done(self, key: PoolKey, created: bool) -> None:
        """A create that called :meth:`take` with ``key`` ended; ``created``:
        it made its environment (a use of ``key``: one created twice within
        :attr:`idle_s` is filled in the background), else it failed."""
        now = time.monotonic()
        with self._cond:
            if created:
                count, last = self._uses.pop(key, (0, now))
                self._uses[key] = (count + 1 if now - last <= self.idle_s else 1, now)
            self._active[key] -= 1
            if not self._active[key]:
                del self._active[key]
                if self.size and not self._closed:  # the fill thread makes up for what was taken
                    self._start_worker()
                    self._cond.notify_all()

    def stats(self) -> PoolStats:
        with self._cond:
            return PoolStats(**{**self._stats.__dict__, "ready": sum(len(v) for v in self._ready.values())})

    # --- control -----------------------------------------------------------------------
    def configure(self, *, size: int | None = None, max_templates: int | None = None,
                  idle_s: float | None = None) -> None:
        """Change :attr:`size`, :attr:`max_templates` or :attr:`idle_s` from now
        on; ready environments beyond the new bounds are removed (at once for
        ``size``; by the fill thread, which wakes now, for the others).
        Raises :class:`InvalidInputError` for a bad value."""
        size = self.size if size is None else size
        max_templates = self.max_templates if max_templates is None else max_templates
        idle_s = self.idle_s if idle_s is None else idle_s
        _check(size, max_templates, idle_s)
        with self._cond:
            self.size, self.max_templates, self.idle_s = size, max_templates, idle_s
            extra = [p for ready in self._ready.values() for p in ready[size:]]
            for ready in self._ready.values():
                del ready[size:]
            self._ready = {k: v for k, v in self._ready.items() if v}
            if size and not self._closed:
                self._start_worker()
            self._cond.notify_all()
        self._remove(extra)

    def drain(self) -> None:
        """Remove every ready environment, wait for the fills under way (they
        are removed too) and forget every use: the pool starts empty."""
        with self._cond:
            self._generation += 1
            gone = [p for ready in self._ready.values() for p in ready]
            self._ready.clear()
            self._uses.clear()
            self._backoff.clear()
        self._remove(gone)
        with self._cond:
            while any(self._inflight.values()):
                self._cond.wait()

    def close(self) -> None:
        """Stop filling and remove every ready environment.  Idempotent."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            worker = self._worker
        if worker is not None:
            worker.join()
        self.drain()

    # --- the fill thread -------------------------------------------------------------
    def _start_worker(self) -> None:
        if self._worker is None:
            self._worker = threading.Thread(target=self._run, name="weenv-pool", daemon=True)
            self._worker.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._closed:
                        return
                    stale = self._stale_locked(time.monotonic())
                    if stale:
                        break
                    key = self._next_locked()
                    if key is not None:
                        self._inflight[key] = self._inflight.get(key, 0) + 1
                        generation = self._generation
                        break
                    self._cond.wait(timeout=min(self.idle_s, 30.0))
            if stale:
                self._remove(stale)
                continue
            self._fill(key, generation)

    def _fill(self, key: PoolKey, generation: int) -> None:
        """Create one environment for ``key``; keep it if the pool still wants
        it.  The fill counts as under way until what it made is kept or gone
        (:meth:`drain` waits for that)."""
        pooled = None
        try:
            pooled = self._prepare(key)
        except Exception as exc:
            log.warning("warm pool: creating an environment of %s ahead failed: %s", key.digest[:19], exc)
        with self._cond:
            keep = (pooled is not None and not self._closed and generation == self._generation
                    and key in self._uses and len(self._ready.get(key, ())) < self.size)  # fmt: skip
            if keep:
                self._ready.setdefault(key, []).append(pooled)
                self._stats.filled += 1
            elif pooled is None:
                self._stats.failed += 1
                self._backoff[key] = time.monotonic() + FAILURE_BACKOFF_S
        if pooled is not None and not keep:
            self._remove([pooled])
        with self._cond:
            self._inflight[key] -= 1
            self._fills_done[key] = self._fills_done.get(key, 0) + 1
            self._cond.notify_all()

    def _next_locked(self) -> PoolKey | None:
        """The most recently created key, of the :attr:`max_templates` most
        recent created twice, that wants an environment and has no create
        under way; or None."""
        if not self.size or not self._may_fill(sum(len(v) for v in self._ready.values())):
            return None
        now = time.monotonic()
        wanted = [key for key in reversed(self._uses) if self._uses[key][0] >= 2][: self.max_templates]
        for key in wanted:
            if key in self._active or self._backoff.get(key, 0.0) > now:
                continue
            if len(self._ready.get(key, ())) + self._inflight.get(key, 0) < self.size:
                return key
        return None

    def _stale_locked(self, now: float) -> list[Pooled]:
        """Forget keys idle past :attr:`idle_s`; take out the ready environments
        of keys :meth:`_next_locked` would not fill (idle, or beyond the
        :attr:`max_templates` most recent)."""
        for key, (_count, last) in list(self._uses.items()):
            if now - last > self.idle_s:
                del self._uses[key]
        wanted = set([key for key in reversed(self._uses) if self._uses[key][0] >= 2][: self.max_templates])
        gone = []
        for key in [k for k in self._ready if k not in wanted]:
            gone += self._ready.pop(key)
        return gone

    def _remove(self, pooled: list[Pooled]) -> None:
        for p in pooled:
            try:
                p.undo.close()
            except Exception:  # keep going: the others must go too
                log.exception("warm pool: removing environment %s", p.env_id)
        if pooled:
            with self._cond:
                self._stats.removed += len(pooled)


def _check(size: int, max_templates: int, idle_s: float) -> None:
    if size < 0 or max_templates < 1 or not idle_s > 0:
        raise InvalidInputError(f"bad warm pool: size {size}, max_templates {max_templates}, idle_s {idle_s}")


def pool_size_from_env() -> int:
    """``WEENV_POOL_SIZE`` (environments per key, 0: no pool), else :data:`DEFAULT_SIZE`.
    Raises :class:`InvalidInputError` for a value that is not an integer >= 0."""
    value = os.environ.get("WEENV_POOL_SIZE")
    if value is None or value == "":
        return DEFAULT_SIZE
    try:
        size = int(value)
    except ValueError:
        size = -1
    if size < 0:
        raise InvalidInputError(f"WEENV_POOL_SIZE={value!r}: want an integer >= 0")
    return size
