"""``weenv bench fork``: fork, snapshot, reset and pause of a running environment (issue 16).

One template (Debian bookworm + python3, the tests' base), one parent
environment that has written ``--parent-mb`` MB into its file system (files of
1 MiB and a tree of small files, as a cloned repository with its dependencies
would be).  Measured, on one in-process node (no daemon, so the figures are
the node's own):

- fork into N children (``--counts``, default 1 4 16): seconds from the call
  until every child has answered its first command (``true``), the parent's
  pause for the capture, per-child added disk (its quota's bytes) and memory
  (its cgroup's);
- snapshot: seconds and bytes published; a create from it on a second node
  home with an empty cache (cold) and then again (warm);
- reset (to the snapshot taken after the parent's writes) against destroy + create;
- pause and resume (the freezer).

Writes JSON (``summary``, every row, the machine) and a PNG with ``--json``.
Docker is not run side by side yet (``docker commit`` + ``run``).
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from pathlib import Path

from weenv_bench import machine, write_report

from weenv.config import Paths
from weenv.node.cgroups import open_cgroups
from weenv.node.node import Node
from weenv.packaging.debootstrap import debian_rootfs
from weenv.packaging.group import build_group
from weenv.formats.manifest import Resources, RuntimeConfig
from weenv.packaging.template import create_template
from weenv.store.file import FileStore

MiB = 1 << 20
SMALL = Resources(cpus=0.05, memory_bytes=128 * MiB, pids=256, disk_bytes=1 << 30)
"""Each environment's resources (children get the parent's): small, so 100 fit the node's admission."""


