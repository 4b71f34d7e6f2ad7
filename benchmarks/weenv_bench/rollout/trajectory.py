"""Replayed agent trajectories: the commands a coding agent issues on a task, and
the model's think time between them.

A trajectory is :data:`STEPS` (10 to 40) shell commands run from the project's
directory, drawn the way coding agents work a bug (SWE-agent / OpenHands style
sessions): look around (``ls``, ``find``), run the failing test, read files
(``cat``, ``head``, ``sed -n A,Bp`` around the bug), search (``grep -rn`` of a
name from the buggy line, ``grep -n "def "``), try the code (``python3 -c``),
then edit with a patch (``patch -p1`` of a here-document), rerun the test and
look at the result.  The **reward** follows the last step: the task's failing
tests run once more (:func:`~weenv_bench.rollout.tasks.reward_command`); exit 0
is reward 1.

GRPO-style groups: of a task's G rollouts, the first half apply the right
patch; the rest alternate between the wrong patch (applies, fixes nothing) and
no patch at all.

**Think time** before each step is the model generating its next action:
lognormal with median :data:`THINK_MEDIAN_S` seconds and shape
:data:`THINK_SIGMA` (mean = median * exp(sigma^2 / 2) = 5.5 s), capped at
:data:`THINK_MAX_S`, times the run's ``think_scale``.  The median is an
assumption for a ~7-32B policy decoding 200-500 tokens per turn at 50-100
tokens/s per sequence in a batched server; the spread covers short tool calls
and long reasoning turns.

Everything is drawn from ``random.Random`` seeded with the run's seed, the task
and the rollout index, so the same seed gives the same trajectories on both
systems and in every run.
"""

from __future__ import annotations

import keyword
import math
import random
import re
import shlex
from dataclasses import dataclass

from weenv.errors import InvalidInputError
from weenv_bench.rollout.tasks import PYTEST, PreparedTask, patch_command, reward_command

THINK_MEDIAN_S = 4.0
THINK_SIGMA = 0.8
THINK_MAX_S = 60.0
STEPS = (10, 40)
"""Fewest and most steps of a trajectory (the reward is not counted)."""


@dataclass(frozen=True)
class Step:
    """One agent action: ``think_s`` seconds of model time, then ``command``."""

    kind: str
    """``list``, ``find``, ``read``, ``grep``, ``test``, ``python`` or ``patch``."""
    command: str
    """A shell command (``bash -c``), run from the project's directory."""
    think_s: float


@dataclass(frozen=True)
class Trajectory:
    task: str
    rollout: int
    patch: str
    """``right``, ``wrong`` or ``none``: what the trajectory submits."""
    steps: tuple[Step, ...]
    reward_command: str

    @property
    def expected_reward(self) -> int:
        return 1 if self.patch == "right" else 0

    @property
    def think_s(self) -> float:
        return sum(s.think_s for s in self.steps)


def patch_kind(rollout: int, group: int) -> str:
    """What rollout ``rollout`` (0-based) of a group of ``group`` submits."""
    if rollout < (group + 1) // 2:
        return "right"
    return "wrong" if (rollout - (group + 1) // 2) % 2 == 0 else "none"


def think_time(rng: random.Random, scale: float) -> float:
    """One think time in seconds (see the module docstring)."""
    return min(THINK_MAX_S, rng.lognormvariate(math.log(THINK_MEDIAN_S), THINK_SIGMA)) * scale


def make_trajectory(
    task: PreparedTask, rollout: int, group: int, *, seed: int, think_scale: float = 1.0, steps: tuple[int, int] = STEPS
) -> Trajectory:
    """The trajectory of rollout ``rollout`` of ``group`` on ``task``, deterministic
    in (``seed``, task, rollout).  ``steps``: (fewest, most) steps."""
    if not 6 <= steps[0] <= steps[1]:
        raise InvalidInputError(f"steps {steps}: want 6 <= fewest <= most")
    spec = task.spec
    rng = random.Random(f"{seed}:{spec.name}:{rollout}")
    kind = patch_kind(rollout, group)
    n = rng.randint(*steps)
    test = rng.choice(spec.tests)
    bug = spec.path
    py_files = [f for f in task.files if f.endswith(".py")] or task.files
    others = [f for f in py_files if f != bug] or [bug]
    package_dir = bug.rsplit("/", 1)[0] if "/" in bug else "."
    module = _module(spec.path, spec.pythonpath)
    names = [w for w in re.findall(r"[A-Za-z_][A-Za-z0-9_]{3,}", spec.mutated) if not keyword.iskeyword(w)]
    lo = max(1, task.bug_line - rng.randint(10, 30))
    hi = task.bug_line + rng.randint(10, 30)

    def explore() -> tuple[str, str]:
        choice = rng.random()
        other = rng.choice(others)
        if choice < 0.22:
            a = max(1, task.bug_line - rng.randint(5, 60))
            return "read", f"sed -n '{a},{a + rng.randint(20, 60)}p' {shlex.quote(bug)}"
        if choice < 0.37:
            return "read", f"head -n {rng.choice((40, 60, 80, 120))} {shlex.quote(other)}"
        if choice < 0.45:
            return "read", f"cat {shlex.quote(rng.choice((bug, other)))}"
        if choice < 0.60:
            word = rng.choice(names) if names else module
            return "grep", f"grep -rn {shlex.quote(word)} {shlex.quote(package_dir)} | head -n 30"
        if choice < 0.68:
            return "grep", f"grep -n 'def ' {shlex.quote(rng.choice((bug, other)))} | head -n 40"
        if choice < 0.76:
            return (
                "list",
                f"ls -la {shlex.quote(rng.choice((package_dir, '.', other.rsplit('/', 1)[0] if '/' in other else '.')))}",
            )
        if choice < 0.82:
            return "list", f"wc -l {shlex.quote(bug)} {shlex.quote(other)}"
        if choice < 0.92:
            snippet = rng.choice(
                (
                    f"import {module}; print({module}.__file__)",
                    f"import {module}; print(sorted(n for n in dir({module}) if not n.startswith('_'))[:25])",
                    f"import sys, {module}; print(sys.version.split()[0], {module}.__name__)",
                )
            )
            return "python", f"python3 -c {shlex.quote(snippet)}"
        return "test", f"{PYTEST} {shlex.quote(test)}"

    commands: list[tuple[str, str]] = [
        ("list", "ls"),
        ("find", "find . -name '*.py' -not -path '*/.*' | head -n 50"),
        ("test", f"{PYTEST} {shlex.quote(test)}"),
    ]
    tail: list[tuple[str, str]] = []
    if kind != "none":
        tail.append(("patch", patch_command(task.fix_patch if kind == "right" else task.wrong_patch)))
    tail.append(("test", f"{PYTEST} {shlex.quote(test)}"))
    tail.append(("read", f"sed -n '{lo},{hi}p' {shlex.quote(bug)}"))
    while len(commands) + len(tail) < n:
        commands.append(explore())
    out = tuple(Step(k, c, round(think_time(rng, think_scale), 4)) for k, c in commands + tail)
    return Trajectory(spec.name, rollout, kind, out, reward_command(spec))


def _module(path: str, pythonpath: str) -> str:
    """The top-level import name of the file at ``path`` under ``pythonpath``."""
    rel = path[len(pythonpath) + 1 :] if pythonpath != "." and path.startswith(pythonpath + "/") else path
    top = rel.split("/", 1)[0]
    return top[:-3] if top.endswith(".py") else top
