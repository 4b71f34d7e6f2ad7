"""Each environment's name server: the node answers its DNS, as its egress policy says.

Why here, and why names become addresses (not SNI or ``Host`` filtering):
E2B's ``allowOut`` takes domain names (``example.com``, ``*.example.com``).
weenv enforces them where every packet already is checked, in the
environment's nftables table (:mod:`weenv.node.runtime.network`): the node resolves
the environment's names itself and opens, for an allowed name, exactly the
IPv4 addresses its answer carried (an nft set with per-element timeouts, the
answer's TTL, at least :data:`MIN_OPEN_S`).  That holds for every protocol
(TCP, UDP, TLS or not) and needs no proxy in the data path; a proxy reading
TLS's SNI or HTTP's ``Host`` would cover ports 80/443 only, and a client may
name an allowed host there while it talks to any address.  The limit of the
choice: an address serving many names (a CDN) is opened for all of them once
an allowed name resolves to it.

How: for every environment with network, two sockets are made *inside its
network namespace* (UDP and TCP, ``127.0.0.53:53``, :data:`LISTEN`), and its
``/etc/resolv.conf`` names only that address.  The node serves them from one
thread of its own (an asyncio loop); a query reaching one of them came from
that environment and no other (no address to spoof: the socket is its
namespace's).  Each query (one question, at most :data:`MAX_QUERY` bytes, at
most :data:`MAX_PENDING` at once per environment) is:

- for a name its ``allowOut`` names: forwarded to the upstream servers and,
  before the answer goes back, the answer's A records added to its set
  ``allow_dns`` (so the client's connect right after finds them open);
- else, when its egress is open (internet on and ``0.0.0.0/0`` not denied):
  forwarded as it is;
- else refused (``REFUSED``): no internet, no DNS (a name server reached by
  name lookups would be a way out: a DNS tunnel).

The environment's packets to other name servers follow its egress rules like
any others (no port-53 exception).  Upstream: :data:`UPSTREAM_ENV`
(``ADDRESS[:PORT],...``), else the host's ``/etc/resolv.conf`` name servers,
queried from the host's namespace (so a resolver on a host address, such as
systemd-resolved's 127.0.0.53, works too); each tried in turn, for
:data:`UPSTREAM_TIMEOUT_S` seconds.  Addresses that an answer opens but that lie in
a local range stay closed (the set is checked after the local drop: no DNS
rebinding into the LAN).  IPv4 only: AAAA answers pass through and open
nothing (environments have no IPv6 route).

Parsing and building DNS messages: dnspython (``dns.message``); a message it
cannot parse is dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import dns.asyncquery
import dns.exception
import dns.flags
import dns.message
import dns.rcode
import dns.rdatatype

from weenv.config import settings
from weenv.errors import InvalidInputError

log = logging.getLogger(__name__)

LISTEN = ("127.0.0.53", 53)
"""Where an environment's name server answers, inside its own network namespace."""
RESOLV_CONF = f"nameserver {LISTEN[0]}\noptions edns0\n"
"""The ``/etc/resolv.conf`` of an environment with network."""
UPSTREAM_ENV = "WEENV_DNS_UPSTREAM"
UPSTREAM_TIMEOUT_S = 2.0
MAX_QUERY = 4096
MAX_PENDING = 64
TCP_IDLE_S = 10.0
MIN_OPEN_S = 60
MAX_OPEN_S = 86400


def matches(name: str, patterns: tuple[str, ...]) -> bool:
    """Whether ``name`` (lowercase, no final dot) is one of ``patterns`` (:func:`weenv.api.names.domain`'s)."""
    return any(name.endswith(p[1:]) if p.startswith("*.") else name == p for p in patterns)


@dataclass(frozen=True)
class NamePolicy:
    """What an environment's name server answers (see the module docstring)."""

    names: tuple[str, ...] = ()
    """Allowed names (:func:`weenv.api.names.domain` patterns): answered, their addresses opened."""
    open: bool = False
    """Every other name answered too (its egress is open)."""


