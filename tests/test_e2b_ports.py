"""E2B's ``get_host`` relay (:mod:`weenv.server.e2b.ports`) under its limits,
against a real ``weenv serve`` started with ``WEENV_RELAY_MAX=4`` and
``WEENV_RELAY_IDLE_S=2``: ``allowPublicTraffic=false`` and the traffic access
token, the request body limit, the idle timeout, the cap on relays at once
(the API keeps answering), and the namespace of a sandbox without network
pinned by a pidfd, never a bare process number.

A server inside each sandbox (:data:`SERVER`) answers by path: ``/headers``
echoes the request's headers, ``/count`` the size of its body, ``/hang``
never answers, ``/trickle`` sends its four bytes one a second, ``/sink`` reads
and drops a body without answering."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

e2b = pytest.importorskip("e2b")

from e2b import Sandbox

from e2b_fixture import E2B, e2b_daemon
from test_e2b import TEMPLATE
from weenv.errors import NotFoundError
from weenv.server.limits import MAX_BODY

PORT = 8000
SERVER = r"""
import http.server, json, sys, time
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a):
        pass
    def note(self):
        with open("/tmp/requests", "a") as f:
            f.write(self.path + "\n")
    def answer(self, body):
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def do_GET(self):
        self.note()
        if self.path == "/hang":
            time.sleep(3600)
        if self.path == "/trickle":
            self.send_response(200)
            self.send_header("content-length", "4")
            self.end_headers()
            for c in b"abcd":
                self.wfile.write(bytes([c]))
                self.wfile.flush()
                time.sleep(1)
            return
        self.answer(json.dumps({k.lower(): v for k, v in self.headers.items()}).encode())
    def do_POST(self):
        self.note()
        if self.path == "/sink":
            while self.rfile.read1(1 << 16):
                pass
            return
        n, left = 0, int(self.headers.get("content-length", 0))
        while left:
            got = self.rfile.read(min(left, 1 << 16))
            n, left = n + len(got), left - len(got)
        self.answer(str(n).encode())
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, shared_store):
    with e2b_daemon(
        tmp_path_factory.mktemp("e2b-ports"), None, shared_store.url, WEENV_RELAY_MAX="4", WEENV_RELAY_IDLE_S="2"
    ) as d:
        yield d


def _serve(sbx: Sandbox, daemon: E2B, headers: dict | None = None) -> str:
    """Start :data:`SERVER` in ``sbx`` and wait until the relay reaches it; its host."""
    sbx.files.write("/tmp/server.py", SERVER)
    sbx.commands.run(f"python3 /tmp/server.py {PORT} >/dev/null 2>&1", background=True)
    host = sbx.get_host(PORT)
    deadline = time.monotonic() + 20
    while (
        r := httpx.get(daemon.daemon.url + "/headers", headers={"Host": host, **(headers or {})}, timeout=5)
    ).status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert r.status_code == 200, r.text
    sbx.files.write("/tmp/requests", "")
    return host


@pytest.fixture(scope="module")
def public(daemon):
    s = Sandbox.create(TEMPLATE, timeout=300)
    host = _serve(s, daemon)
    yield s, host
    s.kill()


def _get(daemon, host: str, path: str, **kw) -> httpx.Response:
    headers = {"Host": host, **kw.pop("headers", {})}
    return httpx.request(
        kw.pop("method", "GET"), daemon.daemon.url + path, headers=headers, timeout=kw.pop("timeout", 10), **kw
    )


def test_a_private_sandboxs_ports_need_its_traffic_token(daemon, public):
    """``allowPublicTraffic=false`` was ignored: anyone knowing the id reached
    its ports.  Now a request without the sandbox's token (or with another's)
    is 403 and never reaches it; with it, it does, and the token is not passed on."""
    s = Sandbox.create(TEMPLATE, timeout=300, network={"allow_public_traffic": False})
    try:
        token = s.traffic_access_token
        assert token and len(token) == 32 and token != s._envd_access_token  # noqa: SLF001
        assert public[0].traffic_access_token is None  # public (E2B's default): none
        host = _serve(s, daemon, {"e2b-traffic-access-token": token})
        for headers in (
            {},
            {"e2b-traffic-access-token": "0" * 32},
            {"e2b-traffic-access-token": Sandbox.connect(public[0].sandbox_id).traffic_access_token or ""},
        ):
            r = _get(daemon, host, "/headers", headers=headers)
            assert r.status_code == 403 and "traffic access token" in r.json()["message"], r.text
        assert s.files.read("/tmp/requests") == ""  # none of them reached it
        r = _get(daemon, host, "/headers", headers={"e2b-traffic-access-token": token, "x-mine": "1"})
        assert r.status_code == 200 and r.json()["x-mine"] == "1" and "e2b-traffic-access-token" not in r.json()
        assert Sandbox.connect(s.sandbox_id).traffic_access_token == token
        assert _get(daemon, public[1], "/headers").status_code == 200  # a public one needs nothing
    finally:
        s.kill()


