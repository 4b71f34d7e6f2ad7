"""``weenv bench rollout``: the environment's share of an RL iteration's rollout
stage on real tasks, weenv against Docker, side by side in one run.

1. **Tasks** (:mod:`.tasks`): a pool of real projects from PyPI sdists, each
   with an injected bug, the tests it breaks and its fixing patch; templates
   (:mod:`.templates`) stack a shared Debian base, a shared runtime, the task's
   deps and its source, and are checked inside weenv (the bug fails the tests,
   the patch makes them pass).
2. **Trajectories** (:mod:`.trajectory`): per task, G rollouts replaying 10-40
   agent commands with lognormal think time between them (scaled by
   ``think_scale``), half submitting the right patch; the reward is the task's
   failing tests after the last step.
3. **The iteration** (:mod:`.iteration`): ``tasks`` tasks sampled (by the seed)
   from the pool, x G rollouts, run ``concurrency`` at a time: create, steps,
   reward, destroy.
4. **Both systems** (:mod:`.systems`): weenv (a daemon of its own, node cache
   empty, the templates in an ``oci://`` store on a loopback docker-registry)
   then Docker (a private dockerd, the same templates as images in the same
   registry, none local at the start).  Every template of the pool is
   published on both; an iteration touches a sample.
5. **Report** (:mod:`.report`): per system the environment share, time to first
   step, exec overhead, create/destroy, rewards, bytes fetched, daemon peak
   memory; JSON ``summary`` with ``weenv_env_share``, ``docker_env_share``,
   ``weenv_first_step_p50_s``, ``docker_first_step_p50_s``, ``rewards_match``;
   a PNG of stacked bars.

With ``setup`` (``--setup``, :mod:`.setup_run`): templates without the tasks'
dependencies, a setup per task (:mod:`.task_setup`: pip installs from a
wheelhouse, an editable install, a first test collection), and three systems
over two iterations: weenv group (the setup once per task, a fork per group),
weenv create and Docker (create + setup per rollout).
"""

from __future__ import annotations

import contextlib
import math
import random
import shutil
import tempfile
import time
from pathlib import Path

from weenv.config import Paths
from weenv.errors import InvalidInputError
from weenv_bench import machine, write_report

DEFAULTS = {"pool": 22, "tasks": 8, "group": 8, "concurrency": 32, "think_scale": 1.0, "steps": (10, 40)}
QUICK = {"pool": 6, "tasks": 3, "group": 4, "concurrency": 6, "think_scale": 0.05, "steps": (10, 16)}
"""``quick``: a pool of 6 tasks, 3 of them x G=4, think time x0.05, 10-16 steps."""
CPUS, MEMORY_BYTES, PIDS = 1.0, 2 << 30, 1024
DISK_BYTES = 1 << 30
"""Each rollout's disk limit: ``concurrency`` of them fit the node's disk (a task writes far less)."""
"""Limits of every environment and container."""
SUMMARY_KEYS = (
    "weenv_env_share",
    "docker_env_share",
    "weenv_first_step_p50_s",
    "docker_first_step_p50_s",
    "rewards_match",
)


