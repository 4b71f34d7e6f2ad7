"""The warm pool: environments created ahead, so a create only starts one.

A create spends most of its time in ``runc run`` (~25-30 ms on a 2-core VM:
namespaces, cgroup, the rootfs's mounts, the first process).  For a request
(:class:`PoolKey`: template digest, resources asked, capabilities) that
created an environment twice within :attr:`WarmPool.idle_s`, the pool keeps
:attr:`WarmPool.size` environments *created but not started*: group mounts
taken, overlay rootfs mounted, bundle written, ``runc create`` done, the first
process waiting in runc's exec FIFO.  The next create with that key takes one
and starts it instead (:meth:`Runc.start`: what ``runc start``, ~7 ms, does,
done in process through that FIFO).  Nothing of an environment runs
before a create takes it, and no environment is reused: a pooled one is
started once or removed.

This is the warm pool of serverless platforms (AWS Lambda's provisioned
concurrency, Modal's warm containers), filled from observed creates rather
than from a setting per function.

When: one background thread fills a key while none of its creates is under
way (between bursts, not against them); a create that finds none ready but a
fill under way waits for that fill (it began earlier than a new environment
would).  A create refused after taking one (e.g. admission's
:class:`~weenv.errors.CapacityError`) gives it back untouched.

Costs: per pooled environment, one waiting ``runc init`` (~10 MB RSS, ~2 MB
anonymous), a cgroup, a network namespace (with ``network``, its veth pair and
/30) and an overlay mount; a fill costs what a create costs.

Removal: a key's environments go when it was not created for
:attr:`WarmPool.idle_s`, when it is not among the :attr:`WarmPool.max_templates`
most recent keys, when its template's name moved (:meth:`WarmPool.forget`),
when the node may not hold them (``may_fill``: ``max_environments``, or
admission stopped under memory pressure), on :meth:`WarmPool.drain` (the
node's ``drop_caches``) and :meth:`WarmPool.close`.  The node does not start
one that reads a group through FUSE once that group's assembled image can be
mounted directly.  After a node process is killed, its pooled environments
have no ``env.json``: the next node removes them like any half-created
environment.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from weenv.config import settings
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
    lowers: list[Path]
    """Its overlay's group mount points, as the template lists its groups."""
    undo: contextlib.ExitStack
    """Removes it: container, cgroup, overlay, group references, directory."""
    tried: bool = False
    """A create tried to start it: if that create fails, it is removed, not given back."""


@dataclass
class PoolStats:
    ready: int = 0
    """Environments created ahead and waiting."""
    hits: int = 0
    """Creates that started a pooled environment."""
    misses: int = 0
    """Creates that made their environment themselves (none was ready, or the one given could not start)."""
    filled: int = 0
    failed: int = 0
    """Fills that raised (the key then waits :data:`FAILURE_BACKOFF_S`)."""
    removed: int = 0
    """Pooled environments removed unused (idle, evicted, drained, closed, or made when no longer wanted)."""


@dataclass(eq=False)
class _Waiter:
    """A create waiting for the fill under way for its key."""

    pooled: Pooled | None = None
    done: bool = False


