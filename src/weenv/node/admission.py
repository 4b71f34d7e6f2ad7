"""Admission: whether a node takes a new environment now.

A node admits creates while it is started and not closing, and, with
``max_environments``, while the environments it holds and those starting are
fewer (:class:`CapacityError` otherwise).  Creates under way are counted
(:meth:`Admission.admit`) so that :meth:`Admission.close` can wait for them,
and the warm pool asks :meth:`Admission.may_pool` before holding more.  The
resources an environment declares are admitted apart, by the provisioner
(:meth:`Provisioner.reserve`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

from weenv.errors import CapacityError, ClosedError


class Admission:
    """``count()``: environments the node holds now."""

    def __init__(self, max_environments: int | None, count: Callable[[], int]):
        self.max_environments = max_environments
        self._count = count
        self._lock = threading.Lock()
        self.started = False
        self.closing = False
        self.pending = 0
        """Creates under way."""

    def check_started(self) -> None:
        """Raises :class:`ClosedError` unless the node is started and not closing."""
        if not self.started:
            raise ClosedError("node is not started")
        if self.closing:
            raise ClosedError("node is closing")

    @contextlib.contextmanager
    def admit(self) -> Iterator[None]:
        """One create, counted while the block runs; raises :class:`ClosedError`
        (closing) or :class:`CapacityError` (``max_environments`` run or start) first."""
        with self._lock:
            if self.closing:  # checked with the count close() waits on
                raise ClosedError("node is closing")
            held = self._count()
            if self.max_environments is not None and held + self.pending >= self.max_environments:
                raise CapacityError(
                    f"the node runs {held} environments (+{self.pending} starting) of at most {self.max_environments}"
                )
            self.pending += 1
        try:
            yield
        finally:
            with self._lock:
                self.pending -= 1

    def open(self) -> None:
        """Admit again (the node started)."""
        self.closing = False

    def close(self) -> None:
        """Refuse creates from now on (:meth:`wait` for those under way)."""
        with self._lock:
            self.closing = True

    def wait(self) -> None:
        """Return once no create is under way."""
        while self.pending:
            time.sleep(0.01)

    def may_pool(self, ready: int, admitting: bool) -> bool:
        """Whether the warm pool may hold ``ready`` environments now: the node
        runs and ``admitting`` (the provisioner's) and, with ``max_environments``,
        they fit beside the running and starting ones (a hint, without the lock)."""
        if not self.started or not admitting:
            return False
        return self.max_environments is None or self._count() + self.pending + ready <= self.max_environments
