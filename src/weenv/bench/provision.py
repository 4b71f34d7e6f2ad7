"""``weenv bench provision``: static against elastic provisioning, same node, same workload.

**Environments.**  One template: Debian bookworm minbase + python3 (cached
debootstrap), pytest and hypothesis (pip, cached), the sdist of ``idna`` with
its test suite at ``/workspace``, and wheels of ``pip``, ``six`` and ``idna``
at ``/wheels``.  Each environment declares the peak it may need: 1 core,
1.5 GiB, 1024 pids.

**Workload.**  Each environment runs rollouts back to back until the mode's
time is up; a rollout is ``episodes`` episodes of *think* (idle, the agent
waiting for its model: exponentially distributed with mean ``think_s``, seeded,
capped at 4 × the mean) followed by one *burst*, in turn:

- ``tests``: idna's test suite (``pytest tests/test_idna.py tests/test_intranges.py``);
- ``pip``: ``pip install --no-index`` of ``six`` and ``idna`` wheels into a fresh target;
- ``compile``: byte-compiling three stdlib packages (``compileall``; the
  template has no gcc, so this stands in for a compiler's CPU-bound work);
- ``memory``: a transient spike, 600 MiB touched and held for 1 s.

**Modes** (one after the other on the same node, each with a fresh Node):

- ``static``: every environment keeps its declared quota; admission by declared
  quota: the sum of declared cores and memory within capacity × overcommit (1).
- ``elastic``: the provisioner (:mod:`weenv.node.provision`) sizes quotas from
  usage; admission by the quotas held, within the same capacity × overcommit.

Environments are created until the node has refused (``CapacityError``) for
``admit_wait_s`` (20 s; a refused create is retried every second, as a
scheduler would) or ``max_envs`` run.  **Burst slowdown** is a burst's wall time over the median
of the same burst run alone, unloaded and unlimited, before the two modes.

JSON ``summary``: ``static_envs``, ``elastic_envs``, ``density_ratio``, and per
mode ``p95_burst_slowdown``, ``oom_kills``, ``rollouts_per_hour``, plus
``throttled_s``.
"""

from __future__ import annotations

import json
import random
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from weenv.bench import machine
from weenv.config import Paths
from weenv.demo import deps_tree, sdist, task_tree
from weenv.errors import CapacityError, WeenvError
from weenv.node.provision import ProvisionConfig
from weenv.packaging.debootstrap import debian_rootfs
from weenv.packaging.group import build_group
from weenv.packaging.manifest import Resources, RuntimeConfig
from weenv.packaging.template import create_template
from weenv.store.file import FileStore

DECLARED = Resources(cpus=1.0, memory_bytes=1536 << 20, pids=1024)
WHEELS = ("pip==24.3.1", "six==1.17.0", "idna==3.20")
BURSTS = {
    "tests": "python3 -m pytest -q -p no:cacheprovider -o addopts= tests/test_idna.py tests/test_intranges.py",
    "pip": "d=$(mktemp -d) && python3 /wheels/pip-24.3.1-py3-none-any.whl/pip install -q --no-index "
           "--disable-pip-version-check --find-links /wheels --target $d six idna && rm -rf $d",
    "compile": "python3 -m compileall -q -f -j1 /usr/lib/python3.11/email /usr/lib/python3.11/json "
               "/usr/lib/python3.11/xml",
    "memory": "python3 -c 'import time; b = bytearray(600 << 20); b[::4096] = b\"x\" * (len(b) // 4096); time.sleep(1)'",
}  # fmt: skip


def _wheels(cache: Path) -> Path:
    d = cache / "pip" / "wheels-provision"
    if not all(list(d.glob(w.split("==")[0] + "-" + w.split("==")[1] + "-*.whl")) for w in WHEELS):
        d.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
                        "--no-deps", "--only-binary=:all:", "-d", str(d), *WHEELS], check=True)  # fmt: skip
    return d


