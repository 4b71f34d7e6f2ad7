"""Slow clients (issue 13, #4): a connection that trickles its request head, or
a keyless body, a byte at a time is closed within seconds, so a few hundred
such clients cannot hold the daemon's TCP connection cap for ever
(:mod:`weenv.server.limits`).  A uvicorn server on loopback with the daemon's
protocol class and body limit, in a thread of the test."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest
import uvicorn

from weenv.server import limits

IDLE_S = 1.0
BODY_S = 1.0


async def _echo(scope, receive, send):
    """Answers 200 with the body's length, once it has the whole body."""
    if scope["type"] != "http":
        return
    size, more = 0, True
    while more:
        message = await receive()
        size += len(message.get("body", b""))
        more = message.get("more_body", False)
    body = str(size).encode()
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-length", str(len(body)).encode())]}
    )
    await send({"type": "http.response.body", "body": body})


@pytest.fixture
def server():
    """``(host, port)`` of a server capped at 4 TCP connections; keyed requests carry ``x-key: k``."""
    app = limits.BodyLimit(
        _echo, credentialed=lambda scope: (b"x-key", b"k") in scope["headers"], anonymous_body_s=BODY_S
    )
    sock = socket.create_server(("127.0.0.1", 0))
    config = uvicorn.Config(
        app,
        log_level="warning",
        lifespan="off",
        timeout_keep_alive=IDLE_S,
        http=limits.tcp_protocol(4, idle_timeout=IDLE_S),
    )
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    try:
        yield sock.getsockname()[:2]
    finally:
        srv.should_exit = True
        thread.join(10)
        sock.close()


def _trickle(s: socket.socket, byte: bytes, seconds: float) -> tuple[float, bytes]:
    """Send ``byte`` every 0.1 s until the server closes ``s`` or ``seconds``
    pass; ``(seconds it stayed open, what the server sent meanwhile)``."""
    t0, got = time.monotonic(), b""
    with contextlib.suppress(OSError):
        while time.monotonic() - t0 < seconds:
            s.sendall(byte)
            s.settimeout(0.1)
            try:
                chunk = s.recv(4096)
            except TimeoutError:
                continue
            if not chunk:
                break
            got += chunk
    return time.monotonic() - t0, got


def _read_all(s: socket.socket, timeout: float = 5.0) -> bytes:
    s.settimeout(timeout)
    data = b""
    with contextlib.suppress(OSError):
        while chunk := s.recv(65536):
            data += chunk
    return data


def test_a_trickled_request_head_is_closed_and_frees_its_slot(server):
    """Four connections trickling a header a byte every 0.1 s (uvicorn's own
    keep-alive timer stops at their first byte) are closed by IDLE_S, and the
    cap serves a fifth client after them."""
    conns = [socket.create_connection(server) for _ in range(4)]
    for s in conns:
        s.sendall(b"GET / HTTP/1.1\r\nhost: x\r\nx-slow: ")
    held = [_trickle(s, b"a", 4 * IDLE_S)[0] for s in conns]
    assert max(held) < 2 * IDLE_S + 0.5, held
    for s in conns:
        s.close()
    with socket.create_connection(server, timeout=5) as s:
        s.sendall(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        assert _read_all(s).startswith(b"HTTP/1.1 200"), "the cap still held the closed connections"


def test_keep_alive_and_pipelined_requests_still_work(server):
    """A client that sends its heads in time is served across pauses shorter
    than IDLE_S, pipelined requests included, and a keyed body may take its time."""
    with socket.create_connection(server, timeout=5) as s:
        for _ in range(3):
            s.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            answer = b""
            while not answer.endswith(b"\r\n\r\n0"):  # the head, then the body "0"
                answer += s.recv(4096)
            assert answer.startswith(b"HTTP/1.1 200")
            time.sleep(IDLE_S / 2)
        s.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n" * 2 + b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        assert _read_all(s).count(b"HTTP/1.1 200") == 3
    with socket.create_connection(server, timeout=5) as s:  # credentialed: the body is not timed
        s.sendall(b"POST / HTTP/1.1\r\nhost: x\r\nx-key: k\r\ncontent-length: 30\r\nconnection: close\r\n\r\n")
        held, got = _trickle(s, b"b", 3 * BODY_S)  # 30 bytes over 3 s: still open, then answered
        assert held >= 2.9 * BODY_S and (got + _read_all(s)).endswith(b"\r\n\r\n30")


def test_a_trickled_keyless_body_gets_408(server):
    with socket.create_connection(server, timeout=5) as s:
        s.sendall(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 1000\r\n\r\n")
        held, answer = _trickle(s, b"b", 4 * BODY_S)
        answer += _read_all(s)
    assert held < BODY_S + 1.0, held
    assert answer.startswith(b"HTTP/1.1 408") and b'"kind": "timeout"' in answer, answer[:300]