def run(
    *,
    quick: bool = False,
    json_path: Path | None = None,
    work: Path | None = None,
    seed: int = 0,
    pool: int | None = None,
    tasks: int | None = None,
    group: int | None = None,
    concurrency: int | None = None,
    think_scale: float | None = None,
    steps: tuple[int, int] | None = None,
    systems: tuple[str, ...] | None = None,
    setup: bool = False,
    log=print,
) -> dict:
    """Run the benchmark; return the result dict (also written to ``json_path``
    with a PNG beside it).

    Settings default to :data:`DEFAULTS` (:data:`QUICK` with ``quick``); any
    given one overrides.  ``pool``: tasks published (1..22, at least ``tasks``);
    ``tasks``: tasks in the iteration; ``group``: rollouts per task (G);
    ``steps``: (fewest, most) agent steps.  ``systems``: of ``weenv`` and
    ``docker`` (default both); with ``setup``, of ``group``, ``create`` and
    ``docker`` (default all three, see :mod:`.setup_run`).  ``work``: directory for the stores,
    homes and build context (default a temporary one, removed).  Raises
    :class:`InvalidInputError` for bad settings, :class:`ToolMissingError`
    without docker.io / docker-registry / debootstrap / mkfs.erofs,
    :class:`RuntimeFailedError` if a download, build, check or push fails.
    Every daemon this starts (weenv, dockerd, registry) is stopped by its PID
    and its directories removed in every case.
    """
    from weenv.formats.manifest import Resources
    from weenv.packaging.debootstrap import debian_rootfs
    from weenv.packaging.transfer import copy_template
    from weenv.store.file import FileStore
    from weenv.store.oci import OciStore
    from weenv_bench.rollout import iteration, report, task_setup, templates
    from weenv_bench.rollout.systems import DockerSystem, WeenvSystem
    from weenv_bench.rollout.tasks import TASKS, prepare_task, runtime_tree
    from weenv_bench.rollout.trajectory import make_trajectory
    from weenv_bench.services.dockerd import Dockerd
    from weenv_bench.services.registry import Registry
    from weenv_bench.start import loadavg
    from weenv_bench.update import fetch_sdists

    cfg = dict(QUICK if quick else DEFAULTS)
    for key, value in (
        ("pool", pool),
        ("tasks", tasks),
        ("group", group),
        ("concurrency", concurrency),
        ("think_scale", think_scale),
        ("steps", steps),
    ):
        if value is not None:
            cfg[key] = value
    if not 1 <= cfg["tasks"] <= cfg["pool"] <= len(TASKS):
        raise InvalidInputError(
            f"want 1 <= tasks <= pool <= {len(TASKS)}, got tasks {cfg['tasks']}, pool {cfg['pool']}"
        )
    if cfg["group"] < 1 or cfg["concurrency"] < 1 or not 0 <= cfg["think_scale"] < math.inf:
        raise InvalidInputError("group and concurrency must be >= 1, think_scale finite and >= 0")
    from weenv_bench.rollout import setup_run

    known = setup_run.SYSTEMS if setup else ("weenv", "docker")
    systems = tuple(known if systems is None else systems)
    if not systems or any(s not in known for s in systems) or len(set(systems)) != len(systems):
        raise InvalidInputError(f"systems: some of {', '.join(known)}{' (with setup)' if setup else ''}")
    resources = Resources(cpus=CPUS, memory_bytes=MEMORY_BYTES, pids=PIDS, disk_bytes=DISK_BYTES)
    env_paths = Paths.from_env()
    cache = env_paths.cache
    cache.mkdir(parents=True, exist_ok=True)
    own = work is None
    work = Path(work or tempfile.mkdtemp(prefix="weenv-bench-rollout-"))
    t_run = time.monotonic()
    load_start = loadavg()
    try:
        # --- tasks and templates ----------------------------------------------------------
        specs = list(TASKS[: cfg["pool"]])
        base = debian_rootfs(cache, log=log)
        runtime = runtime_tree(cache, log=log)
        sources = fetch_sdists(cache, tuple(s.sdist for s in specs))
        prepared = [prepare_task(cache, s, src) for s, src in zip(specs, sources)]
        file_store = FileStore(work / "filestore")
        if setup:  # the runtime group holds patch and a wheelhouse; the setup installs the rest
            runtime = task_setup.tools_tree(cache, prepared, log=log)
            built = templates.build_weenv(
                file_store,
                base,
                runtime,
                prepared,
                resources,
                work,
                log=log,
                deps=False,
                runtime_source={"type": "pip download + deb", "contents": "wheelhouse, patch"},
            )
            verified = {}  # verify_tasks needs pytest in the template: the rewards are checked instead
        else:
            built = templates.build_weenv(file_store, base, runtime, prepared, resources, work, log=log)
            verified = templates.verify_tasks(file_store, built, work / "verify-home", log=log)

        rng = random.Random(seed)
        chosen = rng.sample([p for p in prepared], cfg["tasks"])
        batches = [
            [
                make_trajectory(
                    t, g, cfg["group"], seed=seed + i, think_scale=cfg["think_scale"], steps=tuple(cfg["steps"])
                )
                for t in chosen
                for g in range(cfg["group"])
            ]
            for i in range(setup_run.ITERATIONS if setup else 1)
        ]  # each iteration its own trajectories (seed + its index) of the same tasks
        trajectories = batches[0]
        log(
            f"iteration: {len(chosen)} tasks ({', '.join(t.spec.name for t in chosen)}) x G={cfg['group']} = "
            f"{len(trajectories)} rollouts, {sum(len(t.steps) for t in trajectories)} steps, "
            f"concurrency {cfg['concurrency']}, think x{cfg['think_scale']:g}"
        )

        iterations = []
        services: dict = {}
        with contextlib.ExitStack() as stack:
            registry = stack.enter_context(Registry(work / "registry"))
            oci = OciStore(f"oci://{registry.address}/bench/weenv")
            stack.callback(oci.close)
            t = time.monotonic()
            copied = sum(copy_template(file_store, oci, b.template).bytes_copied for b in built.values())
            weenv_publish_s = time.monotonic() - t
            log(
                f"weenv: {len(built)} templates copied to the registry ({copied / 1e6:.0f} MB) in {weenv_publish_s:.1f} s"
            )
            services = {"registry_pid": registry.pid}
            t = time.monotonic()
            refs, layers = ({}, {})
            if "docker" in systems:
                dockerd = stack.enter_context(Dockerd(insecure_registries=[registry.address]))
                services.update(dockerd_pid=dockerd.pid, dockerd_root=str(dockerd.root))
                refs, layers = templates.build_docker(dockerd, registry, base, runtime, built, work, log=log)
            docker_publish_s = time.monotonic() - t

            if setup:
                by_system, paid = setup_run.run_iterations(
                    systems,
                    batches,
                    cfg["concurrency"],
                    group=cfg["group"],
                    work=work,
                    cache=cache,
                    store_url=oci.url,
                    templates={n: b.template for n, b in built.items()},
                    commands={n: task_setup.setup_commands(b.task.spec) for n, b in built.items()},
                    resources=resources,
                    docker=DockerSystem(dockerd, refs, layers, resources) if "docker" in systems else None,
                    services=services,
                    log=log,
                )
            if "weenv" in systems:
                log("weenv: iteration ...")
                with WeenvSystem(
                    work / "home", cache, oci.url, {n: b.template for n, b in built.items()}, resources
                ) as weenv_sys:
                    services["weenv_daemon_pid"] = weenv_sys.pid
                    iterations.append(iteration.run_iteration(weenv_sys, trajectories, cfg["concurrency"], log=log))
            if "docker" in systems and not setup:
                log("docker: iteration ...")
                iterations.append(
                    iteration.run_iteration(
                        DockerSystem(dockerd, refs, layers, resources), trajectories, cfg["concurrency"], log=log
                    )
                )

        if setup:
            summary, rows, rew = setup_run.summarize(by_system, paid)
            rollouts = {name: [[r.row() for r in it.rollouts] for it in its] for name, its in by_system.items()}
        else:
            rows = [report.system_row(it) for it in iterations]
            by = {r["system"]: r for r in rows}
            rew = report.rewards(iterations)
            rollouts = {it.system: [r.row() for r in it.rollouts] for it in iterations}
            summary = {
                "weenv_env_share": by.get("weenv", {}).get("env_share"),
                "docker_env_share": by.get("docker", {}).get("env_share"),
                "weenv_first_step_p50_s": by.get("weenv", {}).get("first_step_p50_s"),
                "docker_first_step_p50_s": by.get("docker", {}).get("first_step_p50_s"),
                "rewards_match": rew["rewards_match"],
                "rewards_correct": rew["rewards_correct"],
                "env_share_ratio": (
                    round(by["docker"]["env_share"] / by["weenv"]["env_share"], 1)
                    if {"weenv", "docker"} <= by.keys() and by["weenv"]["env_share"]
                    else None
                ),
            }
        summary.update(
            {
                "tasks": cfg["tasks"],
                "group": cfg["group"],
                "rollouts": len(trajectories),
                "concurrency": cfg["concurrency"],
                "think_scale": cfg["think_scale"],
                "pool": cfg["pool"],
                "quick": quick,
                "seed": seed,
                "setup": setup,
                "iterations": len(batches),
            }
        )
        result = {
            "benchmark": "rollout",
            "summary": summary,
            "table": rows,
            "rewards": rew,
            "rollouts": rollouts,
            "tasks": {
                "pool": [
                    {
                        "name": b.task.spec.name,
                        "sdist": b.task.spec.sdist,
                        "bug_file": b.task.spec.path,
                        "tests": list(b.task.spec.tests),
                        "deps": list(b.task.spec.deps),
                        "template_image_bytes": b.image_bytes,
                        "template_stored_bytes": b.stored_bytes,
                        "docker_image": refs.get(b.task.spec.name),
                        "verified": verified.get(b.task.spec.name),
                    }
                    for b in built.values()
                ],
                "iteration": [t.spec.name for t in chosen],
            },
            "settings": {**cfg, "steps": list(cfg["steps"]), "cpus": CPUS, "memory_bytes": MEMORY_BYTES, "pids": PIDS},
            "think_time": _think_doc(),
            "publish": {
                "weenv_copy_to_registry_s": round(weenv_publish_s, 2),
                "weenv_bytes_copied": copied,
                "docker_build_push_s": round(docker_publish_s, 2),
            },
            "method": {
                "env_share": "sum over rollouts of (create + setup + destroy + exec overhead) / sum of rollout "
                "wall time "
                "(create request to destroy return); env_share_of_iteration: the same sum / "
                "(iteration wall x concurrency)",
                "exec_overhead": "exec wall time at the client minus the command's own time measured inside "
                "(bash $EPOCHREALTIME before/after the command)",
                "first_step": "create + the first command's exec (think time excluded)",
                "weenv": "weenv serve (own home, empty node cache, provisioning off) over oci:// on the loopback "
                "docker-registry; SDK Sandbox over its TCP API",
                "docker": "private dockerd, images in the same registry, none local at the start; docker run -d "
                "--network none with the same limits, docker exec per step, docker rm -f",
                "bytes_fetched": "weenv: node cache's stored bytes fetched from the store; docker: manifests + "
                "configs of the images pulled + each distinct layer once (compressed)",
                "daemon_peak": "peak of summed VmRSS sampled every 0.5 s: weenv daemon + its host-side helpers; "
                "dockerd + containerd + shims",
            },
            **({"setup": setup_run.method(built)} if setup else {}),
            "docker_services": services,
            "load": {"start": load_start, "end": loadavg()},
            "seconds": round(time.monotonic() - t_run, 1),
            "machine": machine(),
        }
        log(setup_run.tables(rows) if setup else report.text_table(rows))
        if json_path is not None:
            write_report(result, json_path, report.plot)
        return result
    finally:
        if own:
            shutil.rmtree(work, ignore_errors=True)


def _think_doc() -> dict:
    from weenv_bench.rollout import trajectory as t

    return {
        "distribution": "lognormal",
        "median_s": t.THINK_MEDIAN_S,
        "sigma": t.THINK_SIGMA,
        "max_s": t.THINK_MAX_S,
        "scaled_by": "think_scale",
    }
