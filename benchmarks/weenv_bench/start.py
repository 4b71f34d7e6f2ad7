"""``weenv bench start``: time from a start request to the first command's output,
weenv against Docker, side by side in one run on the same content.

**Content.**  Templates built from real input: the cached Debian bookworm
minbase + python3 tree (:func:`~weenv.packaging.debootstrap.debian_rootfs`)
and real PyPI wheels installed by ``pip install --target`` into
``/usr/local/lib/python3.11/dist-packages``: ``start-1g`` (:data:`FULL_WHEELS`,
about 1 GB in all, measured at every concurrency) and ``start-3g``
(:data:`LARGE_WHEELS`, torch and jax added, about 3 GB, at concurrency 1);
``quick``: ``start-quick`` only (:data:`QUICK_WHEELS`, about 300 MB).  The
installed trees are kept in ``$WEENV_CACHE/bench-start/`` and reused.  The
templates are measured one after the other, each from an empty node cache and
no Docker image present, through the same registry and dockerd.

- **weenv**: two groups (``base``: the Debian tree; ``packages``: the wheels'
  tree) and a template over them, built into a file store and copied
  (:func:`~weenv.packaging.transfer.copy_template`) into an ``oci://`` store on a
  private docker-registry on loopback (:mod:`weenv_bench.services.registry`).  A
  :class:`~weenv.node.node.Node` in this process reads it from there, with its
  own home (empty chunk cache) and provisioning off (no admission control,
  as Docker has none).
- **Docker**: ``docker import`` of the same Debian tree, then ``FROM`` it
  ``COPY`` of the same packages tree (two layers, as weenv's two groups),
  built by a private dockerd (Debian's docker.io, :mod:`weenv_bench.services.dockerd`)
  and pushed to the same registry.

**One start** is: the request, then the first command (:data:`COMMANDS`:
``echo ready``, the headline; also ``numpy``, Debian's python3 importing numpy
from the template, at concurrency 1); the time is taken when its first line of
output arrives.

- weenv: ``Node.create(template, first_command=False)`` then ``Node.spawn`` of
  the command, following its output;
- Docker: ``docker run --rm --network none IMAGE CMD`` (which pulls the image
  when it is missing), reading its stdout.

**Cold**: weenv: node chunk cache empty and group mounts gone
(:meth:`Node.drop_caches`), with the template's prefetch profile in the store
(recorded by a first start, measured apart as ``first_start``); Docker: every
image removed (``docker rmi``), so the start pulls all layers.  **Warm**: right
after, with caches, mounts and images in place.  At each concurrency (1 and 16;
64 too unless ``quick``) all starts of a round are released at once (a barrier);
at concurrency 1 a phase repeats ``cold_runs``/``warm_runs`` times.

Measured per phase: p50/p99 of the time to first output (seconds); bytes
fetched (weenv: the node cache's counter of stored (zstd) bytes fetched from
the store by the time the first output arrived, and after background prefetch
settled; Docker: the image's compressed size from the registry manifest,
layers + config, which a cold start pulls in full); CPU seconds and peak
memory (resident, VmHWM, reset through ``/proc/PID/clear_refs`` at the phase's
start) of the daemons: weenv's node runs in this process, so its figures are
this process's threads plus its reaped children (runc); Docker's are dockerd's
plus its containerd's (read from /proc), not the ``docker`` clients'.  The
exec round trip of ``true``: weenv ``Node.run(env, ["true"])``, Docker
``docker exec CID true`` (its client's start included), p50 over ``exec_runs``.

``summary`` (the main template at concurrency 1): ``cold_p50_s``,
``warm_p50_s``, ``docker_cold_p50_s``, ``docker_warm_p50_s``, ``cold_ratio``
(Docker's cold over weenv's), ``fetched_fraction`` (weenv's bytes fetched by
the first output over the template's stored bytes), ``exec_p50_s``.  The load
(``/proc/loadavg``) is recorded before and after each phase: the machine may
be shared.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Self

from weenv.config import Paths
from weenv.errors import InvalidInputError, RuntimeFailedError
from weenv.node.runtime.idmap import SEARCHABLE_MODE
from weenv_bench import machine, write_report
from weenv_bench.userns_modes import modes_and_runtimes

QUICK_WHEELS = ("numpy==2.2.1", "sympy==1.13.3", "mpmath==1.3.0")
"""~80 MB installed: with the ~220 MB Debian tree, a ~300 MB template."""
FULL_WHEELS = QUICK_WHEELS + (
    "scipy==1.14.1",
    "pandas==2.2.3",
    "pyarrow==18.1.0",
    "scikit-learn==1.6.0",
    "polars==1.17.1",
    "opencv-python-headless==4.10.0.84",
    "matplotlib==3.9.4",
    "pillow==11.0.0",
    "duckdb==1.1.3",
    "lxml==5.3.0",
    "statsmodels==0.14.4",
)
"""~790 MB installed: with the Debian tree, a ~1 GB template."""
LARGE_WHEELS = FULL_WHEELS + ("torch==2.5.1", "jax==0.4.35", "jaxlib==0.4.35")
"""~2.9 GB installed (torch's wheel alone ~1.75 GB): with the Debian tree, a ~3 GB template."""
SITE = "usr/local/lib/python3.11/dist-packages"
"""Where Debian's python3 finds locally installed packages."""
COMMANDS = {
    "echo": (["echo", "ready"], b"ready"),
    "numpy": (
        [
            "python3",
            "-c",
            "import numpy; print('numpy', numpy.__version__, flush=True)",
        ],
        b"numpy",
    ),
}
"""First commands by name: argv and the start of their expected output.  ``echo``
(coreutils' echo from the template) is the headline: the start itself; ``numpy``
(Debian's python3 importing numpy from the template) adds a real first workload."""
MAIN_COMMAND = "echo"
DOCKER_BASE = "weenv-bench/start-base"
DOCKERFILE = "FROM {base}\nCOPY packages/ /\n"
NO_POOL = "warm-no-pool"
"""The kind of the rows of warm starts with weenv's warm pool off."""
LAYOUTS = ("tree", "profile")
"""The group layouts measured by default, in order: ``tree`` (groups as built:
files in tree order), then ``profile`` (each group whose data the first start
read republished by ``weenv update --profile``: those files first, in access
order).  Cold starts are measured in both; warm starts, concurrency above 1
and the exec round trip in the last one, which the summary reports."""
SUMMARY_KEYS = (
    "cold_p50_s",
    "warm_p50_s",
    "docker_cold_p50_s",
    "docker_warm_p50_s",
    "cold_ratio",
    "fetched_fraction",
    "exec_p50_s",
)


# --- content -------------------------------------------------------------------------------
def packages_tree(cache: Path, wheels: tuple[str, ...], log=print) -> Path:
    """A directory holding ``usr/local/lib/python3.11/dist-packages`` with ``wheels``
    installed (``pip install --no-deps --target``, byte-compiled), from real PyPI
    wheels for CPython 3.11 on x86_64.  Built once under
    ``cache/bench-start/tree-<hash of the list>`` (atomically renamed into place);
    wheels are kept in ``cache/pip/wheels-start``.  Raises :class:`RuntimeFailedError`
    if pip fails."""
    key = hashlib.sha256("\n".join(wheels).encode()).hexdigest()[:16]
    base = Path(cache) / "bench-start"
    tree = base / f"tree-{key}"
    if (tree / SITE).is_dir():
        return tree
    base.mkdir(parents=True, exist_ok=True)
    wheel_dir = Path(cache) / "pip" / "wheels-start"
    wheel_dir.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    log(f"pip download {len(wheels)} wheels into {wheel_dir} ...")
    _run(
        [
            *pip,
            "download",
            "--only-binary=:all:",
            "--no-deps",
            "--python-version",
            "3.11",
            "--platform",
            "manylinux2014_x86_64",
            "--platform",
            "manylinux_2_28_x86_64",
            "-d",
            str(wheel_dir),
            *wheels,
        ],
        "pip download",
    )
    files = []
    for spec in wheels:
        name, version = spec.split("==")
        stem = name.replace("-", "_").lower() + "-" + version + "-"
        found = [p for p in wheel_dir.glob("*.whl") if p.name.lower().startswith(stem)]
        if not found:
            raise RuntimeFailedError(f"no wheel for {spec} in {wheel_dir}")
        files.append(str(found[0]))
    tmp = Path(tempfile.mkdtemp(dir=base, prefix=".tmp-tree-"))
    try:
        log(f"pip install --target {len(files)} wheels ...")
        _run(
            [
                *pip,
                "install",
                "--no-deps",
                "--no-index",
                "--target",
                str(tmp / SITE),
                *files,
            ],
            "pip install",
        )
        os.rename(tmp, tree)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tree


def _run(argv: list[str], what: str, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, check=False, **kwargs)
    if proc.returncode != 0:
        raise RuntimeFailedError(f"{what} failed (exit {proc.returncode}):\n{(proc.stderr or proc.stdout)[-1200:]}")
    return proc


def _tree_bytes(root: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, f)).st_size
    return total