class WarmPool:
    """Environments created ahead, by :class:`PoolKey`.  Thread-safe.

    ``prepare(key)``: create one environment for ``key`` without starting it
    (the node's; raises on failure, leaving nothing).  ``may_fill(ready)``:
    whether the node may hold ``ready`` pooled environments now (False: the
    pool makes no more, and removes the least recently wanted until it may;
    called without the pool's lock).
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
        self._waiters: dict[PoolKey, deque[_Waiter]] = {}  # oldest first; at most one per fill under way
        self._active: dict[PoolKey, int] = {}  # creates of a key under way (between take and done)
        self._uses: OrderedDict[PoolKey, tuple[int, float]] = OrderedDict()  # creates, last (monotonic); LRU order
        self._backoff: dict[PoolKey, float] = {}
        self._removing = 0  # pooled environments being removed outside the lock
        self._generation = 0  # drain() bumps it: fills begun before are removed when they finish
        self._closed = False
        self._worker: threading.Thread | None = None
        self._stats = PoolStats()

    # --- the create's side -------------------------------------------------------------
    def take(self, key: PoolKey) -> Pooled | None:
        """A ready environment for ``key`` (the caller now owns it: start it,
        :meth:`give_back` it unstarted, or close its ``undo``), or None.

        With none ready but a fill of ``key`` under way that no other create
        waits for, it waits for that fill and gets what it makes (None if it
        fails): it began earlier than a new environment would, so it is ready
        sooner.

        Every take must be followed by :meth:`done` when the create ends: a
        key is filled only while none of its creates runs (between bursts,
        not against them)."""
        with self._cond:
            self._active[key] = self._active.get(key, 0) + 1
            pooled = self._pop_ready_locked(key)
            if pooled is None and self.size and self._inflight.get(key, 0) > len(self._waiters.get(key, ())):
                waiter = _Waiter()
                self._waiters.setdefault(key, deque()).append(waiter)
                while not waiter.done:
                    self._cond.wait()
                pooled = waiter.pooled
            if pooled is None:
                self._stats.misses += 1
            else:
                self._stats.hits += 1
            return pooled

    def give_back(self, pooled: Pooled) -> None:
        """Return an environment :meth:`take` gave, unstarted and untouched
        (its create was refused before using it); kept if still wanted."""
        with self._cond:
            keep = self._wanted_locked(pooled.key) and len(self._ready.get(pooled.key, ())) < self.size
            if keep:
                self._ready.setdefault(pooled.key, []).insert(0, pooled)
                self._stats.hits -= 1
                self._stats.misses += 1
                self._cond.notify_all()
            else:
                self._removing += 1
        if not keep:
            self._remove([pooled], counted=True)

    def unusable(self) -> None:
        """An environment :meth:`take` gave could not be started (the caller
        removed it and created anew): count that create as a miss."""
        with self._cond:
            self._stats.hits -= 1
            self._stats.misses += 1

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
                self._wake_locked()  # the fill thread makes up for what was taken

    def forget(self, key: PoolKey) -> None:
        """``key`` will not be asked again (its template's name moved on): remove its ready environments."""
        with self._cond:
            self._uses.pop(key, None)
            gone = self._ready.pop(key, [])
            self._removing += len(gone)
        self._remove(gone, counted=True)

    def wake(self) -> None:
        """Something :meth:`may_fill` depends on changed (e.g. an environment went)."""
        with self._cond:
            self._wake_locked()

    def stats(self) -> PoolStats:
        with self._cond:
            return PoolStats(**{**self._stats.__dict__, "ready": self._ready_count_locked()})

    # --- control -----------------------------------------------------------------------
    def configure(
        self, *, size: int | None = None, max_templates: int | None = None, idle_s: float | None = None
    ) -> None:
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
            self._removing += len(extra)
            self._wake_locked()
        self._remove(extra, counted=True)

    def drain(self) -> None:
        """Remove every ready environment, wait for the fills and removals
        under way (what the fills make is removed too) and forget every use:
        the pool is empty when this returns."""
        with self._cond:
            self._generation += 1
            gone = [p for ready in self._ready.values() for p in ready]
            self._ready.clear()
            self._uses.clear()
            self._backoff.clear()
            self._cond.notify_all()
        self._remove(gone)
        with self._cond:
            while self._inflight or self._removing:
                self._cond.wait()

    def open(self) -> None:
        """Fill again after :meth:`close` (a node started anew)."""
        with self._cond:
            self._closed = False

    def close(self) -> None:
        """Stop filling and remove every ready environment.  Idempotent."""
        with self._cond:
            self._closed = True
            worker, self._worker = self._worker, None
            self._cond.notify_all()
        if worker is not None:
            worker.join()
        self.drain()

    # --- the fill thread -------------------------------------------------------------
    def _wake_locked(self) -> None:
        if self.size and not self._closed:
            if self._worker is None or not self._worker.is_alive():
                self._worker = threading.Thread(target=self._run, name="weenv-pool", daemon=True)
                self._worker.start()
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                ready, want = self._ready_count_locked(), self._next_locked() is not None
            may_hold = self._may_fill(ready) if ready else True  # outside the lock: it takes the node's
            may_add = want and may_hold and self._may_fill(ready + 1)
            with self._cond:
                if self._closed:
                    return
                gone = self._stale_locked(time.monotonic(), over=not may_hold)
                self._removing += len(gone)
                key = self._next_locked() if may_add and not gone else None
                if key is not None:
                    self._inflight[key] = self._inflight.get(key, 0) + 1
                    generation = self._generation
                elif not gone:
                    self._cond.wait(timeout=self._sleep_locked())
                    continue
            if gone:
                self._remove(gone, counted=True)
            else:
                self._fill(key, generation)

    def _sleep_locked(self) -> float:
        """Seconds until the fill thread has something to check: the next idle
        key or backoff end (at most 30 s)."""
        now = time.monotonic()
        ends = [last + self.idle_s for _c, last in self._uses.values()] + list(self._backoff.values())
        return min([30.0] + [max(0.05, end - now) for end in ends])

    def _fill(self, key: PoolKey, generation: int) -> None:
        """Create one environment for ``key``; hand it to the oldest create
        waiting for it, or keep it if the pool still wants it, or remove it.
        The fill stops counting as under way in the same lock hold that pops
        its waiter (so every waiter has a fill under way), and what it
        removes counts as being removed from then on (:meth:`drain` waits
        for both)."""
        pooled = None
        try:
            pooled = self._prepare(key)
        except BaseException as exc:  # the pool's own thread: log, back off, go on
            log.warning("warm pool: creating an environment of %s ahead failed: %s", key.digest[:19], exc)
        with self._cond:
            current = not self._closed and generation == self._generation
            waiters = self._waiters.get(key)
            waiter = waiters.popleft() if waiters else None
            if waiters is not None and not waiters:
                del self._waiters[key]
            if waiter is not None:  # it waited for this fill: it gets what it made, or nothing
                waiter.pooled, waiter.done = (pooled if current else None), True
            keep = (
                pooled is not None
                and current
                and (waiter is not None or (self._wanted_locked(key) and len(self._ready.get(key, ())) < self.size))
            )
            if keep:
                self._stats.filled += 1
                if waiter is None:
                    self._ready.setdefault(key, []).append(pooled)
            elif pooled is None:
                self._stats.failed += 1
                self._backoff[key] = time.monotonic() + FAILURE_BACKOFF_S
            else:
                self._removing += 1
            self._inflight[key] -= 1
            if not self._inflight[key]:
                del self._inflight[key]
            self._cond.notify_all()
        if pooled is not None and not keep:
            self._remove([pooled], counted=True)

    def _wanted_locked(self, key: PoolKey) -> bool:
        """Whether ``key`` is among the :attr:`max_templates` most recently
        created keys that were created twice within :attr:`idle_s`."""
        return key in self._wanted_keys_locked()

    def _wanted_keys_locked(self) -> list[PoolKey]:
        return [key for key in reversed(self._uses) if self._uses[key][0] >= 2][: self.max_templates]

    def _next_locked(self) -> PoolKey | None:
        """The most recent wanted key short of :attr:`size` ready, with no
        create under way and not backing off; or None."""
        if not self.size:
            return None
        now = time.monotonic()
        for key in self._wanted_keys_locked():
            if key in self._active or self._backoff.get(key, 0.0) > now:
                continue
            if len(self._ready.get(key, ())) + self._inflight.get(key, 0) < self.size:
                return key
        return None

    def _stale_locked(self, now: float, *, over: bool) -> list[Pooled]:
        """Forget keys idle past :attr:`idle_s` and ended backoffs; take out the
        ready environments of keys no longer wanted, and (``over``: the node
        may not hold them all) the least recently wanted one."""
        for key, (_count, last) in list(self._uses.items()):
            if now - last > self.idle_s:
                del self._uses[key]
        for key, end in list(self._backoff.items()):
            if end <= now:
                del self._backoff[key]
        wanted = self._wanted_keys_locked()
        gone = []
        for key in [k for k in self._ready if k not in wanted]:
            gone += self._ready.pop(key)
        if over and not gone and self._ready:
            key = max(self._ready, key=wanted.index)  # the least recently created (wanted: most recent first)
            gone.append(self._ready[key].pop())
            if not self._ready[key]:
                del self._ready[key]
        return gone

    def _pop_ready_locked(self, key: PoolKey) -> Pooled | None:
        ready = self._ready.get(key)
        if not ready:
            return None
        pooled = ready.pop(0)
        if not ready:
            del self._ready[key]
        return pooled

    def _ready_count_locked(self) -> int:
        return sum(len(v) for v in self._ready.values())

    def _remove(self, pooled: list[Pooled], *, counted: bool = False) -> None:
        """Remove ``pooled`` (outside the lock), counted in ``_removing`` until
        done (``counted``: the caller counted them already, under the lock)."""
        if not pooled:
            return
        if not counted:
            with self._cond:
                self._removing += len(pooled)
        try:
            for p in pooled:
                try:
                    p.undo.close()
                except Exception:  # keep going: the others must go too
                    log.exception("warm pool: removing environment %s", p.env_id)
        finally:
            with self._cond:
                self._removing -= len(pooled)
                self._stats.removed += len(pooled)
                self._cond.notify_all()


def _check(size: int, max_templates: int, idle_s: float) -> None:
    if size < 0 or max_templates < 1 or not idle_s > 0:
        raise InvalidInputError(f"bad warm pool: size {size}, max_templates {max_templates}, idle_s {idle_s}")


def pool_size_from_env() -> int:
    """``WEENV_POOL_SIZE`` (environments per key, 0: no pool), else :data:`DEFAULT_SIZE`.
    Raises :class:`InvalidInputError` for a value that is not an integer >= 0."""
    return settings().pool.size
