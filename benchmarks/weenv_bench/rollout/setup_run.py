"""``weenv bench rollout --setup``: the iterations of the three systems and
their figures.

Templates hold the project's source and no dependency; every rollout starts
after its task's setup (:mod:`weenv_bench.rollout.task_setup`).  Three systems
(:mod:`weenv_bench.rollout.setup_systems`), each run for :data:`ITERATIONS`
iterations of the same tasks (each iteration its own trajectories: the seed
plus the iteration's index), one system after the other:

- ``group``: weenv's RL groups (a daemon of its own): the setup once per task,
  a fork per group; the second iteration reuses the states (store) and the
  root environments (node);
- ``create``: weenv (another daemon, its own empty node cache), create + setup
  per rollout;
- ``docker``: the private dockerd, ``docker run`` + setup per rollout.

Figures per system and iteration are :func:`weenv_bench.rollout.report.system_row`'s,
plus ``setup_s_per_rollout``: the seconds of setup run per rollout (create,
docker: the mean of each rollout's setup; group: the seconds of the state
builds of that iteration over its rollouts).  The summary's
``*_env_share`` are the second iteration's.
"""

from __future__ import annotations

from pathlib import Path

from weenv_bench.rollout import report
from weenv_bench.rollout.iteration import IterationResult, run_iteration
from weenv_bench.rollout.trajectory import Trajectory

ITERATIONS = 2
SYSTEMS = ("group", "create", "docker")
LABELS = {"group": "weenv group", "create": "weenv create", "docker": "docker"}
SUMMARY_KEYS = (
    "group_env_share",
    "create_env_share",
    "docker_env_share",
    "env_share_by_iteration",
    "setup_s_per_rollout",
    "exec_overhead_p50_s",
    "exec_overhead_p99_s",
    "rewards_match",
)


def run_iterations(
    systems: tuple[str, ...],
    trajectories: list[list[Trajectory]],
    concurrency: int,
    *,
    group: int,
    work: Path,
    cache: Path,
    store_url: str,
    templates: dict[str, str],
    commands: dict[str, list[str]],
    resources,
    docker=None,
    services: dict,
    log=print,
) -> tuple[dict[str, list[IterationResult]], dict[str, list[float]]]:
    """Run each of ``systems`` for the iterations of ``trajectories`` (one list
    per iteration); return (system -> its iterations, system -> setup seconds
    paid per rollout in each).  ``docker``: the
    :class:`~weenv_bench.rollout.systems.DockerSystem` (``docker`` in
    ``systems``).  The daemons' PIDs go into ``services``."""
    from weenv_bench.rollout.setup_systems import GroupSystem, PerRollout
    from weenv_bench.rollout.systems import WeenvSystem

    results: dict[str, list[IterationResult]] = {}
    paid: dict[str, list[float]] = {}

    def iterate(system, name: str, setup_of) -> None:
        for i, batch in enumerate(trajectories):
            log(f"{LABELS[name]}: iteration {i + 1} ...")
            it = setup_of.before()
            result = run_iteration(system, batch, concurrency, log=log)
            results.setdefault(name, []).append(result)
            paid.setdefault(name, []).append(round(setup_of.after(it, result), 3))

    for name in systems:
        if name == "group":
            with WeenvSystem(work / "home-group", cache, store_url, templates, resources) as weenv_sys:
                services["weenv_group_daemon_pid"] = weenv_sys.pid
                system = GroupSystem(weenv_sys, templates, commands, group)
                try:
                    iterate(system, name, _Builds(system))
                finally:
                    system.close()
        elif name == "create":
            with WeenvSystem(work / "home-create", cache, store_url, templates, resources) as weenv_sys:
                services["weenv_create_daemon_pid"] = weenv_sys.pid
                iterate(PerRollout(weenv_sys, name, commands), name, _PerRolloutSetup())
        else:
            iterate(PerRollout(docker, name, commands), name, _PerRolloutSetup())
    return results, paid


