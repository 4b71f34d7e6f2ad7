"""An environment's own network, for ``RuntimeConfig.network`` (Linux only).

An environment never shares the host's network namespace.  Without
``network`` runc gives it a new one holding only loopback.  With it,
:func:`setup` makes, before runc runs:

- a network namespace of its own, kept by a bind mount of its nsfs file at
  ``ENV_DIR/netns`` (util-linux ``unshare --net=FILE``); runc joins it through
  the OCI config's ``namespaces[].path``.  A file weenv made (not a runc hook):
  the namespace exists before the container, so the warm pool's ``runc
  create`` and ``runc run`` take it alike, and it is found again after a
  daemon crash as a mount under the environment's directory;
- a veth pair: ``weenv<first 10 hex of the id>`` on the host, ``eth0`` inside,
  with a /30 of :data:`CIDR_ENV` (default :data:`DEFAULT_CIDR`): the host end
  ``.1``, the environment ``.2``, its default route through the host end.
  The addresses exist only on this machine's veths; a free /30 is chosen
  under a machine-wide lock (:data:`LOCK`) among those no interface holds;
- IPv4 only: IPv6 is disabled on the host end.

Then nftables' table ``inet weenv`` (:func:`ruleset`, made anew at every
setup, the same for every node of the machine; it names interfaces by the
``weenv*`` prefix, so it holds nothing per environment):

- *input*: everything from a weenv veth to the host is dropped: the daemon's
  TCP API, services on 127.0.0.1 (the environment's own loopback is its own
  anyway) and on any host address do not answer;
- *forward*: weenv veth to weenv veth dropped (environments do not reach each
  other); nothing new towards an environment (no port of it is published);
  link-local destinations (169.254.0.0/16: cloud metadata) dropped; a source
  that does not route back through its veth dropped (no spoofing);
- *postrouting*: traffic from a weenv veth leaving by another interface is
  masqueraded.

Forwarding must be on: :func:`ensure_rules` sets ``net.ipv4.ip_forward`` to 1
(as Docker does), which makes the host route between its other interfaces
too.  DNS: the environment gets the host's ``/etc/resolv.conf``; a name server
on a host address (e.g. systemd-resolved's 127.0.0.53) is not reachable.

Teardown (:func:`teardown`): the host end is deleted (which deletes the pair)
and the nsfs file unmounted; idempotent, and what a crash leaves goes the same
way (the namespace also dies with its last process and mount, taking its veth).
The teardown that deletes the machine's last weenv veth (of any node) also
deletes the table, under :data:`LOCK`: the next setup makes it again, and no
environment is ever without it.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import os
import random
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from weenv.errors import CapacityError, InvalidInputError, MountError, RuntimeFailedError, ToolMissingError
from weenv.host import mounts

CIDR_ENV = "WEENV_NET_CIDR"
DEFAULT_CIDR = "10.200.0.0/16"
"""Where environments' /30s come from; private, unused on the machines here."""
IF_PREFIX = "weenv"
TABLE = "weenv"
"""nftables table (family ``inet``) holding every rule weenv adds."""
LOCK = Path("/run/weenv-net.lock")
"""Serializes address choice and the table's creation between every weenv node of the machine."""
NETNS_FILE = "netns"
"""The environment's network namespace file, in its directory (outside its rootfs)."""
LINK_LOCAL = "169.254.0.0/16"
TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Link:
    """An environment's network: its namespace file, host interface and addresses."""

    netns: Path
    host_if: str
    host_addr: ipaddress.IPv4Interface
    env_addr: ipaddress.IPv4Interface


def cidr_from_env() -> ipaddress.IPv4Network:
    """:data:`CIDR_ENV` (default :data:`DEFAULT_CIDR`) as a network of at least
    one /30; raises :class:`InvalidInputError` naming the variable."""
    value = os.environ.get(CIDR_ENV, DEFAULT_CIDR)
    try:
        net = ipaddress.IPv4Network(value, strict=True)
    except ValueError as exc:
        raise InvalidInputError(f"{CIDR_ENV}={value!r}: want an IPv4 network such as {DEFAULT_CIDR} ({exc})") from None
    if net.prefixlen > 30:
        raise InvalidInputError(f"{CIDR_ENV}={value!r}: want a /30 or larger")
    return net


def host_ifname(env_id: str) -> str:
    """The host end of environment ``env_id``'s veth (at most 15 bytes, IFNAMSIZ - 1)."""
    return IF_PREFIX + env_id[:10]


def subnet(cidr: ipaddress.IPv4Network, index: int) -> tuple[ipaddress.IPv4Interface, ipaddress.IPv4Interface]:
    """``(host end, environment end)`` of the ``index``-th /30 of ``cidr``."""
    base = int(cidr.network_address) + 4 * index
    return (ipaddress.IPv4Interface(f"{ipaddress.IPv4Address(base + 1)}/30"),
            ipaddress.IPv4Interface(f"{ipaddress.IPv4Address(base + 2)}/30"))  # fmt: skip


