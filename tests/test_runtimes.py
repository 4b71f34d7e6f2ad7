"""One behaviour suite for the node's OCI runtimes: every test runs against
runc and crun (:mod:`weenv.node.runtime.runtime`), through a real node; no mocks.

What a runtime does for weenv: create and start (also apart: the warm pool's
create, then start), exec (the exec agent's start pipe, and the runtime's own
``exec`` as the fallback), kill, delete, state, pause and resume through the
freezer, a user-namespace (sudo) environment, an environment with network,
and the adoption of running containers by a node restarted with the other
runtime.  The runtime-level commands (exec failures, isolation, cgroup
limits, delete of a frozen container...) run against both in test_runtime.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from weenv.api.models import CreateRequest
from weenv.errors import InvalidInputError, RuntimeFailedError, ToolMissingError
from weenv.node.node import Node
from weenv.node.runtime import idmap
from weenv.node.runtime.runtime import RUNTIME_FILE, NodeRuntime, choose_runtime, crun_refusal, runtime_setting

sys.path.insert(0, str(Path(__file__).parent))

RUNTIMES = ["runc", "crun"]


def need(runtime: str) -> None:
    if runtime == "crun" and (why := crun_refusal()) is not None:
        pytest.skip(f"crun cannot run here: {why}")


@pytest.fixture(params=RUNTIMES)
def runtime(request) -> str:
    need(request.param)
    return request.param


@pytest.fixture
def rnode(runtime, paths, shared_store, leak_check):
    n = Node(paths, store=shared_store, runtime=runtime, pool_size=0).start()
    try:
        yield n
    finally:
        n.close()
        assert _containers(paths) == {}


def _containers(paths) -> dict[str, tuple[str, str]]:
    """Container id -> (runtime, status) of every container in the home, asked of each runtime's binary."""
    found = {}
    for name, root in paths.runtime_roots.items():
        if not root.is_dir():
            continue
        out = subprocess.run(
            [name, "--root", str(root), "list", "--format", "json"], capture_output=True, text=True, check=True
        ).stdout
        found |= {c["id"]: (name, c["status"]) for c in json.loads(out.strip() or "null") or []}
    return found


def test_the_node_says_which_runtime_it_uses_and_each_bundle_records_it(rnode, runtime, paths):
    info = rnode.create("task")
    assert rnode.stats().runtime == runtime == rnode.runtime.name
    assert _containers(paths) == {f"weenv-{info.id}": (runtime, "running")}
    assert (paths.environments / info.id / "bundle" / RUNTIME_FILE).read_text() == runtime
    rnode.destroy(info.id)
    assert _containers(paths) == {}
    assert not [c for c in Path("/sys/fs/cgroup").glob(f"*/weenv-{info.id}") if c.is_dir()]


def test_exec_through_the_agent_and_through_the_runtime(rnode):
    info = rnode.create("task")
    r = rnode.exec(info.id, "hostname; pwd; python3 hello.py")
    assert r.stdout == f"weenv-{info.id}\n/workspace\nhello from the task\n".encode()
    assert rnode.exec_counts["agent"] >= 1
    # the runtime's own exec (the fallback when the agent is gone), with its failures
    e = rnode.table.get(info.id)
    res = rnode.runtime.exec(e.container_id, ["cat", "/proc/self/status"])
    status = dict(line.split(":\t", 1) for line in res.stdout.decode().splitlines())
    # noNewPrivileges only outside a user namespace (in one, setuid sudo works as under Docker)
    userns = idmap.range_of(rnode.snapshotter.dir(info.id)) is not None
    assert status["NoNewPrivs"].strip() == ("0" if userns else "1") and status["Seccomp"].strip() == "2"
    assert rnode.runtime.exec(e.container_id, ["no-such-command"]).exit_code == 127
    assert rnode.runtime.exec(e.container_id, ["/etc/passwd"]).exit_code == 126
    assert rnode.runtime.exec(e.container_id, ["true"], cwd="/no/such/dir").exit_code == 126
    rnode.destroy(info.id)


def test_state_kill_and_delete(rnode):
    info = rnode.create("task")
    cid = rnode.table.get(info.id).container_id
    st = rnode.runtime.state(cid)
    assert st["status"] == "running" and st["pid"] > 0 and st["id"] == cid
    rnode.runtime.kill(cid, "KILL")
    deadline = time.monotonic() + 10
    while rnode.runtime.state(cid)["status"] != "stopped":
        assert time.monotonic() < deadline, "the container did not stop after kill"
        time.sleep(0.02)
    rnode.destroy(info.id)
    assert rnode.runtime.state(cid) is None


def test_pause_and_resume_through_the_freezer(rnode):
    info = rnode.create("task")
    cid = rnode.table.get(info.id).container_id
    rnode.exec(info.id, "echo before > /tmp/x")
    assert rnode.pause(info.id).state == "paused"
    assert rnode.runtime.state(cid)["status"] == "paused"
    assert rnode.resume(info.id).state == "running"
    assert rnode.runtime.state(cid)["status"] == "running"
    assert rnode.exec(info.id, "cat /tmp/x").stdout == b"before\n"
    rnode.destroy(info.id)


