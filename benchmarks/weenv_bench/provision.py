"""``weenv bench provision``: static against elastic provisioning, same node, same workload.

**Environments.**  One template: Debian bookworm minbase + python3 (cached
debootstrap), pytest and hypothesis (pip, cached), the sdist of ``idna`` with
its test suite at ``/workspace``, and wheels of ``pip``, ``six`` and ``idna``
at ``/wheels``.  Each environment declares the peak it may need: 1 core,
1.5 GiB, 1024 pids.

**Workload.**  Each environment runs rollouts back to back until the mode's
time is up; a rollout is ``steps`` agent steps, each a *think* (idle, the
agent waiting for its model: lognormal with median ``think_s`` (4 s), shape
0.8 (mean 5.5 s), capped at 60 s, seeded: the think time of ``weenv bench
rollout``, :mod:`weenv_bench.rollout.trajectory`) followed by one command.
One step in ``burst_every`` (4, drawn) is a *burst*, the others a light
command (``cat``, ``grep``, ``ls`` of the task's files: milliseconds), as in
the replayed trajectories of ``weenv bench rollout``, where about one step in
4-7 runs tests or Python; bursts come in turn:

- ``tests``: idna's test suite (``pytest tests/test_idna.py tests/test_intranges.py``);
- ``pip``: ``pip install --no-index`` of ``six`` and ``idna`` wheels into a fresh target;
- ``compile``: byte-compiling three stdlib packages (``compileall``; the
  template has no gcc, so this stands in for a compiler's CPU-bound work);
- ``memory``: a transient spike, 600 MiB touched and held for 1 s.

So a burst comes every ~22 s of think time per environment and lasts 0.2-1.5 s
unloaded: an environment is busy a few per cent of the time.

**Modes** (one after the other on the same node, each with a fresh Node):

- ``static``: every environment keeps its declared quota; admission by declared
  quota: the sum of declared cores and memory within capacity × overcommit (1).
- ``elastic``: the node's default settings (``WEENV_*`` as the node reads
  them): the provisioner (:mod:`weenv.node.provision`) sizes reservations
  from usage; admission by the latency objective (how the running
  environments' bursts overlap: ``admission="burst"``, the node's default, at
  most 2 % of bursts meeting others beyond the cores; ``WEENV_ADMISSION=peak``
  for the N-sigma peak, ``reservations`` for the reservations alone) and the
  reservations held, within capacity × the node's default CPU overcommit
  (memory: × 1, as static).  The CFS quota is the declared ceiling (``cpu_quota_at``,
  default ``ceiling``; ``WEENV_CPU_QUOTA_AT=reservation`` runs the variant
  whose CFS quota is the elastic value itself).

Environments are admitted *while the workload runs*, as a trainer's rollout
stage asks for them: every second a scheduler asks the node for one more (up
to ``max_envs``), and each admitted environment starts its agent at once, so
the node's admission sees the usage of those already running (elastic
admission ``burst``, used here, counts how their bursts overlap; see
:mod:`weenv.node.provision.arbiter`).  ``envs`` is the most held at once,
``mean_envs`` the mean over the run.

**Burst slowdown** is a burst's wall time (``exec`` included) over the median
of the same burst run alone (provisioning off, the declared 1 core, nothing
else of the benchmark running), in the same state: the first burst of a kind
in an environment is compared with first runs in fresh environments (``cold``:
pytest rewrites and caches its plugins' and the tests' bytecode in each
environment's overlay, ~0.5-1 s), later ones with repeated runs.  The unloaded
runs' own spread is the noise floor no provisioning can beat:
``p95_unloaded`` is the p95 of each unloaded repeated run over the median of
its kind.  The machine is shared and its load drifts, so
the unloaded runs are *bracketed*: measured before static, between the modes
and after elastic, and each mode is compared with the runs just before and
just after it.  What contention costs is reported apart: each burst's
``concurrent`` is the most bursts of its mode in flight at once during it;
with at most as many bursts as cores each could have had a core
(``p95_burst_slowdown_uncontended``), above that the cores are shared and
no provisioning can make every burst as fast as alone.  The host's busy cores
(``/proc/stat``) and load average are sampled during every phase;
``other_cpu_cores`` is the host's busy cores minus the environments' own
(``node_cpu_cores`` of it: this process, the node and the agents' threads),
and each mode's ``background`` the same per second, which the simulation
replays beside the traces.  ``p95_burst_slowdown_quiet``: the p95 over the
bursts during which the background stayed below half a core (other tenants
away), the two modes compared where the machine let them be.

**Traces and the simulation** (issue 19).  Each mode's JSON holds ``traces``:
per environment, per controller pass, the cores it used and its working set
(``interval_s`` apart; the static node's 1 s).  After the real modes, the
static mode's traces (the demand, uncontended) are replayed through the real
provisioner on modelled nodes (:mod:`weenv_bench.simulate`): on one of this
machine's size with the elastic mode's settings, predicting the run's elastic
density and p95 burst slowdown (``calibration_error``: the larger relative
error of the two), and on nodes of 16, 64 and 192 cores (4 GiB per core).
``weenv bench provision --simulate --traces RUN.json`` runs the simulation
alone from a real run's JSON.

JSON ``summary``: ``static_envs``, ``elastic_envs``, ``density_ratio``, and per
mode ``p95_burst_slowdown``, ``oom_kills``, ``rollouts_per_hour``, plus
``throttled_s``, ``p50_burst_slowdown``, ``p95_burst_slowdown_uncontended``,
``uncontended_bursts``, ``other_cpu_cores``, ``node_cpu_cores``,
``loadavg1_mean``, ``p95_burst_slowdown_quiet`` and ``quiet_bursts``;
``p95_unloaded``; ``p95_slowdown_vs_static`` (elastic's p95 over static's),
``p95_slowdown_vs_static_interval`` (its 10-90 % bootstrap interval: what
chance alone moves it by, :func:`ratio_interval`) and
``p95_slowdown_vs_static_quiet`` (the same over quiet bursts);
``sim`` (per node size, its cores as the key: ``density_ratio``,
``p95_burst_slowdown``, ``bursts_slowed_over_10pct``, ``oom_kills``) and
``calibration_error``.
"""

