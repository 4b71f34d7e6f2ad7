"""Root inside an environment is Docker's root, in a user namespace of its own
(``WEENV_USERNS=on``): Docker's default capabilities, nothing more, every file
it makes owned on the host by the environment's host id range; and snapshot,
fork and reset of such environments keep owners and modes exactly.

Real runc over the shared Debian template ``task``, a node whose home lies
below a directory others may search (0711, as every parent of a
user-namespace environment's rootfs must be).  No mocks.
"""

from __future__ import annotations

import os
import shutil
import stat
import struct
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from weenv.config import Paths
from weenv.errors import InvalidInputError
from weenv.node.disk import NodeDisk
from weenv.node.node import Node
from weenv.node.runtime import idmap
from weenv.node.runtime.bundle import DOCKER_DEFAULT_CAPS, RUNC_DEFAULT_CAPS, cap_mask
from weenv.node.state.snapshot import CAPTURES
from weenv.store.file import FileStore

# a user, a file of theirs root chowned, one root chmodded, their 0700 directory,
# a setuid file, a symlink and a hard link of theirs, a group-owned directory
SETUP = (
    "set -e; useradd -m -u 1000 user; groupadd -g 2000 team;"
    " touch /tmp/x && chown 1000:2000 /tmp/x;"
    " runuser -u user -- sh -c 'echo mine > /home/user/f; mkdir -m 700 /home/user/secret;"
    " echo s > /home/user/secret/s; ln -s f /home/user/link; ln /home/user/f /home/user/hard';"
    " chmod 640 /home/user/f; cp /usr/bin/id /usr/local/bin/suid-id; chmod 4755 /usr/local/bin/suid-id;"
    " mkdir -p /srv/team && chown :team /srv/team && chmod 2770 /srv/team; rm /etc/hostname"
)
LISTING = (
    "find /tmp /home /srv /etc /usr/local /var/lib/dpkg -xdev -printf '%p %U %G %m %y\\n' | sort;"
    " stat -c %h /home/user/f; test $(stat -c %i /home/user/f) = $(stat -c %i /home/user/hard) && echo one-inode"
)


@pytest.fixture(scope="module")
def base():
    d = Path(tempfile.mkdtemp(prefix="weenv-rootin-"))
    os.chmod(d, 0o711)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def node(base, shared_store, monkeypatch, leak_check, request):
    """A started node with ``WEENV_USERNS=on`` over a hard-linked copy of the shared store."""
    root = Path(tempfile.mkdtemp(dir=base))
    os.chmod(root, 0o711)
    monkeypatch.setenv("WEENV_HOME", str(root / "home"))
    monkeypatch.setenv("WEENV_USERNS", "on")
    subprocess.run(["cp", "-al", str(shared_store.root), str(root / "store")], check=True)
    n = Node(Paths.from_env(), store=FileStore(root / "store"), pool_size=0).start()
    try:
        yield n
    finally:
        n.close()
        held = [p for p in idmap.in_use().values() if str(p).startswith(str(root))]
        with open("/proc/mounts") as f:
            left = [line.split()[1] for line in f if line.split()[1].startswith(str(root))]
        shutil.rmtree(root, ignore_errors=True)
        assert not held, f"ranges left held: {held}"
        assert not left, f"leaked mounts: {left}"


def sh(node: Node, env_id: str, script: str, user: str | None = None) -> str:
    r = node.exec(env_id, ["sh", "-c", script], **({"user": user} if user else {}))
    assert r.exit_code == 0, (script, r.stdout, r.stderr)
    return r.stdout.decode()


def host_range(node: Node, env_id: str) -> int:
    host_id = idmap.range_of(node.snapshotter.dir(env_id))
    assert host_id is not None and host_id >= idmap.RANGE_BASE
    return host_id


def caps_inside(node: Node, env_id: str) -> dict[str, int]:
    lines = sh(node, env_id, "grep ^Cap /proc/self/status").splitlines()
    return {k.rstrip(":"): int(v, 16) for k, v in (line.split() for line in lines)}