def build(paths: Paths, store: FileStore, work: Path, log) -> str:
    """Groups and the template ``bench-provision``; returns its name."""
    base = debian_rootfs(paths.cache, log=log)
    deps = deps_tree(paths.cache, ["pytest", "hypothesis"])
    root, project = task_tree(work, sdist(paths.cache, "idna==3.20"))
    shutil.copytree(_wheels(paths.cache), root / "wheels")
    for name, tree in (("base", base), ("deps", deps), ("task", root)):
        t = time.monotonic()
        build_group(tree, store, name=name)
        log(f"  group {name}: {time.monotonic() - t:.1f} s")
    create_template(store, "bench-provision", ["base", "deps", "task"],
                    runtime=RuntimeConfig(working_dir=f"/workspace/{project}", resources=DECLARED))  # fmt: skip
    return "bench-provision"


def _burst(node, env_id: str, kind: str) -> float:
    r = node.exec(env_id, BURSTS[kind], timeout=600)
    if r.exit_code != 0:
        raise WeenvError(f"burst {kind} exited {r.exit_code}: {r.stderr.decode(errors='replace')[-500:]}")
    return r.duration_s


def baseline(node, template: str, log) -> dict[str, float]:
    """Median seconds of each burst alone (provisioning off, unlimited)."""
    info = node.create(template)
    try:
        out = {}
        for kind in BURSTS:
            _burst(node, info.id, kind)  # warm the page cache
            out[kind] = statistics.median(_burst(node, info.id, kind) for _ in range(3))
            log(f"  {kind}: {out[kind]:.2f} s")
        return out
    finally:
        node.destroy(info.id)


