"""Snapshot, fork, reset, pause and resume through a real ``weenv serve``:
weenv's HTTP API and SDK, its CLI, and the official ``e2b`` SDK (issue 16)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest

from daemon_fixture import point_sdk_at, start_daemon
from weenv import Sandbox
from weenv.errors import BusyError, InvalidInputError, NotFoundError, StateError
from weenv.store.file import FileStore

SMALL = {"cpus": 0.05, "memory_bytes": 64 << 20, "pids": 128}


@pytest.fixture(scope="module")
def daemon(shared_store, tmp_path_factory):
    root = tmp_path_factory.mktemp("fork-api")
    store = root / "store"  # a private copy: snapshots are published into it
    subprocess.run(["cp", "-al", str(shared_store.root), str(store)], check=True)
    d = start_daemon(root / "home", FileStore(store).url)
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture
def remote(daemon, monkeypatch):
    return point_sdk_at(daemon, monkeypatch)


def test_sdk_snapshot_fork_reset_pause(remote):
    with Sandbox.create("task", timeout=120, resources=SMALL, metadata={"run": "f"}) as sb:
        remote.track(sb.id)
        sb.commands.run("echo parent > /workspace/state.txt && rm /workspace/hello.py")
        snap = sb.create_snapshot("sdk-snap")
        assert snap.name == "sdk-snap" and snap.environment == sb.id
        assert "sdk-snap" in [s.name for s in Sandbox.list_snapshots()]
        kids = sb.fork(2, timeout=60)
        assert all(isinstance(k, Sandbox) for k in kids), kids
        remote.track(*(k.id for k in kids))
        for i, k in enumerate(kids):
            assert k.info.metadata == {"run": "f"}
            assert k.commands.run("cat /workspace/state.txt; ls /workspace").stdout == "parent\nbig.bin\nstate.txt\n"
            k.commands.run(f"echo {i} > /workspace/state.txt")
        assert [k.files.read("/workspace/state.txt") for k in kids] == ["0\n", "1\n"]
        for k in kids:
            k.kill()
        with pytest.raises(InvalidInputError):
            sb.fork(0)
        sb.commands.run("echo episode > /workspace/state.txt")
        sb.reset("sdk-snap")
        assert sb.files.read("/workspace/state.txt") == "parent\n"
        sb.reset()
        assert not sb.files.exists("/workspace/state.txt") and sb.files.exists("/workspace/hello.py")
        sb.pause()
        assert sb.info.state == "paused"
        with remote.http() as c:
            assert "weenv_environments_paused 1.0" in c.get("/metrics").text
            assert [e["state"] for e in c.get("/environments").json() if e["id"] == sb.id] == ["paused"]
        with pytest.raises(StateError):
            sb.commands.run("true")
        with pytest.raises(StateError):
            sb.pause()
        sb.resume(timeout=100)
        assert sb.commands.run("echo up").stdout == "up\n"
        with pytest.raises(StateError):
            sb.resume()
        sb.commands.run("echo kept > /workspace/kept.txt && sleep 1000 &")
        sb.pause(release_memory=True)  # the processes end, the files stay
        assert sb.info.state == "paused" and sb.info.memory_released
        sb.resume(timeout=100)
        assert not sb.info.memory_released and sb.files.read("/workspace/kept.txt") == "kept\n"
        assert sb.commands.run("pgrep -x sleep || echo none").stdout == "none\n"
        with Sandbox.create("sdk-snap", timeout=60, resources=SMALL) as fresh:
            remote.track(fresh.id)
            assert fresh.files.read("/workspace/state.txt") == "parent\n"
        assert Sandbox.delete_snapshot("sdk-snap") is True
        assert Sandbox.delete_snapshot("sdk-snap") is False
        with pytest.raises(NotFoundError):
            sb.reset("sdk-snap")  # gone from the node too


def test_a_snapshot_or_e2b_template_never_repoints_a_name_it_does_not_own(remote):
    """A snapshot named like the store's built template ``task``, or like another
    environment's snapshot, and an E2B template build of either name, are
    refused (409) and move no ref; an environment re-takes its own snapshot's name."""
    with (
        remote.http() as c,
        Sandbox.create("task", timeout=120, resources=SMALL) as a,
        Sandbox.create("task", timeout=120, resources=SMALL) as b,
    ):
        remote.track(a.id, b.id)

        def digest(name: str) -> str:
            return c.get(f"/templates/{name}").json()["digest"]

        task = digest("task")
        with pytest.raises(BusyError, match="not a snapshot"):
            a.create_snapshot("task")
        a.files.write("/workspace/own.txt", "a1\n")
        a.create_snapshot("owned")
        a.files.write("/workspace/own.txt", "a2\n")
        assert a.create_snapshot("owned").environment == a.id  # its own snapshot's name: moved
        owned = digest("owned")
        with pytest.raises(BusyError, match=f"of environment '{a.id}'"):
            b.create_snapshot("owned")
        r = c.post(f"/environments/{b.id}/snapshots", json={"name": "task"})
        assert r.status_code == 409 and r.json()["error"]["kind"] == "busy", r.text
        with httpx.Client(base_url=remote.url + "/e2b", headers={"X-API-Key": "e2b_" + remote.key}) as e2b:
            r = e2b.post(f"/sandboxes/{b.id}/snapshots", json={"name": "owned"})
            assert r.status_code == 409, r.text
            for name in ("task", "owned"):  # an E2B template build under a store template's name
                r = e2b.post("/v3/templates", json={"name": name, "cpuCount": 1, "memoryMB": 512})
                assert r.status_code == 409 and "takes a name of its own" in r.json()["message"], r.text
            assert not [t for t in e2b.get("/templates").json() if t["names"] in (["task"], ["owned"])]
            free = [
                e2b.post("/v3/templates", json={"name": "e2b-own", "cpuCount": 1, "memoryMB": 512}) for _ in range(2)
            ]  # a free name, then its own template's again
            assert [r.status_code for r in free] == [202, 202], [r.text for r in free]
            assert free[0].json()["templateID"] == free[1].json()["templateID"]
            assert e2b.delete(f"/templates/{free[0].json()['templateID']}").status_code == 204
        assert (digest("task"), digest("owned")) == (task, owned)
        with Sandbox.create("owned", timeout=60, resources=SMALL) as fresh:
            remote.track(fresh.id)
            assert fresh.files.read("/workspace/own.txt") == "a2\n"
    Sandbox.delete_snapshot("owned")