def test_the_warm_pool_creates_then_starts(runtime, paths, shared_store, leak_check):
    with Node(paths, store=shared_store, runtime=runtime, pool_size=1) as node:
        for _ in range(2):
            node.destroy(node.create("task").id)
        deadline = time.monotonic() + 30
        while node.pool.stats().ready < 1:
            assert time.monotonic() < deadline, "the pool did not fill"
            time.sleep(0.05)
        ((cid, (made_by, status)),) = _containers(paths).items()
        assert (made_by, status) == (runtime, "created")
        info = node.create("task")
        assert info.timing.pooled and cid == f"weenv-{info.id}"
        assert _containers(paths)[cid] == (runtime, "running")
        assert node.exec(info.id, "python3 hello.py").stdout == b"hello from the task\n"
        node.destroy(info.id)
    assert _containers(paths) == {}


def test_an_environment_with_network(rnode):
    info = rnode.create(CreateRequest(template="task", network=True))
    r = rnode.exec(info.id, "cat /proc/net/dev")
    names = [line.split(":")[0].strip() for line in r.stdout.decode().splitlines()[2:]]
    assert "lo" in names and len(names) >= 2  # its own veth beside lo
    rnode.destroy(info.id)


def test_a_sudo_environment_in_its_own_user_namespace(runtime, shared_store, debian_root, monkeypatch, leak_check):
    import shutil
    import tempfile

    from test_userns import sudo_layer
    from weenv.config import Paths
    from weenv.formats.manifest import RuntimeConfig
    from weenv.packaging.group import build_group
    from weenv.packaging.template import create_template
    from weenv.store.file import FileStore

    top = Path(tempfile.mkdtemp(prefix="weenv-sudo-"))  # searchable by others, as a sudo rootfs's parents must be
    top.chmod(0o711)
    monkeypatch.setenv("WEENV_HOME", str(top / "home"))
    paths = Paths.from_env()
    root = top / "store"
    subprocess.run(["cp", "-al", str(shared_store.root), str(root)], check=True)
    store = FileStore(root)
    build_group(sudo_layer(debian_root), store, name="sudo-layer")
    create_template(
        store, "sudo", ["base", "sudo-layer"], runtime=RuntimeConfig(user="1000:1000", working_dir="/", sudo=True)
    )
    with Node(paths, store=store, runtime=runtime, pool_size=0) as node:
        info = node.create("sudo")
        r = node.exec(info.id, "id -u; sudo id -u; sudo touch /root/made-by-root && echo ok")
        assert r.stdout == b"1000\n0\nok\n", r.stderr
        host_uid = int(
            subprocess.run(
                ["stat", "-c", "%u", f"/proc/{node.runtime.state(node.table.get(info.id).container_id)['pid']}"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
        )
        assert host_uid != 0  # root inside is not root outside
        node.destroy(info.id)
    assert _containers(paths) == {}
    shutil.rmtree(top)


# --- choosing the runtime ------------------------------------------------------------------
def test_the_setting_and_the_choice(monkeypatch):
    monkeypatch.delenv("WEENV_RUNTIME", raising=False)
    assert runtime_setting() in ("auto", "crun", "runc")
    monkeypatch.setenv("WEENV_RUNTIME", "crun")
    assert runtime_setting() == "crun"
    monkeypatch.setenv("WEENV_RUNTIME", "docker")
    with pytest.raises(InvalidInputError, match="WEENV_RUNTIME='docker'"):
        runtime_setting()
    assert choose_runtime("runc") == ("runc", None)
    # crun missing: auto falls back to runc saying why; crun refuses in one line
    assert choose_runtime("auto", crun_binary="/no/such/crun") == (
        "runc",
        "no '/no/such/crun' on PATH (Debian: apt-get install crun)",
    )
    with pytest.raises(ToolMissingError) as err:
        choose_runtime("crun", crun_binary="/no/such/crun")
    assert "\n" not in str(err.value) and "/no/such/crun" in str(err.value)
    with pytest.raises(ToolMissingError, match="did not answer as crun"):
        choose_runtime("crun", crun_binary="/bin/false")
    if crun_refusal() is None:
        assert choose_runtime("auto") == ("crun", None)


def test_a_node_told_to_use_a_crun_that_cannot_run_refuses_to_start(paths, shared_store, caplog):
    with pytest.raises(ToolMissingError, match="WEENV_RUNTIME=crun but crun cannot run here"):
        NodeRuntime.for_setting("crun", paths.runtime_roots, crun_binary="/no/such/crun")
    with caplog.at_level("WARNING", logger="weenv.node.runtime.runtime"):
        r = NodeRuntime.for_setting("auto", paths.runtime_roots, crun_binary="/no/such/crun")
    assert r.name == "runc"
    warned = [m for m in caplog.messages if "OCI runtime: runc" in m]
    assert len(warned) == 1 and "\n" not in warned[0]


@pytest.mark.parametrize("first,second", [("runc", "crun"), ("crun", "runc")])
def test_a_node_restarted_with_the_other_runtime_adopts_through_the_one_that_made_them(
    first, second, tmp_path, shared_store, paths, monkeypatch, leak_check
):
    """A daemon killed and started again with the other runtime adopts the
    running environment through the runtime that made it (commands, reset,
    destroy); its new environments are made by the new runtime."""
    need("crun")
    from weenv.server import daemon
    from weenv_bench.services.process import alive

    monkeypatch.setenv("WEENV_STORE", shared_store.url)
    p = type(paths).from_env()
    p.run.mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("WEENV_RUNTIME", first)
    pids = []
    try:
        pids.append(daemon.start_background(p))
        client = daemon.connect(p, autostart=False)
        old = client.create("task").id
        client.exec(old, "echo kept > /workspace/kept.txt")
        assert _containers(p) == {f"weenv-{old}": (first, "running")}
        pid = int(p.pidfile.read_text())
        import os
        import signal

        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while alive(pid):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        client.close()
        monkeypatch.setenv("WEENV_RUNTIME", second)
        pids.append(daemon.start_background(p))
        client = daemon.connect(p, autostart=False)
        said = [line for line in p.daemon_log.read_text().splitlines() if line.startswith("weenv: OCI runtime")]
        assert said == [f"weenv: OCI runtime {first}", f"weenv: OCI runtime {second}"]  # the startup log
        assert client.exec(old, "cat /workspace/kept.txt").stdout == b"kept\n"
        new = client.create("task").id
        assert _containers(p) == {f"weenv-{old}": (first, "running"), f"weenv-{new}": (second, "running")}
        client.reset(old)
        assert client.exec(old, "cat /workspace/hello.py").exit_code == 0
        client.destroy(old)
        client.destroy(new)
        assert _containers(p) == {}
        for env_id in (old, new):
            assert not [c for c in Path("/sys/fs/cgroup").glob(f"*/weenv-{env_id}*") if c.is_dir()]
        client.close()
    finally:
        daemon.stop(p)


def _runtime_leftovers(paths, runtime: str) -> dict:
    """What the node's runtime left in its home: state directories in its root and
    processes naming the home (a ``crun create`` or ``runc init`` waiting)."""
    root = paths.runtime_roots[runtime]
    own = str(os.getpid())
    procs = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if pid != own and str(paths.home) in cmdline:
            procs.append(cmdline)
    return {"state": sorted(p.name for p in root.iterdir()) if root.is_dir() else [], "processes": procs}


def test_a_pooled_container_whose_process_was_killed_is_removed_and_the_create_made_anew(
    runtime, paths, shared_store, leak_check
):
    """The warm pool's container, made ahead by the runtime's ``create``, has
    its waiting first process killed (as by the OOM killer or an operator):
    the create that takes it fails to start it, removes it and creates its
    environment anew; the node closed after (another one made ahead by then
    or under way) leaves no container, state directory or runtime process."""
    with Node(paths, store=shared_store, runtime=runtime, pool_size=1) as node:
        for _ in range(2):
            node.destroy(node.create("task").id)
        deadline = time.monotonic() + 30
        while node.pool.stats().ready < 1:
            assert time.monotonic() < deadline, "the pool did not fill"
            time.sleep(0.05)
        ((cid, made),) = _containers(paths).items()
        assert made == (runtime, "created")
        killed = node.runtime.state(cid)["pid"]
        os.kill(killed, signal.SIGKILL)
        info = node.create("task")
        assert not info.timing.pooled and node.pool.stats().hits == 0
        st = node.runtime.state(cid)  # its id, made anew: another first process, running
        assert cid == f"weenv-{info.id}" and st["pid"] != killed and st["status"] == "running"
        assert node.exec(info.id, "python3 hello.py").stdout == b"hello from the task\n"
        node.destroy(info.id)
    assert _containers(paths) == {}
    assert _runtime_leftovers(paths, runtime) == {"state": [], "processes": []}


def test_the_runtime_killed_as_it_creates_leaves_nothing_after_recovery(
    runtime, paths, shared_store, leak_check, tmp_path
):
    """The runtime's ``run`` is killed (SIGKILL) once it has made the container,
    before it answers: the create fails saying so and removes that container;
    a node started again on the home finds nothing to adopt, and nothing is left."""
    real = shutil.which(runtime)
    killed = tmp_path / f"killed-{runtime}"
    killed.write_text(f'#!/bin/sh\ncase " $* " in *" run "*) "{real}" "$@"; kill -KILL $$;; esac\nexec "{real}" "$@"\n')
    killed.chmod(0o755)
    with Node(paths, store=shared_store, runtime=runtime, pool_size=0) as node:
        node.runtime.binary = str(killed)
        with pytest.raises(RuntimeFailedError, match=rf"^{runtime} run --detach weenv-\w+ was killed by SIGKILL"):
            node.create("task")
        node.runtime.binary = real
        assert _containers(paths) == {}
    with Node(paths, store=shared_store, runtime=runtime, pool_size=0) as node:
        assert node.list() == []
    assert _containers(paths) == {}
    assert _runtime_leftovers(paths, runtime) == {"state": [], "processes": []}
