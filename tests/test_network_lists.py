"""Network on request (a create's ``network``/``allow_out``/``deny_out``, E2B's
``allow_internet_access`` and ``network.allowOut``/``denyOut``), each
environment's egress table, the node's ``WEENV_NETWORK=off``, and E2B's
``get_host`` through the daemon.

Test hosts are network namespaces made here (RFC 2544's 198.18.0.0/15 for the
internet, private ranges for a LAN: :data:`LOCAL_HOSTS`; on
this machine's veths only), each serving TCP with its own name; no packet goes
to an address outside this machine.  After each test: no weenv veth, no
``weenv-*`` table, no namespace mount (``leak_check``, whose snapshot lists the tables).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time

import httpx
import pytest

from conftest import nft_tables, system_snapshot
from daemon_fixture import start_daemon
from test_isolation import ANSWER_PEER, connect_from, env_address, far_host, host_addresses, host_server  # noqa: F401
from weenv.errors import InvalidInputError, NetworkForbiddenError
from weenv.node.node import Node
from weenv.node.runtime import network

HOSTS = {"one": ("198.19.7.1/30", "198.19.7.2/30"), "two": ("198.19.7.5/30", "198.19.7.6/30")}
PORT = 8090


def _tables() -> list[str]:
    return nft_tables()


@pytest.fixture
def no_leak(leak_check):
    """``leak_check``, which also finds weenv nft tables left (each environment's, or the
    shared one).  It checked the tables itself before, at its own teardown: before the
    ``node`` fixture's close, so a test that failed with environments alive (a create
    refused by admission in a full run) was reported as leaking their tables."""
    yield


@pytest.fixture
def far_hosts(tmp_path):
    """Two namespaces beyond the host (``one``, ``two``), each answering
    ``NAME PEER`` on :data:`PORT`; name -> address."""
    with contextlib.ExitStack() as stack:
        yield {
            name: stack.enter_context(
                far_host(tmp_path / f"ns-{name}", f"wvt{name}{os.getpid() % 10000}", host_end, far_end, PORT, name)
            )
            for name, (host_end, far_end) in HOSTS.items()
        }


LOCAL_HOSTS = {
    "pa": ("172.31.250.1/30", "172.31.250.2/30"),
    "pb": ("192.168.250.1/30", "192.168.250.2/30"),
    "pc": ("100.64.250.1/30", "100.64.250.2/30"),
}
"""Test hosts in RFC 1918's 172.16/12 and 192.168/16 and CGNAT's 100.64/10 (network namespaces made here)."""


@pytest.fixture
def local_hosts(tmp_path):
    """Three namespaces on private addresses (:data:`LOCAL_HOSTS`), each answering
    ``NAME PEER`` on :data:`PORT`, as a LAN's machines would; name -> address."""
    with contextlib.ExitStack() as stack:
        yield {
            name: stack.enter_context(
                far_host(tmp_path / f"ns-{name}", f"wvt{name}{os.getpid() % 10000}", host_end, far_end, PORT, name)
            )
            for name, (host_end, far_end) in LOCAL_HOSTS.items()
        }


PROBE_ALL = """
import concurrent.futures, json, socket, sys
def probe(addr):
    try:
        with socket.create_connection((addr, int(sys.argv[1])), timeout=1.5) as s:
            s.settimeout(3)
            return s.recv(100).decode().split()[0]
    except OSError as exc:
        return type(exc).__name__
with concurrent.futures.ThreadPoolExecutor(len(sys.argv) - 2) as pool:
    print(json.dumps(dict(zip(sys.argv[2:], pool.map(probe, sys.argv[2:])))))
"""


def _answers(node, env_id: str, addrs: list[str], port: int = PORT) -> dict[str, str]:
    """address -> the first word each of ``addrs`` answers on ``port``, or the
    error's class name, probed from inside at once (a dropped one costs its
    1.5 s timeout once, not in turn)."""
    r = node.exec(env_id, ["python3", "-c", PROBE_ALL, str(port), *addrs], timeout=30)
    assert r.exit_code == 0, r
    return json.loads(r.stdout)


