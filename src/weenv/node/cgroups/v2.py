"""cgroup v2: the unified hierarchy (``/sys/fs/cgroup`` on a pure v2 host).

Files (kernel ``Documentation/admin-guide/cgroup-v2.rst``):

======================  ===============================================================
CPU time, throttling    ``cpu.stat``: ``usage_usec`` (core, always there), and with the
                        cpu controller ``nr_periods``, ``nr_throttled``, ``throttled_usec``
CPU bandwidth           ``cpu.max``: ``"$MAX $PERIOD"``, ``$MAX`` = ``max`` or µs
memory                  ``memory.current``, ``memory.peak`` (Linux >= 5.19),
                        ``memory.stat`` (``inactive_file``), ``memory.max``,
                        ``memory.events`` (``max``: charges that hit the limit; ``oom_kill``),
                        ``memory.reclaim`` (Linux >= 5.19)
pids                    ``pids.current``, ``pids.max``, ``pids.events``
freeze                  ``cgroup.freeze`` (0/1, core), ``cgroup.events`` (``frozen``)
======================  ===============================================================

Where v2 differs from v1, and what this backend does about it:

- Writing a ``memory.max`` below what can be reclaimed does not fail with
  ``EBUSY`` as v1 does: the kernel OOM-kills in the group.  So a lowering is
  done in two steps: ask ``memory.reclaim`` for the difference, then set
  ``memory.max`` only if ``memory.current`` is at or below the new limit;
  otherwise :class:`LimitRefusedError`, as on v1.  (Usage growing between the
  check and the write can still meet the lower limit: a narrow window.)
- The OOM killer cannot be disabled (no ``oom_kill_disable``):
  :meth:`CgroupV2.set_oom_killer` answers False.
- CPU accounting and freezing are part of the core: they work even where the
  cpu controller is not enabled (as on a hybrid host, whose controllers are
  bound to v1 hierarchies).
"""

from __future__ import annotations

import errno
import time
from pathlib import Path

from weenv.errors import WeenvError
from weenv.node.cgroups.base import (
    CPU_PERIOD_US,
    Cgroup,
    LimitRefusedError,
    Limits,
    Usage,
    parse_keyed,
    quota_us,
)

CORE = frozenset({"cpuacct", "freezer"})
"""What v1 calls controllers and v2 provides in every group."""