def upstream_from_env(resolv_conf: Path = Path("/etc/resolv.conf")) -> list[tuple[str, int]]:
    """:data:`UPSTREAM_ENV` (``ADDRESS[:PORT],...``) or the IPv4 name servers of
    ``resolv_conf`` (port 53).  Raises :class:`InvalidInputError` naming the variable."""
    raw = settings().network.dns_upstream or ""
    if not raw:
        from weenv.node.runtime.network import name_servers

        return [(a, 53) for a in name_servers(resolv_conf)]
    out = []
    for part in raw.split(","):
        host, _, port = part.strip().partition(":")
        try:
            out.append((str(ipaddress.IPv4Address(host)), int(port or 53)))
        except ValueError:
            raise InvalidInputError(f"{UPSTREAM_ENV}={raw!r}: want IPv4 ADDRESS[:PORT],...") from None
        if not 0 < out[-1][1] < 65536:
            raise InvalidInputError(f"{UPSTREAM_ENV}={raw!r}: port out of range")
    return out


class _Env:
    def __init__(self, policy: NamePolicy, open_addresses: Callable[[list[tuple[str, int]]], None]):
        self.policy = policy
        self.open_addresses = open_addresses
        self.pending = 0
        self.socks: list[socket.socket] = []
        self.closers: list[Callable[[], None]] = []


