"""One interface over cgroup v1 and v2: read an environment's usage, set its limits.

A :class:`Cgroup` addresses one control group by its path below the root of
each hierarchy, the ``linux.cgroupsPath`` runc was given (``"/weenv-<id>"``).
It never creates a group implicitly: :meth:`Cgroup.create` is the only call
that makes directories, so a writer racing with ``runc delete`` finds the group
gone (:class:`~weenv.errors.NotFoundError`) instead of bringing it back.

Units: CPU time in seconds, CPU quota in cores (``quota / period``), periods in
microseconds, memory in bytes.

Errors (mapped at one boundary, :meth:`Cgroup._read` / :meth:`Cgroup._write`):

- the group (or its file) does not exist -> :class:`~weenv.errors.NotFoundError`;
- the kernel refuses to lower a memory limit below what it cannot reclaim
  (v1 ``EBUSY``; v2 emulated, see :mod:`weenv.node.cgroups.v2`) ->
  :class:`LimitRefusedError`, the limit unchanged;
- a value the kernel rejects (``EINVAL``) -> :class:`~weenv.errors.InvalidInputError`;
- any other failure -> :class:`CgroupError`.

Sources: the kernel's ``Documentation/admin-guide/cgroup-v1/{memory,cpuacct,
freezer-subsystem,pids}.rst``, ``scheduler/sched-bwc.rst`` and
``Documentation/admin-guide/cgroup-v2.rst``; the working set is cAdvisor's
(usage minus inactive file pages), which the kubelet evicts on.
"""

from __future__ import annotations

import errno
import os
import re
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from weenv.errors import CgroupError, InvalidInputError, LimitRefusedError, NotFoundError, WeenvError

CPU_PERIOD_US = 100_000
"""Default CFS period (µs)."""
REFREEZE_S = 1.0
"""Seconds a freeze waits before thawing and freezing again (:meth:`Cgroup.freeze`)."""
MIN_CPU_QUOTA_US = 1_000
"""The kernel refuses a CFS quota below 1 ms."""
MIN_CPU_PERIOD_US, MAX_CPU_PERIOD_US = 1_000, 1_000_000

_PATH_RE = re.compile(r"^(/[A-Za-z0-9_.:@+-]+)+\Z")


@dataclass(frozen=True)
class Usage:
    """One reading of a cgroup's counters.

    Counters (``cpu_*``, ``memory_failcnt``, ``oom_kills``) only grow; take two
    readings and subtract for a rate.  ``at``: ``time.monotonic()`` seconds.
    """

    at: float
    cpu_usage_s: float
    """CPU time used by all tasks, seconds (v1 ``cpuacct.usage``; v2 ``cpu.stat usage_usec``)."""
    cpu_periods: int
    """Enforcement periods that had runnable tasks (``nr_periods``)."""
    cpu_throttled_periods: int
    """Periods in which the quota ran out (``nr_throttled``)."""
    cpu_throttled_s: float
    """Total time tasks were throttled, seconds (``throttled_time`` ns / ``throttled_usec``)."""
    memory_usage: int
    """Bytes charged (v1 ``memory.usage_in_bytes``; v2 ``memory.current``)."""
    memory_working_set: int
    """``memory_usage`` minus inactive file pages (``memory.stat`` ``total_inactive_file`` / ``inactive_file``)."""
    memory_peak: int
    """Highest ``memory_usage`` seen (v1 ``memory.max_usage_in_bytes``; v2 ``memory.peak``, 0 if the kernel lacks it)."""
    memory_failcnt: int
    """Times a charge hit the limit (v1 ``memory.failcnt``; v2 ``memory.events`` ``max``)."""
    memory_under_oom: bool
    """Tasks wait at the limit with the OOM killer disabled (v1 ``memory.oom_control`` ``under_oom``; v2 never)."""
    oom_kills: int
    """Processes the OOM killer killed in the group (``oom_kill`` of v1 ``memory.oom_control`` / v2 ``memory.events``)."""
    pids_current: int
    """Tasks in the group (``pids.current``)."""
    pids_failcnt: int
    """Forks refused at the pids limit (``pids.events`` ``max``)."""
    memory_refaults: int = 0
    """Pages evicted and then needed again (``memory.stat`` ``workingset_refault_anon`` + ``_file``;
    v1: their ``total_`` sums): what reclaiming them cost."""
    memory_stall_s: float = 0.0
    """Seconds some task waited for memory (v2 ``memory.pressure`` ``some total``; 0 on v1, which has none)."""


