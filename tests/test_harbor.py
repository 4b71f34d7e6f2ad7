"""Harbor (PyPI ``harbor``, the Terminal-Bench harness) unchanged, on weenv:
``harbor run -a oracle -e e2b`` against a real ``weenv serve``.

Harbor needs Python >= 3.12, so it lives in a venv of its own,
``/work/venvs/harbor`` (``WEENV_HARBOR_VENV`` elsewhere; ``scripts/setup.sh``
makes it); without it the test is skipped, saying so.  The tasks are written
here: Dockerfiles ``FROM`` the Debian image in the session's loopback
registry with RUN, COPY, WORKDIR, ENV and USER lines; one task's tests need
root, the other's run as E2B's ``user``.  Harbor builds each task's template
through E2B's template API (``AsyncTemplate.build_in_background`` from the
task's Dockerfile, tag ``default-r5``), creates a sandbox per trial, uploads
the solution and tests as root, runs the oracle's ``solve.sh`` and the
verifier's ``test.sh``, and reads the reward.  The daemon runs every
environment in a user namespace of its own (``WEENV_USERNS=on``), where root
inside holds Docker's default capabilities, as under Docker or E2B.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from e2b_fixture import e2b_daemon
from oci_push import e2b_base_image  # noqa: F401 - a fixture
from registry_fixture import oci_registry  # noqa: F401 - a fixture

VENV = Path(os.environ.get("WEENV_HARBOR_VENV", "/work/venvs/harbor"))
HARBOR = VENV / "bin" / "harbor"

pytestmark = pytest.mark.skipif(
    not HARBOR.exists(), reason=f"Harbor's venv {VENV} is absent (scripts/setup.sh makes it with Python >= 3.12)"
)

TASK_TOML = """\
schema_version = "1.4"
[metadata]
[verifier]
timeout_sec = 120.0
{verifier_user}
[agent]
timeout_sec = 120.0
[environment]
build_timeout_sec = 300.0
"""

ROOT_DOCKERFILE = """\
FROM {image}
RUN mkdir -p /app && echo seed > /app/seed.txt && chmod 0700 /app
COPY data.txt /app/data.txt
WORKDIR /app
ENV TASK_MODE=root-task
RUN echo {last} > /app/last.txt
"""

USER_DOCKERFILE = """\
FROM {image}
RUN mkdir -p /work/project && chown 1000:1000 /work/project
COPY --chown=1000:1000 notes.txt /work/project/notes.txt
ENV TASK_MODE=user-task
WORKDIR /work/project
USER user
RUN echo built-by-$(id -un) > /work/project/built.txt
"""

ROOT_SOLVE = """#!/bin/bash
set -e
cat /app/seed.txt /app/data.txt > /app/answer.txt
echo "$TASK_MODE $(id -u)" >> /app/answer.txt
"""
ROOT_TEST = """#!/bin/bash
# needs root: /app is 0700 root, /etc/shadow is root's
ok=1
[ "$(id -u)" = 0 ] || ok=0
head -c1 /etc/shadow > /dev/null || ok=0
[ "$(cat /app/answer.txt)" = "$(printf 'seed\\ndata\\nroot-task 0')" ] || ok=0
[ "$(cat /app/last.txt)" = "{last}" ] || ok=0
echo $ok > /logs/verifier/reward.txt
"""
USER_SOLVE = """#!/bin/bash
set -e
echo "$(id -un) $TASK_MODE $(cat notes.txt)" > /work/project/answer.txt
"""
USER_TEST = """#!/bin/bash
ok=1
[ "$(id -un)" = user ] || ok=0
[ "$HOME" = /home/user ] || ok=0
[ "$(pwd)" = /work/project ] || ok=0
[ "$(cat /work/project/answer.txt)" = "user user-task notes" ] || ok=0
[ "$(cat /work/project/built.txt)" = built-by-user ] || ok=0
echo $ok > /logs/verifier/reward.txt
"""


def _task(
    root: Path, name: str, dockerfile: str, files: dict[str, str], solve: str, test: str, verifier_user: str = ""
) -> Path:
    task = root / name
    (task / "environment").mkdir(parents=True, exist_ok=True)
    (task / "solution").mkdir(exist_ok=True)
    (task / "tests").mkdir(exist_ok=True)
    (task / "task.toml").write_text(TASK_TOML.format(verifier_user=verifier_user))
    (task / "instruction.md").write_text(f"Solve {name}.\n")
    (task / "environment" / "Dockerfile").write_text(dockerfile)
    for fname, text in files.items():
        (task / "environment" / fname).write_text(text)
    (task / "solution" / "solve.sh").write_text(solve)
    (task / "tests" / "test.sh").write_text(test)
    for script in (task / "solution" / "solve.sh", task / "tests" / "test.sh"):
        script.chmod(0o755)
    return task


def _harbor(d, path: Path, jobs: Path, name: str) -> tuple[list[dict], float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(
        E2B_API_URL=d.api_url,
        E2B_SANDBOX_URL=d.sandbox_url,
        E2B_API_KEY=d.key,
        E2B_DOMAIN="weenv.invalid",
        HOME=str(jobs.parent),
    )
    t0 = time.monotonic()
    proc = subprocess.run(
        [
            str(HARBOR),
            "run",
            "-p",
            str(path),
            "-a",
            "oracle",
            "-e",
            "e2b",
            "-o",
            str(jobs),
            "--job-name",
            name,
            "-n",
            "2",
            "-y",
            "-q",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=jobs.parent,
    )
    seconds = time.monotonic() - t0
    results = [json.loads(p.read_text()) for p in (jobs / name).glob("*/result.json")]
    assert proc.returncode == 0 and results, (
        f"harbor exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return results, seconds


def _rewards(results: list[dict]) -> dict[str, float | None]:
    out = {}
    for r in results:
        rewards = (r.get("verifier_result") or {}).get("rewards") or {}
        out[r["task_name"]] = rewards.get("reward")
        assert r.get("exception_info") is None, json.dumps(r.get("exception_info"), indent=1)[:3000]
    return out


@pytest.fixture(scope="module")
def harbor_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("harbor")
    (root / "jobs").mkdir()
    return root


@pytest.fixture(scope="module")
def weenv_e2b(harbor_root, oci_registry):  # noqa: F811
    with e2b_daemon(harbor_root / "weenv", oci_registry, WEENV_USERNS="on") as d:
        yield d


def test_harbor_task_needing_root_and_its_one_line_rebuild(weenv_e2b, harbor_root, e2b_base_image):  # noqa: F811
    d, tasks, jobs = weenv_e2b, harbor_root / "tasks", harbor_root / "jobs"
    _task(
        tasks,
        "root-task",
        ROOT_DOCKERFILE.format(image=e2b_base_image, last="first"),
        {"data.txt": "data\n"},
        ROOT_SOLVE,
        ROOT_TEST.format(last="first"),
    )
    results, seconds = _harbor(d, tasks / "root-task", jobs, "first")
    assert _rewards(results) == {"root-task": 1.0}, results
    print(f"harbor, the root task built and run: {seconds:.1f} s")

    # its Dockerfile changes in its last line: the rebuild runs that line alone of the Dockerfile's
    _task(
        tasks,
        "root-task",
        ROOT_DOCKERFILE.format(image=e2b_base_image, last="second"),
        {"data.txt": "data\n"},
        ROOT_SOLVE,
        ROOT_TEST.format(last="second"),
    )
    results, seconds = _harbor(d, tasks / "root-task", jobs, "second")
    assert _rewards(results) == {"root-task": 1.0}
    print(f"harbor, the root task rebuilt and run: {seconds:.1f} s")
    first, second = d.build_runs()[-2:]
    assert "RUN mkdir -p /app && echo seed > /app/seed.txt && chmod 0700 /app" in first
    dockerfile = ROOT_DOCKERFILE.format(image=e2b_base_image, last="second").splitlines()
    assert [r for r in second if r in dockerfile] == ["RUN echo second > /app/last.txt"], second
    # beside it only what comes after the Dockerfile: the SDK's USER user, Harbor's USER root and its 3 capture RUNs
    assert len(second) == 6, second
    assert d.environment_ids() == []


def _runs_commands_as_named_users(template: str) -> bool:
    """Whether envd runs a command as the user the caller names (root here) in
    a sandbox of ``template``, whose user is E2B's ``user``."""
    from e2b import Sandbox

    sb = Sandbox.create(template, timeout=60)
    try:
        return sb.commands.run("id -u", user="root").stdout.strip() == "0"
    finally:
        sb.kill()


