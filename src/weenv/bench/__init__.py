"""Benchmarks: each measures weenv against the usual way side by side in one run,
writes JSON (a ``summary`` object, the full table, the machine) and a PNG.

One module per benchmark (``update``, ``start``, ``provision``, ``rollout``);
:func:`machine` describes where a run happened.
"""

from __future__ import annotations

import os
import platform


def machine() -> dict:
    """The machine a benchmark ran on: kernel, CPU model and count, memory bytes."""
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "kernel": platform.release(),
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "memory_bytes": mem,
        "python": platform.python_version(),
    }
