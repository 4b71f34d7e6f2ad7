"""``weenv bench fork``: fork, snapshot, reset and pause of a running environment (issue 16).

One template (Debian bookworm + python3, the tests' base), one parent
environment that has written ``--parent-mb`` MB into its file system (files of
1 MiB and a tree of small files, as a cloned repository with its dependencies
would be).  Measured, on one in-process node (no daemon, so the figures are
the node's own):

- fork into N children (``--count``, default 1 16 100): seconds from the call
  until every child has answered its first command (``true``), the parent's
  pause for the capture, per-child added disk (its quota's bytes) and memory
  (its cgroup's);
- snapshot: seconds and bytes published; a create from it on a second node
  home with an empty cache (cold) and then again (warm);
- reset (to the snapshot taken after the parent's writes) against destroy + create;
- pause and resume: the freezer, and the pause that releases memory (its
  processes ended, its files kept; the resume until a command answered again).

Docker side by side in the same run (unless ``docker=False``; Debian's
``dockerd`` started privately, :mod:`weenv_bench.services.dockerd`): the same
Debian tree imported as an image, a parent container (``--network none``, the
same CPU, memory and pids limits) that wrote the same files, then per N
``docker commit`` of the parent and N ``docker run -d`` of the committed
image, each followed by ``docker exec CHILD true`` (its first command
answered), 8 at once as weenv's fork creates 8 children at once; and
``docker pause``/``unpause`` of the parent.

Writes JSON (``summary``, every row, the machine) and a PNG with ``--json``.
``summary`` holds ``fork_100_s``, ``docker_fork_100_s``, ``fork_ratio``
(Docker's over weenv's, 100 children), ``parent_pause_s``, ``reset_s``,
``destroy_create_s``, ``snapshot_s``, ``child_memory_bytes`` among others.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from weenv.config import Paths
from weenv.formats.manifest import Resources, RuntimeConfig
from weenv.node.cgroups import open_cgroups
from weenv.node.node import Node
from weenv.node.provision.models import ProvisionConfig
from weenv.node.runtime.idmap import SEARCHABLE_MODE
from weenv.packaging.debootstrap import debian_rootfs
from weenv.packaging.group import build_group
from weenv.packaging.template import create_template
from weenv.store.file import FileStore
from weenv_bench import machine, write_report
from weenv_bench.userns_modes import modes_and_runtimes

MiB = 1 << 20
DOCKER_WORKERS = 8
"""Docker children started at once (weenv's fork creates ``FORK_WORKERS`` = 8 at once)."""
SMALL = Resources(cpus=0.05, memory_bytes=128 * MiB, pids=256, disk_bytes=1 << 30)
"""Each environment's resources (children get the parent's): small, so 100 fit the node's admission."""


def _p(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def _stats(values: list[float]) -> dict:
    return {"p50": statistics.median(values), "p99": _p(values, 0.99), "n": len(values)}


def _memory(env_id: str) -> int:
    return open_cgroups(f"/weenv-{env_id}").usage().memory_working_set


def _write_script(parent_mb: int, small_files: int = 2000) -> str:
    """The parent's writes: ``parent_mb`` MB of 1 MiB files, ``small_files`` small files and one big file."""
    return (
        f"mkdir -p /workspace/repo/src && cd /workspace/repo && "
        f"for i in $(seq {parent_mb // 2}); do head -c 1M /dev/urandom > blob$i; done && "
        f"for i in $(seq {small_files}); do head -c 500 /dev/urandom > src/f$i.py; done && "
        f"head -c {(parent_mb - parent_mb // 2)}M /dev/urandom > big.bin && sync"
    )


def run_docker(
    tree: Path, counts: tuple[int, ...], parent_mb: int, repeats: int, log=print, small_files: int = 2000
) -> dict:
    """Docker's side (see the module doc): ``{"fork": [...], "commit": [...], "pause": [...], "unpause": [...]}``."""
    from weenv_bench.services.dockerd import Dockerd

    rows: dict = {"fork": [], "commit": [], "pause": [], "unpause": []}
    limits = [
        "--network",
        "none",
        f"--cpus={SMALL.cpus}",
        f"--memory={SMALL.memory_bytes}",
        f"--pids-limit={SMALL.pids}",
    ]
    with Dockerd() as d:
        d.import_tree(tree, "bench-fork:base")

        def start(image: str) -> str:
            cid = d.docker("run", "-d", *limits, image, "sleep", "infinity").stdout.decode().strip()
            d.docker("exec", cid, "true")
            return cid

        parent = start("bench-fork:base")
        d.docker("exec", parent, "sh", "-c", _write_script(parent_mb, small_files), timeout=600)
        for n in counts:
            for r in range(max(1, repeats // max(1, n // 4))):
                image = f"bench-fork:child-{n}-{r}"
                t = time.perf_counter()
                d.docker("commit", parent, image)
                commit_s = time.perf_counter() - t
                with ThreadPoolExecutor(min(n, DOCKER_WORKERS)) as pool:
                    kids = list(pool.map(lambda _: start(image), range(n)))
                rows["fork"].append({"n": n, "total_s": time.perf_counter() - t, "commit_s": commit_s})
                rows["commit"].append(commit_s)
                d.docker("rm", "-f", *kids, timeout=600)
                d.docker("rmi", image)
            log(
                f"docker commit + run {n}: "
                f"{statistics.median(x['total_s'] for x in rows['fork'] if x['n'] == n) * 1000:.0f} ms"
            )
        for _ in range(repeats):
            t = time.perf_counter()
            d.docker("pause", parent)
            rows["pause"].append(time.perf_counter() - t)
            t = time.perf_counter()
            d.docker("unpause", parent)
            rows["unpause"].append(time.perf_counter() - t)
        d.docker("rm", "-f", parent)
    return rows


def run(
    *,
    quick: bool = False,
    json_path: Path | None = None,
    counts: tuple[int, ...] | None = None,
    parent_mb: int | None = None,
    repeats: int | None = None,
    work: Path | None = None,
    docker: bool = True,
    runtimes: tuple[str, ...] | None = None,
    runtime: str | None = None,
    small_files: int = 2000,
    userns: tuple[str, ...] | None = None,
    log=print,
) -> dict:
    """Run the benchmark; return the result (also written to ``json_path``, a
    PNG beside it).  ``small_files``: how many small files the parent writes besides
    its ``parent_mb`` MB (each one a process at the parent's 5% of a CPU).  ``runtime``: the node's OCI runtime setting (None: the
    node's own); ``runtimes``: run once per named runtime and merge
    (:func:`weenv_bench.runtimes.side_by_side`; Docker in the default's run only);
    ``userns``: run once per named user-namespace mode, ``off``/``on``, each of them per runtime
    if ``runtimes`` too, and merge (:func:`weenv_bench.userns_modes.each_mode`; Docker in
    the first's run only)."""
    if userns or runtimes:

        def again(label: str, sub: str, first: bool, **kw) -> dict:
            """This run once more, with ``kw``, in ``work/sub`` (Docker in the first run only)."""
            log(f"--- {label}")
            return run(
                quick=quick,
                counts=counts,
                parent_mb=parent_mb,
                repeats=repeats,
                docker=docker and first,
                work=None if work is None else Path(work) / sub,
                small_files=small_files,
                log=log,
                **kw,
            )

        result = modes_and_runtimes(userns, runtimes, runtime, again, _runtime_figures)
        if json_path is not None:
            write_report(result, json_path, plot)
        return result
    counts = counts or (1, 16, 100)
    parent_mb = parent_mb if parent_mb is not None else (20 if quick else 100)
    repeats = repeats or (3 if quick else 10)
    if work is None:  # searchable by others: runc's init in a user namespace (WEENV_USERNS) opens the rootfs by path
        work = Path(tempfile.mkdtemp(prefix="weenv-bench-fork-"))
        os.chmod(work, SEARCHABLE_MODE)
    cache = Paths.from_env().cache
    try:
        store = FileStore(work / "store")
        log("building the template (debian bookworm + python3)")
        base = debian_rootfs(cache)
        build_group(base, store, name="base", workdir=work)
        create_template(store, "bench-fork", ["base"], runtime=RuntimeConfig(working_dir="/workspace"))
        rows: dict = {
            "fork": [],
            "reset": [],
            "destroy_create": [],
            "pause": [],
            "resume": [],
            "pause_release": [],
            "resume_release": [],
        }
        # 100 children of one parent whose writes the burst model just learned
        # (CPU-heavy) are refused by the default latency objective on 2 cores;
        # forks here measure the data path, so admission counts reservations
        with Node(
            Paths(work / "home", cache, store.url),
            store=store,
            pool_size=0,
            runtime=runtime,
            provisioning=ProvisionConfig(admission="reservations"),
        ) as node:
            runtime_name = node.runtime.name
            userns_on = node.containers.userns_all
            parent = node.create("bench-fork", resources=SMALL)
            log(f"parent {parent.id} writes {parent_mb} MB")
            r = node.exec(parent.id, ["sh", "-c", _write_script(parent_mb, small_files)])
            assert r.exit_code == 0, r.stderr
            parent_disk = node.disk_usage(parent.id)[0]
            for n in counts:
                for _ in range(max(1, repeats // max(1, n // 4))):
                    mem0 = _memory(parent.id)
                    res = node.fork(parent.id, n)
                    kids = [c for c in res.children if not isinstance(c, Exception)]
                    errors = [c for c in res.children if isinstance(c, Exception)]
                    assert not errors, f"fork {n}: {len(errors)} children failed, first: {errors[:3]}"
                    disk = [node.disk_usage(c.id)[0] for c in kids]
                    mem = [_memory(c.id) for c in kids]
                    rows["fork"].append(
                        {
                            "n": n,
                            "total_s": res.total_s,
                            "pause_s": res.pause_s,
                            "child_disk_bytes": statistics.median(disk),
                            "child_memory_bytes": statistics.median(mem),
                            "parent_memory_bytes": mem0,
                        }
                    )
                    for c in kids:
                        node.destroy(c.id)
                log(f"fork {n}: {statistics.median([x['total_s'] for x in rows['fork'] if x['n'] == n]) * 1000:.0f} ms")
            t = time.perf_counter()
            snap = node.snapshot(parent.id, "bench-fork-snap")
            snapshot_s = time.perf_counter() - t
            log(f"snapshot: {snapshot_s:.2f} s, {snap.bytes_published / MiB:.1f} MiB published")
            for _ in range(repeats):
                node.exec(parent.id, ["sh", "-c", "echo episode > /workspace/episode.txt"])
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
                t = time.perf_counter()
                node.pause(parent.id, release_memory=True)
                rows["pause_release"].append(time.perf_counter() - t)
                t = time.perf_counter()
                node.resume(parent.id)
                node.exec(parent.id, ["true"])  # its first process and agent run again
                rows["resume_release"].append(time.perf_counter() - t)
            with Node(Paths(work / "home2", cache, store.url), store=store, pool_size=0, runtime=runtime) as second:
                cold = second.create("bench-fork-snap")
                second.destroy(cold.id)
                warm = second.create("bench-fork-snap")
                second.destroy(warm.id)
            node.destroy(parent.id)
        if docker:
            log("docker: commit + run, pause/unpause")
            rows["docker"] = run_docker(base, counts, parent_mb, repeats, log=log, small_files=small_files)
        by_n = {n: [x for x in rows["fork"] if x["n"] == n] for n in counts}
        summary = {
            "runtime": runtime_name,
            "userns_on": userns_on,
            **{f"fork_{n}_s": statistics.median(x["total_s"] for x in xs) for n, xs in by_n.items()},
            "parent_pause_s": statistics.median(x["pause_s"] for x in rows["fork"]),
            "parent_disk_bytes": parent_disk,
            "child_disk_bytes": statistics.median(x["child_disk_bytes"] for x in rows["fork"]),
            "child_memory_bytes": statistics.median(x["child_memory_bytes"] for x in rows["fork"]),
            "snapshot_s": snapshot_s,
            "snapshot_bytes_published": snap.bytes_published,
            "snapshot_capture_s": snap.capture_s,
            "create_from_snapshot_cold_s": cold.timing.total_s,
            "create_from_snapshot_warm_s": warm.timing.total_s,
            "cold_bytes_fetched": cold.timing.bytes_fetched,
            "reset_s": statistics.median(rows["reset"]),
            "destroy_create_s": statistics.median(rows["destroy_create"]),
            "pause_s": statistics.median(rows["pause"]),
            "resume_s": statistics.median(rows["resume"]),
            "pause_release_s": statistics.median(rows["pause_release"]),
            "resume_release_s": statistics.median(rows["resume_release"]),
            "reset_speedup": statistics.median(rows["destroy_create"]) / statistics.median(rows["reset"]),
        }
        if docker:
            dk = rows["docker"]
            for n in counts:
                summary[f"docker_fork_{n}_s"] = statistics.median(x["total_s"] for x in dk["fork"] if x["n"] == n)
                summary[f"fork_{n}_ratio"] = summary[f"docker_fork_{n}_s"] / summary[f"fork_{n}_s"]
            if 100 in counts:
                summary["fork_ratio"] = summary["fork_100_ratio"]
            summary.update(
                docker_commit_s=statistics.median(dk["commit"]),
                docker_pause_s=statistics.median(dk["pause"]),
                docker_unpause_s=statistics.median(dk["unpause"]),
            )
        result = {
            "benchmark": "fork",
            "quick": quick,
            "counts": list(counts),
            "parent_mb": parent_mb,
            "repeats": repeats,
            "summary": summary,
            "stats": {
                **{f"fork_{n}": _stats([x["total_s"] for x in xs]) for n, xs in by_n.items()},
                "reset": _stats(rows["reset"]),
                "destroy_create": _stats(rows["destroy_create"]),
                "pause": _stats(rows["pause"]),
                "resume": _stats(rows["resume"]),
            },
            "rows": rows,
            "machine": machine(),
        }
        if json_path is not None:
            write_report(result, json_path, plot)
        return result
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _runtime_figures(result: dict) -> dict:
    """The figures of one run that tell OCI runtimes apart."""
    s = result["summary"]
    keys = [f"fork_{n}_s" for n in result["counts"]] + [
        "reset_s",
        "destroy_create_s",
        "pause_s",
        "resume_s",
        "resume_release_s",
        "create_from_snapshot_warm_s",
    ]
    return {k: s[k] for k in keys}


def plot(result: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result["summary"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    counts = result["counts"]
    x = range(len(counts))
    docker = all(f"docker_fork_{n}_s" in s for n in counts)
    w = 0.4 if docker else 0.8
    a.bar([i - (w / 2 if docker else 0) for i in x], [s[f"fork_{n}_s"] for n in counts], w, label="weenv fork")
    if docker:
        a.bar([i + w / 2 for i in x], [s[f"docker_fork_{n}_s"] for n in counts], w, label="docker commit + run")
    a.set_xticks(list(x), [str(n) for n in counts])
    a.set_yscale("log")
    a.set_xlabel("children")
    a.set_ylabel("s until every child answered (log)")
    a.set_title("fork")
    a.legend()
    names = ["reset_s", "destroy_create_s", "pause_s", "resume_s", "pause_release_s", "resume_release_s"] + (
        ["docker_pause_s", "docker_unpause_s"] if docker else []
    )
    b.bar([n[:-2].replace("_", "\n") for n in names], [s[n] * 1000 for n in names])
    b.set_ylabel("ms (p50)")
    b.set_title("reset vs destroy + create; pause, resume")
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)
