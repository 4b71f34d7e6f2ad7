"""``weenv bench rollout --setup``: the group and create systems over two
iterations against real ``weenv serve`` daemons (Docker left out: its
per-rollout path is the create one's through ``docker exec``), with a small
real setup instead of the benchmark's pip installs; the summary's shape, the
setup paid once, the rollouts isolated from each other; bad settings refused."""

from __future__ import annotations

import subprocess

import pytest
from typer.testing import CliRunner

from daemon_fixture import CACHE
from weenv.errors import InvalidInputError
from weenv.formats.manifest import Resources, RuntimeConfig
from weenv.packaging.template import create_template
from weenv.store.file import FileStore
from weenv_bench.rollout import run, setup_run
from weenv_bench.rollout.trajectory import Step, Trajectory
from weenv_bench.services.process import alive

SETUP = [
    "echo ready > /workspace/setup.txt",
    'python3 -c \'import json; json.dump({"state": 1}, open("/workspace/state.json", "w"))\'',
]
REWARD = "test -f /workspace/state.json && test -f /workspace/fixed"
"""Reward 1 only with the setup's file and the rollout's own fix (a sibling's does not count)."""


def trajectory(rollout: int, patch: str) -> Trajectory:
    # the first rollout thinks a while: it takes the group's first sandbox and is destroyed last
    steps = [Step("read", "cat /workspace/setup.txt", 0.0), Step("list", "ls /workspace", 1.0 if rollout == 0 else 0.0)]
    steps.append(Step("patch", "echo fix > /workspace/fixed" if patch == "right" else "echo no > /workspace/n", 0.0))
    return Trajectory("t", rollout, patch, tuple(steps), REWARD)


@pytest.fixture(scope="module")
def ran(shared_store, tmp_path_factory):
    """Group and create, 2 iterations of G=2 (one right, one wrong rollout), 2 at once."""
    root = tmp_path_factory.mktemp("rollout-setup")
    store = root / "store"
    subprocess.run(["cp", "-al", str(shared_store.root), str(store)], check=True)
    small = Resources(cpus=0.25, memory_bytes=256 << 20, pids=128)
    create_template(
        FileStore(store), "setup-t", ["base", "task"], runtime=RuntimeConfig(working_dir="/workspace", resources=small)
    )
    batch = [trajectory(0, "right"), trajectory(1, "wrong")]
    services: dict = {}
    results, paid = setup_run.run_iterations(
        ("group", "create"),
        [batch, batch],
        2,
        group=2,
        work=root,
        cache=CACHE,
        store_url=FileStore(store).url,
        templates={"t": "setup-t"},
        commands={"t": SETUP},
        resources=small,
        services=services,
        log=lambda _m: None,
    )
    return results, paid, services


def test_the_summary_has_the_issue_s_keys_per_system_and_iteration(ran):
    results, paid, services = ran
    summary, rows, rewards = setup_run.summarize(results, paid)
    assert set(setup_run.SUMMARY_KEYS) <= set(summary)
    assert 0 < summary["group_env_share"] < 1 and 0 < summary["create_env_share"] < 1
    assert summary["docker_env_share"] is None
    for key in ("env_share_by_iteration", "setup_s_per_rollout"):
        assert set(summary[key]) == {"group", "create"} and all(len(v) == 2 for v in summary[key].values()), key
    for key in ("exec_overhead_p50_s", "exec_overhead_p99_s"):
        assert set(summary[key]) == {"group", "create"} and all(v > 0 for v in summary[key].values()), key
    assert summary["exec_overhead_p50_s"]["group"] <= summary["exec_overhead_p99_s"]["group"]
    assert summary["rewards_match"] is True and summary["rewards_correct"] is True
    assert [(r["system"], r["iteration"]) for r in rows] == [("group", 1), ("group", 2), ("create", 1), ("create", 2)]
    assert all(r["rollouts"] == 2 and r["failed"] == 0 for r in rows), [
        r.error for its in results.values() for it in its for r in it.rollouts
    ]
    assert len(rewards["per_iteration"]) == 2
    text = setup_run.tables(rows)
    assert "iteration 2:" in text and "weenv group" in text and "setup paid per rollout" in text
    for key in ("weenv_group_daemon_pid", "weenv_create_daemon_pid"):
        assert not alive(services[key]), key


def test_the_group_pays_the_setup_once_and_create_every_rollout(ran):
    results, paid, _ = ran
    assert paid["group"][0] > 0 and paid["group"][1] == 0
    assert all(x > 0 for x in paid["create"])
    for it in results["create"]:
        assert all(r.setup_s > 0 for r in it.rollouts)
    # the second iteration's groups fork the stored state: no rollout waits for a setup
    assert all(r.setup_s == 0 for r in results["group"][1].rollouts)
    for name, its in results.items():
        for it in its:
            by = {r.rollout: r for r in it.rollouts}
            assert (by[0].reward, by[1].reward) == (1, 0), name  # the right one's fix is not its sibling's
            assert all(r.steps[0].exit_code == 0 for r in it.rollouts), name  # the setup's file is there


def test_the_plot_names_each_system_and_iteration(ran, tmp_path):
    from weenv_bench.rollout import report

    summary, rows, _ = setup_run.summarize(*ran[:2])
    summary.update(tasks=1, group=2, rollouts=2, concurrency=2, think_scale=0.0)
    report.plot({"table": rows, "summary": summary}, tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_systems_are_refused_before_any_work(tmp_path):
    with pytest.raises(InvalidInputError, match="group, create, docker"):
        run(setup=True, systems=("weenv",), work=tmp_path)
    with pytest.raises(InvalidInputError, match="weenv, docker"):
        run(systems=("group",), work=tmp_path)
    with pytest.raises(InvalidInputError):
        run(setup=True, systems=("group", "group"), work=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_the_cli_has_the_option():
    from weenv_bench.cli import bench_app

    out = CliRunner().invoke(bench_app, ["rollout", "--help"], env={"COLUMNS": "200"})
    assert out.exit_code == 0 and "--setup" in out.output and "--systems" in out.output