def test_a_relayed_body_is_bounded(daemon, public):
    s, host = public
    r = _get(daemon, host, "/count", method="POST", content=b"x" * (1 << 20))
    assert r.status_code == 200 and r.text == str(1 << 20)
    big = _get(daemon, host, "/count", method="POST", content=b"x" * (MAX_BODY + 1))
    assert big.status_code == 413 and str(MAX_BODY) in big.json()["message"]

    def chunks():
        for _ in range((MAX_BODY >> 16) + 2):
            yield b"y" * (1 << 16)

    t = time.monotonic()
    chunked = _get(daemon, host, "/sink", method="POST", content=chunks())
    assert chunked.status_code == 413 and time.monotonic() - t < 10
    assert "/count" in s.files.read("/tmp/requests").splitlines()  # the first; the Content-Length one never came
    assert s.files.read("/tmp/requests").count("/count") == 1


def test_an_idle_relay_ends_and_a_trickling_one_does_not(daemon, public):
    _s, host = public
    t = time.monotonic()
    r = _get(daemon, host, "/hang", timeout=30)
    assert r.status_code == 504 and "2 s" in r.json()["message"]
    assert 1.5 < time.monotonic() - t < 10
    t = time.monotonic()
    r = _get(daemon, host, "/trickle", timeout=30)  # a byte a second: never idle for 2 s
    assert r.status_code == 200 and r.text == "abcd" and time.monotonic() - t > 3