# --- measurement helpers -------------------------------------------------------------------
def _percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile ``q`` in (0, 1] of ``values``."""
    values = sorted(values)
    return values[max(0, min(len(values), math.ceil(q * len(values))) - 1)]


def _stats(values: list[float]) -> dict:
    return {
        "n": len(values),
        "p50_s": round(statistics.median(values), 4),
        "p99_s": round(_percentile(values, 0.99), 4),
        "max_s": round(max(values), 4),
    }


def loadavg() -> list[float]:
    """The 1, 5 and 15 minute load averages (``/proc/loadavg``)."""
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def _proc_cpu_s(pid: int) -> float:
    """utime + stime of ``pid`` (all its threads), seconds; 0 if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _proc_hwm(pid: int | str) -> int:
    """Peak resident bytes of ``pid`` (VmHWM) since start or the last reset."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _reset_hwm(pid: int | str) -> None:
    with contextlib.suppress(OSError):
        Path(f"/proc/{pid}/clear_refs").write_text("5")


class _SelfMeter:
    """CPU and peak memory of this process (the in-process node) over a phase:
    its threads plus the children it reaped meanwhile (runc and its helpers)."""

    def __enter__(self) -> Self:
        _reset_hwm("self")
        t = os.times()
        self._cpu = t.user + t.system + t.children_user + t.children_system
        return self

    def __exit__(self, *exc) -> None:
        t = os.times()
        self.cpu_s = t.user + t.system + t.children_user + t.children_system - self._cpu
        self.peak_bytes = _proc_hwm("self")


class _DaemonMeter:
    """CPU and summed peak memory of dockerd and its containerd over a phase."""

    def __init__(self, pids):
        self.pids = pids  # callable returning the daemon pids

    def __enter__(self) -> Self:
        self._pids = self.pids()
        for p in self._pids:
            _reset_hwm(p)
        self._cpu = {p: _proc_cpu_s(p) for p in self._pids}
        return self

    def __exit__(self, *exc) -> None:
        self.cpu_s = sum(max(0.0, _proc_cpu_s(p) - c) for p, c in self._cpu.items())
        self.peak_bytes = sum(_proc_hwm(p) for p in self._pids)


def _released_together(n: int, start) -> list:
    """Run ``start()`` ``n`` times at once (threads released by one barrier);
    return the results in completion order.  The first error is raised after all end."""
    barrier = threading.Barrier(n)

    def one(_i):
        barrier.wait()
        return start()

    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(one, i) for i in range(n)]
        return [f.result() for f in futures]


# --- weenv side ----------------------------------------------------------------------------
PHASES = (
    "manifest_s",
    "groups_s",
    "upper_s",
    "overlay_s",
    "runtime_s",
    "create_s",
    "command_s",
    "prefetch_begin_s",
    "prefetch_end_s",
    "pack_chunks",
    "demand_chunks",
)
"""The phases of one start a row reports (p50 over its starts; seconds unless named otherwise):
the create's own (:class:`~weenv.api.models.CreateTiming`: manifests, group
mounts (``upper_s``, the upper dir made meanwhile, is a part of them),
overlay, runc; ``create_s`` the whole create), ``command_s`` from the create's
return to the first output (spawn, the agent, the command), the background
prefetch job's start and end measured from the request (``prefetch_end_s``:
every chunk of the profile cached) and the chunks it cached from the pack (only
for starts whose job still ran when the create returned: a job that ended
before is gone from the node's table), and the chunks demand reads fetched by
the first output."""


def _demand_chunks(node) -> int:
    s = node.cache.stats()
    return s.chunks_fetched - s.chunks_prefetched


def _with_prefetch(r: dict) -> dict:
    """One start's phases with its prefetch job's (after it settled)."""
    phases, job = dict(r["phases"]), r["job"]
    phases["demand_chunks"] = r["demand_chunks"]
    if job is not None:
        phases["prefetch_begin_s"] = job.started - r["t0"]
        if job.ended is not None:
            phases["prefetch_end_s"] = job.ended - r["t0"]
        phases["pack_chunks"] = job.from_pack
    return phases


def _phase_medians(phases: list[dict]) -> dict:
    out = {}
    for k in PHASES:
        values = [p[k] for p in phases if p.get(k) is not None]
        if values:
            v = statistics.median(values)
            out[k] = round(v, 4) if k.endswith("_s") else v
    return out


class _WeenvSide:
    def __init__(self, node, template: str, stored_bytes: int, log, layout: str = "tree"):
        self.node, self.template, self.stored_bytes, self.log = node, template, stored_bytes, log
        self.layout = layout
        """How the template's groups lay out their files: ``tree`` (as built) or ``profile``."""

    def start(self, command: str = MAIN_COMMAND) -> dict:
        """One start: create, spawn the first command, wait for its first output."""
        from weenv.formats.manifest import Resources

        argv, expect = COMMANDS[command]

        node = self.node
        demand0 = _demand_chunks(node)
        t0, m0 = time.perf_counter(), time.monotonic()
        info = node.create(
            self.template,
            first_command=False,
            resources=Resources(cpus=float(os.cpu_count() or 1)),
        )
        created = time.perf_counter() - t0
        job = node.prefetch.job(info.id)
        p = node.spawn(info.id, argv, primary_reader=True)
        first, out, err, code = None, b"", b"", None
        for ev in p.log.follow(p.primary):
            if ev.type == "stdout":
                if first is None:
                    first = time.perf_counter() - t0
                    fetched = node.cache.bytes_fetched
                    demand = _demand_chunks(node) - demand0
                out += ev.data or b""
            elif ev.type == "stderr":
                err += ev.data or b""
            elif ev.type == "end":
                code = ev.exit_code
        if first is None or code != 0 or not out.startswith(expect):
            raise RuntimeFailedError(
                f"first command in weenv failed (exit {code}): {err.decode(errors='replace')[-600:]}"
            )
        t = info.timing
        phases = {
            "manifest_s": t.manifest_s,
            "groups_s": t.groups_s,
            "upper_s": t.upper_s,
            "overlay_s": t.overlay_s,
            "runtime_s": t.runtime_s,
            "create_s": created,
            "command_s": first - created,
        }
        return {
            "env": info.id,
            "seconds": first,
            "create_s": created,
            "fetched_at": fetched,
            "output": out.decode().strip(),
            "pooled": t.pooled,
            "phases": phases,
            "job": job,
            "t0": m0,
            "demand_chunks": demand,
        }

    def destroy(self, env_id: str) -> None:
        job = self.node.prefetch.job(env_id)
        self.node.destroy(env_id)
        if job is not None:
            job.done.wait(60)

    def settle(self, env_ids: list[str], timeout: float = 120.0) -> None:
        """Wait for the prefetch of ``env_ids`` to finish (it runs after the first output)."""
        deadline = time.monotonic() + timeout
        for env_id in env_ids:
            job = self.node.prefetch.job(env_id)
            if job is not None:
                job.done.wait(max(0.0, deadline - time.monotonic()))

    def phase(self, kind: str, concurrency: int, rounds: int, command: str = MAIN_COMMAND) -> dict:
        """``rounds`` rounds of ``concurrency`` starts released together; cold
        rounds drop caches first."""
        times, fetched_first, fetched_total, pooled, phases = [], [], [], 0, []
        with _SelfMeter() as meter:
            loads = [loadavg()]
            for _ in range(rounds):
                if kind == "cold":
                    self.node.drop_caches()
                before = self.node.cache.bytes_fetched
                results = _released_together(concurrency, lambda: self.start(command))
                times += [r["seconds"] for r in results]
                pooled += sum(r["pooled"] for r in results)
                fetched_first.append(max(r["fetched_at"] for r in results) - before)
                self.settle([r["env"] for r in results])
                phases += [_with_prefetch(r) for r in results]
                fetched_total.append(self.node.cache.bytes_fetched - before)
                for r in results:
                    self.destroy(r["env"])
            loads.append(loadavg())
        row = {
            "system": "weenv",
            "command": command,
            "kind": kind,
            "concurrency": concurrency,
            **_stats(times),
            "bytes_fetched": round(statistics.median(fetched_first)),
            "bytes_fetched_after_prefetch": round(statistics.median(fetched_total)),
            "fetched_fraction": round(statistics.median(fetched_first) / self.stored_bytes, 4),
            "daemon_cpu_s": round(meter.cpu_s, 2),
            "daemon_peak_bytes": meter.peak_bytes,
            "cpu_ms_per_start": round(meter.cpu_s / len(times) * 1000, 1),
            "direct_mounts": len(self.node.groups.mounted_directly()),
            "pooled_starts": pooled,
            "pool_size": self.node.pool.size,
            "layout": self.layout,
            "phases_p50_s": _phase_medians(phases),
            "loadavg": loads,
            "times_s": [round(t, 4) for t in times],
        }
        self.log(
            f"weenv {command} {kind} x{concurrency} ({self.layout} layout): p50 {row['p50_s']:.3f} s, "
            f"p99 {row['p99_s']:.3f} s, fetched {row['bytes_fetched'] / 1e6:.1f} MB; phases p50 "
            + ", ".join(
                f"{k.removesuffix('_s')} {v * 1000:.1f}" if k.endswith("_s") else f"{k} {v}"
                for k, v in row["phases_p50_s"].items()
            )
            + " (ms)"
        )
        return row

    def exec_rtt(self, runs: int) -> dict:
        """p50 of ``Node.run(env, ["true"])`` in one started environment."""
        r = self.start()
        try:
            times = []
            for _ in range(runs):
                t = time.perf_counter()
                res = self.node.run(r["env"], ["true"])
                times.append(time.perf_counter() - t)
                if res.exit_code != 0:
                    raise RuntimeFailedError(f"'true' exited {res.exit_code} in weenv")
        finally:
            self.settle([r["env"]])
            self.destroy(r["env"])
        return {
            "system": "weenv",
            "how": "Node.run(env, ['true']) in process",
            **_stats(times),
        }


# --- Docker side ---------------------------------------------------------------------------
class _DockerSide:
    def __init__(self, dockerd, ref: str, image_bytes: int, log):
        self.dockerd, self.ref, self.image_bytes, self.log = (
            dockerd,
            ref,
            image_bytes,
            log,
        )

    def daemon_pids(self) -> list[int]:
        from weenv_bench.services import process

        pids = {self.dockerd.pid}
        for pid in process.pids_mentioning(str(self.dockerd.root) + "/"):
            try:
                comm = Path(f"/proc/{pid}/comm").read_text().strip()
            except OSError:
                continue
            if comm == "containerd":
                pids.add(pid)
        return sorted(p for p in pids if p)

    def remove_images(self) -> None:
        """Remove every image (``docker image prune -a``: no container holds one,
        runs are ``--rm``), so the next run pulls every layer."""
        self.dockerd.docker("image", "prune", "-a", "-f", timeout=300)
        left = self.dockerd.docker("images", "-aq").stdout.decode().split()
        if left:
            self.dockerd.docker("rmi", "-f", *left, timeout=300, check=False)
        if self.dockerd.docker("images", "-aq").stdout.strip():
            raise RuntimeFailedError("docker images remain after docker image prune -a")

    def start(self, command: str = MAIN_COMMAND) -> dict:
        from weenv_bench.services.dockerd import DOCKER

        argv, expect = COMMANDS[command]
        with tempfile.TemporaryFile() as errf:
            t0 = time.perf_counter()
            proc = subprocess.Popen(
                [DOCKER, "run", "--rm", "--network", "none", self.ref, *argv],
                stdout=subprocess.PIPE,
                stderr=errf,
                env=self.dockerd.env(),
            )
            line = proc.stdout.readline()
            first = time.perf_counter() - t0
            proc.stdout.read()
            proc.stdout.close()
            code = proc.wait(600)
            errf.seek(0)
            err = errf.read().decode(errors="replace")
        if code != 0 or not line.startswith(expect):
            raise RuntimeFailedError(f"docker run failed (exit {code}): {err[-600:]}")
        return {"seconds": first, "output": line.decode().strip()}

    def phase(self, kind: str, concurrency: int, rounds: int, command: str = MAIN_COMMAND) -> dict:
        times = []
        with _DaemonMeter(self.daemon_pids) as meter:
            loads = [loadavg()]
            for _ in range(rounds):
                if kind == "cold":
                    self.remove_images()
                times += [r["seconds"] for r in _released_together(concurrency, lambda: self.start(command))]
            loads.append(loadavg())
        row = {
            "system": "docker",
            "command": command,
            "kind": kind,
            "concurrency": concurrency,
            **_stats(times),
            "bytes_fetched": self.image_bytes if kind == "cold" else 0,
            "daemon_cpu_s": round(meter.cpu_s, 2),
            "daemon_peak_bytes": meter.peak_bytes,
            "loadavg": loads,
            "times_s": [round(t, 4) for t in times],
        }
        self.log(f"docker {command} {kind} x{concurrency}: p50 {row['p50_s']:.3f} s, p99 {row['p99_s']:.3f} s")
        return row

    def exec_rtt(self, runs: int) -> dict:
        cid = (
            self.dockerd.docker("run", "-d", "--network", "none", self.ref, "sleep", "infinity").stdout.decode().strip()
        )
        try:
            times = []
            for _ in range(runs):
                t = time.perf_counter()
                self.dockerd.docker("exec", cid, "true")
                times.append(time.perf_counter() - t)
        finally:
            self.dockerd.docker("rm", "-f", cid, check=False)
        return {
            "system": "docker",
            "how": "docker exec CID true (client start included)",
            **_stats(times),
        }


def _registry_image_bytes(registry, repository: str, tag: str) -> int:
    """Compressed layers + config of ``repository:tag`` (what a full pull downloads)."""
    import httpx

    accept = "application/vnd.docker.distribution.manifest.v2+json"
    r = httpx.get(
        f"{registry.url}/v2/{repository}/manifests/{tag}",
        headers={"Accept": accept},
        timeout=30,
    )
    r.raise_for_status()
    m = r.json()
    return sum(ly["size"] for ly in m["layers"]) + m["config"]["size"] + len(r.content)


# --- the run -------------------------------------------------------------------------------
def run(
    *,
    quick: bool = False,
    json_path: Path | None = None,
    work: Path | None = None,
    concurrency: tuple[int, ...] | None = None,
    cold_runs: int | None = None,
    warm_runs: int | None = None,
    exec_runs: int | None = None,
    commands: tuple[str, ...] = ("numpy",),
    large: bool | None = None,
    docker: bool = True,
    layouts: tuple[str, ...] = LAYOUTS,
    runtimes: tuple[str, ...] | None = None,
    runtime: str | None = None,
    userns: tuple[str, ...] | None = None,
    wheels: tuple[str, ...] | None = None,
    log=print,
) -> dict:
    """Run the benchmark; return the result dict (also written to ``json_path``
    with a PNG beside it, ``.png`` for ``.json``).

    ``quick``: the ~300 MB template, concurrency 1 and 16, fewer runs.
    ``wheels``: the wheels installed into the main template's packages group
    (default :data:`QUICK_WHEELS` with ``quick``, else :data:`FULL_WHEELS`); one
    small pure-Python wheel makes the smallest template (the Debian tree, ~230 MB)
    that still measures every system, phase and key, as the tests run it.
    ``concurrency``: levels (default 1, 16, and 64 unless ``quick``).
    ``cold_runs``/``warm_runs``: rounds at concurrency 1 (higher levels run one
    round each).  ``large``: also the ~3 GB template (:data:`LARGE_WHEELS`), at
    concurrency 1 only (default: unless ``quick``).  ``docker``: measure Docker
    too (False: weenv alone, no dockerd; the Docker figures are None).
    ``layouts``: the group layouts measured, in order (:data:`LAYOUTS`).  ``runtime``: the node's
    OCI runtime setting (None: the node's own); ``runtimes``: the whole run once per named
    runtime, merged (:func:`weenv_bench.runtimes.side_by_side`; Docker in the default's run
    only; ``work`` then ``work/<runtime>``).  ``userns``: the whole run once per named
    user-namespace mode, ``off``/``on`` (each per runtime if ``runtimes`` too), merged
    (:func:`weenv_bench.userns_modes.each_mode`; Docker in the first's run only; ``work``
    then ``work/userns-<mode>``).  ``work``: directory for
    the stores, the node's home and the build context (default: a temporary
    one, removed).  Raises :class:`ToolMissingError` without docker.io /
    docker-registry / debootstrap, :class:`RuntimeFailedError` if a build, push
    or start fails.  The node is closed, the dockerd and registry stopped by
    PID and their directories removed in every case.
    """
    from weenv.packaging.debootstrap import debian_rootfs
    from weenv_bench.services.dockerd import Dockerd
    from weenv_bench.services.registry import Registry

    if userns or runtimes:

        def again(label: str, sub: str, first: bool, **kw) -> dict:
            """This run once more, with ``kw``, in ``work/sub`` (Docker in the first run only)."""
            log(f"--- {label}")
            return run(
                quick=quick,
                work=None if work is None else Path(work) / sub,
                concurrency=concurrency,
                cold_runs=cold_runs,
                warm_runs=warm_runs,
                exec_runs=exec_runs,
                commands=commands,
                large=large,
                docker=docker and first,
                layouts=layouts,
                wheels=wheels,
                log=log,
                **kw,
            )

        result = modes_and_runtimes(userns, runtimes, runtime, again, _runtime_figures)
        if json_path is not None:
            write_report(result, json_path, plot)
        return result
    levels = tuple(concurrency or ((1, 16) if quick else (1, 16, 64)))
    runs = _Runs(
        cold=cold_runs or (3 if quick else 5),
        warm=warm_runs or (5 if quick else 10),
        exec=exec_runs or (30 if quick else 100),
        extra_cold=2 if quick else 3,
    )
    extra = tuple(c for c in commands if c != MAIN_COMMAND)
    if any(c not in COMMANDS for c in extra):
        raise InvalidInputError(f"unknown first command; known: {sorted(COMMANDS)}")
    large = not quick if large is None else large
    if not layouts or any(x not in LAYOUTS for x in layouts) or len(set(layouts)) != len(layouts):
        raise InvalidInputError(f"layouts: want distinct names of {LAYOUTS} (the first one is built)")
    env_paths = Paths.from_env()
    own = work is None
    work = Path(work or tempfile.mkdtemp(prefix="weenv-bench-start-"))
    if own:  # searchable by others: runc's init in a user namespace (WEENV_USERNS) opens the rootfs by path
        os.chmod(work, SEARCHABLE_MODE)
    t_run = time.monotonic()
    load_start = loadavg()
    try:
        base_tree = debian_rootfs(env_paths.cache, log=log)
        main_wheels = wheels if wheels is not None else QUICK_WHEELS if quick else FULL_WHEELS
        plan = [("start-quick" if quick else "start-1g", main_wheels, levels, extra)]
        if large:
            plan.append(("start-3g", LARGE_WHEELS, (1,), ()))
        with contextlib.ExitStack() as stack:
            registry = stack.enter_context(Registry(work / "registry"))
            services = {"registry_pid": registry.pid}
            dockerd = None
            if docker:
                dockerd = stack.enter_context(Dockerd(insecure_registries=[registry.address]))
                services |= {
                    "dockerd_pid": dockerd.pid,
                    "dockerd_root": str(dockerd.root),
                    "dockerd_cgroup_parent": dockerd.cgroup_parent,
                }
            measured = [
                _measure_template(
                    name,
                    base_tree,
                    wheels,
                    lv,
                    ex,
                    runs,
                    registry=registry,
                    dockerd=dockerd,
                    work=work / name,
                    env_paths=env_paths,
                    log=log,
                    layouts=layouts,
                    docker=docker,
                    runtime=runtime,
                )
                for name, wheels, lv, ex in plan
            ]
        main = measured[0]
        rows = [r for m in measured for r in m["rows"]]

        def row(system: str, kind: str, c: int = 1, layout: str | None = layouts[-1]) -> dict:
            return next(
                (
                    r
                    for r in main["rows"]
                    if r["system"] == system
                    and r["kind"] == kind
                    and r["concurrency"] == c
                    and r["command"] == MAIN_COMMAND
                    and (system != "weenv" or r["layout"] == layout)
                ),
                {},
            )

        cold, warm, no_pool = row("weenv", "cold"), row("weenv", "warm"), row("weenv", NO_POOL)
        c16 = row("weenv", "cold", 16)
        d_cold, d_warm = row("docker", "cold"), row("docker", "warm")
        result = {
            "benchmark": "start",
            "summary": {
                "runtime": main["runtime"],
                "userns_on": main["userns_on"],
                "cold_p50_s": cold["p50_s"],
                **{f"cold_p50_{lay}_layout_s": row("weenv", "cold", layout=lay)["p50_s"] for lay in layouts},
                "cold_phases_p50_s": cold["phases_p50_s"],
                "warm_p50_s": warm["p50_s"],
                "warm_no_pool_p50_s": no_pool["p50_s"],
                "c16_p50_s": c16.get("p50_s"),
                "cpu_ms_per_create": no_pool["cpu_ms_per_start"],
                "docker_cold_p50_s": d_cold.get("p50_s"),
                "docker_warm_p50_s": d_warm.get("p50_s"),
                "cold_ratio": round(d_cold["p50_s"] / cold["p50_s"], 1) if d_cold else None,
                "fetched_fraction": cold["fetched_fraction"],
                "exec_p50_s": main["exec"][0]["p50_s"],
                "docker_exec_p50_s": main["exec"][1]["p50_s"] if docker else None,
                "template": main["template"]["name"],
                "template_bytes": main["template"]["image_bytes"],
            },
            "table": rows,
            "exec": main["exec"],
            "template": main["template"],
            "templates": [m["template"] for m in measured],
            "publish": main["publish"],
            "method": {
                "start": "request to the first line of the first command's output",
                "weenv": "in-process Node over oci:// (loopback docker-registry); cold = Node.drop_caches() "
                "(chunk cache empty, group mounts and assembled images gone), prefetch profile present and known to "
                "the node (its replay starts before the group manifests load)",
                "docker": "docker run --rm --network none (private dockerd, overlay2); cold = docker rmi of every "
                "image, so the run pulls all layers from the same registry",
                "bytes_fetched": "weenv: stored (zstd) bytes fetched from the store by the first output "
                "(median over rounds; all starts of a round); docker: compressed image size pulled",
                "daemon": "weenv: this process (node + benchmark threads) + reaped children (runc); "
                "docker: dockerd + containerd (/proc); peak = VmHWM after clear_refs",
                "concurrency": "starts of a round released together by a barrier; concurrency 1 repeats rounds",
                "pool": "weenv's warm pool at its default size (weenv.node.state.pool): a template created twice gets "
                "environments created ahead (runc create), which later creates start (runc start); rows count "
                f"them in pooled_starts. {NO_POOL}: the warm starts at concurrency 1 again with the pool off "
                "(pool size 0), every create running runc run",
                "templates": "the summary is the first template's; rows name their template",
            },
            "levels": list(levels),
            "not_run": ([] if 64 in levels else ["concurrency 64 (quick mode or not requested)"])
            + ([] if large else ["the ~3 GB template (quick mode or not requested)"])
            + ([] if docker else ["Docker (not requested)"]),
            "docker_services": services,
            "load": {"start": load_start, "end": loadavg(), "uptime": _uptime()},
            "seconds": round(time.monotonic() - t_run, 1),
            "machine": machine(),
        }
        if json_path is not None:
            write_report(result, json_path, plot)
        return result
    finally:
        if own:
            shutil.rmtree(work, ignore_errors=True)


@dataclass(frozen=True)
class _Runs:
    cold: int
    """Rounds of cold starts at concurrency 1 (weenv; Docker one fewer: each pulls the whole image)."""
    warm: int
    """Rounds of warm starts at concurrency 1."""
    exec: int
    """Round trips of ``true`` (Docker: a third of them, at least 10)."""
    extra_cold: int
    """Cold rounds of the other first commands."""


def _measure_template(
    name: str,
    base_tree: Path,
    wheels: tuple[str, ...],
    levels: tuple[int, ...],
    extra: tuple[str, ...],
    runs: _Runs,
    *,
    registry,
    dockerd,
    work: Path,
    env_paths: Paths,
    log,
    layouts: tuple[str, ...] = LAYOUTS,
    docker: bool = True,
    runtime: str | None = None,
) -> dict:
    """Build template ``name`` (the Debian tree + ``wheels``) for both systems,
    publish both to ``registry``, and measure both; return ``{"rows", "exec",
    "template", "publish"}`` (rows carry ``template``).  The node, the build
    context and the images are gone afterwards."""
    from weenv.node.node import Node
    from weenv.node.provision import ProvisionConfig
    from weenv.packaging.group import build_group
    from weenv.packaging.template import create_template
    from weenv.packaging.transfer import copy_template
    from weenv.store.file import FileStore
    from weenv.store.oci import OciStore

    work.mkdir(parents=True, exist_ok=True)
    pkgs = packages_tree(env_paths.cache, wheels, log=log)
    content = {"base_bytes": _tree_bytes(base_tree), "packages_bytes": _tree_bytes(pkgs), "wheels": list(wheels)}
    content["tree_bytes"] = content["base_bytes"] + content["packages_bytes"]

    file_store = FileStore(work / "filestore")
    t = time.monotonic()
    base_g = build_group(base_tree, file_store, name="base", workdir=work)
    pkgs_g = build_group(pkgs, file_store, name="packages", workdir=work)
    create_template(file_store, name, ["base", "packages"])
    weenv_build_s = time.monotonic() - t
    groups = (base_g.manifest, pkgs_g.manifest)
    template_bytes = sum(g.image_size for g in groups)
    stored_bytes = sum(g.stored_size for g in groups)
    log(
        f"weenv template {name}: {template_bytes / 1e6:.0f} MB image, {stored_bytes / 1e6:.0f} MB stored "
        f"(built in {weenv_build_s:.1f} s)"
    )

    rows: list[dict] = []
    execs: list[dict] = []
    with contextlib.ExitStack() as stack:
        # weenv: publish to the registry
        oci = OciStore(f"oci://{registry.address}/bench/weenv")
        stack.callback(oci.close)
        t = time.monotonic()
        copied = copy_template(file_store, oci, name)
        weenv_push_s = time.monotonic() - t
        log(f"weenv: copied {copied.bytes_copied / 1e6:.0f} MB to the registry in {weenv_push_s:.1f} s")
        shutil.rmtree(work / "filestore", ignore_errors=True)

        # weenv phases
        paths = Paths(home=work / "home", cache=env_paths.cache, store_url=oci.url)
        node = Node(paths, store=oci, cache_bytes=8 << 30, provisioning=ProvisionConfig(mode="off"), runtime=runtime)
        runtime_name = node.runtime.name
        userns_on = node.containers.userns_all
        node.start()
        stack.callback(node.close)
        side = _WeenvSide(node, name, stored_bytes, log)
        trees = {"base": base_tree, "packages": pkgs}

        def record() -> dict:  # a template's first start: it records its prefetch profile
            first = side.start()
            side.settle([first["env"]])
            side.destroy(first["env"])
            node.prefetch.wait_published()
            return first

        for i, layout in enumerate(layouts):
            side.layout = layout
            with _SelfMeter() as meter:
                if layout == "profile":  # the user's path: weenv update --profile, group by group
                    t = time.monotonic()
                    side.template, side.stored_bytes, first = _relayout(oci, name, trees, paths, record)
                    log(
                        f"weenv: groups laid out by the recorded profile (weenv update --profile) and "
                        f"started once in {time.monotonic() - t:.1f} s"
                    )
                else:
                    first = record()
            if first is None:
                raise RuntimeFailedError(f"the prefetch profile of {name} read no group's data: nothing to lay out")
            rows.append(
                {
                    "system": "weenv",
                    "command": MAIN_COMMAND,
                    "kind": "first_start",
                    "concurrency": 1,
                    **_stats([first["seconds"]]),
                    "bytes_fetched": first["fetched_at"],
                    "daemon_cpu_s": round(meter.cpu_s, 2),
                    "daemon_peak_bytes": meter.peak_bytes,
                    "layout": layout,
                    "note": "no prefetch profile yet (it records one)",
                }
            )
            log(f"weenv first start (records the prefetch profile): {first['seconds']:.3f} s")
            last = i == len(layouts) - 1
            for c in levels if last else levels[:1]:
                rows.append(side.phase("cold", c, runs.cold if c == 1 else 1))
                if not last:
                    continue
                rows.append(side.phase("warm", c, runs.warm if c == 1 else 1))
                if c == 1:  # the same warm starts without the warm pool: every one runs runc run
                    pool_size = node.pool.size
                    node.pool.configure(size=0)
                    rows.append(side.phase(NO_POOL, 1, runs.warm))
                    node.pool.configure(size=pool_size)
            for command in extra:
                rows.append(side.phase("cold", 1, runs.extra_cold, command))
                if last:
                    rows.append(side.phase("warm", 1, runs.warm, command))
        execs.append(side.exec_rtt(runs.exec))
        node.close()
        if not docker:
            return _template_result(
                name,
                rows,
                execs,
                groups,
                template_bytes,
                stored_bytes,
                None,
                content,
                first,
                extra,
                weenv_build_s,
                weenv_push_s,
                copied,
                None,
                None,
            ) | {"runtime": runtime_name, "userns_on": userns_on}

        # Docker: import + build + push the same trees
        t = time.monotonic()
        dockerd.import_tree(base_tree, DOCKER_BASE)
        context = work / "context"
        context.mkdir()
        proc = subprocess.run(
            ["cp", "-a", "--link", str(pkgs), str(context / "packages")], capture_output=True, check=False
        )
        if proc.returncode != 0:
            shutil.copytree(pkgs, context / "packages", symlinks=True)
        (context / "Dockerfile").write_text(DOCKERFILE.format(base=DOCKER_BASE))
        ref = registry.reference("bench/start", name)
        dockerd.docker("build", "-q", "-t", ref, str(context), timeout=1800)
        docker_build_s = time.monotonic() - t
        t = time.monotonic()
        dockerd.docker("push", ref, timeout=1800)
        docker_push_s = time.monotonic() - t
        image_bytes = _registry_image_bytes(registry, "bench/start", name)
        log(
            f"docker image: {image_bytes / 1e6:.0f} MB compressed (import+build {docker_build_s:.1f} s, "
            f"push {docker_push_s:.1f} s)"
        )
        shutil.rmtree(context, ignore_errors=True)

        dside = _DockerSide(dockerd, ref, image_bytes, log)
        dside.remove_images()

        # Docker phases
        for c in levels:
            rows.append(dside.phase("cold", c, max(1, runs.cold - 1) if c == 1 else 1))
            rows.append(dside.phase("warm", c, runs.warm if c == 1 else 1))
        for command in extra:
            rows.append(dside.phase("cold", 1, runs.extra_cold, command))
            rows.append(dside.phase("warm", 1, runs.warm, command))
        execs.append(dside.exec_rtt(max(10, runs.exec // 3)))
        dside.remove_images()
        dockerd.docker("rmi", "-f", DOCKER_BASE, timeout=300, check=False)

    return _template_result(
        name,
        rows,
        execs,
        groups,
        template_bytes,
        stored_bytes,
        image_bytes,
        content,
        first,
        extra,
        weenv_build_s,
        weenv_push_s,
        copied,
        docker_build_s,
        docker_push_s,
    ) | {"runtime": runtime_name, "userns_on": userns_on}


def _template_result(
    name,
    rows,
    execs,
    groups,
    template_bytes,
    stored_bytes,
    image_bytes,
    content,
    first,
    extra,
    weenv_build_s,
    weenv_push_s,
    copied,
    docker_build_s,
    docker_push_s,
) -> dict:
    for r in rows:
        r["template"] = name
    return {
        "rows": rows,
        "exec": execs,
        "template": {
            "name": name,
            "image_bytes": template_bytes,
            "stored_bytes": stored_bytes,
            "groups": [
                {"name": g.name, "image_bytes": g.image_size, "stored_bytes": g.stored_size, "chunks": len(g.chunks)}
                for g in groups
            ],
            "docker_image_bytes": image_bytes,
            **content,
            "first_command": COMMANDS[MAIN_COMMAND][0],
            "first_output": first["output"],
            "other_commands": {k: COMMANDS[k][0] for k in extra},
        },
        "publish": {
            "weenv_build_s": round(weenv_build_s, 2),
            "weenv_copy_to_registry_s": round(weenv_push_s, 2),
            "weenv_bytes_copied": copied.bytes_copied,
            "docker_import_build_s": None if docker_build_s is None else round(docker_build_s, 2),
            "docker_push_s": None if docker_push_s is None else round(docker_push_s, 2),
        },
    }


RUNTIME_KEYS = ("cold_p50_s", "warm_p50_s", "warm_no_pool_p50_s", "c16_p50_s", "cpu_ms_per_create")
"""The summary's figures that tell OCI runtimes apart (``summary.runtimes.<name>``):
``c16_p50_s`` the cold starts at concurrency 16, ``cpu_ms_per_create`` this
process's CPU and its reaped children's (the runtime) per warm start without
the pool (every one a runtime ``run``, nothing fetched), the first command included."""


def _runtime_figures(result: dict) -> dict:
    return {k: result["summary"][k] for k in RUNTIME_KEYS}


def _relayout(store, name: str, trees: dict, paths, record) -> tuple[str, int, dict]:
    """Republish template ``name``'s groups (``trees``: group name -> its
    tree) with their files laid out by its recorded prefetch profile, as a
    user would (``weenv update NAME -c GROUP --from-dir TREE --profile``, one
    group at a time, bottom up; each update makes a new template, whose first
    start, ``record()``, records its own profile for the next).  Groups whose
    data the profile did not read stay as they are.  Returns the final
    template's digest, its stored bytes and its first start's result (None if
    no group changed).  Raises :class:`RuntimeFailedError` without a profile."""
    from weenv.packaging.group import load_group
    from weenv.packaging.layout import startup_files
    from weenv.packaging.profile import load_profile
    from weenv.packaging.template import load_template
    from weenv.packaging.update import update_component

    first = None
    for component, tree in trees.items():
        digest, manifest = load_template(store, name)
        profile = load_profile(store, digest)
        if profile is None:
            raise RuntimeFailedError(f"template {name} ({digest}) has no prefetch profile to lay out by")
        index = [load_group(store, g).name for g in manifest.groups].index(component)
        group = manifest.groups[index]
        if not startup_files(store, group, load_group(store, group), profile):
            continue  # its data was not read at the start: its layout does not matter
        update_component(store, name, component, tree, paths=paths, profile=True)
        first = record()
    digest, manifest = load_template(store, name)
    return digest, sum(load_group(store, g).stored_size for g in manifest.groups), first


def _uptime() -> str:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5, check=False).stdout.strip()
    return ""


def plot(result: dict, png: Path) -> None:
    """Bars of p50 time to first output (log scale, p99 as whiskers) per
    phase and concurrency, weenv beside Docker; exec round trip in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["table"] if r["kind"] in ("cold", "warm", NO_POOL)]
    order = {t["name"]: i for i, t in enumerate(result.get("templates", [result["template"]]))}
    labels = sorted(
        {(r.get("template", ""), r["command"], r["kind"], r["concurrency"], r.get("layout", "")) for r in rows},
        key=lambda k: (order.get(k[0], 0), k[1] != MAIN_COMMAND, k[1], k[2], k[3], k[4]),
    )
    fig, ax = plt.subplots(figsize=(max(9, 0.8 * len(labels)), 4.8))
    width = 0.38
    for j, (system, color) in enumerate((("weenv", "#2a7"), ("docker", "#27a"))):
        xs, p50, err = [], [], []
        for i, (template, command, kind, c, layout) in enumerate(labels):
            r = next(
                (
                    r
                    for r in rows
                    if r["system"] == system
                    and r.get("template", "") == template
                    and r["kind"] == kind
                    and r["concurrency"] == c
                    and r["command"] == command
                    and (system != "weenv" or r.get("layout", "") == layout)
                ),
                None,
            )
            if r is None:
                continue
            xs.append(i + (j - 0.5) * width)
            p50.append(r["p50_s"])
            err.append(max(0.0, r["p99_s"] - r["p50_s"]))
        ax.bar(
            xs,
            p50,
            width,
            yerr=[[0] * len(err), err],
            capsize=3,
            label=system,
            color=color,
        )
        for x, v in zip(xs, p50):
            ax.annotate(
                f"{v * 1000:.0f} ms" if v < 1 else f"{v:.1f} s",
                (x, v),
                ha="center",
                va="bottom",
                fontsize=7,
            )
    ax.set_xticks(
        range(len(labels)),
        [f"{t.removeprefix('start-')}\n{cmd}\n{k} x{c}\n{lay}" for t, cmd, k, c, lay in labels],
        fontsize=7,
    )
    ax.set_yscale("log")
    ax.set_ylabel("time to first output, s (p50; whisker p99)")
    s = result["summary"]
    ax.set_title(
        f"start of {s['template']} ({s['template_bytes'] / 1e9:.2f} GB): cold ratio {s['cold_ratio']}x, "
        f"fetched {s['fetched_fraction'] * 100:.1f}%, exec p50 {s['exec_p50_s'] * 1000:.1f} ms",
        fontsize=9,
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
