"""NeMo Gym (PyPI ``nemo-gym``, unchanged) on weenv: its sandbox provider
contract through ``weenv.adapters.nemo.WeenvProvider``, loaded from the
``nemo_gym.sandbox_providers`` entry point, against a real ``weenv serve``.

NeMo Gym needs Python >= 3.12, so the contract runs in its own venv
(``$WEENV_NEMO_VENV``, default ``/work/venvs/nemo``, made by scripts/setup.sh)
as a subprocess (``tests/nemo_contract.py``), with this checkout's ``src``
first on its path; the test is skipped only when that venv is absent."""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import subprocess
from pathlib import Path

import pytest

from daemon_fixture import start_daemon
from weenv.sdk._async import AsyncCommands

HERE = Path(__file__).resolve().parent
VENV = Path(os.environ.get("WEENV_NEMO_VENV", "/work/venvs/nemo"))
PYTHON = VENV / "bin" / "python"

pytestmark = pytest.mark.skipif(not PYTHON.exists(), reason=f"no NeMo Gym venv at {VENV} (scripts/setup.sh makes it)")


@pytest.fixture(scope="module")
def daemon(shared_store, tmp_path_factory):
    d = start_daemon(tmp_path_factory.mktemp("nemo") / "home", shared_store.url)
    try:
        yield d
    finally:
        d.stop()


def test_nemo_gyms_provider_contract_runs_in_weenv_environments(daemon):
    env = dict(os.environ, WEENV_API_URL=daemon.url, WEENV_API_KEY=daemon.key, PYTHONPATH=str(HERE.parent / "src"))
    out = subprocess.run(
        [str(PYTHON), str(HERE / "nemo_contract.py"), "task"], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-4000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    daemon.track(seen["id"])
    assert "weenv" in seen["providers"] and seen["class"] == "weenv.adapters.nemo"
    assert seen["node"] == daemon.url
    assert seen["info"] == {
        "cpus": 0.5,
        "memory": 256 << 20,
        "priority": 5,
        "metadata": {"run": "contract"},
        "timeout_s": 120.0,
    }
    assert seen["status"] == "running"
    assert seen["exec"] == ["/work/run\nsolve me7\n", "err\n", 3, None]  # workdir, spec.files, spec.env
    assert seen["exec_env"] == ["y\n0\n", 0]
    stdout, code, error_type = seen["timeout"]
    assert (stdout, code, error_type) == ("partial\n", 137, "timeout")
    if "user" in inspect.signature(AsyncCommands.run).parameters:
        assert seen["user"] == ["nobody\n", 0, None]
    else:  # no per-command users in this SDK: refused, clearly
        assert seen["user"][1:] == [125, "sandbox"] and "template's user" in seen["user"][0]
    assert seen["uploaded"] == hashlib.sha256(bytes(range(256)) * 4096).hexdigest()[:16]
    assert seen["round_trip"] is True
    assert seen["after_stop"] == "stopped" and seen["listed_after_stop"] is False
    tally = seen["tally"]
    assert tally["environments"] == 1 and tally["command_s"] >= 1.0  # the 1 s timeout ran in the command
    assert all(tally["phases"][p] > 0 for p in ("create", "exec", "files", "destroy")), tally
    name, message, cause = seen["missing"]
    assert name == "SandboxCreateError" and "no-such-template" in message and cause == "NotFoundError"
    assert "GPU" in seen["gpu"]
    assert seen["sync"] == {"stdout": "sync\n", "code": 0, "status": "running"}
    with daemon.http() as http:
        assert http.get("/environments").json() == []
        assert any(b["name"] == "nemo-batch" for b in http.get("/tax").json()["batches"])