@dataclass(frozen=True)
class Pressure:
    """The few counters that say a group is stalled now (cheaper to read than :class:`Usage`)."""

    cpu_periods: int
    cpu_throttled_periods: int
    memory_under_oom: bool
    """Tasks wait at the memory limit (v1 with the OOM killer disabled; v2 never)."""


@dataclass(frozen=True)
class Limits:
    """The limits a cgroup has now.  ``None``: unlimited."""

    cpu_quota: float | None
    """Cores (quota / period)."""
    cpu_period_us: int
    memory_limit: int | None
    pids_limit: int | None
    frozen: bool
    """Frozen or freezing."""
    oom_killer: bool
    """Whether the kernel OOM-kills in the group at its limit (v1 can disable it; v2 always kills)."""


class Cgroup(ABC):
    """One control group, ``path`` (``"/weenv-<id>"``) below each hierarchy's root.

    Methods block briefly (file reads and writes in cgroupfs); :meth:`freeze`
    waits until the kernel reports the group frozen.  The object holds no open
    files, so it outlives the group harmlessly.
    """

    version: ClassVar[int]
    CONTROLLERS: ClassVar[tuple[str, ...]] = ("cpu", "cpuacct", "memory", "pids", "freezer")

    def __init__(self, path: str):
        if not isinstance(path, str) or not _PATH_RE.match(path) or "/.." in path or "/./" in path + "/":
            raise InvalidInputError(f"bad cgroup path {path!r}: want an absolute path like '/weenv-<id>'")
        self.path = path

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.path!r})"

    # --- where files are ---------------------------------------------------------------
    @abstractmethod
    def controllers(self) -> frozenset[str]:
        """Which of ``cpu``, ``cpuacct``, ``memory``, ``pids``, ``freezer`` this
        group can use (v2: ``cpuacct`` and ``freezer`` are part of the core)."""

    @abstractmethod
    def directories(self) -> list[Path]:
        """The group's directory in every hierarchy it lives in."""

    # --- lifetime ----------------------------------------------------------------------
    def exists(self) -> bool:
        return any(d.is_dir() for d in self.directories())

    def create(self) -> None:
        """Make the group in every hierarchy (runc does this for environments;
        tests and tools use it).  An existing directory is kept."""
        for d in self.directories():
            try:
                d.mkdir(exist_ok=True)
            except OSError as exc:
                raise _map(exc, d) from exc

    def remove(self) -> None:
        """Remove the group's directories (it must have no tasks).  A missing one is fine."""
        for d in self.directories():
            try:
                d.rmdir()
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise _map(exc, d) from exc

    @abstractmethod
    def procs(self) -> list[int]:
        """Host pids of the group's processes."""

    @abstractmethod
    def add_process(self, pid: int) -> None:
        """Move process ``pid`` into the group (every hierarchy)."""

    # --- reading -----------------------------------------------------------------------
    @abstractmethod
    def usage(self) -> Usage:
        """Read every counter.  Raises :class:`NotFoundError` if the group is gone."""

    def pressure(self) -> Pressure:
        """Throttling counters and whether tasks wait at the memory limit.
        Raises :class:`NotFoundError` if the group is gone."""
        u = self.usage()
        return Pressure(u.cpu_periods, u.cpu_throttled_periods, u.memory_under_oom)

    @abstractmethod
    def limits(self) -> Limits:
        """Read every limit.  Raises :class:`NotFoundError` if the group is gone."""

    # --- writing -----------------------------------------------------------------------
    @abstractmethod
    def set_cpu(self, quota: float | None, period_us: int = CPU_PERIOD_US) -> None:
        """CPU bandwidth: ``quota`` cores per ``period_us`` µs (``None``: unlimited).
        The quota is rounded to µs, at least 1 ms.  Raises :class:`InvalidInputError`
        for a period outside 1 ms..1 s or a quota <= 0."""

    @abstractmethod
    def set_memory_limit(self, limit: int | None) -> None:
        """Hard memory limit in bytes (``None``: unlimited).  Lowering it below
        what the kernel can reclaim raises :class:`LimitRefusedError`, the limit
        unchanged."""

    @abstractmethod
    def reclaim(self, nbytes: int) -> None:
        """Ask the kernel to reclaim up to ``nbytes`` of the group's memory now
        (page cache first; anonymous memory only where there is swap), its
        limit left as it is: v2 ``memory.reclaim``; v1 has none, so its limit
        is lowered by ``nbytes`` below its usage (the kernel reclaims to fit
        or refuses) and put back at once, its OOM killer disabled meanwhile
        (a task charging memory then waits a moment; none is killed).  A
        partial reclaim is not an error."""

    @abstractmethod
    def set_oom_killer(self, enabled: bool) -> bool:
        """Whether tasks reaching the memory limit are OOM-killed (the default)
        or wait until the limit is raised.  Returns False where the kernel cannot
        disable it (v2), True once applied."""

    @abstractmethod
    def set_pids_limit(self, limit: int | None) -> None:
        """At most ``limit`` tasks (``None``: unlimited)."""

    @abstractmethod
    def _set_frozen(self, frozen: bool) -> None: ...

    @abstractmethod
    def _is_frozen(self) -> bool:
        """True once the kernel reports every task frozen."""

    def freeze(self, timeout: float = 10.0) -> None:
        """Stop every task of the group and wait until the kernel reports it
        frozen.  A group still freezing after :data:`REFREEZE_S` is thawed and
        frozen again, as runc's freezer does (libcontainer/cgroups/fs/freezer.go:
        v1's freezer can stay in FREEZING while a task sits in a kernel wait it
        was asked to leave before it entered; once in a full run here).  Raises
        :class:`CgroupError` (the group thawed again) after ``timeout`` seconds."""
        self._set_frozen(True)
        deadline = time.monotonic() + timeout
        refreeze = time.monotonic() + REFREEZE_S
        while not self._is_frozen():
            now = time.monotonic()
            if now > deadline:
                self._set_frozen(False)
                raise CgroupError(f"cgroup {self.path} did not freeze within {timeout} s")
            if now > refreeze:
                self._set_frozen(False)
                self._set_frozen(True)
                refreeze = now + REFREEZE_S
            time.sleep(0.005)

    def thaw(self) -> None:
        """Let the group's tasks run again."""
        self._set_frozen(False)

    def is_frozen(self) -> bool:
        """Whether the kernel reports every task of the group frozen."""
        return self._is_frozen()

    # --- the one I/O boundary -----------------------------------------------------------
    @staticmethod
    def _read(path: Path) -> str:
        try:
            with open(path) as f:
                return f.read()
        except OSError as exc:
            raise _map(exc, path) from exc

    @staticmethod
    def _write(path: Path, value: str) -> None:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_TRUNC)  # never O_CREAT: the files are the kernel's
        except OSError as exc:
            raise _map(exc, path) from exc
        try:
            os.write(fd, value.encode())
        except OSError as exc:
            raise _map(exc, path, value) from exc
        finally:
            os.close(fd)