def _p(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def _stats(values: list[float]) -> dict:
    return {"p50": statistics.median(values), "p99": _p(values, 0.99), "n": len(values)}


def _memory(env_id: str) -> int:
    return open_cgroups(f"/weenv-{env_id}").usage().memory_working_set


def run(*, quick: bool = False, json_path: Path | None = None, counts: tuple[int, ...] | None = None,
        parent_mb: int | None = None, repeats: int | None = None, work: Path | None = None, log=print) -> dict:
    counts = counts or ((1, 4) if quick else (1, 4, 16))
    parent_mb = parent_mb if parent_mb is not None else (20 if quick else 100)
    repeats = repeats or (3 if quick else 10)
    work = Path(work or tempfile.mkdtemp(prefix="weenv-bench-fork-"))
    cache = Paths.from_env().cache
    try:
        store = FileStore(work / "store")
        log("building the template (debian bookworm + python3)")
        base = debian_rootfs(cache)
        build_group(base, store, name="base", workdir=work)
        create_template(store, "bench-fork", ["base"], runtime=RuntimeConfig(working_dir="/workspace"))
        rows: dict = {"fork": [], "reset": [], "destroy_create": [], "pause": [], "resume": []}
        with Node(Paths(work / "home", cache, store.url), store=store, pool_size=0) as node:
            parent = node.create("bench-fork", resources=SMALL)
            log(f"parent {parent.id} writes {parent_mb} MB")
            script = (f"mkdir -p /workspace/repo/src && cd /workspace/repo && "
                      f"for i in $(seq {parent_mb // 2}); do head -c 1M /dev/urandom > blob$i; done && "
                      f"for i in $(seq 2000); do head -c 500 /dev/urandom > src/f$i.py; done && "
                      f"head -c {(parent_mb - parent_mb // 2)}M /dev/urandom > big.bin && sync")  # fmt: skip
            r = node.exec(parent.id, ["sh", "-c", script])
            assert r.exit_code == 0, r.stderr
            parent_disk = node.disk_usage(parent.id)[0]
            for n in counts:
                for _ in range(max(1, repeats // max(1, n // 4))):
                    mem0 = _memory(parent.id)
                    res = node.fork(parent.id, n)
                    kids = [c for c in res.children if not isinstance(c, Exception)]
                    assert len(kids) == n, res.children
                    disk = [node.disk_usage(c.id)[0] for c in kids]
                    mem = [_memory(c.id) for c in kids]
                    rows["fork"].append({"n": n, "total_s": res.total_s, "pause_s": res.pause_s,
                                         "child_disk_bytes": statistics.median(disk),
                                         "child_memory_bytes": statistics.median(mem), "parent_memory_bytes": mem0})
                    for c in kids:
                        node.destroy(c.id)
                log(f"fork {n}: {statistics.median([x['total_s'] for x in rows['fork'] if x['n'] == n]) * 1000:.0f} ms")
            t = time.perf_counter()
            snap = node.snapshot(parent.id, "bench-fork-snap")
            snapshot_s = time.perf_counter() - t
            log(f"snapshot: {snapshot_s:.2f} s, {snap.bytes_published / MiB:.1f} MiB published")
            for _ in range(repeats):
                rows["reset"].append(node.reset(parent.id, "bench-fork-snap").timing.total_s)
                t = time.perf_counter()
                e = node.create("bench-fork", resources=SMALL)
                node.destroy(e.id)
                rows["destroy_create"].append(time.perf_counter() - t)
                t = time.perf_counter()
                node.pause(parent.id)
                rows["pause"].append(time.perf_counter() - t)
                t = time.perf_counter()
                node.resume(parent.id)
                rows["resume"].append(time.perf_counter() - t)
            with Node(Paths(work / "home2", cache, store.url), store=store, pool_size=0) as second:
                cold = second.create("bench-fork-snap")
                second.destroy(cold.id)
                warm = second.create("bench-fork-snap")
                second.destroy(warm.id)
            node.destroy(parent.id)
        by_n = {n: [x for x in rows["fork"] if x["n"] == n] for n in counts}
        summary = {
            **{f"fork_{n}_s": statistics.median(x["total_s"] for x in xs) for n, xs in by_n.items()},
            "parent_pause_s": statistics.median(x["pause_s"] for x in rows["fork"]),
            "parent_disk_bytes": parent_disk,
            "child_disk_bytes": statistics.median(x["child_disk_bytes"] for x in rows["fork"]),
            "child_memory_bytes": statistics.median(x["child_memory_bytes"] for x in rows["fork"]),
            "snapshot_s": snapshot_s, "snapshot_bytes_published": snap.bytes_published,
            "snapshot_capture_s": snap.capture_s,
            "create_from_snapshot_cold_s": cold.timing.total_s, "create_from_snapshot_warm_s": warm.timing.total_s,
            "cold_bytes_fetched": cold.timing.bytes_fetched,
            "reset_s": statistics.median(rows["reset"]), "destroy_create_s": statistics.median(rows["destroy_create"]),
            "pause_s": statistics.median(rows["pause"]), "resume_s": statistics.median(rows["resume"]),
        }  # fmt: skip
        result = {
            "benchmark": "fork", "quick": quick, "counts": list(counts), "parent_mb": parent_mb, "repeats": repeats,
            "summary": summary,
            "stats": {
                **{f"fork_{n}": _stats([x["total_s"] for x in xs]) for n, xs in by_n.items()},
                "reset": _stats(rows["reset"]), "destroy_create": _stats(rows["destroy_create"]),
                "pause": _stats(rows["pause"]), "resume": _stats(rows["resume"]),
            },
            "rows": rows, "machine": machine(),
        }  # fmt: skip
        if json_path is not None:
            write_report(result, json_path, plot)
        return result
    finally:
        shutil.rmtree(work, ignore_errors=True)


def plot(result: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result["summary"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    counts = result["counts"]
    a.bar([str(n) for n in counts], [s[f"fork_{n}_s"] * 1000 for n in counts])
    a.set_xlabel("children")
    a.set_ylabel("ms until every child answered")
    a.set_title("fork")
    names = ["reset_s", "destroy_create_s", "pause_s", "resume_s"]
    b.bar([n[:-2] for n in names], [s[n] * 1000 for n in names])
    b.set_ylabel("ms (p50)")
    b.set_title("reset, destroy + create, pause, resume")
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)