def test_root_holds_dockers_default_capabilities_and_no_more(node):
    env = node.create("task").id
    caps = caps_inside(node, env)
    assert caps["CapEff"] == caps["CapBnd"] == caps["CapPrm"] == cap_mask(DOCKER_DEFAULT_CAPS), {
        k: hex(v) for k, v in caps.items()
    }
    assert sh(node, env, "id -u").strip() == "0"
    host_id = host_range(node, env)
    # root inside is the range's first id on the host, never host root
    pid = node.runc.state(node.table.get(env).container_id)["pid"]
    with open(f"/proc/{pid}/status") as f:
        uids = next(line for line in f if line.startswith("Uid:")).split()[1:]
    assert set(map(int, uids)) == {host_id}


def test_a_create_may_ask_fewer_capabilities_never_more(node):
    with pytest.raises(InvalidInputError, match="CAP_SYS_ADMIN"):
        node.create("task", capabilities=(*DOCKER_DEFAULT_CAPS, "CAP_SYS_ADMIN"))
    env = node.create("task", capabilities=RUNC_DEFAULT_CAPS).id
    assert caps_inside(node, env)["CapEff"] == cap_mask(RUNC_DEFAULT_CAPS)
    r = node.exec(env, ["sh", "-c", "touch /tmp/x; chown 1000 /tmp/x"])
    assert r.exit_code != 0 and b"Operation not permitted" in r.stderr


def test_root_inside_has_roots_everyday_powers(node):
    """chown, chmod of another user's file, runuser, reading another user's 0700
    directory; on the host every file is owned by the range's ids."""
    env = node.create("task").id
    sh(node, env, SETUP)
    assert sh(node, env, "runuser -u user -- id -u").strip() == "1000"
    assert sh(node, env, "cat /home/user/secret/s").strip() == "s"  # 0700 of another user
    assert sh(node, env, "stat -c '%u %g %a' /tmp/x /home/user/f /usr/local/bin/suid-id").split("\n")[:3] == [
        "1000 2000 644",
        "1000 1000 640",
        "0 0 4755",
    ]
    # the user's 0700 directory is closed to other users inside
    r = node.exec(env, ["sh", "-c", "runuser -u nobody -- cat /home/user/secret/s"])
    assert r.exit_code != 0
    host_id = host_range(node, env)
    rootfs = node.snapshotter.dir(env) / "rootfs"
    st = os.lstat(rootfs / "tmp/x")
    assert (st.st_uid, st.st_gid) == (host_id + 1000, host_id + 2000)
    suid = os.lstat(rootfs / "usr/local/bin/suid-id")
    # a setuid file made inside runs as the range's root for a host user, never as host root
    assert suid.st_uid == host_id and suid.st_mode & stat.S_ISUID
    assert os.lstat(NodeDisk.upper(node.snapshotter.dir(env)) / "home/user/f").st_uid == host_id + 1000


def test_dpkg_installs_a_local_package_with_its_owners(node, tmp_path):
    """``dpkg -i`` of a local .deb (built here with dpkg-deb) unpacks files owned by
    a non-root user, runs its maintainer script as root and records it."""
    tree = tmp_path / "pkg"
    (tree / "DEBIAN").mkdir(parents=True)
    (tree / "DEBIAN/control").write_text(
        "Package: weenv-probe\nVersion: 1.0\nArchitecture: all\nMaintainer: weenv <weenv@localhost>\n"
        "Description: probe\n"
    )
    (tree / "DEBIAN/postinst").write_text("#!/bin/sh\nset -e\nchown 1000:1000 /opt/probe/by-postinst\n")
    os.chmod(tree / "DEBIAN/postinst", 0o755)
    (tree / "opt/probe").mkdir(parents=True)
    (tree / "opt/probe/owned").write_text("owned\n")
    (tree / "opt/probe/by-postinst").write_text("x\n")
    os.chown(tree / "opt/probe/owned", 1000, 1000)
    deb = tmp_path / "probe.deb"
    subprocess.run(["dpkg-deb", "--build", str(tree), str(deb)], check=True, capture_output=True)
    env = node.create("task").id
    sh(node, env, "useradd -u 1000 user")
    node.files(env).write_file("/tmp/probe.deb", deb.read_bytes())
    sh(node, env, "dpkg -i /tmp/probe.deb")
    assert sh(node, env, "stat -c %u:%g /opt/probe/owned /opt/probe/by-postinst").split() == ["1000:1000", "1000:1000"]
    assert "ii  weenv-probe" in sh(node, env, "dpkg -l weenv-probe")
    host_id = host_range(node, env)
    assert os.lstat(node.snapshotter.dir(env) / "rootfs/opt/probe/owned").st_uid == host_id + 1000


