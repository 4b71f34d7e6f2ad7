"""Benchmarks: each measures weenv against the usual way side by side in one run,
writes JSON (a ``summary`` object, the full table, the machine) and a PNG.

One module per benchmark (``update``, ``start``, ``provision``, ``rollout``);
:func:`machine` describes where a run happened.
"""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Callable
from pathlib import Path


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


def write_report(result: dict, json_path: str | os.PathLike[str], plot: Callable[[dict, Path], None]) -> None:
    """Write ``result`` as JSON to ``json_path`` and draw ``plot(result, PNG path)``
    beside it (same name, ``.png``)."""
    json_path = Path(json_path)
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, json_path.with_suffix(".png"))
