"""cgroup v1: one hierarchy per controller (``/sys/fs/cgroup/{cpu,cpuacct,memory,pids,freezer}``).

Files (kernel ``Documentation/admin-guide/cgroup-v1/``, ``scheduler/sched-bwc.rst``):

======================  ===============================================================
CPU time                ``cpuacct.usage`` (ns)
throttling              ``cpu.stat``: ``nr_periods``, ``nr_throttled``, ``throttled_time`` (ns)
CPU bandwidth           ``cpu.cfs_quota_us`` (-1 = unlimited), ``cpu.cfs_period_us``
memory                  ``memory.usage_in_bytes``, ``memory.max_usage_in_bytes``,
                        ``memory.failcnt``, ``memory.stat`` (``total_inactive_file``),
                        ``memory.limit_in_bytes`` (EBUSY when it cannot be lowered),
                        ``memory.oom_control`` (``oom_kill_disable``, ``under_oom``, ``oom_kill``)
pids                    ``pids.current``, ``pids.max``, ``pids.events``
freezer                 ``freezer.state``: THAWED, FREEZING, FROZEN
======================  ===============================================================

``cpu`` and ``cpuacct`` may share one hierarchy (``cpu,cpuacct``); the mount
points come from ``/proc/self/mountinfo`` (:func:`weenv.node.cgroups.detect`).
"""

from __future__ import annotations

import time
from pathlib import Path

from weenv.errors import NotFoundError
from weenv.node.cgroups.base import (
    CPU_PERIOD_US,
    Cgroup,
    LimitRefusedError,
    Limits,
    Pressure,
    Usage,
    parse_keyed,
    quota_us,
)

UNLIMITED_V1 = 0x7FFFFFFFFFFFF000
"""What ``memory.limit_in_bytes`` reads when unlimited (PAGE_COUNTER_MAX pages of 4 KiB)."""