class DnsProxy:
    """The node's name servers of its environments (see the module docstring).
    Thread-safe; its loop thread starts at the first :meth:`attach`."""

    def __init__(self, upstream: list[tuple[str, int]] | None = None):
        self.upstream = upstream_from_env() if upstream is None else upstream
        self._envs: dict[str, _Env] = {}
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def _start(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=loop.run_forever, name="weenv-dns", daemon=True)
                self._thread.start()
                self._loop = loop
            return self._loop

    def attach(
        self, env_id: str, netns: Path, policy: NamePolicy, open_addresses: Callable[[list[tuple[str, int]]], None]
    ) -> None:
        """Serve environment ``env_id``'s names on :data:`LISTEN` inside ``netns``;
        ``open_addresses([(ipv4, seconds)])`` opens the addresses of an allowed
        name's answer (blocking; called before the answer is sent).  Raises
        ``OSError`` when the sockets cannot be made."""
        from weenv.node.runtime.network import socket_in

        self.detach(env_id)
        env = _Env(policy, open_addresses)
        try:
            udp = socket_in(netns, socket.AF_INET, socket.SOCK_DGRAM)
            env.socks.append(udp)
            udp.bind(LISTEN)
            tcp = socket_in(netns, socket.AF_INET, socket.SOCK_STREAM)
            env.socks.append(tcp)
            tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            tcp.bind(LISTEN)
            tcp.listen(16)
            for s in env.socks:
                s.setblocking(False)
            loop = self._start()
            asyncio.run_coroutine_threadsafe(self._serve(env, udp, tcp), loop).result(timeout=10)
        except BaseException:
            self._close_env(env)
            raise
        with self._lock:
            self._envs[env_id] = env

    def detach(self, env_id: str) -> None:
        """Stop serving ``env_id`` (idempotent)."""
        with self._lock:
            env = self._envs.pop(env_id, None)
        if env is not None:
            self._close_env(env)

    def _close_env(self, env: _Env) -> None:
        loop = self._loop
        if loop is not None and env.closers:

            async def close_all() -> None:
                for c in env.closers:
                    with contextlib.suppress(Exception):
                        c()

            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(close_all(), loop).result(timeout=10)
        for s in env.socks:
            s.close()

    def close(self) -> None:
        """Stop serving every environment and end the thread (idempotent)."""
        with self._lock:
            ids = list(self._envs)
        for env_id in ids:
            self.detach(env_id)
        loop, self._loop = self._loop, None
        if loop is not None:
            loop.call_soon_threadsafe(loop.stop)
            if self._thread is not None:
                self._thread.join(timeout=10)

    # --- the loop's side --------------------------------------------------------------------
    async def _serve(self, env: _Env, udp: socket.socket, tcp: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        proxy = self

        class Datagrams(asyncio.DatagramProtocol):
            def connection_made(self, transport) -> None:
                self.transport = transport

            def datagram_received(self, data: bytes, addr) -> None:
                if len(data) > MAX_QUERY or env.pending >= MAX_PENDING:
                    return  # dropped: the client retries
                env.pending += 1

                async def one() -> None:
                    try:
                        answer = await proxy._answer(env, data, tcp=False)
                        if answer is not None and not self.transport.is_closing():
                            self.transport.sendto(answer, addr)
                    finally:
                        env.pending -= 1

                loop.create_task(one())

        transport, _ = await loop.create_datagram_endpoint(Datagrams, sock=udp)
        env.closers.append(transport.close)

        async def stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while True:
                    head = await asyncio.wait_for(reader.readexactly(2), TCP_IDLE_S)
                    (n,) = struct.unpack("!H", head)
                    data = await asyncio.wait_for(reader.readexactly(n), TCP_IDLE_S)
                    answer = await proxy._answer(env, data, tcp=True)
                    if answer is None:
                        return
                    writer.write(struct.pack("!H", len(answer)) + answer)
                    await writer.drain()
            except (TimeoutError, asyncio.IncompleteReadError, OSError):
                pass
            finally:
                writer.close()

        server = await asyncio.start_server(stream, sock=tcp)
        env.closers.append(server.close)

    async def _answer(self, env: _Env, data: bytes, *, tcp: bool) -> bytes | None:
        """The answer to the query ``data`` (None: dropped)."""
        try:
            query = dns.message.from_wire(data)
        except (dns.exception.DNSException, ValueError):
            return None
        if query.flags & dns.flags.QR or len(query.question) != 1:
            return None
        name = query.question[0].name.to_text(omit_final_dot=True).lower()
        allowed = matches(name, env.policy.names)
        if not (allowed or env.policy.open):
            return _refused(query)
        response = await self._forward(query, tcp=tcp)
        if response is None:
            r = dns.message.make_response(query)
            r.set_rcode(dns.rcode.SERVFAIL)
            return r.to_wire()
        if allowed:
            opened = [
                (rd.address, min(max(rrset.ttl, MIN_OPEN_S), MAX_OPEN_S))
                for rrset in response.answer
                if rrset.rdtype == dns.rdatatype.A
                for rd in rrset
            ]
            if opened:
                try:
                    await asyncio.get_running_loop().run_in_executor(None, env.open_addresses, opened)
                except Exception as exc:  # not opened: the client is told the name failed
                    log.warning("dns: opening %s for %s failed: %s", opened, name, exc)
                    r = dns.message.make_response(query)
                    r.set_rcode(dns.rcode.SERVFAIL)
                    return r.to_wire()
        try:
            return response.to_wire(max_size=65535 if tcp else max(512, query.payload))
        except dns.exception.TooBig:
            r = dns.message.make_response(query)
            r.flags |= dns.flags.TC
            return r.to_wire()

    async def _forward(self, query: dns.message.Message, *, tcp: bool) -> dns.message.Message | None:
        """The first upstream answer (a TCP query over TCP, else over UDP), None if none answered."""
        for host, port in self.upstream:
            for over_tcp in (True, False) if tcp else (False,):
                try:
                    if over_tcp:
                        return await dns.asyncquery.tcp(query, host, timeout=UPSTREAM_TIMEOUT_S, port=port)
                    return await dns.asyncquery.udp(
                        query, host, timeout=UPSTREAM_TIMEOUT_S, port=port, ignore_trailing=True
                    )
                except (dns.exception.DNSException, OSError, ValueError, EOFError):
                    continue
        return None


def _refused(query: dns.message.Message) -> bytes:
    r = dns.message.make_response(query)
    r.set_rcode(dns.rcode.REFUSED)
    return r.to_wire()
