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
  anyway) and on any host address do not answer; only replies to what the
  host started pass, and a source that does not route back through its veth
  is dropped first (an environment with ``CAP_NET_RAW``, as build steps have,
  spoofing the source of a server the host talks to matched that flow's
  conntrack entry: e.g. answers to the host's DNS queries);
- *forward*: weenv veth to weenv veth dropped (environments do not reach each
  other); nothing new towards an environment (no port of it is published);
  link-local destinations (169.254.0.0/16: cloud metadata) dropped; a source
  that does not route back through its veth dropped (no spoofing);
- *postrouting*: traffic from a weenv veth leaving by another interface is
  masqueraded.

Per environment, a table of its own, ``inet weenv-<first 10 hex of the id>``
(:func:`egress_ruleset`, made for every environment with network, before its
veth exists), holds its egress lists (:class:`Egress`, a create's
``allow_out`` / ``deny_out``, E2B's ``allowOut`` / ``denyOut``) and the
default drop of local destinations: a forward chain after the shared one's
(priority ``filter - 5``) that, for packets from its veth, in this order:

1. accepts ``allow`` entries that lie inside a local range (``allow_local``):
   an explicit allow of a private address or range is honoured
   (``10.1.2.3``, ``192.168.0.0/16``), one that merely covers it is not
   (``0.0.0.0/0`` does not open the LAN);
2. accepts packets of connections already accepted (``ct state
   established``): a flow opened by a name's answer outlives that answer's TTL;
3. drops every other local destination (:func:`local_ranges`): the private
   ranges of RFC 1918 (10/8, 172.16/12, 192.168/16), CGNAT's 100.64/10,
   link-local 169.254/16, loopback, ``0/8``, multicast and reserved, and the
   networks of the interfaces that carry the host's default routes (its LAN:
   other machines of the cluster, their Ray and weenv ports);
4. accepts ``allow`` and ``allow_dns`` (the addresses that the
   environment's name server answered for a name its ``allow_out`` names,
   each for its TTL: :mod:`weenv.node.runtime.nameserver`), drops ``deny`` and, without
   internet (``Egress.internet`` False), drops the rest; allowed entries
   take precedence, as E2B documents.

DNS follows the same policy: no port-53 exception.  The environment's
``/etc/resolv.conf`` names its own name server (:mod:`weenv.node.runtime.nameserver`, the
node's, inside its namespace), which answers allowed names, every name when
its egress is open, and refuses the rest (no internet: no DNS).

The shared table's drops run first and stay final: no list opens the host
itself (any of its addresses), another environment or link-local addresses.
:func:`teardown` deletes the environment's table.

The node's policy, ``WEENV_NETWORK`` (:func:`policy_from_env`): ``on``
(default) or ``off``; with ``off`` every create that asks for network is
refused (:class:`NetworkForbiddenError`) before anything is made.

Forwarding must be on: :func:`ensure_rules` sets ``net.ipv4.ip_forward`` to 1
(as Docker does), which makes the host route between its other interfaces
too.

IPv6: environments have none (no address, no route; the shared table drops
their IPv6 packets); an IPv6 entry in a list is refused at the request.

Teardown (:func:`teardown`): the host end is deleted (which deletes the pair)
and the nsfs file unmounted; idempotent, and what a crash leaves goes the same
way (the namespace also dies with its last process and mount, taking its veth).
The teardown that deletes the machine's last weenv veth (of any node) also
deletes the table, under :data:`LOCK`: the next setup makes it again, and no
environment is ever without it.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import ipaddress
import json
import os
import random
import shutil
import socket
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

from weenv.config import settings
from weenv.errors import (
    CapacityError,
    NetworkForbiddenError,
    RuntimeFailedError,
    ToolMissingError,
)
from weenv.node.runtime import owned_netns

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
LOCAL_RANGES = (
    "0.0.0.0/8",
    "10.0.0.0/8",
    "100.64.0.0/10",
    "127.0.0.0/8",
    LINK_LOCAL,
    "172.16.0.0/12",
    "192.0.0.0/24",
    "192.168.0.0/16",
    "224.0.0.0/4",
    "240.0.0.0/4",
)
"""Destinations an environment does not reach unless its ``allow_out`` names them
(:func:`local_ranges` adds the host's LAN): "this network", RFC 1918, CGNAT
(RFC 6598), loopback, link-local, IETF protocol assignments, multicast, reserved."""
RESOLV_CONF = Path("/etc/resolv.conf")
"""The host's resolver configuration, bound into every environment (:mod:`weenv.node.runtime.bundle`)."""
TIMEOUT_S = 30.0


POLICY_ENV = "WEENV_NETWORK"
"""The node's network policy: ``on`` (default) or ``off`` (creates with network are refused)."""


def policy_from_env() -> bool:
    """Whether :data:`POLICY_ENV` lets environments have network; raises
    :class:`InvalidInputError` naming the variable for a value not on/off."""
    return settings().network.enabled


def check_policy(allowed: bool) -> None:
    """Raise :class:`NetworkForbiddenError` unless ``allowed`` (the node's policy)."""
    if not allowed:
        raise NetworkForbiddenError(
            f"this node's policy forbids network for environments ({POLICY_ENV}=off): "
            "create without network, allow_out or allow_internet_access, or use another node"
        )


@dataclass(frozen=True)
class Egress:
    """What an environment with network may reach (beyond the shared table's limits)."""

    internet: bool = True
    """Whether a destination in neither list is reachable."""
    allow: tuple[str, ...] = ()
    """IPv4 CIDRs always reachable (precedence over ``deny``)."""
    deny: tuple[str, ...] = ()
    """IPv4 CIDRs refused."""
    domains: tuple[str, ...] = ()
    """Domain names always reachable (``allow_out``'s names, :func:`weenv.api.names.domain`
    patterns): the addresses their answers carry, opened as they are resolved."""

    def names(self):
        """The :class:`~weenv.node.runtime.nameserver.NamePolicy` of its name server."""
        from weenv.node.runtime.nameserver import NamePolicy

        return NamePolicy(names=self.domains, open=self.internet and "0.0.0.0/0" not in self.deny)


def egress_of(internet: bool, allow_out: list[str], deny_out: list[str]) -> Egress:
    """The :class:`Egress` of validated lists (``allow_out``'s domain names apart from its CIDRs)."""
    return Egress(
        internet=internet,
        allow=tuple(a for a in allow_out if "/" in a),
        deny=tuple(deny_out),
        domains=tuple(a for a in allow_out if "/" not in a),
    )


def env_table(env_id: str) -> str:
    """The name of environment ``env_id``'s own table (family ``inet``)."""
    return f"{TABLE}-{env_id[:10]}"


def egress_ruleset(env_id: str, egress: Egress, local: tuple[str, ...] = LOCAL_RANGES) -> str:
    """Environment ``env_id``'s own table as an ``nft -f`` script (see the module
    docstring): ``local``, the ranges dropped unless an ``allow`` entry lies inside
    one of them (:func:`local_ranges`)."""
    veth = f'"{host_ifname(env_id)}"'
    local_nets = [ipaddress.IPv4Network(c) for c in local]
    allow_local = tuple(a for a in egress.allow if any(ipaddress.IPv4Network(a).subnet_of(n) for n in local_nets))

    def nft_set(name: str, cidrs: tuple[str, ...]) -> str:
        nets = ipaddress.collapse_addresses(ipaddress.IPv4Network(c) for c in cidrs)  # no overlap for nft
        elements = f"\n    elements = {{ {', '.join(map(str, nets))} }}" if cidrs else ""
        return f"  set {name} {{\n    type ipv4_addr; flags interval; auto-merge;{elements}\n  }}\n"

    rest = "" if egress.internet else f"    iifname {veth} drop\n"
    return (
        f"table inet {env_table(env_id)} {{\n"
        + nft_set("allow_local", allow_local)
        + nft_set("local", local)
        + nft_set("allow", egress.allow)
        + nft_set("deny", egress.deny)
        + f"  set {DNS_SET} {{\n    type ipv4_addr; flags timeout;\n  }}\n"
        + "  chain egress {\n    type filter hook forward priority filter - 5; policy accept;\n"
        f"    iifname {veth} ip daddr @allow_local accept\n"
        f"    iifname {veth} ct state established,related accept\n"
        f"    iifname {veth} ip daddr @local drop\n"
        f"    iifname {veth} ip daddr @allow accept\n    iifname {veth} ip daddr @{DNS_SET} accept\n"
        f"    iifname {veth} ip daddr @deny drop\n{rest}  }}\n}}\n"
    )


DNS_SET = "allow_dns"
"""The set of an environment's table holding the addresses its allowed names resolved to."""


def open_addresses(env_id: str, addresses: list[tuple[str, int]]) -> None:
    """Add ``[(ipv4, seconds)]`` to environment ``env_id``'s :data:`DNS_SET`, each
    for its seconds (an address there already gets the new timeout).  Raises
    :class:`RuntimeFailedError`."""
    elements = ", ".join(f"{ipaddress.IPv4Address(a)} timeout {int(t)}s" for a, t in addresses)
    table = env_table(env_id)
    # delete-then-add refreshes the timeout of an element present (add keeps the old one)
    _run(
        ["nft", "-f", "-"],
        input=f"add element inet {table} {DNS_SET} {{ {elements} }}\n"
        f"delete element inet {table} {DNS_SET} {{ {', '.join(a for a, _ in addresses)} }}\n"
        f"add element inet {table} {DNS_SET} {{ {elements} }}\n",
    )


def local_ranges() -> tuple[str, ...]:
    """:data:`LOCAL_RANGES` and the networks (``ip route`` scope link) of every
    interface carrying one of the host's default routes, other than a weenv
    veth: the LAN the host is on.  Raises :class:`RuntimeFailedError` or
    :class:`ToolMissingError` (``ip``)."""
    routes = json.loads(_run(["ip", "-j", "-4", "route", "show", "table", "main"]).stdout or "[]")
    uplinks = {r.get("dev") for r in routes if r.get("dst") == "default"} - {None}
    lan = []
    for r in routes:
        if r.get("dev") in uplinks and not r["dev"].startswith(IF_PREFIX) and r.get("scope") == "link":
            with contextlib.suppress(ValueError):
                lan.append(str(ipaddress.IPv4Network(r["dst"], strict=False)))
    return LOCAL_RANGES + tuple(dict.fromkeys(lan))


def name_servers(resolv_conf: Path = RESOLV_CONF) -> tuple[str, ...]:
    """The IPv4 name servers ``resolv_conf`` names (``nameserver ADDRESS`` lines);
    none when it is missing or unreadable."""
    try:
        lines = resolv_conf.read_text(errors="replace").splitlines()
    except OSError:
        return ()
    out = []
    for line in lines:
        words = line.split()
        if len(words) >= 2 and words[0] == "nameserver":
            with contextlib.suppress(ValueError):
                out.append(str(ipaddress.IPv4Address(words[1])))
    return tuple(dict.fromkeys(out))


@dataclass(frozen=True)
class Link:
    """An environment's network: its namespace file, host interface and addresses."""

    netns: Path
    host_if: str
    host_addr: ipaddress.IPv4Interface
    env_addr: ipaddress.IPv4Interface
    userns: Path | None = None
    """The user namespace owning :attr:`netns` (:mod:`weenv.node.runtime.owned_netns`), None: the host's."""


def cidr_from_env() -> ipaddress.IPv4Network:
    """:data:`CIDR_ENV` (default :data:`DEFAULT_CIDR`) as a network of at least
    one /30; raises :class:`InvalidInputError` naming the variable."""
    return settings().network.cidr


def host_ifname(env_id: str) -> str:
    """The host end of environment ``env_id``'s veth (at most 15 bytes, IFNAMSIZ - 1)."""
    return IF_PREFIX + env_id[:10]


def subnet(cidr: ipaddress.IPv4Network, index: int) -> tuple[ipaddress.IPv4Interface, ipaddress.IPv4Interface]:
    """``(host end, environment end)`` of the ``index``-th /30 of ``cidr``."""
    base = int(cidr.network_address) + 4 * index
    return (
        ipaddress.IPv4Interface(f"{ipaddress.IPv4Address(base + 1)}/30"),
        ipaddress.IPv4Interface(f"{ipaddress.IPv4Address(base + 2)}/30"),
    )


def ruleset() -> str:
    """The table ``inet weenv`` as an ``nft -f`` script (see the module docstring)."""
    veth = f'"{IF_PREFIX}*"'
    return f"""table inet {TABLE} {{
  chain input {{
    type filter hook input priority filter - 10; policy accept;
    iifname {veth} fib saddr . iif oif missing drop
    iifname {veth} ct state established,related accept
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


def ensure_rules(also: str = "") -> None:
    """Make the table ``inet weenv`` exactly :func:`ruleset` (and what the
    ``nft -f`` script ``also`` makes, in the same transaction: an
    environment's own table) and turn IPv4 forwarding on.  Call with
    :data:`LOCK` held.

    The table is replaced whole, in one atomic transaction (made if missing,
    deleted, made anew: no packet sees it half made), not only made when
    missing: a table left by an older weenv, or one whose rules were flushed
    (a firewall reload), would otherwise keep its gaps for every environment
    made after it.  One ``nft`` call, as the check for it cost."""
    _run(["nft", "-f", "-"], input=f"table inet {TABLE} {{}}\ndelete table inet {TABLE}\n" + ruleset() + also)
    fwd = Path("/proc/sys/net/ipv4/ip_forward")
    if fwd.read_text().strip() != "1":
        fwd.write_text("1\n")


def setup(
    env_id: str, env_dir: Path, cidr: ipaddress.IPv4Network, egress: Egress = Egress(), host_id: int | None = None
) -> Link:
    """Make environment ``env_id``'s namespace (``env_dir/netns``), veth pair,
    addresses, routes and its own table (see the module docstring); return its
    :class:`Link`.  With ``host_id`` (the environment's host id range) the
    namespace is owned by a user namespace over that range, made with it
    (:mod:`weenv.node.runtime.owned_netns`).
    On failure nothing is left (:func:`teardown`) and :class:`RuntimeFailedError`
    (a command failed), :class:`ToolMissingError` (no ``ip``, ``nft`` or
    ``unshare``) or :class:`CapacityError` (no free /30 in ``cidr``) is raised."""
    netns = env_dir / NETNS_FILE
    host_if = host_ifname(env_id)
    try:
        own = env_table(env_id)
        own_rules = f"table inet {own} {{}}\ndelete table inet {own}\n" + egress_ruleset(env_id, egress, local_ranges())
        with _machine_lock():
            netns.touch(mode=0o600)  # from here on teardown knows there is something to remove
            ensure_rules(own_rules)  # its own table before its veth exists: no packet of it passes unfiltered
            host_addr, env_addr = _free_subnet(cidr)
            if host_id is None:
                _run(["unshare", f"--net={netns}", "true"])
            else:
                owned_netns.make(env_dir / owned_netns.USERNS_FILE, netns, host_id)
            _run(["ip", "link", "add", host_if, "type", "veth", "peer", "name", "eth0", "netns", str(netns)])
            Path(f"/proc/sys/net/ipv6/conf/{host_if}/disable_ipv6").write_text("1\n")
            _run(["ip", "-b", "-"], input=f"addr add {host_addr} dev {host_if}\nlink set {host_if} up\n")
        _run(
            ["nsenter", f"--net={netns}", "ip", "-b", "-"],
            input=f"link set lo up\naddr add {env_addr} dev eth0\nlink set eth0 up\n"
            f"route add default via {host_addr.ip}\n",
        )
    except BaseException:
        teardown(env_id, env_dir)
        raise
    return Link(netns, host_if, host_addr, env_addr, None if host_id is None else env_dir / owned_netns.USERNS_FILE)


def teardown(env_id: str, env_dir: Path) -> None:
    """Remove environment ``env_id``'s veth pair and namespace file, if any
    (idempotent; after the container is gone)."""
    host_if = host_ifname(env_id)
    netns = env_dir / NETNS_FILE
    if Path("/sys/class/net", host_if).exists() or netns.exists():
        with _machine_lock():  # against a setup between the last veth's going and the table's
            _run(["ip", "link", "del", host_if], check=False)
            _run(["nft", "delete", "table", "inet", env_table(env_id)], check=False)  # if it has one
            if not _weenv_links():  # the last environment with network on this machine: no rule is needed
                _run(["nft", "delete", "table", "inet", TABLE], check=False)
    owned_netns.unpin(netns)
    owned_netns.unpin(env_dir / owned_netns.USERNS_FILE)


_CLONE_NEWNET = 0x40000000


def open_in(netns: Path | int, port: int, host: str = "127.0.0.1", timeout: float = TIMEOUT_S) -> socket.socket:
    """A TCP connection to ``host:port`` inside the network namespace ``netns``:
    a namespace file (an environment's ``netns``), or an open descriptor of a
    namespace or of a process (a pidfd, :func:`weenv.host.procroot.pin_process`:
    its namespace, never that of a later process with the same number; left
    open).  The socket is made in a short-lived thread that joins the
    namespace (a thread of the daemon never stays in it), then connected from
    the caller's thread.  Raises ``OSError`` (refused, timed out, no such
    namespace, the process ended: ``ESRCH``)."""
    sock = socket_in(netns, socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect((host, port))
        sock.settimeout(None)
    except BaseException:
        sock.close()
        raise
    return sock


def socket_in(netns: Path | int, family: int, kind: int) -> socket.socket:
    """A socket of ``family`` and ``kind`` made inside the network namespace
    ``netns`` (as :func:`open_in` takes it), in a short-lived thread that joins
    it: the socket stays the namespace's wherever it is used.  Raises ``OSError``."""
    made: list = []

    def make() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        try:
            fd = netns if isinstance(netns, int) else os.open(netns, os.O_RDONLY | os.O_CLOEXEC)
            try:
                if libc.setns(fd, _CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns {netns}: {os.strerror(ctypes.get_errno())}")
            finally:
                if fd is not netns:
                    os.close(fd)
            made.append(socket.socket(family, kind | socket.SOCK_CLOEXEC))
        except OSError as exc:
            made.append(exc)

    t = threading.Thread(target=make, name="weenv-netns-socket")
    t.start()
    t.join()
    if isinstance(made[0], OSError):
        raise made[0]
    return made[0]


def env_address(env_id: str) -> str | None:
    """Environment ``env_id``'s address (the ``.2`` of its host end's /30), None without a link."""
    out = _run(["ip", "-j", "-4", "addr", "show", "dev", host_ifname(env_id)], check=False).stdout
    for link in json.loads(out or "[]"):
        for a in link.get("addr_info", []):
            return str(ipaddress.IPv4Address(a["local"]) + 1)
    return None


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
        proc = subprocess.run(
            argv,
            input=input,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            stdin=None if input is not None else subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as exc:
        raise RuntimeFailedError(f"{' '.join(argv)} took more than {TIMEOUT_S:.0f} s") from exc
    if check and proc.returncode != 0:
        raise RuntimeFailedError(f"{' '.join(argv)} failed: {proc.stderr.strip()}")
    return proc
