"""The setup phase of ``weenv bench rollout --setup``: what a task's
environment runs before its first agent step when its template holds the
project's source but none of its dependencies.

A task's setup is three shell commands run from the project's directory,
drawn from how SWE-style task sets prepare a repository:

1. ``pip install`` of the test runner and the task's test requirements;
2. ``pip install --no-deps -e .``: an editable install of the project, its
   build backend (setuptools, flit_core, ...) installed by pip into an
   isolated build environment first;
3. a first test collection (``pytest --collect-only`` of the files holding
   the task's tests).

Environments have no network, so pip reads a **wheelhouse** instead of an
index: ``/wheels`` in the shared ``tools`` group holds pip's own wheel (run
from the wheel: Debian's minbase has no pip), the runtime's requirements, every
task's test requirements and every project's build requirements (read from its
``pyproject.toml``), each with their dependencies, downloaded once on the host
with ``pip download`` for Python 3.11 (cached under
``$WEENV_CACHE/bench-rollout``).  The ``tools`` group also holds Debian's
``patch``, which the agents' edits use.  pip installs into Debian's
``/usr/local/lib/python3.11/dist-packages`` (``--break-system-packages``:
Debian marks its Python as externally managed).
"""

from __future__ import annotations

import hashlib
import json
import shlex
import shutil
import sys
import tomllib
from pathlib import Path

from weenv_bench.rollout.tasks import (
    FORMAT,
    RUNTIME_REQUIREMENTS,
    PreparedTask,
    TaskSpec,
    make_once,
    run_checked,
    runtime_tree,
)

PIP_WHEEL = "pip-24.3.1-py3-none-any.whl"
PIP_REQUIREMENT = "pip==24.3.1"
BUILD_DEFAULTS = ("setuptools>=64", "wheel")
"""What pip builds a project without ``[build-system]`` with (and an editable
install needs setuptools 64 or later)."""
WHEELHOUSE = "/wheels"
PIP = (
    f"python3 {WHEELHOUSE}/{PIP_WHEEL}/pip install -q --no-index --find-links {WHEELHOUSE} "
    "--disable-pip-version-check --break-system-packages --root-user-action=ignore"
)
PIP_DOWNLOAD = (sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check")
PIP_DOWNLOAD += ("--only-binary=:all:", "--python-version", "3.11")
COLLECT = "python3 -m pytest --collect-only -q -p no:cacheprovider -o addopts="


def setup_commands(spec: TaskSpec) -> list[str]:
    """The task's setup, as shell commands run in order from its directory."""
    files = sorted({t.split("::", 1)[0] for t in spec.tests})
    return [
        " ".join([PIP, *RUNTIME_REQUIREMENTS, *spec.deps]),
        f"{PIP} --no-deps -e .",
        " ".join([COLLECT, *map(shlex.quote, files)]),
    ]


def build_requirements(task: PreparedTask) -> list[str]:
    """The project's ``[build-system] requires`` (pip's defaults without one)."""
    pyproject = task.project / "pyproject.toml"
    if pyproject.is_file():
        requires = tomllib.loads(pyproject.read_text()).get("build-system", {}).get("requires")
        if requires:
            return list(requires)
    return list(BUILD_DEFAULTS)


def tools_tree(cache: Path, tasks: list[PreparedTask], log=print) -> Path:
    """The ``tools`` group's tree: Debian's ``patch`` at ``usr/bin/patch`` and the
    wheelhouse at ``wheels/`` for ``tasks`` (see the module docstring); cached
    by the requirements it holds.  :class:`RuntimeFailedError` if pip fails."""
    sets = [[PIP_REQUIREMENT, *RUNTIME_REQUIREMENTS, *BUILD_DEFAULTS]]
    sets += [[*t.spec.deps, *build_requirements(t)] for t in tasks]
    key = hashlib.sha256(json.dumps([FORMAT, sets]).encode()).hexdigest()[:16]
    root = Path(cache) / "bench-rollout" / f"tools-{key}"
    if (root / "wheels" / PIP_WHEEL).is_file():
        return root
    log(f"tools group: patch + a wheelhouse for {len(tasks)} tasks (pip download) ...")
    patch = runtime_tree(cache, log=log) / "usr" / "bin" / "patch"

    def fill(tmp: Path) -> None:
        (tmp / "usr" / "bin").mkdir(parents=True)
        shutil.copy2(patch, tmp / "usr" / "bin" / "patch")
        for requirements in sets:  # one resolution per task: their pins need not agree with each other
            run_checked([*PIP_DOWNLOAD, "-d", str(tmp / "wheels"), *requirements], f"pip download {requirements}")

    make_once(root, fill)
    return root