from __future__ import annotations

import compileall
import os
import random
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Self

from weenv.config import Paths
from weenv.demo import deps_tree, sdist, task_tree
from weenv.errors import CapacityError, InvalidInputError, WeenvError
from weenv.formats.manifest import Resources, RuntimeConfig
from weenv.node.provision import ProvisionConfig
from weenv.packaging.debootstrap import debian_rootfs
from weenv.packaging.group import build_group
from weenv.packaging.template import create_template
from weenv.store.file import FileStore
from weenv_bench import machine, write_report
from weenv_bench.rollout.trajectory import THINK_MAX_S, THINK_MEDIAN_S, THINK_SIGMA, think_time
from weenv_bench.simulate import NODE_SIZES, QUIET_CORES, calibrate, p95_draws, parse_traces, run_sizes, traces_of

DECLARED = Resources(cpus=1.0, memory_bytes=1536 << 20, pids=1024)
WHEELS = ("pip==24.3.1", "six==1.17.0", "idna==3.20")
BURSTS = {
    "tests": "python3 -m pytest -q -p no:cacheprovider -o addopts= tests/test_idna.py tests/test_intranges.py",
    "pip": "d=$(mktemp -d) && python3 /wheels/pip-24.3.1-py3-none-any.whl/pip install -q --no-index "
    "--disable-pip-version-check --find-links /wheels --target $d six idna && rm -rf $d",
    "compile": "python3 -m compileall -q -f -j1 /usr/lib/python3.11/email /usr/lib/python3.11/json "
    "/usr/lib/python3.11/xml",
    "memory": "python3 -c 'import time; b = bytearray(600 << 20); b[::4096] = b\"x\" * (len(b) // 4096); time.sleep(1)'",
}
LIGHT = (
    "cat README.rst > /dev/null",
    "grep -rn 'def ' idna/core.py | head -n 30 > /dev/null",
    "ls -la . tests > /dev/null",
    "head -n 80 idna/codec.py > /dev/null",
)
"""An agent's other steps: reading, searching, listing (milliseconds)."""


def _wheels(cache: Path) -> Path:
    d = cache / "pip" / "wheels-provision"
    if not all(list(d.glob(w.split("==")[0] + "-" + w.split("==")[1] + "-*.whl")) for w in WHEELS):
        d.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--disable-pip-version-check",
                "--no-deps",
                "--only-binary=:all:",
                "-d",
                str(d),
                *WHEELS,
            ],
            check=True,
        )
    return d


