"""mini-swe-agent (the PyPI package, unchanged) on weenv through
``weenv.adapters.minisweagent.WeenvEnvironment``: its agent loop with its
deterministic test model against a real ``weenv serve``; and a small rollout
batch of it under ``weenv.meter()``, whose phases must add up to the batch's
wall time, and which ``/v1/metrics`` and ``weenv stats --tax`` show."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import httpx
import pytest
import yaml

os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
minisweagent = pytest.importorskip("minisweagent", reason="mini-swe-agent is not installed (weenv[minisweagent])")

from minisweagent.agents.default import DefaultAgent  # noqa: E402
from minisweagent.config import builtin_config_dir  # noqa: E402
from minisweagent.environments import get_environment  # noqa: E402
from minisweagent.models.test_models import DeterministicModel, make_output  # noqa: E402

import weenv  # noqa: E402
from daemon_fixture import point_sdk_at, start_daemon  # noqa: E402
from weenv.errors import InvalidInputError, NotFoundError  # noqa: E402

ENV_CLASS = "weenv.adapters.minisweagent.WeenvEnvironment"
SMALL = {"cpus": 0.5, "memory_mib": 256}


@pytest.fixture(scope="module")
def daemon(shared_store, tmp_path_factory):
    d = start_daemon(tmp_path_factory.mktemp("msa") / "home", shared_store.url)
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture
def remote(daemon, monkeypatch):
    return point_sdk_at(daemon, monkeypatch)


def config() -> dict:
    """mini-swe-agent's default config, with the environment class set to weenv's."""
    cfg = yaml.safe_load((builtin_config_dir / "default.yaml").read_text())
    cfg["environment"].update(environment_class=ENV_CLASS, template="task", **SMALL)
    return cfg


def agent(cfg: dict, commands: list[str], think_s: float = 0.0):
    """An agent whose model sends ``commands`` one step each (after ``think_s``
    seconds of "thinking": the model's ``/sleep`` action), in a new weenv environment."""
    outputs = []
    for i, cmd in enumerate(commands):
        if think_s:
            outputs.append(make_output("thinking", [{"command": f"/sleep {think_s}"}]))
        outputs.append(make_output(f"step {i}", [{"command": cmd}]))
    model = DeterministicModel(outputs=outputs, observation_template=cfg["model"]["observation_template"])
    env = get_environment(cfg["environment"])
    return DefaultAgent(model, env, **cfg["agent"]), env


def test_the_agent_loop_runs_real_commands_and_submits(remote):
    cfg = config()
    a, env = agent(
        cfg,
        [
            "cd /workspace && python3 hello.py > out.txt && echo oops >&2 && cat out.txt",
            "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat /workspace/out.txt && id -u",
        ],
    )
    remote.track(env.env_id)
    try:
        assert type(env).__module__ == "weenv.adapters.minisweagent"
        assert env.node == remote.url and env.sandbox.info.resources.cpus == 0.5
        assert env.sandbox.info.resources.memory_bytes == 256 << 20
        result = a.run("print the greeting")
        assert result["exit_status"] == "Submitted"
        assert result["submission"] == "hello from the task\n0\n"
        observation = a.messages[3]["content"]  # the first step's: stderr merged, in order
        assert "<returncode>0</returncode>" in observation and "oops\nhello from the task" in observation
        trajectory = a.serialize()
        assert trajectory["info"]["config"]["weenv_env_id"] == env.env_id
        assert trajectory["info"]["config"]["environment_type"] == ENV_CLASS
        assert env.get_template_vars()["weenv_node"] == remote.url

        out = env.execute({"command": "echo partial; sleep 30"}, timeout=1)  # as Docker's: -1 and the reason
        assert out["returncode"] == -1 and out["output"] == "partial\n" and "timed out" in out["exception_info"]
        out = env.execute({"command": "pwd; exit 3"}, cwd="/tmp")
        assert (out["output"], out["returncode"]) == ("/tmp\n", 3)
    finally:
        env.cleanup()
    assert env.sandbox is None and env.env_id not in [e.id for e in weenv.Sandbox.list()]


def test_an_unknown_template_is_a_clear_error(remote):
    cfg = config()
    cfg["environment"]["template"] = "no-such-template"
    with pytest.raises(NotFoundError, match="no-such-template"):
        get_environment(cfg["environment"])
    cfg["environment"].update(template="task", cpus=1000)
    with pytest.raises(InvalidInputError, match="cpus"):
        get_environment(cfg["environment"])


def metric(text: str, phase: str) -> float:
    m = re.search(rf'^weenv_env_seconds_total{{phase="{phase}"}} (\S+)$', text, re.M)
    assert m, text
    return float(m.group(1))


def test_a_metered_rollout_batch_adds_up_to_its_wall_time(remote):
    """Four rollouts in a row, each: create, a file up and one down, three
    steps of 0.3 s think and a command (one runs 0.4 s), submit, destroy.  The
    meter's phases + the commands' own time + the think time the model spent
    must come to the batch's wall time (measured here) within 5 %."""
    cfg = config()
    think = 0.3
    before = remote.http().get("/metrics").text
    t0 = time.monotonic()
    with weenv.meter("msa-batch") as tally:
        for i in range(4):
            a, env = agent(
                cfg,
                [
                    f"cd /workspace && python3 -c 'print({i} * 7)' > r.txt && cat input.txt",
                    "sleep 0.4; ls /workspace",
                    "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat /workspace/r.txt",
                ],
                think_s=think,
            )
            remote.track(env.env_id)
            try:
                env.sandbox.files.write("/workspace/input.txt", f"task {i}\n")
                result = a.run("rollout")
                assert env.sandbox.files.read("/workspace/r.txt") == f"{i * 7}\n"
            finally:
                env.cleanup()
            assert result["exit_status"] == "Submitted" and result["submission"] == f"{i * 7}\n"
        wall = time.monotonic() - t0  # the meter's report to the node comes after its end
    think_total = 4 * 3 * think
    assert len(tally.environments) == 4 and all(e.ended for e in tally.environments.values())
    p = tally.phases
    assert all(p[k] > 0 for k in ("create", "exec", "files", "destroy")), p
    assert abs(tally.wall_s - wall) < 0.01
    accounted = tally.env_s + tally.command_s + think_total
    assert abs(accounted - wall) <= 0.05 * wall, (accounted, wall, p, tally.command_s)
    assert abs(tally.other_s - think_total) <= 0.05 * wall, (tally.other_s, think_total)
    assert 4 * 0.4 <= tally.command_s < 4 * 0.4 + 1.0
    assert abs(tally.env_s + tally.command_s + tally.other_s - tally.rollout_s) < 1e-6
    assert 0 < tally.share < 1

    # the node's own measure (every phase grew, by at most what the client waited) ...
    after = remote.http().get("/metrics").text
    for phase in ("create", "exec", "files", "destroy"):
        grown = metric(after, phase) - metric(before, phase)
        assert 0 < grown <= p[phase] + 0.01, (phase, grown, p[phase])
    # ... and the batch the meter reported, in GET /v1/tax and weenv stats --tax
    batches = remote.http().get("/tax").json()["batches"]
    mine = [b for b in batches if b["name"] == "msa-batch"]
    assert len(mine) == 1 and mine[0]["environments"] == 4
    assert abs(mine[0]["share"] - tally.share) < 1e-6
    env = dict(os.environ, WEENV_HOME=str(remote.home), COLUMNS="250")
    env.pop("WEENV_API_URL")
    out = subprocess.run(
        [sys.executable, "-m", "weenv", "stats", "--tax"], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    row = next(line for line in out.stdout.splitlines() if "msa-batch" in line)
    assert f"{tally.share:.1%}" in row and f"{p['create']:.3f}" in row
    assert "node (all clients)" in out.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "weenv", "stats", "--tax", "some-id"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 1 and "--tax shows batches" in bad.stderr


def test_bad_tax_reports_are_refused(remote):
    with remote.http() as http:
        good = {
            "name": "x",
            "started_at": 1,
            "wall_s": 1,
            "rollout_s": 1,
            "environments": 1,
            "phases": {"create": 0.5},
            "command_s": 0,
            "other_s": 0.5,
            "share": 0.5,
        }
        for bad in ({**good, "wall_s": 1e999}, {**good, "phases": {"think": 1}}, {**good, "name": "x" * 257}):
            r = http.post("/tax", content=json.dumps(bad), headers={"content-type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["kind"] == "invalid_input", r.text
        assert http.post("/tax", json=good).status_code == 204
        r = http.post("/tax", content=b"{" * 100)
        assert r.status_code == 400
    r = httpx.post(remote.url + "/v1/tax", json={})
    assert r.status_code == 401
