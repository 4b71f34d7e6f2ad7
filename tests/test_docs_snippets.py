"""The code the README and the docs show, run as they show it: the Python SDK's
quick start and the same with the official ``e2b`` SDK (``docs/snippets/``), each
as a script of its own against a real ``weenv serve`` whose store holds template
``my-task`` (the first-hour guide's: the Debian base and a task group)."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from daemon_fixture import start_daemon
from weenv.formats.manifest import Resources, RuntimeConfig
from weenv.packaging.template import create_template
from weenv.store.file import FileStore

SNIPPETS = Path(__file__).resolve().parents[1] / "docs" / "snippets"
EXPECTED = "42\n\nattempt 1\n\n" + repr([f"attempt 1\nrollout {i}\n" for i in range(8)]) + "\n"
"""What both quick starts print: the command's output, the file read back, and
each of the 8 forked children's own version of the file."""


@pytest.fixture(scope="module")
def daemon(shared_store, tmp_path_factory):
    root = tmp_path_factory.mktemp("docs-snippets")
    store = root / "store"  # a private copy: my-task is published into it
    subprocess.run(["cp", "-al", str(shared_store.root), str(store)], check=True)
    small = Resources(cpus=0.1, memory_bytes=128 << 20, pids=256)  # 9 environments on any test machine
    create_template(
        FileStore(store), "my-task", ["base", "task"], runtime=RuntimeConfig(working_dir="/workspace", resources=small)
    )
    d = start_daemon(root / "home", FileStore(store).url)
    try:
        yield d
    finally:
        d.stop()


def run_snippet(name: str, daemon, **env: str) -> str:
    """Run ``docs/snippets/NAME`` as a script with ``env`` added; its stdout."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("WEENV_API_", "E2B_"))} | env
    r = subprocess.run(
        [sys.executable, str(SNIPPETS / name)],
        env=environ,
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert r.returncode == 0, f"{name} exited {r.returncode}:\n{r.stderr}\n{daemon.log()}"
    with daemon.http() as c:
        assert c.get("/environments").json() == [], "the snippet left environments"
    return r.stdout


def test_sdk_quickstart(daemon):
    out = run_snippet("sdk_quickstart.py", daemon, WEENV_API_URL=daemon.url, WEENV_API_KEY=daemon.key)
    assert out == EXPECTED


def test_e2b_quickstart(daemon):
    pytest.importorskip("e2b")
    out = run_snippet(
        "e2b_quickstart.py",
        daemon,
        E2B_API_URL=daemon.url + "/e2b",
        E2B_SANDBOX_URL=daemon.url + "/e2b/envd",
        E2B_API_KEY="e2b_" + daemon.key,
    )
    assert out == EXPECTED


def test_tree_search(daemon):
    out = run_snippet("tree_search.py", daemon, WEENV_API_URL=daemon.url, WEENV_API_KEY=daemon.key)
    assert out == "def f(x):\n    return x * x\ndef f(x):\n    return x\n"
    with daemon.http() as c:
        assert "my-task-ready" not in [s["name"] for s in c.get("/snapshots").json()]


def test_snapshot_group(daemon):
    out = run_snippet("snapshot_group.py", daemon, WEENV_API_URL=daemon.url, WEENV_API_KEY=daemon.key)
    assert out == "{'set up once\\n'}\n"


def test_rl_groups(daemon):
    out = run_snippet("rl_groups.py", daemon, WEENV_API_URL=daemon.url, WEENV_API_KEY=daemon.key)
    assert out == "0 True {'installed once\\n'}\n1 False {'installed once\\n'}\nTrue\n"
    with daemon.http() as c:
        assert not [s["name"] for s in c.get("/snapshots").json() if s["name"].startswith("my-task-state-")]


def test_environment_tax(daemon):
    out = run_snippet("environment_tax.py", daemon, WEENV_API_URL=daemon.url, WEENV_API_KEY=daemon.key)
    share, phases = out.splitlines()
    assert re.fullmatch(r"environment share \d+\.\d% of \d+\.\d s", share), share
    assert 0 < float(share.split()[2].rstrip("%")) < 100
    assert {"create", "exec", "destroy"} <= set(ast.literal_eval(phases)), phases
    with daemon.http() as c:
        assert c.get("/tax").json(), "the meter posted no batch to the node"