def _reach_all(node, env_id: str, hosts: dict[str, str]) -> dict[str, bool]:
    """Which of ``hosts`` (name -> address) answer with their own name on :data:`PORT`."""
    got = _answers(node, env_id, list(hosts.values()))
    return {name: got[addr] == name for name, addr in hosts.items()}


def _reach(node, env_id: str, hosts: dict[str, str]) -> dict[str, bool]:
    return {name: connect_from(node, env_id, addr, PORT).startswith("connected") for name, addr in hosts.items()}


def test_network_on_request_and_egress_lists(node, far_hosts, host_server, no_leak):  # noqa: F811
    one, two = far_hosts["one"], far_hosts["two"]
    plain = node.create("task")  # the template has no network, and none was asked
    assert plain.address is None and _reach(node, plain.id, far_hosts) == {"one": False, "two": False}
    on = node.create("task", network=True)
    assert on.address == str(env_address(on.id)) and _reach(node, on.id, far_hosts) == {"one": True, "two": True}
    denied = node.create("task", network=True, deny_out=[f"{two}/32"])
    assert _reach(node, denied.id, far_hosts) == {"one": True, "two": False}
    only = node.create("task", allow_out=[one])  # a list alone: network, that list only
    assert _reach(node, only.id, far_hosts) == {"one": True, "two": False}
    # allowed entries take precedence over denied ones (E2B's rule): all denied, one allowed
    both = node.create("task", network=True, allow_out=["198.19.7.0/30"], deny_out=["0.0.0.0/0"])
    assert _reach(node, both.id, far_hosts) == {"one": True, "two": False}
    # no list opens the host or another environment: the shared table's drops stay final
    host_end = str(env_address(both.id) - 1)
    opened = node.create("task", allow_out=[host_end, f"{env_address(on.id)}/32", "198.19.7.0/29"])
    assert connect_from(node, opened.id, host_end, host_server) == "TimeoutError"
    p = node.spawn(on.id, ["python3", "-c", ANSWER_PEER, "0.0.0.0", "8082", "on"])
    try:
        assert connect_from(node, opened.id, str(env_address(on.id)), 8082) == "TimeoutError"
    finally:
        p.kill()
    tables = _tables()
    assert network.env_table(plain.id) not in tables  # no network: no table
    assert {network.env_table(e.id) for e in (on, denied, only, both, opened)} <= set(tables)
    for e in (plain, on, denied, only, both, opened):
        node.destroy(e.id)
    assert not [t for t in _tables() if t.startswith("weenv-")]


def test_local_destinations_are_dropped_unless_an_allow_entry_names_them(
    node, local_hosts, far_hosts, host_server, no_leak
):  # noqa: F811
    """An environment with network reached every private address the host
    routes to (RFC 1918, CGNAT, the host's LAN: other machines of the
    cluster, their Ray and weenv ports).  Now they are dropped by default; an
    ``allow_out`` entry inside a private range opens that part (allow wins,
    as E2B's), one that merely covers it (``0.0.0.0/0``) does not; the host
    itself stays closed whatever the lists say."""
    none = {"pa": False, "pb": False, "pc": False}
    on = node.create("task", network=True)
    assert _reach_all(node, on.id, local_hosts) == none
    assert _reach_all(node, on.id, far_hosts) == {"one": True, "two": True}  # beyond the LAN: as before
    everything = node.create("task", allow_out=["0.0.0.0/0"])
    assert _reach_all(node, everything.id, local_hosts) == none
    named = node.create(
        "task", network=True, deny_out=["0.0.0.0/0"], allow_out=[f"{local_hosts['pa']}/32", "100.64.0.0/10"]
    )
    assert _reach_all(node, named.id, local_hosts) == {"pa": True, "pb": False, "pc": True}
    assert _reach_all(node, named.id, far_hosts) == {"one": False, "two": False}
    hosts = [a for a in host_addresses() if not a.startswith("127.")]
    assert hosts, "the host has a non-loopback address"
    host = node.create("task", network=True, allow_out=[f"{a}/32" for a in hosts] + ["10.0.0.0/8"])
    # this machine's own addresses (where Ray and the daemon listen): never
    assert set(_answers(node, host.id, hosts, host_server).values()) == {"TimeoutError"}
    for e in (on, everything, named, host):
        node.destroy(e.id)