def test_cli_pause_resume_fork_snapshot_reset(remote):
    env = dict(os.environ, WEENV_HOME=str(remote.home))

    def weenv(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "weenv", *args], capture_output=True, text=True, env=env, timeout=120
        )

    with Sandbox.create("task", timeout=120, resources=SMALL) as sb:
        remote.track(sb.id)
        sb.commands.run("echo cli > /workspace/c.txt")
        r = weenv("snapshot", sb.id, "--name", "cli-snap")
        assert r.returncode == 0 and r.stdout.strip() == "cli-snap", r.stderr
        r = weenv("fork", sb.id, "--count", "2")
        assert r.returncode == 0, r.stderr
        kids = r.stdout.split()
        assert len(kids) == 2
        remote.track(*kids)
        for k in kids:
            assert Sandbox.connect(k).files.read("/workspace/c.txt") == "cli\n"
            assert weenv("rm", k).returncode == 0
        assert weenv("pause", sb.id).returncode == 0
        assert sb.get_info().state == "paused"
        r = weenv("pause", sb.id)
        assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1 and "paused" in r.stderr
        assert weenv("resume", sb.id).returncode == 0
        assert weenv("pause", sb.id, "--release-memory").returncode == 0
        assert sb.get_info().memory_released
        assert weenv("resume", sb.id).returncode == 0 and sb.files.read("/workspace/c.txt") == "cli\n"
        sb.commands.run("rm /workspace/c.txt")
        assert weenv("reset", sb.id, "--snapshot", "cli-snap").returncode == 0
        assert sb.files.read("/workspace/c.txt") == "cli\n"
        r = weenv("fork", sb.id, "--count", "0")
        assert r.returncode != 0 and "count" in r.stderr and len(r.stderr.strip().splitlines()) == 1
        Sandbox.delete_snapshot("cli-snap")


def test_e2b_sdk_pause_connect_fork_snapshot(daemon, monkeypatch):
    e2b = pytest.importorskip("e2b")
    monkeypatch.setenv("E2B_API_URL", daemon.url + "/e2b")
    monkeypatch.setenv("E2B_SANDBOX_URL", daemon.url + "/e2b/envd")
    monkeypatch.setenv("E2B_API_KEY", "e2b_" + daemon.key)
    sbx = e2b.Sandbox.create("task", timeout=120)
    daemon.track(sbx.sandbox_id)
    try:
        sbx.files.write("/workspace/e.txt", "e2b\n")
        p = sbx.commands.run("sleep 600", background=True)
        assert sbx.pause() is True
        assert sbx.pause() is False  # already paused: E2B's 409
        listed = {s.sandbox_id: s.state for s in e2b.Sandbox.list().next_items()}
        assert str(listed[sbx.sandbox_id]).lower().endswith("paused")
        again = e2b.Sandbox.connect(sbx.sandbox_id)  # resumes
        assert again.commands.run("cat /workspace/e.txt").stdout == "e2b\n"
        assert p.pid in [q.pid for q in again.commands.list()]  # the same process, kept across the pause
        snap = sbx.create_snapshot()
        assert snap.snapshot_id.startswith("snapshot-")
        assert snap.snapshot_id in [s.snapshot_id for s in e2b.Sandbox.list_snapshots().next_items()]
        from_snap = e2b.Sandbox.create(snap.snapshot_id, timeout=60)
        daemon.track(from_snap.sandbox_id)
        assert from_snap.files.read("/workspace/e.txt") == "e2b\n"
        from_snap.kill()
        kids = sbx.fork(count=2, timeout=60)
        assert all(isinstance(k, e2b.Sandbox) for k in kids), kids
        daemon.track(*(k.sandbox_id for k in kids))
        for k in kids:
            assert k.files.read("/workspace/e.txt") == "e2b\n"
            k.kill()
        assert e2b.Sandbox.delete_snapshot(snap.snapshot_id) is True
        assert e2b.Sandbox.delete_snapshot(snap.snapshot_id) is False
    finally:
        sbx.kill()
    time.sleep(0)