def test_without_the_setting_environments_run_on_host_ids_as_before(shared_store, paths, leak_check, monkeypatch):
    """``WEENV_USERNS=off``: no user namespace (no range), runc's set and
    ``noNewPrivileges``, root cannot ``chown``; a fork child has the parent's
    files with their owners and modes, and a reset goes back to the template."""
    monkeypatch.setenv("WEENV_USERNS", "off")
    with Node(paths, store=shared_store, pool_size=0) as n:
        env = n.create("task").id
        assert idmap.range_of(n.snapshotter.dir(env)) is None
        assert caps_inside(n, env)["CapEff"] == cap_mask(RUNC_DEFAULT_CAPS)
        assert sh(n, env, "grep ^NoNewPrivs /proc/self/status").split() == ["NoNewPrivs:", "1"]
        r = n.exec(env, ["sh", "-c", "touch /tmp/x; chown 1000 /tmp/x"])
        assert r.exit_code != 0 and b"Operation not permitted" in r.stderr, r
        sh(n, env, "echo parent > /tmp/p; chmod 4755 /tmp/p")
        (child,) = n.fork(env, 1).children
        assert idmap.range_of(n.snapshotter.dir(child.id)) is None
        assert sh(n, child.id, "cat /tmp/p; stat -c %a:%u /tmp/p") == "parent\n4755:0\n"
        assert os.lstat(n.snapshotter.dir(child.id) / "rootfs/tmp/p").st_uid == 0  # host ids as inside
        n.reset(env)
        assert sh(n, env, "test -e /tmp/p && echo yes || echo no") == "no\n"


def test_a_home_below_a_private_directory_runs_root_with_its_powers(shared_store, paths, leak_check, monkeypatch):
    """pytest's home lies below a 0700 directory the range's root cannot search:
    the environments' directories are reached through /run instead (``node/envs``
    a link to them), so root inside starts and ``chown`` works."""
    monkeypatch.setenv("WEENV_USERNS", "on")
    assert any(not os.stat(d).st_mode & 0o001 for d in paths.home.parents)
    with Node(paths, store=shared_store, pool_size=0) as n:
        env = n.create("task").id
        sh(n, env, "touch /tmp/x; chown 1000:2000 /tmp/x")
        assert sh(n, env, "stat -c '%u %g' /tmp/x").strip() == "1000 2000"
        assert paths.environments.is_symlink()
        assert n.snapshotter.dir(env).parent == paths.environments.resolve()
        envs = paths.environments.resolve()
    assert not envs.exists()


def test_bad_setting_is_refused_naming_it(monkeypatch):
    monkeypatch.setenv("WEENV_USERNS", "maybe")
    with pytest.raises(InvalidInputError, match="WEENV_USERNS"):
        idmap.userns_from_env()


# --- snapshot, fork and reset keep owners and modes --------------------------------------------
def test_fork_child_in_another_range_has_the_parents_owners(node):
    parent = node.create("task").id
    sh(node, parent, SETUP)
    want = sh(node, parent, LISTING)
    result = node.fork(parent, 2)
    assert all(not isinstance(c, Exception) for c in result.children), result
    children = [c.id for c in result.children]
    ranges = {host_range(node, e) for e in (parent, *children)}
    assert len(ranges) == 3
    for child in children:
        assert sh(node, child, LISTING) == want
        assert sh(node, child, "runuser -u user -- cat /home/user/f").strip() == "mine"
        host_id = host_range(node, child)
        assert os.lstat(node.snapshotter.dir(child) / "rootfs/home/user/f").st_uid == host_id + 1000
        assert sh(node, child, "test -e /etc/hostname && echo yes || echo no").strip() == "no"
    assert not (node.paths.environments / CAPTURES).exists() or not any((node.paths.environments / CAPTURES).iterdir())