class CgroupV2(Cgroup):
    """A group below the cgroup2 mount ``root``."""

    version = 2

    def __init__(self, path: str, root: Path = Path("/sys/fs/cgroup")):
        super().__init__(path)
        self.root = Path(root)
        self.dir = self.root / path.lstrip("/")

    def directories(self) -> list[Path]:
        return [self.dir]

    def controllers(self) -> frozenset[str]:
        where = self.dir if self.dir.is_dir() else self.dir.parent
        own = set(self._read(where / "cgroup.controllers").split())
        return frozenset(own & {"cpu", "memory", "pids"}) | CORE

    def create(self) -> None:
        """Make the group, enabling in its parent the cpu, memory and pids
        controllers the parent offers (as runc does)."""
        parent = self.dir.parent
        offered = set(self._read(parent / "cgroup.controllers").split()) & {"cpu", "memory", "pids"}
        enabled = set(self._read(parent / "cgroup.subtree_control").split())
        missing = offered - enabled
        if missing:
            self._write(parent / "cgroup.subtree_control", " ".join(f"+{c}" for c in sorted(missing)))
        super().create()

    def _f(self, name: str) -> Path:
        return self.dir / name

    def _int(self, name: str) -> int:
        return int(self._read(self._f(name)).strip())

    def _enabled(self) -> set[str]:
        return set(self._read(self._f("cgroup.controllers")).split())

    # --- tasks ------------------------------------------------------------------------
    def procs(self) -> list[int]:
        return [int(x) for x in self._read(self._f("cgroup.procs")).split()]

    def add_process(self, pid: int) -> None:
        self._write(self._f("cgroup.procs"), str(pid))

    # --- reading -----------------------------------------------------------------------
    def usage(self) -> Usage:
        at = time.monotonic()
        enabled = self._enabled()
        cpu = parse_keyed(self._read(self._f("cpu.stat")))
        usage = peak = failcnt = oom_kills = inactive = refaults = 0
        stall = 0.0
        if "memory" in enabled:
            usage = self._int("memory.current")
            if self._f("memory.peak").exists():
                peak = self._int("memory.peak")
            stat = parse_keyed(self._read(self._f("memory.stat")))
            inactive = stat.get("inactive_file", 0)
            refaults = stat.get("workingset_refault_anon", 0) + stat.get("workingset_refault_file", 0)
            if self._f("memory.pressure").exists():  # "some avg10=0.00 avg60=0.00 avg300=0.00 total=USEC"
                first = self._read(self._f("memory.pressure")).split("\n", 1)[0]
                stall = int(first.rsplit("total=", 1)[1]) / 1e6 if "total=" in first else 0.0
            events = parse_keyed(self._read(self._f("memory.events")))
            failcnt, oom_kills = events.get("max", 0), events.get("oom_kill", 0)
        pids = pids_failcnt = 0
        if "pids" in enabled:
            pids = self._int("pids.current")
            pids_failcnt = parse_keyed(self._read(self._f("pids.events"))).get("max", 0)
        return Usage(
            at=at,
            cpu_usage_s=cpu.get("usage_usec", 0) / 1e6,
            cpu_periods=cpu.get("nr_periods", 0),
            cpu_throttled_periods=cpu.get("nr_throttled", 0),
            cpu_throttled_s=cpu.get("throttled_usec", 0) / 1e6,
            memory_usage=usage,
            memory_working_set=max(0, usage - inactive),
            memory_peak=peak,
            memory_failcnt=failcnt,
            memory_under_oom=False,
            oom_kills=oom_kills,
            pids_current=pids,
            pids_failcnt=pids_failcnt,
            memory_refaults=refaults,
            memory_stall_s=stall,
        )

    def limits(self) -> Limits:
        enabled = self._enabled()
        quota, period = None, CPU_PERIOD_US
        if "cpu" in enabled:
            q, p = self._read(self._f("cpu.max")).split()
            period = int(p)
            quota = None if q == "max" else int(q) / period
        memory = None
        if "memory" in enabled:
            raw = self._read(self._f("memory.max")).strip()
            memory = None if raw == "max" else int(raw)
        pids = None
        if "pids" in enabled:
            raw = self._read(self._f("pids.max")).strip()
            pids = None if raw == "max" else int(raw)
        frozen = self._read(self._f("cgroup.freeze")).strip() == "1"
        return Limits(
            cpu_quota=quota, cpu_period_us=period, memory_limit=memory, pids_limit=pids, frozen=frozen, oom_killer=True
        )

    # --- writing -----------------------------------------------------------------------
    def set_cpu(self, quota: float | None, period_us: int = CPU_PERIOD_US) -> None:
        q = "max" if quota is None else str(quota_us(quota, period_us))
        self._write(self._f("cpu.max"), f"{q} {period_us}")

    def set_memory_limit(self, limit: int | None) -> None:
        if limit is None:
            self._write(self._f("memory.max"), "max")
            return
        limit = int(limit)
        current = self._int("memory.current")
        if current > limit:
            self._reclaim(current - limit)
            current = self._int("memory.current")
            if current > limit:
                raise LimitRefusedError(
                    f"cgroup {self.path}: memory.current {current} stays above {limit} after reclaim"
                )
        self._write(self._f("memory.max"), str(limit))

    def _reclaim(self, nbytes: int) -> None:
        """Ask the kernel to reclaim ``nbytes`` from the group; a partial reclaim
        (``EAGAIN``) or a kernel without ``memory.reclaim`` is not an error here:
        the caller checks ``memory.current`` afterwards."""
        if not self._f("memory.reclaim").exists():
            return
        try:
            self._write(self._f("memory.reclaim"), str(nbytes))
        except WeenvError as exc:
            if getattr(exc, "errno", None) != errno.EAGAIN:
                raise

    def reclaim(self, nbytes: int) -> None:
        if nbytes > 0:
            self._reclaim(int(nbytes))

    def set_oom_killer(self, enabled: bool) -> bool:
        return bool(enabled)  # v2 always kills at memory.max; only "enabled" is honoured

    def set_pids_limit(self, limit: int | None) -> None:
        self._write(self._f("pids.max"), "max" if limit is None else str(int(limit)))

    def _set_frozen(self, frozen: bool) -> None:
        self._write(self._f("cgroup.freeze"), "1" if frozen else "0")

    def _is_frozen(self) -> bool:
        return parse_keyed(self._read(self._f("cgroup.events"))).get("frozen", 0) == 1
