"""One RL iteration's rollout stage on one system: a batch of trajectories (tasks
x G rollouts) run with bounded concurrency, as a trainer's rollout workers
would: per rollout, create the task's environment, replay the steps (think,
then exec), run the reward command, destroy.

Rollouts are started in batch order (a task's G rollouts one after another,
the tasks in the sampled order) by ``concurrency`` worker threads; a worker
takes the next rollout when its current one is destroyed.

Per rollout, seconds: ``create_s`` (request to a running environment, a pull
included on Docker), ``setup_s`` (the task's setup, for a system that has one:
see :class:`~weenv_bench.rollout.systems.System`), ``first_step_s`` (create + setup + the first command's exec),
each step's exec wall time and the command's own run time (see
:mod:`weenv_bench.rollout.systems`), think time slept, the reward command
alike, ``destroy_s``, and ``wall_s`` from the create request to the destroy's
return.  A rollout that fails (an exec or create error) keeps its error and
gets no reward.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from weenv_bench.rollout.systems import ExecResult, MemorySampler, System
from weenv_bench.rollout.trajectory import Trajectory

STEP_TIMEOUT_S = 300.0


@dataclass
class StepTiming:
    kind: str
    exit_code: int
    wall_s: float
    inner_s: float
    think_s: float

    @property
    def overhead_s(self) -> float:
        return max(0.0, self.wall_s - self.inner_s)


@dataclass
class RolloutResult:
    task: str
    rollout: int
    patch: str
    expected_reward: int
    reward: int | None = None
    create_s: float = 0.0
    setup_s: float = 0.0
    first_step_s: float | None = None
    destroy_s: float = 0.0
    wall_s: float = 0.0
    steps: list[StepTiming] = field(default_factory=list)
    reward_step: StepTiming | None = None
    error: str | None = None
    started_at: float = 0.0
    """Seconds from the iteration's start."""

    @property
    def exec_overhead_s(self) -> float:
        return sum(s.overhead_s for s in self.all_steps())

    @property
    def command_s(self) -> float:
        return sum(s.inner_s for s in self.all_steps())

    @property
    def think_s(self) -> float:
        return sum(s.think_s for s in self.steps)

    @property
    def env_s(self) -> float:
        """The environment's time: create + setup + destroy + exec overhead."""
        return self.create_s + self.setup_s + self.destroy_s + self.exec_overhead_s

    def all_steps(self) -> list[StepTiming]:
        return self.steps + ([self.reward_step] if self.reward_step else [])

    def row(self) -> dict:
        d = asdict(self)
        d.update(exec_overhead_s=self.exec_overhead_s, command_s=self.command_s, think_s=self.think_s, env_s=self.env_s)
        return d


def run_rollout(system: System, trajectory: Trajectory, t_start: float) -> RolloutResult:
    """Create, replay, reward, destroy (the destroy runs whatever failed)."""
    r = RolloutResult(trajectory.task, trajectory.rollout, trajectory.patch, trajectory.expected_reward)
    t0 = time.perf_counter()
    r.started_at = t0 - t_start
    env = None
    try:
        env = system.create(trajectory.task)
        r.create_s = time.perf_counter() - t0
        setup = getattr(system, "setup", None)
        if setup is not None:
            after, inside = setup(env)  # inside: the part of the create that was the task's setup
            r.setup_s = after + inside
            r.create_s -= inside
        for step in trajectory.steps:
            time.sleep(step.think_s)
            res = system.exec(env, step.command, STEP_TIMEOUT_S)
            r.steps.append(_timing(step.kind, res, step.think_s))
            if r.first_step_s is None:
                r.first_step_s = r.create_s + r.setup_s + res.wall_s
        res = system.exec(env, trajectory.reward_command, STEP_TIMEOUT_S)
        r.reward_step = _timing("reward", res, 0.0)
        r.reward = 1 if res.exit_code == 0 else 0
    except Exception as exc:  # a failed rollout is a result, not the end of the run
        r.error = f"{type(exc).__name__}: {exc}"[:800]
        r.reward = None
    finally:
        if env is not None:
            t = time.perf_counter()
            try:
                system.destroy(env)
            except Exception as exc:
                r.error = r.error or f"destroy: {type(exc).__name__}: {exc}"[:800]
            r.destroy_s = time.perf_counter() - t
        r.wall_s = time.perf_counter() - t0
    return r


def _timing(kind: str, res: ExecResult, think_s: float) -> StepTiming:
    return StepTiming(kind, res.exit_code, round(res.wall_s, 5), round(res.inner_s, 5), think_s)


@dataclass
class IterationResult:
    system: str
    concurrency: int
    wall_s: float
    rollouts: list[RolloutResult]
    bytes_fetched: int
    daemon_peak_bytes: int
    loadavg: list[list[float]]


def run_iteration(system: System, trajectories: list[Trajectory], concurrency: int, log=print) -> IterationResult:
    """Run every trajectory on ``system``, ``concurrency`` at a time; return the
    results in batch order with the iteration's wall time, the bytes the system
    fetched meanwhile and its daemons' peak memory."""
    from weenv_bench.start import loadavg

    results: list[RolloutResult | None] = [None] * len(trajectories)
    done = [0]
    lock = threading.Lock()
    loads = [loadavg()]
    fetched0 = system.bytes_fetched()

    def one(i: int) -> None:
        res = run_rollout(system, trajectories[i], t0)
        results[i] = res
        with lock:
            done[0] += 1
            n = done[0]
        if res.error or n % max(1, len(trajectories) // 8) == 0 or n == len(trajectories):
            log(
                f"  {system.name}: {n}/{len(trajectories)} rollouts done"
                + (f" (error in {res.task}#{res.rollout}: {res.error})" if res.error else "")
            )

    with MemorySampler(system.daemon_pids) as memory:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(concurrency, thread_name_prefix=f"rollout-{system.name}") as pool:
            list(pool.map(one, range(len(trajectories))))
        wall = time.perf_counter() - t0
    loads.append(loadavg())
    return IterationResult(
        system.name,
        concurrency,
        wall,
        [r for r in results if r is not None],
        system.bytes_fetched() - fetched0,
        memory.peak_bytes,
        loads,
    )
