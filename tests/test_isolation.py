"""What an environment makes cannot act on the host (issue 13, findings 1 and 2).

- A setuid file or a device node made inside is neither on the host: the
  environment's mounts are ``nodev`` on the host side and ``nosuid`` but for
  the overlay of an environment in a user namespace (the default), whose
  setuid files run as its host id range (root inside, an unprivileged id
  outside), and the home's ``node/`` and ``run/`` are closed to other users (0700).
- An environment with ``network: true`` has its own network namespace, linked
  to the host by a veth pair and NATed out; it cannot reach the host (its
  loopback, its veth address, its abstract Unix sockets) nor bind a host port.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from test_restart import restart_home  # noqa: F401  (fixture)
from weenv.host.mounts import mounts_under
from weenv.node.runtime import idmap, nameserver, network
from weenv.node.runtime.bundle import DOCKER_DEFAULT_CAPS

AS_NOBODY = ["runuser", "-u", "nobody", "--"]
"""An unprivileged host user (setpriv --reuid keeps its capabilities until the execve, which then finds
the program with CAP_DAC_OVERRIDE)."""


@contextlib.contextmanager
def traversable_ancestors(path: Path):
    """Let other users traverse every directory above ``path`` (pytest's own
    temporary directories are 0700), as they can above ``/var/lib/weenv``;
    restores the modes after."""
    saved = []
    for d in reversed(path.parents):
        mode = stat.S_IMODE(d.stat().st_mode)
        if mode & 0o001 == 0:
            saved.append((d, mode))
            os.chmod(d, mode | 0o011)
    try:
        yield
    finally:
        for d, mode in reversed(saved):
            os.chmod(d, mode)


def run_as_nobody(program: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*AS_NOBODY, str(program), "-c", "import os; print(os.geteuid())"], capture_output=True, text=True, timeout=30
    )


# --- finding 1: setuid files and device nodes ---------------------------------------------------


def test_setuid_file_made_inside_is_not_root_on_the_host(node, paths):
    """The issue's reproduction: a setuid copy of python3 made inside printed
    euid 0 when `nobody` on the host ran it through rootfs/ or upper/.  In a
    user namespace the file is the range's root's on the host, and the overlay
    is not nosuid (sudo inside needs it): through rootfs/ it runs as that id."""
    env = node.create("task")
    host_id = idmap.range_of(node.snapshotter.dir(env.id))
    assert (host_id is not None) == node.containers.userns_all
    if host_id is not None:
        assert host_id >= idmap.RANGE_BASE
    r = node.exec(env.id, "cp /usr/bin/python3 /tmp/p && chmod 4755 /tmp/p && stat -c %a:%u /tmp/p")
    assert r.exit_code == 0 and r.stdout == b"4755:0\n", r
    env_dir = paths.environments / env.id
    upper = env_dir / "disk/upper/tmp/p"  # the overlay's upper dir, in the environment's btrfs subvolume
    assert upper.is_file() and upper.stat().st_mode & stat.S_ISUID, upper  # the same file, seen from the host
    with traversable_ancestors(paths.home):
        for program in (env_dir / "rootfs/tmp/p", upper):
            r = run_as_nobody(program)
            assert r.returncode != 0 and "Permission denied" in r.stderr, (program, r)
        for d in (paths.node, paths.run):
            assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
        # A home opened by hand (or a path reached another way) still gives no setuid root:
        # the overlay is mounted nosuid on the host.
        opened = [
            paths.node,
            paths.environments,
            env_dir,
            env_dir / "disk",
            env_dir / "disk/upper",
            env_dir / "disk/upper/tmp",
        ]
        modes = [stat.S_IMODE(d.stat().st_mode) for d in opened]
        try:
            for d in opened:
                os.chmod(d, 0o755 if d.name != "tmp" else 0o1777)
            # the btrfs disk is nosuid, and so is the overlay of an environment without a user namespace
            euid = {env_dir / "rootfs/tmp/p": host_id or 65534, upper: 65534}
            for program, want in euid.items():
                r = run_as_nobody(program)
                assert r.returncode == 0 and r.stdout == f"{want}\n", (program, r)
        finally:
            for d, mode in zip(opened, modes):
                os.chmod(d, mode)


def test_group_and_overlay_mounts_are_nosuid_nodev(node, paths):
    """Every mount of the node is nodev and nosuid, but the overlay of an environment
    in a user namespace, which is nodev only (its setuid files run as its host id range)."""
    env = node.create("task")
    envs = str(node.snapshotter.environments)  # node/envs, or its alias under /run
    options = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if fields[4].startswith((str(paths.node), envs)):
                options[fields[4]] = set(fields[5].split(","))
    rootfs = str(node.snapshotter.dir(env.id) / "rootfs")
    disk = envs  # the btrfs disk holding every upper dir
    assert rootfs in options and disk in options and any("/groups/" in p for p in options), options
    userns = idmap.range_of(node.snapshotter.dir(env.id)) is not None
    for point, opts in options.items():
        if point in (rootfs, disk) or "/groups/" in point:
            want = {"nodev"} if point == rootfs and userns else {"nosuid", "nodev"}
            assert want <= opts, (point, opts)


def test_device_node_made_inside_cannot_be_opened_from_the_host(node, paths):
    """With Docker's capabilities (CAP_MKNOD) an environment without a user namespace
    makes a device node the device cgroup allows (/dev/zero's 1:5); root on the host
    opened it through rootfs/ before the overlay was nodev.  In a user namespace
    (the default) the kernel refuses the device node itself."""
    env = node.create("task", capabilities=DOCKER_DEFAULT_CAPS)
    r = node.exec(env.id, "mknod /tmp/z c 1 5 && stat -c %t:%T /tmp/z")
    if idmap.range_of(node.snapshotter.dir(env.id)) is not None:
        assert r.exit_code != 0 and b"Operation not permitted" in r.stderr, r
        return
    assert r.exit_code == 0 and r.stdout == b"1:5\n", r
    with pytest.raises(PermissionError):
        open(paths.environments / env.id / "rootfs/tmp/z", "rb").close()


# --- finding 2: an environment's own network -------------------------------------------------

CONNECT = """
import socket, sys
try:
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1.5) as s:
        s.settimeout(3)
        print("connected", s.recv(100).decode().strip())