def build(paths: Paths, store: FileStore, work: Path, log) -> str:
    """Groups and the template ``bench-provision``; returns its name."""
    base = debian_rootfs(paths.cache, log=log)
    deps = deps_tree(paths.cache, ["pytest", "hypothesis"])
    root, project = task_tree(work, sdist(paths.cache, "idna==3.20"))
    shutil.copytree(_wheels(paths.cache), root / "wheels")
    # Ship the task's bytecode, as pip does for the deps group (else each new
    # environment's first import of idna compiles its data tables).
    compileall.compile_dir(root / "workspace", quiet=1)
    for name, tree in (("base", base), ("deps", deps), ("task", root)):
        t = time.monotonic()
        build_group(tree, store, name=name)
        log(f"  group {name}: {time.monotonic() - t:.1f} s")
    create_template(
        store,
        "bench-provision",
        ["base", "deps", "task"],
        runtime=RuntimeConfig(working_dir=f"/workspace/{project}", resources=DECLARED),
    )
    return "bench-provision"


def _burst(node, env_id: str, kind: str) -> float:
    r = node.exec(env_id, BURSTS[kind], timeout=600)
    if r.exit_code != 0:
        raise WeenvError(f"burst {kind} exited {r.exit_code}: {r.stderr.decode(errors='replace')[-500:]}")
    return r.duration_s


def baseline(node, template: str, log, runs: int = 3) -> dict[str, list[float]]:
    """Seconds of each burst alone (provisioning off: the declared 1 core,
    nothing else of the benchmark running): ``KIND``, ``runs`` times after one
    warm-up; ``KIND:cold``, the first run of each kind in each of ``runs``
    fresh environments (the node's page cache warm)."""
    out: dict[str, list[float]] = {}
    info = node.create(template)
    try:
        for kind in BURSTS:
            _burst(node, info.id, kind)  # warm the page cache
            out[kind] = [_burst(node, info.id, kind) for _ in range(runs)]
            log(f"  {kind}: {statistics.median(out[kind]):.2f} s (runs {', '.join(f'{x:.2f}' for x in out[kind])})")
    finally:
        node.destroy(info.id)
    for _ in range(runs):
        info = node.create(template)
        try:
            for kind in BURSTS:
                out.setdefault(f"{kind}:cold", []).append(_burst(node, info.id, kind))
        finally:
            node.destroy(info.id)
    log(
        "  first in a fresh environment: "
        + ", ".join(f"{k} {statistics.median(out[k + ':cold']):.2f} s" for k in BURSTS)
    )
    return out


def p95_unloaded(passes: list[dict[str, list[float]]]) -> float | None:
    """The noise floor: the p95 of every unloaded repeated run over the median
    of its kind in its pass."""
    return p95([x / statistics.median(p[k]) for p in passes for k in BURSTS for x in p[k]])


def busy_cores(total_jiffies: int, idle_jiffies: int, ncpu: int) -> float:
    """Cores busy over an interval, from ``/proc/stat``'s all-CPU deltas: the
    busy share of the jiffies that passed, times ``ncpu`` (in [0, ncpu]: the
    interval's own jiffies are its time base, as top's are; dividing by wall
    seconds read apart from ``/proc/stat`` gave 2.002 cores on 2)."""
    if total_jiffies <= 0:
        return 0.0
    return ncpu * min(1.0, max(0.0, (total_jiffies - idle_jiffies) / total_jiffies))


class HostLoad:
    """Samples the host every ``every`` seconds while running: busy cores from
    ``/proc/stat`` (all CPUs, busy = total - idle - iowait), the 1-minute
    load average and, with ``ours`` (environment id -> CPU seconds used so
    far, :meth:`~weenv.node.provision.Provisioner.cpu_seconds`), the cores
    the benchmark's environments used, so that the rest, the *background*
    (other engineers' tests share this machine, and the node's own process),
    can be replayed by the simulation.  :attr:`node_cpu_s`: CPU seconds of
    this process (the node and the benchmark's agents) while sampling."""

    def __init__(self, every: float = 1.0, ours=None):
        self.every = every
        self.ours = ours
        self.samples: list[tuple[float, float, float]] = []  # (monotonic, busy cores, loadavg1)
        self.background: list[float] = []
        """Cores busy outside the environments in each sample (with ``ours``)."""
        self.node_cpu_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _jiffies() -> tuple[int, int]:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + (v[4] if len(v) > 4 else 0)

    def _envs_cpu(self, before: dict[str, float]) -> tuple[dict[str, float], float]:
        """The environments' CPU seconds now, and those used since ``before``
        (an environment new since then counts all it used)."""
        now = self.ours()
        return now, sum(max(0.0, x - before.get(k, 0.0)) for k, x in now.items())

    def _run(self) -> None:
        ncpu = os.cpu_count() or 1
        t0, (tot0, idle0) = time.monotonic(), self._jiffies()
        cpu0 = time.process_time()
        envs0 = self.ours() if self.ours else {}
        while not self._stop.wait(self.every):
            t, (tot, idle) = time.monotonic(), self._jiffies()
            with open("/proc/loadavg") as f:
                load1 = float(f.read().split()[0])
            busy = busy_cores(tot - tot0, idle - idle0, ncpu)
            self.samples.append((t, busy, load1))
            if self.ours:
                envs0, used = self._envs_cpu(envs0)
                self.background.append(round(min(ncpu, max(0.0, busy - used / (t - t0))), 3))
            t0, tot0, idle0 = t, tot, idle
        self.node_cpu_s = time.process_time() - cpu0

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict:
        if not self.samples:
            return {"host_busy_cores": None, "loadavg1_mean": None, "loadavg1_max": None}
        return {
            "host_busy_cores": statistics.fmean(b for _, b, _ in self.samples),
            "loadavg1_mean": statistics.fmean(x for _, _, x in self.samples),
            "loadavg1_max": max(x for _, _, x in self.samples),
        }


