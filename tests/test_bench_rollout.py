"""``weenv bench rollout``: the task set, the trajectories, the exec timing
wrapper, and a trimmed ``--quick`` run end to end on both systems (real
dockerd, docker-registry, weenv daemon); afterwards nothing of them remains."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from weenv.config import Paths
from weenv.errors import InvalidInputError, RuntimeFailedError
from weenv.host import mounts
from weenv_bench.rollout import SUMMARY_KEYS, run
from weenv_bench.rollout.systems import unwrap, wrap
from weenv_bench.rollout.tasks import TASKS, TaskSpec, mutate, patch_command, prepare_task
from weenv_bench.rollout.trajectory import STEPS, make_trajectory, patch_kind
from weenv_bench.services import process
from weenv_bench.services.dockerd import DOCKERD
from weenv_bench.services.process import alive
from weenv_bench.services.registry import REGISTRY
from weenv_bench.update import fetch_sdists

needs_docker = pytest.mark.skipif(
    not (os.access(DOCKERD, os.X_OK) and os.access(REGISTRY, os.X_OK)),
    reason="needs Debian's docker.io and docker-registry",
)


@pytest.fixture(scope="module")
def prepared():
    """The first four tasks prepared from their sdists (cached in WEENV_CACHE)."""
    specs = TASKS[:4]
    cache = Paths.from_env().cache
    return [prepare_task(cache, s, src) for s, src in zip(specs, fetch_sdists(cache, tuple(s.sdist for s in specs)))]


def test_task_pool_is_real_and_distinct():
    assert len(TASKS) >= 20
    assert len({t.name for t in TASKS}) == len(TASKS) == len({t.sdist.split("==")[0] for t in TASKS})
    for t in TASKS:
        assert "==" in t.sdist and t.tests and t.original != t.mutated, t.name


def test_prepared_task_holds_the_bug_and_patches(prepared, tmp_path):
    for task in prepared:
        spec = task.spec
        buggy = (task.project / spec.path).read_text()
        assert spec.mutated in buggy and spec.original not in buggy
        assert spec.mutated in buggy.splitlines()[task.bug_line - 1] or spec.mutated.startswith(
            buggy.splitlines()[task.bug_line - 1]
        )
        # the fixing patch restores the sdist's file with the real patch(1)
        copy = tmp_path / spec.name
        subprocess.run(["cp", "-a", str(task.project), str(copy)], check=True)
        r = subprocess.run(["bash", "-c", patch_command(task.fix_patch)], cwd=copy, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert spec.original in (copy / spec.path).read_text()
        assert spec.path in task.files


def test_mutation_must_match_once():
    spec = TaskSpec("x", "x==1", "x.py", "a = 1", "a = 2", ("t.py::t",))
    assert mutate("a = 1\n", spec) == "a = 2\n"
    with pytest.raises(InvalidInputError):
        mutate("a = 1\na = 1\n", spec)
    with pytest.raises(InvalidInputError):
        mutate("b = 1\n", spec)


def test_trajectories_are_deterministic_and_grpo_shaped(prepared):
    task = prepared[0]
    group = 8
    a = [make_trajectory(task, g, group, seed=3, think_scale=0.5) for g in range(group)]
    b = [make_trajectory(task, g, group, seed=3, think_scale=0.5) for g in range(group)]
    c = [make_trajectory(task, g, group, seed=4, think_scale=0.5) for g in range(group)]
    assert a == b and a != c
    assert [t.patch for t in a].count("right") == group // 2
    assert {t.patch for t in a} == {"right", "wrong", "none"}
    for t in a:
        assert STEPS[0] <= len(t.steps) <= STEPS[1]
        assert t.steps[0].command == "ls" and t.reward_command.startswith("python3 -m pytest")
        patches = [s for s in t.steps if s.kind == "patch"]
        assert len(patches) == (0 if t.patch == "none" else 1)
        assert all(0 <= s.think_s <= 60 * 0.5 for s in t.steps)
        assert t.expected_reward == (t.patch == "right")
    # think time scales linearly
    z = make_trajectory(task, 0, group, seed=3, think_scale=0.0)
    assert z.think_s == 0 and [s.command for s in z.steps] == [s.command for s in a[0].steps]
    assert [patch_kind(i, 3) for i in range(3)] == ["right", "right", "wrong"]
    with pytest.raises(InvalidInputError):
        make_trajectory(task, 0, group, seed=0, steps=(3, 5))


def test_exec_wrapper_measures_the_command_inside():
    argv = wrap("sleep 0.2; echo out; echo err >&2; exit 3")
    p = subprocess.run(argv, capture_output=True, text=True)
    r = unwrap(p.returncode, p.stdout, p.stderr, wall_s=5.0)
    assert (r.exit_code, r.stdout, r.stderr) == (3, "out\n", "err\n")
    assert 0.19 < r.inner_s < 1.0 and r.overhead_s == pytest.approx(5.0 - r.inner_s)
    # a here-document (the patch step) inside the wrapper
    p = subprocess.run(wrap("cat <<'EOF'\nline\nEOF\n"), capture_output=True, text=True)
    assert unwrap(p.returncode, p.stdout, p.stderr, 1.0).stdout == "line\n"
    with pytest.raises(RuntimeFailedError):
        unwrap(126, "", "exec failed: no such container", 0.1)


def test_daemon_side_processes_leave_out_other_mount_namespaces():
    from weenv_bench.rollout.systems import descendants, host_side, rss_bytes

    child = subprocess.Popen(["sleep", "30"])
    inside = subprocess.Popen(["unshare", "--mount", "sleep", "30"])
    try:
        time.sleep(0.2)
        tree = descendants(os.getpid())
        assert {child.pid, inside.pid} <= set(tree)
        assert host_side(tree).count(child.pid) == 1 and inside.pid not in host_side(tree)
        assert rss_bytes(child.pid) > 0 and rss_bytes(2**22 + 7) == 0
    finally:
        for p in (child, inside):
            p.kill()
            p.wait()


def test_tasks_are_verified_inside_weenv(prepared, paths, debian_root, leak_check, tmp_path):
    """The build-time check runs the tests in weenv environments: a real bug
    passes it; a "bug" that breaks none of the named tests is refused."""
    import dataclasses

    from weenv.formats.manifest import Resources
    from weenv.store.file import FileStore
    from weenv_bench.rollout import templates
    from weenv_bench.rollout.tasks import runtime_tree

    good = prepared[1]  # idna
    spec = dataclasses.replace(good.spec, name="idna-harmless", mutated="    if len(label) >  63:")
    harmless = prepare_task(paths.cache, spec, fetch_sdists(paths.cache, (spec.sdist,))[0])
    store = FileStore(tmp_path / "store")
    built = templates.build_weenv(
        store, debian_root, runtime_tree(paths.cache), [good, harmless], Resources(), tmp_path, log=lambda _m: None
    )
    marks = tmp_path / "marks"
    checks = templates.verify_tasks(store, {"idna": built["idna"]}, tmp_path / "home", marks=marks, log=lambda _m: None)
    assert {k: v["exit_code"] for k, v in checks["idna"].items()} == {"none": 1, "wrong": 1, "right": 0}
    assert len(list(marks.iterdir())) == 1
    again = templates.verify_tasks(
        store, {"idna": built["idna"]}, tmp_path / "unused-home", marks=marks, log=lambda _m: None
    )
    assert again == checks and not (tmp_path / "unused-home").exists()  # remembered: no node started
    with pytest.raises(RuntimeFailedError, match="idna-harmless.*exit 0, want 1"):
        templates.verify_tasks(
            store, {"idna-harmless": built["idna-harmless"]}, tmp_path / "home2", marks=marks, log=lambda _m: None
        )
    assert len(list(marks.iterdir())) == 1


@needs_docker
def test_quick_rollout_benchmark_weenv_against_docker(paths, debian_root, leak_check, tmp_path):
    out = tmp_path / "rollout.json"
    work = tmp_path / "work"
    work.mkdir()
    # a pool of 3 published tasks (quick: 6), 2 of them in the iteration: a pool larger than the iteration
    result = run(
        quick=True,
        json_path=out,
        work=work,
        pool=3,
        tasks=2,
        group=4,
        concurrency=4,
        steps=(10, 12),
        log=lambda _msg: None,
    )

    written = json.loads(out.read_text())
    assert written == json.loads(json.dumps(result))
    s = written["summary"]
    assert set(SUMMARY_KEYS) <= set(s)
    assert s["rewards_match"] is True and s["rewards_correct"] is True
    for key in ("weenv_env_share", "docker_env_share"):
        assert 0 < s[key] < 1, key
    for key in ("weenv_first_step_p50_s", "docker_first_step_p50_s"):
        assert 0 < s[key] < 120, key
    assert s["rollouts"] == 8 and s["pool"] > s["tasks"]

    rows = {r["system"]: r for r in written["table"]}
    assert set(rows) == {"weenv", "docker"}
    for r in rows.values():
        assert r["rollouts"] == 8 and r["failed"] == 0
        assert r["bytes_fetched"] > 0 and r["daemon_peak_bytes"] > 0
        assert 0 < r["exec_overhead_p50_s"] <= r["exec_overhead_p99_s"]
        assert r["env_s"] < r["rollout_wall_s"]
    # weenv fetches part of what it runs; Docker pulls whole images (the Debian layer at least)
    assert rows["weenv"]["bytes_fetched"] < rows["docker"]["bytes_fetched"]
    assert rows["docker"]["bytes_fetched"] > 50e6

    per = written["rewards"]["per_rollout"]
    assert len(per) == 8
    for r in per:
        assert r["weenv"] == r["docker"] == (1 if r["patch"] == "right" else 0), r
    assert {r["patch"] for r in per} >= {"right", "wrong"}
    for system in ("weenv", "docker"):
        for r in written["rollouts"][system]:
            assert r["first_step_s"] >= r["create_s"] > 0 and r["reward_step"]["kind"] == "reward"
            assert 10 <= len(r["steps"]) <= 12
    assert all(t["verified"]["right"]["exit_code"] == 0 for t in written["tasks"]["pool"])
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # nothing left behind: daemons, containers, containerd, mounts, cgroups
    services = written["docker_services"]
    for key in ("dockerd_pid", "registry_pid", "weenv_daemon_pid"):
        assert not alive(services[key]), key
    root = services["dockerd_root"]
    assert not Path(root).exists() and not process.pids_mentioning(root + "/")
    assert not mounts.mounts_under(Path(root)) and not mounts.mounts_under(work)
    assert not process.pids_mentioning(str(work) + "/")