class CgroupV1(Cgroup):
    """A group in the v1 hierarchies ``mounts`` (controller -> mount point)."""

    version = 1

    def __init__(self, path: str, mounts: dict[str, Path]):
        super().__init__(path)
        self.mounts = {c: Path(p) for c, p in mounts.items() if c in self.CONTROLLERS}

    def controllers(self) -> frozenset[str]:
        return frozenset(self.mounts)

    def directories(self) -> list[Path]:
        seen: list[Path] = []
        for c in self.CONTROLLERS:
            if c in self.mounts:
                d = self._dir(c)
                if d not in seen:
                    seen.append(d)
        return seen

    def _dir(self, controller: str) -> Path:
        try:
            return self.mounts[controller] / self.path.lstrip("/")
        except KeyError:
            raise NotFoundError(f"no cgroup v1 hierarchy for the {controller} controller") from None

    def _f(self, controller: str, name: str) -> Path:
        return self._dir(controller) / name

    def _int(self, controller: str, name: str) -> int:
        return int(self._read(self._f(controller, name)).strip())

    # --- tasks ------------------------------------------------------------------------
    def procs(self) -> list[int]:
        first = next(iter(self.mounts), None)
        if first is None:
            return []
        return [int(x) for x in self._read(self._f(first, "cgroup.procs")).split()]

    def add_process(self, pid: int) -> None:
        for d in self.directories():
            self._write(d / "cgroup.procs", str(pid))

    # --- reading -----------------------------------------------------------------------
    def usage(self) -> Usage:
        at = time.monotonic()
        cpu = parse_keyed(self._read(self._f("cpu", "cpu.stat"))) if "cpu" in self.mounts else {}
        cpu_ns = self._int("cpuacct", "cpuacct.usage") if "cpuacct" in self.mounts else 0
        mem = {"usage": 0, "peak": 0, "failcnt": 0, "inactive_file": 0, "refaults": 0}
        oom: dict[str, int] = {}
        if "memory" in self.mounts:
            mem["usage"] = self._int("memory", "memory.usage_in_bytes")
            mem["peak"] = self._int("memory", "memory.max_usage_in_bytes")
            mem["failcnt"] = self._int("memory", "memory.failcnt")
            stat = parse_keyed(self._read(self._f("memory", "memory.stat")))
            mem["inactive_file"] = stat.get("total_inactive_file", stat.get("inactive_file", 0))
            mem["refaults"] = sum(
                stat.get(f"total_workingset_refault_{k}", stat.get(f"workingset_refault_{k}", 0))
                for k in ("anon", "file")
            )
            oom = parse_keyed(self._read(self._f("memory", "memory.oom_control")))
        pids, pids_events = 0, {}
        if "pids" in self.mounts:
            pids = self._int("pids", "pids.current")
            pids_events = parse_keyed(self._read(self._f("pids", "pids.events")))
        return Usage(
            at=at,
            cpu_usage_s=cpu_ns / 1e9,
            cpu_periods=cpu.get("nr_periods", 0),
            cpu_throttled_periods=cpu.get("nr_throttled", 0),
            cpu_throttled_s=cpu.get("throttled_time", 0) / 1e9,
            memory_usage=mem["usage"],
            memory_working_set=max(0, mem["usage"] - mem["inactive_file"]),
            memory_peak=mem["peak"],
            memory_failcnt=mem["failcnt"],
            memory_under_oom=bool(oom.get("under_oom", 0)),
            oom_kills=oom.get("oom_kill", 0),
            pids_current=pids,
            pids_failcnt=pids_events.get("max", 0),
            memory_refaults=mem["refaults"],
        )

    def pressure(self) -> Pressure:
        cpu = parse_keyed(self._read(self._f("cpu", "cpu.stat"))) if "cpu" in self.mounts else {}
        oom = parse_keyed(self._read(self._f("memory", "memory.oom_control"))) if "memory" in self.mounts else {}
        return Pressure(cpu.get("nr_periods", 0), cpu.get("nr_throttled", 0), bool(oom.get("under_oom", 0)))

    def limits(self) -> Limits:
        quota, period = -1, CPU_PERIOD_US
        if "cpu" in self.mounts:
            quota = self._int("cpu", "cpu.cfs_quota_us")
            period = self._int("cpu", "cpu.cfs_period_us")
        memory, oom_killer = None, True
        if "memory" in self.mounts:
            m = self._int("memory", "memory.limit_in_bytes")
            memory = None if m >= UNLIMITED_V1 else m
            oom_killer = not parse_keyed(self._read(self._f("memory", "memory.oom_control"))).get("oom_kill_disable", 0)
        pids = None
        if "pids" in self.mounts:
            raw = self._read(self._f("pids", "pids.max")).strip()
            pids = None if raw == "max" else int(raw)
        frozen = False
        if "freezer" in self.mounts:
            frozen = self._read(self._f("freezer", "freezer.state")).strip() in ("FROZEN", "FREEZING")
        return Limits(
            cpu_quota=None if quota < 0 else quota / period,
            cpu_period_us=period,
            memory_limit=memory,
            pids_limit=pids,
            frozen=frozen,
            oom_killer=oom_killer,
        )

    # --- writing -----------------------------------------------------------------------
    def set_cpu(self, quota: float | None, period_us: int = CPU_PERIOD_US) -> None:
        q = -1 if quota is None else quota_us(quota, period_us)
        quota_f, period_f = self._f("cpu", "cpu.cfs_quota_us"), self._f("cpu", "cpu.cfs_period_us")
        # Lift the quota first so that no intermediate (quota, period) pair is invalid.
        self._write(quota_f, "-1")
        self._write(period_f, str(period_us))
        if q != -1:
            self._write(quota_f, str(q))

    def set_memory_limit(self, limit: int | None) -> None:
        # The kernel reclaims down to a lower limit itself and answers EBUSY when it cannot.
        self._write(self._f("memory", "memory.limit_in_bytes"), "-1" if limit is None else str(int(limit)))

    def reclaim(self, nbytes: int) -> None:
        limit_f, oom_f = self._f("memory", "memory.limit_in_bytes"), self._f("memory", "memory.oom_control")
        limit = self._int("memory", "memory.limit_in_bytes")
        target = self._int("memory", "memory.usage_in_bytes") - int(nbytes)
        if nbytes <= 0 or target <= 0 or target >= limit:
            return
        killer = not parse_keyed(self._read(oom_f)).get("oom_kill_disable", 0)
        if killer:
            self._write(oom_f, "1")
        try:
            self._write(limit_f, str(target))
        except LimitRefusedError:
            pass  # reclaimed what it could
        finally:
            self._write(limit_f, "-1" if limit >= UNLIMITED_V1 else str(limit))
            if killer:
                self._write(oom_f, "0")

    def set_oom_killer(self, enabled: bool) -> bool:
        self._write(self._f("memory", "memory.oom_control"), "0" if enabled else "1")
        return True

    def set_pids_limit(self, limit: int | None) -> None:
        self._write(self._f("pids", "pids.max"), "max" if limit is None else str(int(limit)))

    def _set_frozen(self, frozen: bool) -> None:
        self._write(self._f("freezer", "freezer.state"), "FROZEN" if frozen else "THAWED")

    def _is_frozen(self) -> bool:
        return self._read(self._f("freezer", "freezer.state")).strip() == "FROZEN"