@pytest.mark.parametrize("bad", ["10.0.0.0/33", "10.0.0.1/8", "-bad-.com", "a..b.com", "localhost", ""])
def test_a_list_entry_that_is_not_a_cidr_or_a_name_is_refused_before_anything_is_made(node, bad, no_leak):
    with pytest.raises(InvalidInputError, match="not an IPv4 CIDR"):
        node.create("task", allow_out=[bad])
    with pytest.raises(InvalidInputError, match="not an IPv4 CIDR"):
        node.create("task", deny_out=["10.0.0.0/8", bad])
    assert node.count() == 0


def test_ipv6_entries_and_names_in_deny_out_are_refused_clearly(node, no_leak):
    """Environments have no IPv6 (no address, no route): an IPv6 entry says so;
    a domain name in ``deny_out`` is refused as E2B refuses it."""
    for fields in ({"allow_out": ["::1/128"]}, {"deny_out": ["2001:db8::/32"]}, {"allow_out": ["2001:db8::1"]}):
        with pytest.raises(InvalidInputError, match="IPv6 is not served"):
            node.create("task", **fields)
    with pytest.raises(InvalidInputError, match="domain names are not supported in deny_out"):
        node.create("task", network=True, deny_out=["example.com"])
    assert node.count() == 0


DNS_SERVER = r"""
import json, socket, sys
import dns.message, dns.rcode, dns.rdatatype, dns.rrset
names = json.loads(sys.argv[3])
log = open(sys.argv[4], "a", buffering=1)
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind((sys.argv[1], int(sys.argv[2])))
print("ready", flush=True)
while True:
    data, peer = s.recvfrom(4096)
    q = dns.message.from_wire(data)
    name = q.question[0].name.to_text(omit_final_dot=True)
    log.write(f"{name} {peer[0]}\n")
    r = dns.message.make_response(q)
    if name not in names:
        r.set_rcode(dns.rcode.NXDOMAIN)
    elif q.question[0].rdtype == dns.rdatatype.A:
        r.answer.append(dns.rrset.from_text(q.question[0].name, 5, "IN", "A", names[name]))
    s.sendto(r.to_wire(), peer)
"""
"""A name server for the test's names only (dnspython), run in a test host's namespace: it logs each query."""

RESOLVE_AND_REACH = r"""
import json, socket, sys
out = {}
for name in sys.argv[3:]:
    try:
        addr = socket.getaddrinfo(name, None, socket.AF_INET)[0][4][0]
    except OSError:
        out[name] = "unresolved"
        continue
    try:
        with socket.create_connection((addr, int(sys.argv[1])), timeout=1.5) as s:
            s.settimeout(3)
            out[name] = addr + " " + s.recv(100).decode().split()[0]
    except OSError as exc:
        out[name] = addr + " " + type(exc).__name__
q = b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00" + b"".join(
    bytes([len(x)]) + x.encode() for x in "svc.weenv.test".split(".")) + b"\x00\x00\x01\x00\x01"
d = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
d.settimeout(1.5)
d.sendto(q, (sys.argv[2], 53))
try:
    d.recv(512)
    out["direct"] = "answered"
except OSError as exc:
    out["direct"] = type(exc).__name__
print(json.dumps(out))
"""
"""Inside an environment: each name's address (its resolver: /etc/resolv.conf) and
the first word its host answers on PORT; ``direct``: a query sent to ARGV[2]:53 itself."""