def test_relays_cannot_take_the_connections_the_api_needs(daemon, public):
    """A relay needs no key and lasted as long as the sandbox's port kept it:
    keyless clients could hold every TCP connection of the daemon.  Now at most
    ``WEENV_RELAY_MAX`` relays run at once (one more is 503 at once), idle ones
    end, and the API answers throughout."""
    _s, host = public
    url = httpx.URL(daemon.daemon.url)
    held = []
    for _ in range(4):
        c = socket.create_connection((url.host, url.port), timeout=30)
        c.sendall(f"GET /hang HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        held.append(c)
    try:
        time.sleep(0.5)
        t = time.monotonic()
        r = _get(daemon, host, "/headers", timeout=5)
        assert r.status_code == 503 and "4 connections" in r.json()["message"] and time.monotonic() - t < 2
        with httpx.Client(base_url=daemon.api_url, headers={"X-API-Key": daemon.key}, timeout=5) as api:
            assert api.get("/v2/sandboxes").status_code == 200
        for c in held:  # each idle relay ends after 2 s: 504
            assert c.recv(100).startswith(b"HTTP/1.1 504 ")
    finally:
        for c in held:
            c.close()
    time.sleep(0.2)
    assert _get(daemon, host, "/headers").status_code == 200  # room again


@pytest.fixture
def on_runc(monkeypatch):
    """The node runs runc (WEENV_RUNTIME=runc): the test rewrites runc's own
    state file (``ROOT/ID/state.json``; crun keeps another, ``ROOT/ID/status``)."""
    monkeypatch.setenv("WEENV_RUNTIME", "runc")


def test_the_namespace_of_a_sandbox_without_network_is_pinned(on_runc, node, tmp_path):
    """A sandbox without network is reached in the namespace of its first
    process.  That was found as ``/proc/PID/ns/net`` of the number runc
    reported: a number that names another process by the time it is opened (a
    reused pid) led the relay into that process's namespace.  Here runc's
    state is made to name another process, in a namespace of its own serving
    the same port: the relay must refuse it, never connect there."""
    env = node.create("task")
    serve = (
        "import socket,sys\ns=socket.create_server(('127.0.0.1',int(sys.argv[1])))\nprint('ready',flush=True)\n"
        "while True:\n c,_=s.accept(); c.sendall(sys.argv[2].encode()); c.close()"
    )
    mine = node.spawn(env.id, ["python3", "-c", serve, str(PORT), "env"])
    other = subprocess.Popen(
        ["unshare", "--net", "sh", "-c", f'ip link set lo up && exec {sys.executable} -c "$0" {PORT} impostor', serve],
        stdout=subprocess.PIPE,
        text=True,
    )
    state_file = node.runc.chosen.root / node.table.get(env.id).container_id / "state.json"
    saved = state_file.read_bytes()
    try:
        assert other.stdout.readline() == "ready\n"
        deadline = time.monotonic() + 10
        while True:
            try:
                with node.open_port(env.id, PORT) as c:
                    assert c.recv(100) == b"env"
                break
            except ConnectionRefusedError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        state = json.loads(saved)
        start = open(f"/proc/{other.pid}/stat").read().rsplit(")", 1)[1].split()[19]  # field 22: starttime
        state.update(init_process_pid=other.pid, init_process_start=int(start))
        state_file.write_text(json.dumps(state))
        assert node.runc.state(node.table.get(env.id).container_id)["pid"] == other.pid  # runc believes it
        with pytest.raises(NotFoundError):
            node.open_port(env.id, PORT).close()
    finally:
        state_file.write_bytes(saved)
        other.kill()
        other.wait()
    with node.open_port(env.id, PORT) as c:  # runc's true state: its own namespace again
        assert c.recv(100) == b"env"
    mine.kill()
    node.destroy(env.id)
    assert not os.path.exists(state_file)


WS_SERVER = r"""
import base64, hashlib, socket, struct, sys, threading
GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
def exact(c, n):
    out = b""
    while len(out) < n:
        got = c.recv(n - len(out))
        if not got:
            raise EOFError
        out += got
    return out
def frame(c):
    b1, b2 = exact(c, 2)
    n = b2 & 127
    if n == 126:
        n = struct.unpack("!H", exact(c, 2))[0]
    elif n == 127:
        n = struct.unpack("!Q", exact(c, 8))[0]
    mask = exact(c, 4) if b2 & 128 else b""
    data = exact(c, n)
    if mask:
        data = bytes(x ^ mask[i % 4] for i, x in enumerate(data))
    return b1 & 15, data
def put(c, op, data):
    n = len(data)
    head = bytes([0x80 | op]) + (bytes([n]) if n < 126 else bytes([126]) + struct.pack("!H", n) if n < 65536
                                 else bytes([127]) + struct.pack("!Q", n))
    c.sendall(head + data)
def serve(c):
    head = b""
    while b"\r\n\r\n" not in head:
        head += c.recv(4096)
    lines = head.decode().split("\r\n")
    path = lines[0].split()[1]
    h = {k.strip().lower(): v.strip() for k, v in (x.split(":", 1) for x in lines[1:] if ":" in x)}
    if path == "/refuse":
        c.sendall(b"HTTP/1.1 404 Not Found\r\nx-why: test\r\ncontent-length: 14\r\n\r\nno such socket")
        c.close()
        return
    key = base64.b64encode(hashlib.sha1((h["sec-websocket-key"] + GUID).encode()).digest()).decode()
    proto = h.get("sec-websocket-protocol", "").split(",")[-1].strip()
    answer = f"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: {key}\r\n"
    c.sendall((answer + (f"Sec-WebSocket-Protocol: {proto}\r\n" if proto else "") + "\r\n").encode())
    put(c, 1, f"hello {path} {h.get('x-mine', '-')} {'e2b-traffic-access-token' in h}".encode())
    while True:
        op, data = frame(c)
        if op == 8:
            open("/tmp/ws-closed", "w").write(str(struct.unpack("!H", data[:2])[0]))
            put(c, 8, data[:2])
            c.close()
            return
        if op == 9:
            put(c, 10, data)
        elif data == b"close-me":
            put(c, 8, struct.pack("!H", 4001) + b"bye")
        else:
            put(c, op, data[::-1] if op == 1 else data)
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen()
while True:
    threading.Thread(target=serve, args=(s.accept()[0],), daemon=True).start()
"""
"""A WebSocket server of python's standard library only (RFC 6455 by hand), in the sandbox:
greets with ``hello PATH X-MINE TOKEN-SEEN``, answers text reversed and binary as it came,
``close-me`` with a close 4001, a client's close with its code (noted in /tmp/ws-closed);
``/refuse`` is answered 404."""
WS_PORT = 8010


class _WsClient:
    """A WebSocket client (wsproto) over a plain socket to the daemon, naming a sandbox's port by ``Host``."""

    def __init__(self, url: str, host: str, target: str, subprotocols=(), extra=()):
        from wsproto import ConnectionType, WSConnection
        from wsproto.events import Request

        u = httpx.URL(url)
        self.sock = socket.create_connection((u.host, u.port), timeout=15)
        self.ws = WSConnection(ConnectionType.CLIENT)
        self.sock.sendall(
            self.ws.send(Request(host=host, target=target, subprotocols=list(subprotocols), extra_headers=list(extra)))
        )
        self.pending: list = []

    def next(self):
        while not self.pending:
            self.pending.extend(self.ws.events())
            if self.pending:
                break
            data = self.sock.recv(1 << 16)
            if not data:
                raise EOFError("the daemon closed the connection")
            self.ws.receive_data(data)
        return self.pending.pop(0)

    def message(self):
        """The next whole message (text or bytes), its fragments joined."""
        from wsproto.events import BytesMessage, TextMessage

        parts = []
        while True:
            e = self.next()
            assert isinstance(e, (TextMessage, BytesMessage)), e
            parts.append(e.data)
            if e.message_finished:
                return "".join(parts) if isinstance(e, TextMessage) else b"".join(parts)

    def send(self, event) -> None:
        self.sock.sendall(self.ws.send(event))


def test_a_websocket_passes_through_get_host_both_ways(daemon, public):
    """A WebSocket upgrade to ``get_host(port)`` was relayed as plain HTTP (the
    upgrade dropped).  Now the sandbox's 101 reaches the client (the
    subprotocol it chose, the path and headers it was sent), messages pass
    both ways whole (text and binary, one larger than a frame), pings are
    answered, close codes pass either way, a refusal arrives as the HTTP answer
    it was, and a quiet WebSocket ends at the relay's idle timeout."""
    from wsproto.events import AcceptConnection, CloseConnection, Message, Ping, Pong, RejectConnection, RejectData

    sbx, _ = public
    sbx.files.write("/tmp/ws.py", WS_SERVER)
    sbx.commands.run(f"python3 /tmp/ws.py {WS_PORT} >/dev/null 2>&1", background=True)
    host = sbx.get_host(WS_PORT)
    deadline = time.monotonic() + 20
    while True:
        c = _WsClient(daemon.daemon.url, host, "/chat?x=1", ["one", "two"], [("x-mine", "7")])
        first = c.next()
        if isinstance(first, AcceptConnection) or time.monotonic() > deadline:
            break
        c.sock.close()
        time.sleep(0.3)
    assert isinstance(first, AcceptConnection) and first.subprotocol == "two", first
    assert c.message() == "hello /chat?x=1 7 False"  # the token header is never passed on
    c.send(Message(data="abc"))
    assert c.message() == "cba"
    big = bytes(range(256)) * 1024  # 256 KiB: several reads on each side
    c.send(Message(data=big))
    assert c.message() == big
    c.send(Ping(payload=b"p"))
    assert isinstance(pong := c.next(), Pong) and pong.payload == b"p"
    c.send(CloseConnection(code=1000, reason="done"))
    closed = c.next()
    assert isinstance(closed, CloseConnection) and closed.code == 1000, closed
    c.sock.close()
    deadline = time.monotonic() + 10
    while sbx.commands.run("cat /tmp/ws-closed || true").stdout.strip() != "1000" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert sbx.commands.run("cat /tmp/ws-closed").stdout.strip() == "1000"  # the client's close reached it

    c = _WsClient(daemon.daemon.url, host, "/")
    assert isinstance(c.next(), AcceptConnection) and c.message().startswith("hello / ")
    c.send(Message(data="close-me"))
    closed = c.next()
    assert isinstance(closed, CloseConnection) and (closed.code, closed.reason) == (4001, "bye"), closed
    c.sock.close()

    c = _WsClient(daemon.daemon.url, host, "/refuse")
    refused = c.next()
    assert isinstance(refused, RejectConnection) and refused.status_code == 404, refused
    assert dict(refused.headers).get(b"x-why") == b"test"
    body = b""
    while not body.endswith(b"socket"):
        e = c.next()
        assert isinstance(e, RejectData), e
        body += e.data
    assert body == b"no such socket"
    c.sock.close()

    c = _WsClient(daemon.daemon.url, host, "/")  # quiet past WEENV_RELAY_IDLE_S=2
    assert isinstance(c.next(), AcceptConnection) and c.message().startswith("hello")
    closed = c.next()
    assert isinstance(closed, CloseConnection) and closed.code == 1001, closed
    c.sock.close()

    c = _WsClient(daemon.daemon.url, f"{WS_PORT + 1}-{sbx.sandbox_id}.e2b.app", "/")  # nothing listens
    refused = c.next()
    assert isinstance(refused, RejectConnection) and refused.status_code == 502, refused
    c.sock.close()
    assert _get(daemon, public[1], "/headers").status_code == 200  # the relay's HTTP face is as it was
