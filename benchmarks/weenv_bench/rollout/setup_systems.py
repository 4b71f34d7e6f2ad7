"""The systems of ``weenv bench rollout --setup``: the same rollouts, each
starting after its task's setup (:mod:`weenv_bench.rollout.task_setup`).

- :class:`PerRollout` (``docker``, ``create``): a system of
  :mod:`weenv_bench.rollout.systems` that creates every rollout's environment
  from the task's template and then runs the setup's commands in it (through
  the system's own exec, timed like a step).  Every rollout repays the setup.
- :class:`GroupSystem` (``group``): weenv's RL-group path.  Per task one
  :class:`weenv.Task` (the template and the setup's commands); the first
  rollout of a task in an iteration asks :func:`weenv.rollout_group` for a
  group of G sandboxes, which builds the task's state once (setup in a fresh
  environment, published as a snapshot in the store) and forks the group from
  a root environment made from it; the task's other rollouts take the group's
  other sandboxes (waiting for it if it is still being made).  The next
  iteration's groups find the state in the store and the root on the node:
  only the fork remains.

Per rollout, ``setup_s`` is the setup's commands for :class:`PerRollout`; for
:class:`GroupSystem`, the part of the rollout's wait for its sandbox during
which its task's state was being built (the rest of the wait is its create).
:attr:`GroupSystem.built_s` lists the seconds of every state build, so the
setup paid per rollout is their sum over the rollouts.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time

from weenv.errors import RuntimeFailedError
from weenv_bench.rollout.systems import ExecResult, unwrap, wrap

SETUP_TIMEOUT_S = 900.0
"""Seconds the whole setup of one task may take."""


class PerRollout:
    """``system`` with ``commands`` (task name -> the setup's shell commands) run
    after every create; named ``name``."""

    def __init__(self, system, name: str, commands: dict[str, list[str]]):
        self.system, self.name, self.commands = system, name, commands
        self._task: dict[str, str] = {}

    def create(self, task: str) -> str:
        env = self.system.create(task)
        self._task[env] = task
        return env

    def setup(self, env: str) -> tuple[float, float]:
        """Run the task's setup in ``env``: (its seconds, 0).  :class:`RuntimeFailedError`
        with its output if a command fails."""
        task = self._task[env]
        t0 = time.perf_counter()
        for command in self.commands[task]:
            r = self.system.exec(env, command, SETUP_TIMEOUT_S)
            if r.exit_code != 0:
                raise RuntimeFailedError(
                    f"setup of {task}: {command!r} exited {r.exit_code}: {(r.stdout + r.stderr)[-800:]}"
                )
        return time.perf_counter() - t0, 0.0

    def exec(self, env: str, command: str, timeout: float) -> ExecResult:
        return self.system.exec(env, command, timeout)

    def destroy(self, env: str) -> None:
        self._task.pop(env, None)
        self.system.destroy(env)

    def bytes_fetched(self) -> int:
        return self.system.bytes_fetched()

    def daemon_pids(self) -> list[int]:
        return self.system.daemon_pids()


class GroupSystem:
    """Rollouts from :func:`weenv.rollout_group` on the daemon of ``weenv_system``
    (a started :class:`~weenv_bench.rollout.systems.WeenvSystem`, which also
    runs their commands); ``templates`` and ``commands``: task name -> template
    name, setup commands; ``group``: G.  :meth:`close` kills the groups and
    the tasks' root environments (their states stay in the store)."""

    name = "group"

    def __init__(self, weenv_system, templates: dict[str, str], commands: dict[str, list[str]], group: int):
        import weenv

        self.system, self.group = weenv_system, group
        self.tasks = {
            name: weenv.Task(templates[name], setup=list(commands[name]), timeout=SETUP_TIMEOUT_S) for name in templates
        }
        self.built_s: list[float] = []
        """Seconds of each state build (a task whose state the store already had adds none)."""
        self._lock = threading.Lock()
        self._task_locks = {name: threading.Lock() for name in templates}
        self._ready: dict[str, collections.deque] = {name: collections.deque() for name in templates}
        self._build_window: dict[str, tuple[float, float]] = {}
        self._setup_part: dict[str, float] = {}
        self._groups: list = []
        self._sandboxes: dict[str, tuple] = {}
        """Environment id -> (its sandbox, its group)."""
        self._left: dict[int, int] = {}
        """id() of a group -> its sandboxes not destroyed yet."""

    def create(self, task: str) -> str:
        import weenv

        arrived = time.perf_counter()
        with self._task_locks[task]:
            if not self._ready[task]:
                started = time.perf_counter()
                group = weenv.rollout_group(
                    self.tasks[task], self.group, api_url=self.system.api_url, api_key=self.system.api_key
                )
                build = group.state.build_s if group.state.built else 0.0
                with self._lock:
                    self._groups.append(group)
                    self._left[id(group)] = len(group)
                    if group.state.built:
                        self.built_s.append(build)
                self._build_window[task] = (started, started + build)
                self._ready[task].extend((sb, group) for sb in group)
            sb, group = self._ready[task].popleft()
            start, end = self._build_window[task]
        got = time.perf_counter()
        with self._lock:
            self._sandboxes[sb.id] = (sb, group)
            self._setup_part[sb.id] = max(0.0, min(got, end) - max(arrived, start))
        return sb.id

    def setup(self, env: str) -> tuple[float, float]:
        """Nothing to run: the sandbox holds the task's state.  (0, the part of
        its create that waited for the state's build)."""
        return 0.0, self._setup_part.pop(env, 0.0)

    def exec(self, env: str, command: str, timeout: float) -> ExecResult:
        sb = self._sandboxes[env][0]
        t0 = time.perf_counter()
        r = sb.commands.run(wrap(command), timeout=timeout)
        return unwrap(r.exit_code, r.stdout, r.stderr, time.perf_counter() - t0)

    def destroy(self, env: str) -> None:
        """Kill the sandbox; the group's last one kills the group (closing its meter)."""
        with self._lock:
            sb, group = self._sandboxes.pop(env)
            self._left[id(group)] -= 1
            last = self._left[id(group)] == 0
            if last:
                self._groups.remove(group)
        if last:
            # The group's kill asks again for the others (gone: no error) and closes its meter.  The
            # sandboxes share one connection, closed by the kill of the last one open: that one goes last.
            group.remove(sb)
            group.append(sb)
            group.kill()
        else:
            sb.kill()

    def bytes_fetched(self) -> int:
        return self.system.bytes_fetched()

    def daemon_pids(self) -> list[int]:
        return self.system.daemon_pids()

    def close(self) -> None:
        """Kill what is left of the groups (closing their meters) and the tasks' roots."""
        import weenv

        with self._lock:
            groups, self._groups = self._groups, []
        for group in groups:
            with contextlib.suppress(Exception):
                group.kill()
        for task in self.tasks.values():
            with contextlib.suppress(Exception):
                weenv.release_task(task, api_url=self.system.api_url, api_key=self.system.api_key)