def ruleset() -> str:
    """The table ``inet weenv`` as an ``nft -f`` script (see the module docstring)."""
    veth = f'"{IF_PREFIX}*"'
    return f"""table inet {TABLE} {{
  chain input {{
    type filter hook input priority filter - 10; policy accept;
    iifname {veth} drop
  }}
  chain forward {{
    type filter hook forward priority filter - 10; policy accept;
    iifname {veth} oifname {veth} drop
    oifname {veth} ct state established,related accept
    oifname {veth} drop
    iifname {veth} meta nfproto ipv6 drop
    iifname {veth} ip daddr {LINK_LOCAL} drop
    iifname {veth} fib saddr . iif oif missing drop
  }}
  chain postrouting {{
    type nat hook postrouting priority srcnat; policy accept;
    iifname {veth} oifname != {veth} masquerade
  }}
}}
"""


def ensure_rules() -> None:
    """Make the table ``inet weenv`` exactly :func:`ruleset` and turn IPv4
    forwarding on.  Call with :data:`LOCK` held.

    The table is replaced whole, in one atomic transaction (made if missing,
    deleted, made anew: no packet sees it half made), not only made when
    missing: a table left by an older weenv, or one whose rules were flushed
    (a firewall reload), would otherwise keep its gaps for every environment
    made after it.  One ``nft`` call, as the check for it cost."""
    _run(["nft", "-f", "-"], input=f"table inet {TABLE} {{}}\ndelete table inet {TABLE}\n" + ruleset())
    fwd = Path("/proc/sys/net/ipv4/ip_forward")
    if fwd.read_text().strip() != "1":
        fwd.write_text("1\n")


def setup(env_id: str, env_dir: Path, cidr: ipaddress.IPv4Network) -> Link:
    """Make environment ``env_id``'s namespace (``env_dir/netns``), veth pair,
    addresses and routes (see the module docstring); return its :class:`Link`.
    On failure nothing is left (:func:`teardown`) and :class:`RuntimeFailedError`
    (a command failed), :class:`ToolMissingError` (no ``ip``, ``nft`` or
    ``unshare``) or :class:`CapacityError` (no free /30 in ``cidr``) is raised."""
    netns = env_dir / NETNS_FILE
    host_if = host_ifname(env_id)
    try:
        with _machine_lock():
            ensure_rules()
            host_addr, env_addr = _free_subnet(cidr)
            netns.touch(mode=0o600)
            _run(["unshare", f"--net={netns}", "true"])
            _run(["ip", "link", "add", host_if, "type", "veth", "peer", "name", "eth0", "netns", str(netns)])
            Path(f"/proc/sys/net/ipv6/conf/{host_if}/disable_ipv6").write_text("1\n")
            _run(["ip", "-b", "-"], input=f"addr add {host_addr} dev {host_if}\nlink set {host_if} up\n")
        _run(["nsenter", f"--net={netns}", "ip", "-b", "-"],
             input=f"link set lo up\naddr add {env_addr} dev eth0\nlink set eth0 up\n"
                   f"route add default via {host_addr.ip}\n")  # fmt: skip
    except BaseException:
        teardown(env_id, env_dir)
        raise
    return Link(netns, host_if, host_addr, env_addr)


def teardown(env_id: str, env_dir: Path) -> None:
    """Remove environment ``env_id``'s veth pair and namespace file, if any
    (idempotent; after the container is gone)."""
    host_if = host_ifname(env_id)
    if Path("/sys/class/net", host_if).exists():
        with _machine_lock():  # against a setup between the last veth's going and the table's
            _run(["ip", "link", "del", host_if], check=False)
            if not _weenv_links():  # the last environment with network on this machine: no rule is needed
                _run(["nft", "delete", "table", "inet", TABLE], check=False)
    netns = env_dir / NETNS_FILE
    if mounts.is_mounted(netns):
        try:
            mounts.umount(netns)
        except MountError:
            mounts.umount(netns, detach=True)
    with contextlib.suppress(FileNotFoundError):
        netns.unlink()


def _weenv_links() -> list[str]:
    """Host ends of environments' veths on this machine (any node's)."""
    return [name for name in os.listdir("/sys/class/net") if name.startswith(IF_PREFIX)]


def _free_subnet(cidr: ipaddress.IPv4Network) -> tuple[ipaddress.IPv4Interface, ipaddress.IPv4Interface]:
    used = set()
    for link in json.loads(_run(["ip", "-j", "-4", "addr", "show"]).stdout or "[]"):
        for a in link.get("addr_info", []):
            addr = ipaddress.IPv4Address(a["local"])
            if addr in cidr:
                used.add((int(addr) - int(cidr.network_address)) // 4)
    count = cidr.num_addresses // 4
    if len(used) >= count:
        raise CapacityError(f"every /30 of {CIDR_ENV}={cidr} is in use ({count} environments with network)")
    for _ in range(64):  # random first: a crashed node's leftovers and other nodes' choices rarely collide
        index = random.randrange(count)
        if index not in used:
            return subnet(cidr, index)
    return subnet(cidr, min(set(range(count)) - used))


@contextlib.contextmanager
def _machine_lock():
    fd = os.open(LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _run(argv: list[str], *, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    if shutil.which(argv[0]) is None:
        raise ToolMissingError(f"{argv[0]} is not installed (Debian: iproute2, nftables, util-linux)")
    try:
        proc = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=TIMEOUT_S,
                              stdin=None if input is not None else subprocess.DEVNULL)  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        raise RuntimeFailedError(f"{' '.join(argv)} took more than {TIMEOUT_S:.0f} s") from exc
    if check and proc.returncode != 0:
        raise RuntimeFailedError(f"{' '.join(argv)} failed: {proc.stderr.strip()}")
    return proc