def parse_keyed(text: str) -> dict[str, int]:
    """``"key value\\n..."`` (``memory.stat``, ``cpu.stat``, ``memory.events``...) -> dict."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2:
            try:
                out[parts[0]] = int(parts[1])
            except ValueError:
                continue
    return out


def quota_us(quota: float, period_us: int) -> int:
    """Cores -> µs per period (at least :data:`MIN_CPU_QUOTA_US`); checks both."""
    if not MIN_CPU_PERIOD_US <= period_us <= MAX_CPU_PERIOD_US:
        raise InvalidInputError(f"CPU period {period_us} µs is outside 1000..1000000")
    if not quota > 0:
        raise InvalidInputError(f"CPU quota {quota!r} must be > 0 cores")
    return max(MIN_CPU_QUOTA_US, round(quota * period_us))


def _map(exc: OSError, path: Path, value: str | None = None) -> WeenvError:
    what = f"{path}" + (f" <- {value!r}" if value is not None else "")
    if exc.errno in (errno.ENOENT, errno.ENODEV):
        return NotFoundError(f"cgroup file {path} is gone (the group was removed?)")
    if exc.errno == errno.EBUSY and value is not None:
        return LimitRefusedError(f"{what}: the kernel refused (busy)")
    if exc.errno == errno.EINVAL:
        return InvalidInputError(f"{what}: the kernel rejected the value")
    return CgroupError(exc.errno, f"{what}: {exc.strerror}")