def run_mode(node, template: str, *, mode: str, max_envs: int, duration_s: float, think_s: float,
             episodes: int, base: dict[str, float], seed: int, log, admit_wait_s: float = 20.0) -> dict:  # fmt: skip
    envs = []
    refused_since = None
    while len(envs) < max_envs:  # as a scheduler would: retry a refused create until admit_wait_s pass
        try:
            envs.append(node.create(template).id)
            refused_since = None
        except CapacityError as exc:
            refused_since = refused_since or time.monotonic()
            if time.monotonic() - refused_since > admit_wait_s:
                log(f"  {mode}: admission stopped at {len(envs)}: {exc}")
                break
            time.sleep(1.0)
    log(f"  {mode}: {len(envs)} environments held")
    bursts: list[dict] = []
    rollouts = [0] * len(envs)
    errors: list[str] = []
    deadline = time.monotonic() + duration_s
    lock = threading.Lock()

    def agent(i: int, env_id: str) -> None:
        rng = random.Random(seed * 1000 + i)
        kinds = list(BURSTS)
        k = i
        while time.monotonic() < deadline:
            for _ in range(episodes):
                time.sleep(min(rng.expovariate(1 / think_s), 4 * think_s))
                if time.monotonic() >= deadline:
                    return
                kind = kinds[k % len(kinds)]
                k += 1
                try:
                    d = _burst(node, env_id, kind)
                except WeenvError as exc:
                    with lock:
                        errors.append(f"{env_id} {kind}: {exc}")
                    continue
                with lock:
                    bursts.append({"env": env_id, "kind": kind, "seconds": d, "slowdown": d / base[kind]})
            with lock:
                rollouts[i] += 1

    t0 = time.monotonic()
    threads = [threading.Thread(target=agent, args=(i, e)) for i, e in enumerate(envs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    st = node.provision_stats()
    oom = sum(e.oom_kills for e in st.environments)
    throttled = sum(e.throttled_s for e in st.environments)
    history = {e.id: [h.model_dump() for h in e.history] for e in st.environments}
    for env_id in envs:
        node.destroy(env_id)
    slow = sorted(b["slowdown"] for b in bursts)
    p95 = slow[min(len(slow) - 1, int(0.95 * len(slow)))] if slow else None
    return {
        "mode": mode, "envs": len(envs), "wall_s": wall, "rollouts": sum(rollouts),
        "rollouts_per_hour": sum(rollouts) / wall * 3600, "bursts": bursts, "p95_burst_slowdown": p95,
        "oom_kills": oom, "throttled_s": throttled, "errors": errors, "history": history,
        "events": [e.model_dump() for e in st.events][-200:],
    }  # fmt: skip


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [result["static"], result["elastic"]]
    fig, axes = plt.subplots(1, 4, figsize=(15, 3.8))
    names = [m["mode"] for m in modes]
    for ax, key, title in ((axes[0], "envs", "environments held"),
                           (axes[1], "rollouts_per_hour", "rollouts / hour"),
                           (axes[2], "p95_burst_slowdown", "p95 burst slowdown (×)")):  # fmt: skip
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
    fig.suptitle(f"weenv bench provision ({result['config']['label']}): static vs elastic, "
                 f"{result['machine']['cpus']} cores")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(*, quick: bool = False, json_path: Path | None = None, max_envs: int | None = None,
        duration_s: float | None = None, think_s: float | None = None, log=print) -> dict:  # fmt: skip
    """Run the benchmark in a private home under ``$WEENV_HOME``; return the result
    (and write JSON + PNG when ``json_path`` is given)."""
    from weenv.node.node import Node

    env = Paths.from_env()
    home = env.home / f"bench-provision-{int(time.time())}"
    paths = Paths(home=home, cache=env.cache, store_url=f"file://{home / 'store'}")
    home.mkdir(parents=True)
    cfg = {
        "label": "quick" if quick else "full",
        "max_envs": max_envs or (8 if quick else 16),
        "duration_s": duration_s or (120.0 if quick else 900.0),
        "think_s": think_s or (8.0 if quick else 20.0),
        "episodes": 2 if quick else 4,
        "think_distribution": "exponential, capped at 4 x mean, seeded",
        "declared": DECLARED.model_dump(),
        "overcommit": 1.0,
        "elastic": {"interval_s": 0.5, "cpu_raise_factor": 4.0},
    }
    try:
        store = FileStore(home / "store")
        log("building the template")
        template = build(paths, store, home / "work", log)
        common = dict(cpu_overcommit=1.0, memory_overcommit=1.0)
        result: dict = {"config": cfg, "machine": machine()}
        log("baseline: each burst alone, unlimited")
        with Node(paths, store=store, provisioning=ProvisionConfig(mode="off")) as node:
            result["baseline_s"] = base = baseline(node, template, log)
        for mode, pc in (("static", ProvisionConfig(mode="static", **common)),
                         ("elastic", ProvisionConfig(mode="elastic", interval_s=0.5, cpu_raise_factor=4.0,
                                                     **common))):  # fmt: skip
            log(f"{mode}: running for {cfg['duration_s']:.0f} s")
            with Node(paths, store=store, provisioning=pc) as node:
                result[mode] = run_mode(node, template, mode=mode, max_envs=cfg["max_envs"],
                                        duration_s=cfg["duration_s"], think_s=cfg["think_s"],
                                        episodes=cfg["episodes"], base=base, seed=7, log=log)  # fmt: skip
        s, e = result["static"], result["elastic"]
        result["summary"] = {
            "static_envs": s["envs"],
            "elastic_envs": e["envs"],
            "density_ratio": e["envs"] / s["envs"] if s["envs"] else None,
            "p95_burst_slowdown": {"static": s["p95_burst_slowdown"], "elastic": e["p95_burst_slowdown"]},
            "oom_kills": {"static": s["oom_kills"], "elastic": e["oom_kills"]},
            "rollouts_per_hour": {"static": s["rollouts_per_hour"], "elastic": e["rollouts_per_hour"]},
            "throttled_s": {"static": s["throttled_s"], "elastic": e["throttled_s"]},
        }
        if json_path is not None:
            json_path = Path(json_path)
            json_path.write_text(json.dumps(result, indent=2))
            plot(result, json_path.with_suffix(".png"))
        return result
    finally:
        shutil.rmtree(home, ignore_errors=True)
