"""Root inside an environment of a node with ``WEENV_USERNS=on`` is Docker's
root in a user namespace of its own: it ``chown``s, apt drops to ``_apt``,
and it still cannot reach the host.

One node for the module, its home below pytest's 0700 directories (the
environments' directories then lie under /run, :mod:`weenv.node.runtime.envs_dir`),
real runtime over the shared Debian template ``task``.  No mocks.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from weenv.config import Paths
from weenv.node.node import Node
from weenv.node.runtime import idmap
from weenv.node.runtime.bundle import AGENT_PATH, DOCKER_DEFAULT_CAPS, cap_mask
from weenv.store.file import FileStore


@pytest.fixture(scope="module")
def node(tmp_path_factory, shared_store):
    root = tmp_path_factory.mktemp("root-default")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WEENV_USERNS", "on")
        mp.setenv("WEENV_HOME", str(root / "home"))
        subprocess.run(["cp", "-al", str(shared_store.root), str(root / "store")], check=True)
        n = Node(Paths.from_env(), store=FileStore(root / "store"), pool_size=0).start()
        envs = n.snapshotter.environments
        try:
            yield n
        finally:
            n.close()
            held = [p for p in idmap.in_use().values() if str(p).startswith(str(envs))]
            with open("/proc/mounts") as f:
                left = [line.split()[1] for line in f if line.split()[1].startswith((str(root), str(envs)))]
            shutil.rmtree(root, ignore_errors=True)
            assert not held, f"ranges left held: {held}"
            assert not left, f"leaked mounts: {left}"


def run(node: Node, env_id: str, script: str) -> tuple[int, str, str]:
    r = node.exec(env_id, ["sh", "-c", script])
    return r.exit_code, r.stdout.decode(), r.stderr.decode()


def sh(node: Node, env_id: str, script: str) -> str:
    code, out, err = run(node, env_id, script)
    assert code == 0, (script, out, err)
    return out


def test_root_chowns(node):
    env = node.create("task").id
    sh(node, env, "touch /tmp/x; chown 1000:2000 /tmp/x; chmod 4755 /tmp/x")
    assert sh(node, env, "stat -c '%u %g %a' /tmp/x").strip() == "1000 2000 4755"
    host_id = idmap.range_of(node.snapshotter.dir(env))
    assert host_id is not None and host_id >= idmap.RANGE_BASE
    st = os.lstat(node.snapshotter.dir(env) / "rootfs/tmp/x")
    assert (st.st_uid, st.st_gid) == (host_id + 1000, host_id + 2000)
    status = sh(node, env, "grep ^CapEff /proc/self/status").split()[1]
    assert int(status, 16) == cap_mask(DOCKER_DEFAULT_CAPS)


def test_root_inside_cannot_act_on_the_host(node):
    """No host process to see or signal, no mount, no nested user namespace,
    no power over a host file bound in (host root's: unmapped inside)."""
    env = node.create("task").id
    me = os.getpid()
    pids = sh(node, env, "ls /proc | grep -E '^[0-9]+$'").split()
    assert all(int(p) < 100 for p in pids), pids  # its own pid namespace only
    assert run(node, env, f"kill -0 {me}")[0] != 0 and run(node, env, "kill -0 1")[0] == 0
    assert run(node, env, "mount -t tmpfs none /mnt")[0] != 0
    assert run(node, env, "mount --bind /tmp /mnt")[0] != 0
    assert run(node, env, "unshare -U true")[0] != 0
    assert run(node, env, "unshare -m true")[0] != 0
    # the exec agent is a host file bound read-only: owned by nobody inside, root cannot change it
    host = Path(node.agent.get())
    before = hashlib.sha256(host.read_bytes()).hexdigest(), os.stat(host).st_mode
    assert sh(node, env, f"stat -c %u {AGENT_PATH}").strip() == "65534"
    assert run(node, env, f"chmod 777 {AGENT_PATH}")[0] != 0
    assert run(node, env, f"chown 0 {AGENT_PATH}")[0] != 0
    assert run(node, env, f"mount -o remount,rw {AGENT_PATH}")[0] != 0
    assert run(node, env, f"echo x >> {AGENT_PATH}")[0] != 0
    assert (hashlib.sha256(host.read_bytes()).hexdigest(), os.stat(host).st_mode) == before
    # host-wide knobs stay closed
    assert run(node, env, "echo 1 > /proc/sys/kernel/sysrq")[0] != 0
    nodename = os.uname().nodename
    assert run(node, env, "hostname weenv-x")[0] != 0 and os.uname().nodename == nodename


DEB_CONTROL = (
    "Package: weenv-apt-probe\nVersion: 1.0\nArchitecture: all\n"
    "Maintainer: weenv <weenv@localhost>\nDescription: probe\n"
)


def test_apt_installs_from_a_loopback_repository_dropping_to_apt(node, tmp_path):
    """``apt-get update`` and ``install`` from a repository served inside the
    environment on its loopback: apt's fetchers drop to ``_apt`` (setgroups,
    setgid, setuid), which needs root's powers."""
    tree = tmp_path / "pkg"
    (tree / "DEBIAN").mkdir(parents=True)
    (tree / "DEBIAN/control").write_text(DEB_CONTROL)
    (tree / "opt/apt-probe").mkdir(parents=True)
    (tree / "opt/apt-probe/f").write_text("probe\n")
    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run(["dpkg-deb", "--build", str(tree), str(repo / "probe.deb")], check=True, capture_output=True)
    packages = subprocess.run(["dpkg-scanpackages", "."], cwd=repo, check=True, capture_output=True).stdout
    env = node.create("task", network=True).id
    files = node.files(env)
    files.write_file("/srv/repo/probe.deb", (repo / "probe.deb").read_bytes())
    files.write_file("/srv/repo/Packages", packages)
    files.write_file("/etc/apt/sources.list.d/loop.list", b"deb [trusted=yes] http://127.0.0.1:8080 ./\n")
    sh(
        node,
        env,
        "cd /srv/repo && (python3 -m http.server 8080 --bind 127.0.0.1 >/dev/null 2>&1 &);"
        " for i in $(seq 100); do python3 -c 'import socket; socket.create_connection((\"127.0.0.1\", 8080))'"
        " 2>/dev/null && break; sleep 0.1; done",
    )
    out = sh(node, env, "apt-get update 2>&1 && apt-get install -y weenv-apt-probe 2>&1")
    assert "setgroups" not in out and "seteuid" not in out, out
    assert (
        sh(node, env, "cat /opt/apt-probe/f; dpkg-query -W -f '${Status}' weenv-apt-probe")
        == "probe\ninstall ok installed"
    )