except OSError as exc:
    print(type(exc).__name__)
"""
ANSWER_PEER = """
import socket, sys
srv = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("ready", flush=True)
while True:
    c, peer = srv.accept()
    c.sendall(f"{sys.argv[3]} {peer[0]}\\n".encode())
    c.close()
"""
OUTSIDE = ("198.18.0.1/30", "198.18.0.2/30", 8080)
"""The test's stand-in for the internet (RFC 2544's benchmark range, on this machine's veths only):
the host end, the far end and its port."""


def connect_from(node, env_id: str, host: str, port: int) -> str:
    """What a TCP connect from inside gives: ``"connected WHAT"`` or the error's class name."""
    r = node.exec(env_id, ["python3", "-c", CONNECT, host, str(port)], timeout=30)
    assert r.exit_code == 0, r
    return r.stdout.decode().strip()


def env_address(env_id: str) -> ipaddress.IPv4Address:
    """The environment's address: its host veth's + 1."""
    out = subprocess.run(
        ["ip", "-j", "-4", "addr", "show", "dev", network.host_ifname(env_id)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return ipaddress.IPv4Address(json.loads(out)[0]["addr_info"][0]["local"]) + 1


def host_addresses() -> list[str]:
    out = subprocess.run(["ip", "-j", "-4", "addr", "show"], capture_output=True, text=True, check=True).stdout
    return [a["local"] for link in json.loads(out) for a in link["addr_info"]]


@pytest.fixture
def net_template(shared_store):
    """The digest of template ``task`` with ``network: true`` (no ref: the session's store lists none more)."""
    from weenv.formats.manifest import canonical_json
    from weenv.packaging.template import load_template

    _digest, m = load_template(shared_store, "task")
    m = m.model_copy(update={"runtime": m.runtime.model_copy(update={"network": True})})
    return shared_store.put_manifest(canonical_json(m))


@pytest.fixture
def host_server():
    """A TCP server on every host address (0.0.0.0, so 127.0.0.1 and each veth's
    too) answering ``host``; its port."""
    srv = socket.create_server(("0.0.0.0", 0))
    srv.settimeout(0.2)
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                c, _ = srv.accept()
                c.sendall(b"host\n")
                c.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield srv.getsockname()[1]
    finally:
        stop.set()
        t.join()
        srv.close()


@contextlib.contextmanager
def far_host(ns: Path, link: str, host_end: str, far_end: str, port: int, word: str):
    """A network namespace (its file ``ns``) linked to the host by the veth
    ``link`` (not a weenv one), ``host_end`` on the host and ``far_end``
    inside, serving TCP on the far end's ``port``: each connection is answered
    with ``WORD PEER_ADDRESS``.  Yields the far address; removes it all after."""
    ns.touch()
    subprocess.run(["unshare", f"--net={ns}", "true"], check=True)
    server = None
    try:
        subprocess.run(
            ["ip", "link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", str(ns)], check=True
        )
        subprocess.run(
            ["ip", "-b", "-"], input=f"addr add {host_end} dev {link}\nlink set {link} up\n", text=True, check=True
        )
        subprocess.run(
            ["nsenter", f"--net={ns}", "ip", "-b", "-"],
            text=True,
            check=True,
            input=f"link set lo up\naddr add {far_end} dev eth0\nlink set eth0 up\n",
        )
        server = subprocess.Popen(
            ["nsenter", f"--net={ns}", sys.executable, "-c", ANSWER_PEER, far_end.split("/")[0], str(port), word],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert server.stdout.readline() == "ready\n"
        yield far_end.split("/")[0]
    finally:
        if server is not None:
            server.kill()
            server.wait()
        subprocess.run(["ip", "link", "del", link], capture_output=True)
        subprocess.run(["umount", str(ns)], check=True)


@pytest.fixture
def outside(tmp_path):
    """A network namespace standing in for the internet (:func:`far_host` on
    :data:`OUTSIDE`); each connection is answered with ``outside PEER_ADDRESS``."""
    host_end, far_end, port = OUTSIDE
    with far_host(
        tmp_path / "outside-netns", f"wvtout{os.getpid() % 100000}", host_end, far_end, port, "outside"
    ) as far:
        yield far, port


def test_network_environment_reaches_out_through_nat_but_never_the_host(node, net_template, host_server, outside):
    """With ``network: true`` an environment shared the host's namespace: the
    host's 127.0.0.1 (the daemon's TCP API too) answered it.  Now it has its
    own namespace and veth, reaches a server beyond the host (masqueraded: the
    server sees the host's address), and nothing of the host answers."""
    env = node.create(net_template)
    # its 127.0.0.1 is its own: refused; every host address (its veth's, eth0's, the outside veth's) is dropped
    assert connect_from(node, env.id, "127.0.0.1", host_server) == "ConnectionRefusedError"
    assert env_address(env.id) in ipaddress.IPv4Network(network.DEFAULT_CIDR)
    far, port = outside
    assert connect_from(node, env.id, far, port) == f"connected outside {OUTSIDE[0].split('/')[0]}"
    for addr in host_addresses():
        if not addr.startswith("127."):
            assert connect_from(node, env.id, addr, host_server) == "TimeoutError", addr
    r = node.exec(env.id, "cat /etc/resolv.conf")  # its own name server (weenv.node.runtime.nameserver), not the host's
    assert r.stdout == nameserver.RESOLV_CONF.encode()


def test_a_stale_or_flushed_table_is_made_whole_by_the_next_create(node, net_template, host_server):
    """The table ``inet weenv`` was only made when missing: one whose rules were
    flushed (a firewall reload) or left by an older weenv kept its gaps, and a
    new environment reached the host.  Every create with network makes it anew."""
    subprocess.run(["nft", "-f", "-"], input=network.ruleset(), text=True, check=True)  # as a running node made it
    subprocess.run(["nft", "flush", "chain", "inet", network.TABLE, "input"], check=True)
    subprocess.run(["nft", "add", "chain", "inet", network.TABLE, "stale"], check=True)
    env = node.create(net_template)
    host_end = str(env_address(env.id) - 1)
    assert connect_from(node, env.id, host_end, host_server) == "TimeoutError"
    listed = subprocess.run(
        ["nft", "list", "table", "inet", network.TABLE], capture_output=True, text=True, check=True
    ).stdout
    assert 'iifname "weenv*" drop' in listed.split("chain forward")[0] and "chain stale" not in listed, listed


def test_network_environment_sees_no_host_abstract_socket_and_binds_no_host_port(node, net_template):
    name = f"weenv-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as host_sock:
        host_sock.bind("\0" + name)
        host_sock.listen()
        env = node.create(net_template)
        code = (
            "import socket, sys\ns = socket.socket(socket.AF_UNIX)\n"
            "try:\n    s.connect('\\0' + sys.argv[1]); print('connected')\nexcept OSError as e: print(type(e).__name__)"
        )
        r = node.exec(env.id, ["python3", "-c", code, name])
        assert r.stdout == b"ConnectionRefusedError\n", r
    p = node.spawn(env.id, ["python3", "-c", ANSWER_PEER, "0.0.0.0", "8081", "env"])
    try:
        for _ in range(100):
            if b":1F91" in node.exec(env.id, "cat /proc/net/tcp").stdout:
                break
            time.sleep(0.05)
        with pytest.raises(ConnectionRefusedError):  # bound in its own namespace, not on the host
            socket.create_connection(("127.0.0.1", 8081), timeout=2).close()
    finally:
        p.kill()


def test_network_environments_do_not_reach_each_other(node, net_template):
    a, b = node.create(net_template), node.create(net_template)
    p = node.spawn(a.id, ["python3", "-c", ANSWER_PEER, "0.0.0.0", "8082", "a"])
    try:
        addr_a = str(env_address(a.id))
        assert connect_from(node, a.id, "127.0.0.1", 8082) == "connected a 127.0.0.1"
        assert connect_from(node, b.id, addr_a, 8082) == "TimeoutError"
    finally:
        p.kill()


def _weenv_table() -> bool:
    return subprocess.run(["nft", "list", "table", "inet", "weenv"], capture_output=True).returncode == 0


def test_the_table_lives_as_long_as_an_environment_with_network(node, net_template):
    """The rules are made by the first environment with network and deleted
    with the machine's last one (none is ever without them): nothing of weenv
    stays in the host's firewall."""
    # without prefetch: never from the warm pool, never filling it (a pooled one holds a veth too)
    a, b = (node.create(net_template, prefetch=False) for _ in range(2))
    assert _weenv_table()
    node.destroy(a.id)
    assert _weenv_table()  # b still runs behind it
    assert connect_from(node, b.id, str(env_address(b.id) - 1), 22) == "TimeoutError"  # the host end: dropped
    node.destroy(b.id)
    assert not _weenv_table()
    c = node.create(net_template, prefetch=False)  # made again
    assert _weenv_table()
    node.destroy(c.id)
    assert not _weenv_table()


def test_environment_without_network_has_loopback_only(node):
    env = node.create("task")
    lines = node.exec(env.id, "cat /proc/net/dev").stdout.decode().splitlines()[2:]
    assert [line.split(":")[0].strip() for line in lines] == ["lo"]


def test_failed_create_with_network_leaves_no_namespace_veth_or_rule(node, shared_store):
    """A create failing after its network was made (runc cannot start its
    command) leaves no veth, namespace file or mount."""
    from weenv.errors import RuntimeFailedError
    from weenv.formats.manifest import canonical_json
    from weenv.packaging.template import load_template

    _digest, m = load_template(shared_store, "task")
    m = m.model_copy(update={"runtime": m.runtime.model_copy(update={"network": True, "command": ["/nonexistent"]})})
    digest = shared_store.put_manifest(canonical_json(m))
    before = set(os.listdir("/sys/class/net"))
    with pytest.raises(RuntimeFailedError):
        node.create(digest)
    assert set(os.listdir("/sys/class/net")) == before
    assert not list(node.paths.environments.iterdir())


def test_pooled_environment_with_network(node, net_template, outside, host_server):
    """The warm pool makes environments up to ``runc create``: their namespace
    and veth are made then, and work once one is started."""
    for _ in range(2):  # a template created twice recently gets a pool
        node.destroy(node.create(net_template).id)
    deadline = time.monotonic() + 30
    while node.stats().pool_ready < 1:
        assert time.monotonic() < deadline, "the pool did not fill"
        time.sleep(0.05)
    env = node.create(net_template)
    assert env.timing.pooled
    assert connect_from(node, env.id, *outside).startswith("connected outside")
    assert connect_from(node, env.id, str(env_address(env.id) - 1), host_server) == "TimeoutError"


def test_network_after_daemon_crash_recovery_and_stop(restart_home, outside):
    """A killed daemon's successor keeps a running environment's network; with
    the FUSE holder killed too it removes it; ``weenv stop`` removes the rest:
    no veth, namespace file or mount is left."""
    from weenv.formats.manifest import RuntimeConfig
    from weenv.node.data.fuse import holder
    from weenv.packaging.template import create_template
    from weenv.server import daemon

    home = restart_home
    create_template(home.store, "rn", ["base", "data"], runtime=RuntimeConfig(network=True, working_dir="/data"))
    client = home.start()
    env_id = client.create("rn").id
    home.env_ids.add(env_id)
    veth = Path("/sys/class/net", network.host_ifname(env_id))
    assert veth.exists()
    home.kill(home.daemon_pid())
    client.close()

    client = home.start()  # recovered: its network is as it was
    assert [e.id for e in client.list()] == [env_id]
    r = client.exec(env_id, ["python3", "-c", CONNECT, *map(str, outside)])
    assert r.stdout.decode().startswith("connected outside"), r
    home.kill(home.daemon_pid())
    home.kill(home.holder_pid())
    client.close()

    client = home.start()  # nothing could be served: removed, its network too
    assert client.list() == [] and not veth.exists()
    assert not [p for t, p in mounts_under(home.paths.environments) if t != "btrfs"]  # the disk itself stays
    env2 = client.create("rn").id
    home.env_ids.add(env2)
    client.close()
    assert Path("/sys/class/net", network.host_ifname(env2)).exists()
    assert daemon.stop(home.paths) is True
    assert holder.pid_of(home.paths.run) is None
    assert not Path("/sys/class/net", network.host_ifname(env2)).exists()
    assert not mounts_under(home.paths.home)