def _concurrency(bursts: list[dict]) -> None:
    """Set each burst's ``concurrent``: the most bursts of the same mode in flight
    at once during it (itself included)."""
    edges = sorted([(b["start"], 1) for b in bursts] + [(b["end"], -1) for b in bursts])
    for b in bursts:
        n = sum(1 for o in bursts if o["start"] <= b["start"] < o["end"])  # in flight when it started
        peak = n
        for t, d in edges:
            if b["start"] < t < b["end"]:
                n += d
                peak = max(peak, n)
        b["concurrent"] = peak


def _background_during(bursts: list[dict], background: list[float], every: float) -> None:
    """Set each burst's ``background``: the most cores the machine's other
    work used in the samples (``every`` seconds from the mode's start) its
    run overlapped (None without samples)."""
    for b in bursts:
        xs = background[int(b["start"] // every) : int(b["end"] // every) + 1]
        b["background"] = max(xs) if xs else None


def p95(values: list[float]) -> float | None:
    """Nearest-rank 95th percentile (None if empty)."""
    s = sorted(values)
    return s[min(len(s) - 1, int(0.95 * len(s)))] if s else None


def ratio_interval(num: list[float], den: list[float], *, draws: int = 2000) -> list[float] | None:
    """The 10th and 90th percentiles of ``p95(num) / p95(den)`` over ``draws``
    bootstrap resamples of each list (:func:`~weenv_bench.simulate.p95_draws`):
    how far a p95 ratio taken from a few dozen bursts moves by chance alone.
    A quick run times some 20 static and 35 elastic bursts, so the nearest-rank
    p95 is the largest or second largest of them: one run's
    ``p95_slowdown_vs_static`` of 1.13 had an interval of [0.98, 1.77].
    None if either list is empty."""
    if not num or not den:
        return None
    r = sorted(a / b for a, b in zip(p95_draws(num, draws, seed=0), p95_draws(den, draws, seed=1)))
    return [r[int(0.1 * draws)], r[int(0.9 * draws)]]


def run_mode(
    node,
    template: str,
    *,
    mode: str,
    max_envs: int,
    duration_s: float,
    think_s: float,
    steps: int,
    burst_every: int,
    base: dict[str, float],
    seed: int,
    log,
    admit_every_s: float = 1.0,
) -> dict:
    """Run the workload for ``duration_s``: a scheduler thread asks the node for
    one more environment every ``admit_every_s`` (until ``max_envs`` are held),
    as a trainer's rollout stage would, and each admitted environment starts
    its agent at once, so later admissions see the earlier ones' usage."""
    envs: list[str] = []
    held: list[tuple[float, int]] = []  # (seconds since start, environments held)
    refusals: list[str] = []
    bursts: list[dict] = []
    rollouts: dict[int, int] = {}
    errors: list[str] = []
    t0 = time.monotonic()
    deadline = t0 + duration_s
    lock = threading.Lock()
    threads: list[threading.Thread] = []

    def agent(i: int, env_id: str) -> None:
        rng = random.Random(seed * 1000 + i)
        kinds = list(BURSTS)
        k = i
        done: set[str] = set()
        while time.monotonic() < deadline:
            for _ in range(steps):
                time.sleep(think_time(rng, think_s / THINK_MEDIAN_S))
                if time.monotonic() >= deadline:
                    return
                if rng.random() >= 1 / burst_every:
                    try:
                        node.exec(env_id, rng.choice(LIGHT), timeout=60)
                    except WeenvError as exc:
                        with lock:
                            errors.append(f"{env_id} light: {exc}")
                    continue
                kind = kinds[k % len(kinds)]
                k += 1
                start = time.monotonic()
                try:
                    d = _burst(node, env_id, kind)
                except WeenvError as exc:
                    with lock:
                        errors.append(f"{env_id} {kind}: {exc}")
                    continue
                key = kind if kind in done else f"{kind}:cold"
                done.add(kind)
                with lock:
                    bursts.append(
                        {
                            "env": env_id,
                            "kind": kind,
                            "base": key,
                            "seconds": d,
                            "slowdown": d / base[key],
                            "start": start - t0,
                            "end": time.monotonic() - t0,
                        }
                    )
            with lock:
                rollouts[i] = rollouts.get(i, 0) + 1

    with HostLoad(ours=node.provisioner.cpu_seconds) as load:
        while time.monotonic() < deadline:
            if len(envs) < max_envs:
                try:
                    env_id = node.create(template).id
                except CapacityError as exc:
                    if not refusals or refusals[-1] != str(exc):
                        refusals.append(str(exc))
                else:
                    envs.append(env_id)
                    log(f"  {mode}: {len(envs)} environments held at {time.monotonic() - t0:.0f} s")
                    th = threading.Thread(target=agent, args=(len(envs) - 1, env_id))
                    th.start()
                    threads.append(th)
            held.append((time.monotonic() - t0, len(envs)))
            time.sleep(max(0.0, min(admit_every_s, deadline - time.monotonic())))
        for th in threads:
            th.join()
    if refusals:
        log(f"  {mode}: last refusal: {refusals[-1]}")
    wall = time.monotonic() - t0
    st = node.provision_stats()
    oom = sum(e.oom_kills for e in st.environments)
    throttled = sum(e.throttled_s for e in st.environments)
    history = {e.id: [h.model_dump() for h in e.history] for e in st.environments}
    for env_id in envs:
        node.destroy(env_id)
    _concurrency(bursts)
    _background_during(bursts, load.background, load.every)
    cores = machine()["cpus"]
    ours = sum(h["cpu_used"] for pts in history.values() for h in pts) * node.provisioner.config.interval_s / wall
    host = load.summary()
    mean_held = sum(n for _, n in held) / len(held) if held else 0.0
    return {
        "traces": traces_of(history, node.provisioner.config.interval_s),
        "mode": mode,
        "envs": len(envs),
        "mean_envs": mean_held,
        "held": held,
        "refusals": refusals[-20:],
        "wall_s": wall,
        "rollouts": sum(rollouts.values()),
        "rollouts_per_hour": sum(rollouts.values()) / wall * 3600,
        "bursts": bursts,
        "p95_burst_slowdown": p95([b["slowdown"] for b in bursts]),
        "p50_burst_slowdown": statistics.median([b["slowdown"] for b in bursts]) if bursts else None,
        # bursts during which at most `cores` bursts of this mode ran at once: each could have a core
        "p95_burst_slowdown_uncontended": p95([b["slowdown"] for b in bursts if b["concurrent"] <= cores]),
        "uncontended_bursts": sum(b["concurrent"] <= cores for b in bursts),
        "env_cpu_cores": ours,
        **host,
        "other_cpu_cores": None if host["host_busy_cores"] is None else max(0.0, host["host_busy_cores"] - ours),
        "node_cpu_cores": load.node_cpu_s / wall,
        "background": {"interval_s": load.every, "cores": load.background},
        "oom_kills": oom,
        "throttled_s": throttled,
        "errors": errors,
        "history": history,
        "events": [e.model_dump() for e in st.events][-200:],
    }


def _rescore(mode: dict, base: dict[str, float]) -> None:
    """Slowdowns against ``base`` (seconds per burst kind) and their percentiles."""
    cores = machine()["cpus"]
    for b in mode["bursts"]:
        b["slowdown"] = b["seconds"] / base[b["base"]]
    slow = [b["slowdown"] for b in mode["bursts"]]
    mode["p95_burst_slowdown"] = p95(slow)
    mode["p50_burst_slowdown"] = statistics.median(slow) if slow else None
    mode["p95_burst_slowdown_uncontended"] = p95([b["slowdown"] for b in mode["bursts"] if b["concurrent"] <= cores])
    mode["p95_by_kind"] = {k: p95([b["slowdown"] for b in mode["bursts"] if b["kind"] == k]) for k in BURSTS}
    quiet = [b["slowdown"] for b in mode["bursts"] if b.get("background") is not None and b["background"] < QUIET_CORES]
    mode["p95_burst_slowdown_quiet"] = p95(quiet)
    mode["quiet_bursts"] = len(quiet)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [result["static"], result["elastic"]]
    fig, axes = plt.subplots(1, 4, figsize=(15, 3.8))
    names = [m["mode"] for m in modes]
    for ax, key, title in (
        (axes[0], "envs", "environments held"),
        (axes[1], "rollouts_per_hour", "rollouts / hour"),
        (axes[2], "p95_burst_slowdown", "p95 burst slowdown (×)"),
    ):
        ax.bar(names, [m[key] or 0 for m in modes], color=["C7", "C0"])
        ax.set_title(title)
        for x, m in enumerate(modes):
            ax.annotate(f"{m[key] or 0:.2f}".rstrip("0").rstrip("."), (x, m[key] or 0), ha="center", va="bottom")
    for m, color in zip(modes, ["C7", "C0"]):
        s = sorted(b["slowdown"] for b in m["bursts"])
        if s:
            axes[3].plot(s, [(i + 1) / len(s) for i in range(len(s))], color=color, label=m["mode"])
    axes[3].set_title("burst slowdown CDF")
    axes[3].set_xlabel("× unloaded")
    axes[3].legend()
    fig.suptitle(
        f"weenv bench provision ({result['config']['label']}): static vs elastic, {result['machine']['cpus']} cores"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def elastic_config(cfg: dict) -> ProvisionConfig:
    """The elastic mode's provisioning of a run whose ``config`` is ``cfg``."""
    return ProvisionConfig(mode="elastic", **cfg["elastic"], memory_overcommit=1.0)


def simulated(result: dict, *, sizes=NODE_SIZES, duration_s: float = 300.0, log=print) -> dict:
    """The summary's ``sim`` and ``calibration_error`` from a real run's
    ``result`` (as :func:`run` returns it or its JSON holds it): its static
    mode's traces (each environment's demand, uncontended) replayed through
    the real provisioner (:mod:`weenv_bench.simulate`) on a node of the real
    machine's size, predicting the run's elastic density and p95 burst
    slowdown (``calibration``), and on nodes of ``sizes`` (cores, GiB).
    Raises :class:`~weenv.errors.InvalidInputError` for bad traces."""
    cfg = result["config"]
    traces = parse_traces(result["static"].get("traces"))
    declared = Resources(**cfg["declared"])
    elastic = elastic_config(cfg)
    cores = float(result["machine"]["cpus"])
    memory = max(1 << 30, result["machine"]["memory_bytes"] - ProvisionConfig().memory_reserve)
    log(f"simulating: {len(traces)} traces on {cores:g} cores (calibration), then {[c for c, _ in sizes]} cores")
    cal = calibrate(
        traces,
        result,
        cores=cores,
        memory=memory,
        elastic=elastic,
        declared=declared,
        max_envs=cfg["max_envs"],
        duration_s=cfg["duration_s"],
    )
    log(f"  calibration: predicted {cal['predicted']}, real {cal['real']}, error {cal['calibration_error']}")
    return {
        "calibration": cal,
        "sizes": run_sizes(traces, elastic=elastic, declared=declared, duration_s=duration_s, sizes=sizes, log=log),
    }


def sim_summary(sim: dict) -> dict:
    """The summary's ``sim`` (per node size) and ``calibration_error``."""
    keys = ("density_ratio", "p95_burst_slowdown", "bursts_slowed_over_10pct", "oom_kills")
    return {
        "sim": {cores: {k: r[k] for k in keys} for cores, r in sim["sizes"].items()},
        "calibration_error": sim["calibration"]["calibration_error"],
    }


MAX_RESULT_BYTES = 256 << 20
"""A recorded run's JSON read by ``--simulate`` at most (bytes)."""


def simulate_recorded(
    traces_path: Path, *, json_path: Path | None = None, sizes=NODE_SIZES, duration_s: float = 300.0, log=print
) -> dict:
    """``weenv bench provision --simulate --traces PATH``: the simulation alone,
    from the JSON a real run wrote (its traces, config, machine and figures);
    returns it with ``summary`` (the real run's and :func:`sim_summary`'s keys).
    Raises :class:`~weenv.errors.InvalidInputError` for a file that is too
    large, not JSON, not such a run's, or whose traces are bad."""
    import json

    from weenv.errors import InvalidInputError

    try:
        size = traces_path.stat().st_size
        if size > MAX_RESULT_BYTES:
            raise InvalidInputError(f"{traces_path}: {size} bytes, more than {MAX_RESULT_BYTES}")
        recorded = json.loads(traces_path.read_bytes())
    except OSError as exc:
        raise InvalidInputError(f"{traces_path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise InvalidInputError(f"{traces_path}: not JSON ({exc})") from None
    if not isinstance(recorded, dict) or not all(
        isinstance(recorded.get(k), dict) for k in ("config", "machine", "static", "elastic")
    ):
        raise InvalidInputError(
            f"{traces_path}: not the JSON of a weenv bench provision run (needs config, machine, static and elastic)"
        )
    try:
        sim = simulated(recorded, sizes=sizes, duration_s=duration_s, log=log)
    except (KeyError, TypeError) as exc:
        raise InvalidInputError(f"{traces_path}: a field is missing or of the wrong type ({exc})") from None
    out = {
        "config": recorded["config"],
        "machine": recorded["machine"],
        "traces_from": str(traces_path),
        "simulation": sim,
        "summary": {**(recorded.get("summary") or {}), **sim_summary(sim)},
    }
    if json_path is not None:
        write_report(out, json_path, plot_sim)
    return out


def plot_sim(result: dict, path: Path) -> None:
    """Density ratio and p95 burst slowdown per simulated node size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = result["simulation"]["sizes"]
    names = list(sizes)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    axes[0].bar(names, [sizes[n]["density_ratio"] or 0 for n in names], color="C0")
    axes[0].set_title("density ratio (elastic / static)")
    axes[1].bar(names, [sizes[n]["p95_burst_slowdown"] or 0 for n in names], color="C1")
    axes[1].set_title("p95 burst slowdown (×)")
    for ax in axes:
        ax.set_xlabel("cores")
    err = result["simulation"]["calibration"]["calibration_error"]
    fig.suptitle("weenv bench provision --simulate: calibration error " + ("n/a" if err is None else f"{err:.2f}"))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(
    *,
    quick: bool = False,
    json_path: Path | None = None,
    max_envs: int | None = None,
    duration_s: float | None = None,
    think_s: float | None = None,
    log=print,
    cpu_quota_at: str | None = None,
    baseline_runs: int | None = None,
    steps: int | None = None,
    sim_sizes=NODE_SIZES,
    sim_duration_s: float = 300.0,
    order: tuple[str, str] = ("static", "elastic"),
) -> dict:
    """Run the benchmark in a private home under ``$WEENV_HOME``, the modes in
    ``order``, then the simulation of its traces (:func:`simulated`:
    ``sim_sizes``, ``sim_duration_s`` each); return the result (and write
    JSON + PNG when ``json_path`` is given).  ``weenv bench provision
    --rounds N``: :mod:`weenv_bench.provision_rounds`."""
    from weenv.node.node import Node

    env = Paths.from_env()
    home = env.home / f"bench-provision-{int(time.time())}"
    paths = Paths(home=home, cache=env.cache, store_url=f"file://{home / 'store'}")
    from_env = ProvisionConfig.from_env()
    cpu_quota_at = cpu_quota_at or from_env.cpu_quota_at
    home.mkdir(parents=True)
    cfg = {
        "label": "quick" if quick else "full",
        "max_envs": max_envs or (8 if quick else 16),
        "duration_s": duration_s or (180.0 if quick else 900.0),
        "think_s": think_s or THINK_MEDIAN_S,
        "steps": steps or (12 if quick else 24),
        "burst_every": 4,
        "think_distribution": f"lognormal, median think_s, sigma {THINK_SIGMA}, capped at {THINK_MAX_S:g} s "
        f"x think_s / {THINK_MEDIAN_S:g}, seeded (weenv bench rollout's)",
        "declared": DECLARED.model_dump(),
        "overcommit": {"static": 1.0, "elastic_cpu": from_env.cpu_overcommit, "memory": 1.0},
        # the node's defaults (WEENV_* as the node reads them: admission "burst", the latency
        # objective); creates do not wait for room: the scheduler below asks again every second
        "elastic": {
            "interval_s": from_env.interval_s,
            "cpu_quota_at": cpu_quota_at,
            "admission": from_env.admission,
            "admission_sigmas": from_env.admission_sigmas,
            "admission_wait_s": 0.0,
            "admission_burst_risk": from_env.admission_burst_risk,
            "admission_min_history_s": from_env.admission_min_history_s,
            "reclaim": from_env.reclaim,
        },
        "order": list(order),
    }
    try:
        store = FileStore(home / "store")
        log("building the template")
        template = build(paths, store, home / "work", log)
        common = dict(cpu_overcommit=1.0, memory_overcommit=1.0)
        result: dict = {"config": cfg, "machine": machine()}
        runs = baseline_runs or (3 if quick else 5)

        def measure_baseline(when: str) -> dict[str, list[float]]:
            log(f"baseline ({when}): each burst alone")
            with Node(paths, store=store, provisioning=ProvisionConfig(mode="off")) as node, HostLoad() as load:
                out = baseline(node, template, log, runs=runs)
            result.setdefault("baseline_load", {})[when] = load.summary()
            return out

        # Bracketed: the machine is shared, its load drifts; each mode is compared
        # with the unloaded runs just before and just after it.
        passes = [measure_baseline(f"before {order[0]}")]
        configs = {"static": ProvisionConfig(mode="static", **common), "elastic": elastic_config(cfg)}
        if sorted(order) != sorted(configs):
            raise InvalidInputError(f"order {order!r}: want static and elastic, each once")
        for mode, pc in ((m, configs[m]) for m in order):
            log(f"{mode}: running for {cfg['duration_s']:.0f} s")
            # the baseline after this mode is not known yet: slowdowns are recomputed below
            base = {k: statistics.median(v) for k, v in passes[-1].items()}
            with Node(paths, store=store, provisioning=pc) as node:
                result[mode] = run_mode(
                    node,
                    template,
                    mode=mode,
                    max_envs=cfg["max_envs"],
                    duration_s=cfg["duration_s"],
                    think_s=cfg["think_s"],
                    steps=cfg["steps"],
                    burst_every=cfg["burst_every"],
                    base=base,
                    seed=7,
                    log=log,
                )
            passes.append(measure_baseline(f"after {mode}"))
            around = {k: statistics.median(passes[-2][k] + passes[-1][k]) for k in passes[-1]}
            _rescore(result[mode], around)
            result[mode]["baseline_s"] = around
        result["baseline_runs_s"] = passes
        result["baseline_s"] = {k: statistics.median([x for p in passes for x in p[k]]) for k in passes[0]}
        s, e = result["static"], result["elastic"]

        def per_mode(key: str) -> dict:
            return {"static": s[key], "elastic": e[key]}

        result["summary"] = {
            "static_envs": s["envs"],
            "elastic_envs": e["envs"],
            "density_ratio": e["envs"] / s["envs"] if s["envs"] else None,
            "mean_envs": per_mode("mean_envs"),
            "p95_burst_slowdown": per_mode("p95_burst_slowdown"),
            "oom_kills": per_mode("oom_kills"),
            "rollouts_per_hour": per_mode("rollouts_per_hour"),
            "throttled_s": per_mode("throttled_s"),
            "p50_burst_slowdown": per_mode("p50_burst_slowdown"),
            "p95_burst_slowdown_uncontended": per_mode("p95_burst_slowdown_uncontended"),
            "uncontended_bursts": {
                m: f"{r['uncontended_bursts']}/{len(r['bursts'])}" for m, r in (("static", s), ("elastic", e))
            },
            "other_cpu_cores": per_mode("other_cpu_cores"),
            "loadavg1_mean": per_mode("loadavg1_mean"),
            "p95_unloaded": p95_unloaded(passes),
            "p95_slowdown_vs_static": (
                e["p95_burst_slowdown"] / s["p95_burst_slowdown"]
                if e["p95_burst_slowdown"] and s["p95_burst_slowdown"]
                else None
            ),
            "node_cpu_cores": per_mode("node_cpu_cores"),
            "p95_burst_slowdown_quiet": per_mode("p95_burst_slowdown_quiet"),
            "quiet_bursts": {m: f"{r['quiet_bursts']}/{len(r['bursts'])}" for m, r in (("static", s), ("elastic", e))},
            "p95_slowdown_vs_static_interval": ratio_interval(
                [b["slowdown"] for b in e["bursts"]], [b["slowdown"] for b in s["bursts"]]
            ),
            "p95_slowdown_vs_static_quiet": (
                e["p95_burst_slowdown_quiet"] / s["p95_burst_slowdown_quiet"]
                if e["p95_burst_slowdown_quiet"] and s["p95_burst_slowdown_quiet"]
                else None
            ),
        }
        result["simulation"] = simulated(result, sizes=sim_sizes, duration_s=sim_duration_s, log=log)
        result["summary"].update(sim_summary(result["simulation"]))
        if json_path is not None:
            write_report(result, json_path, plot)
        return result
    finally:
        shutil.rmtree(home, ignore_errors=True)