def test_reset_to_a_snapshot_and_create_from_it_keep_owners(node):
    env = node.create("task").id
    sh(node, env, SETUP)
    want = sh(node, env, LISTING)
    info = node.snapshot(env, "owners-kept")
    sh(node, env, "chown -R 0:0 /home/user; chmod 700 /tmp/x; rm -rf /srv/team")
    assert sh(node, env, LISTING) != want
    node.reset(env, "owners-kept")
    assert sh(node, env, LISTING) == want
    # a new environment of the published snapshot (its top group holds the ids as they are inside)
    other = node.create(info.name).id
    assert host_range(node, other) != host_range(node, env)
    assert sh(node, other, LISTING) == want
    assert sh(node, other, "/usr/local/bin/suid-id -u", user="user").strip() == "0"  # setuid works inside


# --- the shift itself, on a plain directory ------------------------------------------------------
def test_shift_owners_moves_ids_keeping_modes_links_and_file_capabilities(tmp_path):
    src, dst = idmap.RANGE_BASE, idmap.RANGE_BASE + 3 * idmap.ID_RANGE
    sub = tmp_path / "sub"
    upper = sub / "upper"
    (sub / "upper/d").mkdir(parents=True)
    (sub / "work").mkdir()
    f = sub / "upper/d/f"
    f.write_text("x")
    os.link(f, sub / "upper/hard")
    os.symlink("d/f", sub / "upper/link")
    for p, (u, g) in (
        (sub / "work", (0, 0)),
        (sub / "upper", (0, 0)),
        (sub / "upper/d", (1000, 1000)),
        (f, (0, 50)),
        (sub / "upper/link", (1000, 2000)),
    ):
        os.chown(p, src + u, src + g, follow_symlinks=False)
    os.chown(sub / "work", src, src)
    os.chmod(f, 0o6755)
    v3 = struct.pack("<IIIIII", 0x03000001, 1 << 13, 0, 0, 0, src)  # cap_net_raw+ep for range src's root
    os.setxattr(f, idmap.XATTR_CAPS, v3)
    outside = sub / "upper/outside"
    outside.write_text("y")
    os.chown(outside, 7, 7)  # not of range src: left
    assert idmap.range_of_subvolume(sub) == src
    idmap.shift_owners(upper, src, dst)
    os.chown(sub / "work", dst, dst)
    assert idmap.range_of_subvolume(sub) == dst
    st = os.lstat(f)
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (dst, dst + 50, 0o6755)
    assert os.getxattr(f, idmap.XATTR_CAPS)[20:] == struct.pack("<I", dst)
    assert os.lstat(sub / "upper/link").st_uid == dst + 1000 and os.lstat(sub / "upper/d").st_gid == dst + 1000
    assert os.lstat(outside).st_uid == 7
    idmap.shift_owners(upper, dst, 0)
    os.chown(sub / "work", 0, 0)  # back to the ids as they are inside: host root's capabilities, version 2
    assert os.lstat(f).st_uid == 0 and stat.S_IMODE(os.lstat(f).st_mode) == 0o6755
    caps = os.getxattr(f, idmap.XATTR_CAPS)
    assert len(caps) == 20 and struct.unpack_from("<I", caps)[0] == 0x02000001
    assert idmap.range_of_subvolume(sub) == 0


def test_network_with_a_user_namespace_answers_on_a_port(node):
    """An environment with network in its user namespace starts (its network
    namespace is owned by that user namespace, so runc's sysfs mount works),
    mounts nothing over the host, and answers on a port through the node."""
    env = node.create("task", network=True).id
    # its own sysfs, not the host's bound in (crun's fallback when the mount is refused)
    assert sh(node, env, "id -u; ls /sys/class/net").split() == ["0", "eth0", "lo"]
    sh(node, env, "cd /tmp && (python3 -m http.server 8000 --bind 0.0.0.0 >/dev/null 2>&1 &)")
    for _ in range(200):
        try:
            sock = node.open_port(env, 8000)
            break
        except OSError:
            time.sleep(0.05)
    else:
        raise AssertionError("nothing answers on port 8000")
    with sock:
        sock.sendall(b"GET / HTTP/1.0\r\n\r\n")
        assert sock.recv(12).startswith(b"HTTP/1.0 200")
    # the network namespace's owner is the environment's, root inside is the range's root
    env_dir = node.snapshotter.dir(env)
    pid = node.runc.state(node.table.get(env).container_id)["pid"]
    assert os.stat(f"/proc/{pid}/ns/user").st_ino == os.stat(env_dir / "netns.owner").st_ino
    assert os.stat(f"/proc/{pid}/ns/net").st_ino == os.stat(env_dir / "netns").st_ino