class _PerRolloutSetup:
    """Setup paid per rollout: the mean of the rollouts' setup time."""

    def before(self) -> None:
        return None

    def after(self, _mark, result: IterationResult) -> float:
        return sum(r.setup_s for r in result.rollouts) / max(1, len(result.rollouts))


class _Builds:
    """Setup paid per rollout: the iteration's state builds over its rollouts."""

    def __init__(self, system):
        self.system = system

    def before(self) -> int:
        return len(self.system.built_s)

    def after(self, mark: int, result: IterationResult) -> float:
        return sum(self.system.built_s[mark:]) / max(1, len(result.rollouts))


def summarize(results: dict[str, list[IterationResult]], paid: dict[str, list[float]]) -> tuple[dict, list, dict]:
    """(the summary's setup figures, the table's rows, the rewards) of
    :func:`run_iterations`'s results."""
    rows = []
    for name, its in results.items():
        for i, it in enumerate(its):
            row = report.system_row(it)
            row.update(label=LABELS[name], iteration=i + 1, setup_s_per_rollout=paid[name][i])
            rows.append(row)
    shares = {name: [r["env_share"] for r in rows if r["system"] == name] for name in results}
    overheads = {
        name: [s.overhead_s for it in its for r in it.rollouts for s in r.all_steps()] for name, its in results.items()
    }
    n = min(len(its) for its in results.values())
    per_iteration = [report.rewards([its[i] for its in results.values()]) for i in range(n)]
    rewards = {
        "rewards_match": all(r["rewards_match"] for r in per_iteration),
        "rewards_correct": all(r["rewards_correct"] for r in per_iteration),
        "per_iteration": per_iteration,
    }
    last = {name: s[-1] for name, s in shares.items()}
    summary = {
        "group_env_share": last.get("group"),
        "create_env_share": last.get("create"),
        "docker_env_share": last.get("docker"),
        "env_share_by_iteration": shares,
        "setup_s_per_rollout": paid,
        "exec_overhead_p50_s": {k: _r(report.percentile(v, 0.5)) for k, v in overheads.items()},
        "exec_overhead_p99_s": {k: _r(report.percentile(v, 0.99)) for k, v in overheads.items()},
        "rewards_match": rewards["rewards_match"],
        "rewards_correct": rewards["rewards_correct"],
        "create_over_group": _ratio(last.get("create"), last.get("group")),
        "docker_over_group": _ratio(last.get("docker"), last.get("group")),
    }
    return summary, rows, rewards


def method(built: dict) -> dict:
    """How the setup phase was run, for the JSON: the commands per task and what each system does."""
    from weenv_bench.rollout.setup_systems import SETUP_TIMEOUT_S
    from weenv_bench.rollout.task_setup import setup_commands

    return {
        "commands": {name: setup_commands(b.task.spec) for name, b in built.items()},
        "templates": "base + runtime (Debian's patch and a wheelhouse at /wheels) + the task's source; no deps",
        "timeout_s": SETUP_TIMEOUT_S,
        "group": "weenv.rollout_group(weenv.Task(template, setup=commands), G) per task and iteration: the state "
        "built once (setup in a fresh environment, snapshot in the oci:// store), G forks of a root made from it",
        "create": "weenv Sandbox.create + the commands per rollout (own daemon, empty node cache)",
        "docker": "docker run + the commands per rollout (docker exec)",
        "setup_s": "per rollout: its setup commands (create, docker); group: the part of its wait for the group "
        "during which the task's state was built",
        "setup_s_per_rollout": "create, docker: mean setup_s; group: seconds of the iteration's state builds / "
        "its rollouts",
        "iterations": "the same tasks each iteration; trajectories drawn with seed + the iteration's index",
    }


def tables(rows: list[dict]) -> str:
    """One text table per iteration."""
    out = []
    for i in sorted({r["iteration"] for r in rows}):
        out.append(f"iteration {i}:")
        out.append(report.text_table([r for r in rows if r["iteration"] == i]))
    return "\n".join(out)


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 1) if a is not None and b else None