def test_harbor_task_running_as_user(weenv_e2b, harbor_root, e2b_base_image):  # noqa: F811
    d, tasks, jobs = weenv_e2b, harbor_root / "tasks", harbor_root / "jobs"
    from e2b import Template

    Template.build(Template().from_image(e2b_base_image), "probe-base")
    if not _runs_commands_as_named_users("probe-base"):
        pytest.skip(
            "envd runs every command as the template's user: Harbor's transfers as root "
            "(mkdir /solution, /tests) need envd's user selection (issue 15, item 3, commands and files)"
        )
    with d.api() as c:
        before = {t["templateID"] for t in c.get("/templates").json()}
    _task(
        tasks,
        "user-task",
        USER_DOCKERFILE.format(image=e2b_base_image),
        {"notes.txt": "notes\n"},
        USER_SOLVE,
        USER_TEST,
    )
    results, seconds = _harbor(d, tasks / "user-task", jobs, "user")
    assert _rewards(results) == {"user-task": 1.0}, results
    print(f"harbor, the user task built and run: {seconds:.1f} s")
    _replay_solution_as_older_harbor_uploads_it(d, before)


REPLAYED_SOLVE = """#!/bin/bash
set -e
id -un > /work/project/answer.txt
"""


def _replay_solution_as_older_harbor_uploads_it(d, before: set[str]) -> None:
    """On the template of a task whose Dockerfile ends as ``USER user``, the
    steps older Harbor releases take (``solve.sh`` uploaded as the sandbox's
    default user, ``chmod +x`` as root, run as the default user) work, root's
    ``chmod`` of the user's file included (CAP_FOWNER: root inside a user
    namespace of its own; without one it failed, Operation not permitted)."""
    from e2b import Sandbox

    with d.api() as c:
        (template,) = {t["templateID"] for t in c.get("/templates").json()} - before
    sb = Sandbox.create(template, timeout=60)
    try:
        sb.files.write("/solution/solve.sh", REPLAYED_SOLVE)  # no user: the sandbox's default, E2B's user
        owners = sb.commands.run("stat -c '%U:%G:%a' /solution /solution/solve.sh", user="root").stdout
        assert owners.split() == ["user:user:755", "user:user:644"]
        sb.commands.run("chmod +x /solution/solve.sh", user="root")
        assert sb.commands.run("stat -c %U:%G:%a /solution/solve.sh").stdout == "user:user:755\n"
        sb.commands.run("/solution/solve.sh")
        assert sb.files.read("/work/project/answer.txt") == "user\n"
    finally:
        sb.kill()