@pytest.fixture
def name_server(tmp_path, far_hosts):
    """:data:`DNS_SERVER` on test host ``two``'s address, port 53, answering
    ``svc.weenv.test`` and names under ``wild.weenv.test`` with host ``one``,
    ``other.weenv.test`` with ``two``; ``(address, log file)``."""
    one, two = far_hosts["one"], far_hosts["two"]
    names = {"svc.weenv.test": one, "wild.weenv.test": one, "a.b.wild.weenv.test": one, "other.weenv.test": two}
    log_file = tmp_path / "queries"
    log_file.touch()
    ns = tmp_path / "ns-two"
    server = subprocess.Popen(
        ["nsenter", f"--net={ns}", sys.executable, "-c", DNS_SERVER, two, "53", json.dumps(names), str(log_file)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout.readline() == "ready\n"
        yield two, log_file
    finally:
        server.kill()
        server.wait()


def test_names_in_allow_out_open_their_answers_and_dns_follows_the_policy(node, far_hosts, name_server, no_leak):
    """``allow_out`` took CIDRs only (E2B's takes domain names too), and DNS to
    the resolv.conf name servers was accepted before ``deny_out`` and with
    internet off (a way out: a DNS tunnel).  Now each environment with network
    resolves through its own name server (the node's, inside its namespace):
    an allowed name is answered and the addresses of its answer opened; with
    egress closed every other name is refused without reaching any server, and
    no environment reaches a name server its egress does not allow."""
    one, two = far_hosts["one"], far_hosts["two"]
    dns_addr, log_file = name_server
    node.containers.dns.upstream = [(dns_addr, 53)]
    names = ["svc.weenv.test", "a.b.wild.weenv.test", "wild.weenv.test", "other.weenv.test"]

    def resolve(env_id: str) -> dict[str, str]:
        r = node.exec(env_id, ["python3", "-c", RESOLVE_AND_REACH, str(PORT), dns_addr, *names], timeout=60)
        assert r.exit_code == 0, r
        return json.loads(r.stdout)

    named = node.create("task", allow_out=["svc.weenv.test", "*.wild.weenv.test"])  # internet off
    assert named.allow_out == ["svc.weenv.test", "*.wild.weenv.test"]
    assert resolve(named.id) == {
        "svc.weenv.test": f"{one} one",
        "a.b.wild.weenv.test": f"{one} one",
        "wild.weenv.test": "unresolved",  # a wildcard names subdomains only
        "other.weenv.test": "unresolved",
        "direct": "TimeoutError",
    }
    assert connect_from(node, named.id, two, PORT) == "TimeoutError"  # only what an allowed name answered
    asked = log_file.read_text().split()
    assert "svc.weenv.test" in asked and "other.weenv.test" not in asked and "wild.weenv.test" not in asked

    log_file.write_text("")
    closed = node.create("task", allow_out=[f"{one}/32"])  # network, no internet, no names: no DNS
    assert resolve(closed.id) == {n: "unresolved" for n in names} | {"direct": "TimeoutError"}
    assert log_file.read_text() == ""  # no query of it left the node
    rules = subprocess.run(
        ["nft", "list", "table", "inet", network.env_table(closed.id)], capture_output=True, text=True, check=True
    ).stdout
    assert "dport 53" not in rules and "allow_dns" in rules

    walled = node.create("task", network=True, allow_out=["svc.weenv.test"], deny_out=["0.0.0.0/0"])
    got = resolve(walled.id)
    assert got["svc.weenv.test"] == f"{one} one" and got["other.weenv.test"] == "unresolved", got
    assert got["direct"] == "TimeoutError"

    opened = node.create("task", network=True)  # egress open: every name, and any name server
    got = resolve(opened.id)
    assert got["other.weenv.test"] == f"{two} two" and got["svc.weenv.test"] == f"{one} one", got
    assert got["direct"] == "answered"
    child = node.fork(named.id, 1).children[0]  # a fork child inherits the names
    assert resolve(child.id)["svc.weenv.test"] == f"{one} one"
    for e in (named, closed, walled, opened, child):
        node.destroy(e.id)


def test_a_node_whose_policy_forbids_network_refuses_it(paths, shared_store, monkeypatch, no_leak):
    monkeypatch.setenv(network.POLICY_ENV, "off")
    with Node(paths, store=shared_store, pool_size=0) as node:
        for fields in ({"network": True}, {"allow_out": ["198.19.7.2"]}):
            with pytest.raises(NetworkForbiddenError, match="WEENV_NETWORK=off"):
                node.create("task", **fields)
        assert node.count() == 0 and not os.listdir(paths.environments)
        assert node.create("task").address is None  # without network: fine
    monkeypatch.setenv(network.POLICY_ENV, "sometimes")
    with pytest.raises(InvalidInputError, match="want on or off"):
        Node(paths, store=shared_store)


def test_e2b_sdk_network_options_and_get_host(tmp_path_factory, shared_store, far_hosts, name_server, monkeypatch):
    pytest.importorskip("e2b")
    from e2b import Sandbox
    from e2b.exceptions import InvalidArgumentException, SandboxException

    home = tmp_path_factory.mktemp("net-e2b-home")
    before = system_snapshot(home)
    monkeypatch.setenv("WEENV_DNS_UPSTREAM", f"{name_server[0]}:53")  # the test's names only
    daemon = start_daemon(home, shared_store.url)
    url = daemon.url
    one, two = far_hosts["one"], far_hosts["two"]
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("E2B_API_URL", url + "/e2b")
            mp.setenv("E2B_SANDBOX_URL", url + "/e2b/envd")
            mp.setenv("E2B_API_KEY", "e2b_" + daemon.key)
            probe = (
                f"import socket,sys\ntry:\n socket.create_connection((sys.argv[1], {PORT}), timeout=1.5)\n"
                " print('ok')\nexcept OSError as e:\n print(type(e).__name__)"
            )

            def reach(sbx, addr):
                return sbx.commands.run(f'python3 -c "{probe}" {addr}').stdout.strip()

            sbx = Sandbox.create("task", allow_internet_access=True, timeout=120)
            lists = Sandbox.create(
                "task", allow_internet_access=False, timeout=120, network={"allow_out": [f"{one}/32"]}
            )
            closed = Sandbox.create("task", timeout=120)
            named = Sandbox.create(
                "task",
                allow_internet_access=True,
                timeout=120,  # E2B's domain pattern
                network={"allow_out": ["svc.weenv.test"], "deny_out": ["0.0.0.0/0"]},
            )
            try:
                assert reach(named, "svc.weenv.test") == "ok" and reach(named, "other.weenv.test") == "gaierror"
                assert reach(named, two) == "TimeoutError"
                assert reach(sbx, one) == "ok" and reach(sbx, two) == "ok"
                assert reach(lists, one) == "ok" and reach(lists, two) == "TimeoutError"
                assert reach(closed, one) != "ok"  # no network unless asked
                # get_host: PORT-ID.DOMAIN, proxied by the daemon to the port inside the sandbox
                sbx.commands.run(
                    "cd /tmp && echo served > index.html && python3 -m http.server 8000 >/dev/null 2>&1",
                    background=True,
                )
                host = sbx.get_host(8000)
                assert host.startswith(f"8000-{sbx.sandbox_id}.")
                deadline = time.monotonic() + 20
                while True:
                    r = httpx.get(url + "/index.html", headers={"Host": host}, timeout=5)
                    if r.status_code == 200 or time.monotonic() > deadline:
                        break
                    time.sleep(0.2)
                assert r.status_code == 200 and r.text == "served\n"
                posted = httpx.post(url + "/nothing", headers={"Host": host}, content=b"x" * 100_000, timeout=5)
                assert posted.status_code == 501  # http.server's answer to POST, relayed
                closed_port = httpx.get(url + "/", headers={"Host": f"8001-{sbx.sandbox_id}.e2b.app"}, timeout=5)
                assert closed_port.status_code == 502 and "port is not open" in closed_port.text
                unknown = httpx.get(url + "/", headers={"Host": "8000-0123456789ab.e2b.app"}, timeout=5)
                assert unknown.status_code == 502 and "not found" in unknown.text
                # a sandbox without network is reachable the same way (inside its own namespace)
                closed.commands.run(
                    "cd /tmp && echo closed > index.html && python3 -m http.server 8000 >/dev/null 2>&1",
                    background=True,
                )
                deadline = time.monotonic() + 20
                while (
                    r := httpx.get(url + "/index.html", headers={"Host": closed.get_host(8000)}, timeout=5)
                ).status_code != 200 and time.monotonic() < deadline:
                    time.sleep(0.2)
                assert r.text == "closed\n"
            finally:
                for s in (sbx, lists, closed, named):
                    s.kill()
            with pytest.raises((InvalidArgumentException, SandboxException), match="not an IPv4 CIDR"):
                Sandbox.create("task", timeout=60, network={"deny_out": ["not-a-cidr"]})
    finally:
        daemon.stop()
    after = system_snapshot(home)
    for kind in after:
        assert not set(after[kind]) - set(before[kind]), f"leaked {kind}"
    assert not [t for t in _tables() if t.startswith("weenv-")]
