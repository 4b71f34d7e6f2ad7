"""E2B's ``get_host(port)`` relayed: HTTP and WebSocket traffic to a
``PORT-ID.`` host passed on to a connection, for the node's
:class:`~weenv.server.e2b.ports.PortProxy` (to the sandbox's port) and the
cluster gateway's :class:`~weenv.cluster.ports.ClusterPorts` (to the
sandbox's node) alike.

:class:`PortRelay` is the middleware both are: which hosts it takes
(:func:`port_named`), the idle timeout a request asks (:func:`asked_idle`),
the cap on relays at once, E2B's ``{"code", "message", "sandboxId", "port"}``
refusals (:func:`port_refusal`, :func:`ws_refusal`), then :func:`relay_http`
(one HTTP/1.1 request, streamed both ways, bounded in body bytes and idle
time) or :func:`~weenv.server.kit.wsrelay.relay_websocket`.  What differs, how
the connection is opened and what is checked first, is each subclass's.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket

import h11
from starlette.datastructures import Headers
from starlette.responses import JSONResponse

from weenv.errors import InvalidInputError
from weenv.server.kit.wsrelay import relay_websocket
from weenv.server.limits import drain

ENVD_PORT = 49983
"""envd's port in E2B sandboxes: hosts naming it go to the envd face (:mod:`weenv.server.e2b.envd`)."""
TOKEN_HEADER = "e2b-traffic-access-token"
"""The header carrying a private sandbox's traffic access token (E2B's name)."""
RELAY_IDLE_S = 60.0
"""Seconds a relay may move no byte either way before it ends."""
IDLE_HEADER = "x-weenv-relay-idle"
"""The header of an HTTP request asking its own idle timeout, seconds (with :data:`KEY_HEADER`)."""
KEY_HEADER = "x-weenv-key"
"""The header carrying the daemon's API key for :data:`IDLE_HEADER` (``X-API-Key`` is the sandbox's own)."""
MAX_RELAY_IDLE_S = 86400.0
"""The longest idle timeout a request may ask."""
_HOST = re.compile(r"^(\d{1,5})-([0-9a-f]{12})\.")
_HOP = {
    b"connection",
    b"keep-alive",
    b"proxy-connection",
    b"proxy-authenticate",
    b"proxy-authorization",
    b"te",
    b"trailer",
    b"upgrade",
    TOKEN_HEADER.encode(),
    IDLE_HEADER.encode(),
    KEY_HEADER.encode(),
}
_NODE_CHECKS = {TOKEN_HEADER.encode(), IDLE_HEADER.encode(), KEY_HEADER.encode()}
"""What a gateway relaying to the node passes on for the node to check."""
READ_SIZE = 64 << 10


class PortRelay:
    """ASGI middleware relaying ``PORT-ID.`` hosts, HTTP and WebSocket, to a
    connection :meth:`connect` opens (the sandbox's port on a node, the
    sandbox's node at the cluster's gateway); other requests go to ``app``.

    Its steps, the same for both: a WebSocket's connect message is taken; an
    HTTP request's asked idle timeout is read (400 if bad) and
    :meth:`admit_http` may refuse it; past ``max_relays`` relays at once one
    more is answered 503; :meth:`connect` opens the connection (or answers why
    not); the request is relayed within ``max_body`` bytes and the idle
    timeout.  ``keep_token``: pass the traffic access token and an asked idle
    timeout with its key on (to a node, which checks them)."""

    who = "the daemon"
    """Who relays, as refusals name it."""

    def __init__(self, app, *, max_relays: int, max_body: int, idle_timeout: float, keep_token: bool = False):
        self.app = app
        self.max_relays, self.max_body, self.idle_timeout = max_relays, max_body, idle_timeout
        self.keep_token = keep_token
        self.relays = 0
        """Relays running now (the event loop's only: no lock)."""

    async def __call__(self, scope, receive, send) -> None:
        named = port_named(scope)
        if named is None:
            await self.app(scope, receive, send)
            return
        port, sandbox_id = named
        websocket = scope["type"] == "websocket"

        async def refuse(status: int, message: str) -> None:
            if websocket:
                await ws_refusal(send, status, message, sandbox_id, port)
            else:
                await port_refusal(scope, receive, send, status, message, sandbox_id, port)

        if websocket:
            if (await receive())["type"] != "websocket.connect":
                return
            idle = self.idle_timeout
        else:
            try:
                idle = asked_idle(scope, self.idle_timeout)
            except InvalidInputError as exc:
                await refuse(400, str(exc))
                return
            if not await self.admit_http(scope, receive, refuse, idle):
                return
        if self.relays >= self.max_relays:
            await refuse(503, f"{self.who} relays {self.max_relays} connections to sandbox ports already")
            return
        self.relays += 1
        try:
            sock = await self.connect(scope, sandbox_id, port, refuse)
            if sock is None:
                return
            status = None
            try:
                if websocket:
                    await relay_websocket(
                        sock, scope, receive, send, refuse, idle=self.idle_timeout, keep_token=self.keep_token
                    )
                else:
                    status = await relay_http(
                        sock, scope, receive, send, max_body=self.max_body, idle=idle, keep_token=self.keep_token
                    )
            finally:
                sock.close()
            if status is not None:
                await refuse(*status)
        finally:
            self.relays -= 1

    async def admit_http(self, scope, receive, refuse, idle: float) -> bool:
        """Whether an HTTP request asking ``idle`` seconds goes on (False once
        ``refuse(status, message)`` answered why not); all go on by default."""
        return True

    async def connect(self, scope, sandbox_id: str, port: int, refuse) -> socket.socket | None:
        """A connected socket to relay to, or None once ``refuse(status, message)`` answered why not."""
        raise NotImplementedError


def asked_idle(scope, default: float) -> float:
    """The idle timeout an HTTP request asks in :data:`IDLE_HEADER` (``default``
    without it).  Raises :class:`InvalidInputError` for a value that is not
    seconds in (0, :data:`MAX_RELAY_IDLE_S`]."""
    raw = Headers(scope=scope).get(IDLE_HEADER)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 < value <= MAX_RELAY_IDLE_S:  # NaN fails too
        raise InvalidInputError(f"{IDLE_HEADER}: {raw[:40]!r} is not seconds in (0, {MAX_RELAY_IDLE_S:g}]")
    return value


def port_named(scope) -> tuple[int, str] | None:
    """``(port, sandbox id)`` an HTTP or WebSocket ``scope``'s ``Host`` names
    (``PORT-ID.``, ``PORT`` not envd's), None for any other request."""
    m = _HOST.match(Headers(scope=scope).get("host", "")) if scope["type"] in ("http", "websocket") else None
    if m is None or int(m.group(1)) == ENVD_PORT or not 0 < int(m.group(1)) < 65536:
        return None
    return int(m.group(1)), m.group(2)


async def ws_refusal(send, status: int, message: str, sandbox_id: str, port: int) -> None:
    """E2B's error as the HTTP answer to a WebSocket upgrade (ASGI's ``websocket.http.response``)."""
    body = json.dumps({"code": status, "message": message, "sandboxId": sandbox_id, "port": port}).encode()
    await send(
        {
            "type": "websocket.http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "websocket.http.response.body", "body": body})


async def port_refusal(scope, receive, send, status: int, message: str, sandbox_id: str, port: int) -> None:
    await JSONResponse({"code": status, "message": message, "sandboxId": sandbox_id, "port": port}, status_code=status)(
        scope, receive, send
    )


class _Idle(Exception):
    """No byte moved either way for the idle timeout."""


class _TooLarge(Exception):
    """The client's body passed the limit."""


class _Clock:
    """When a byte last moved either way in a relay, and waits bounded by it."""

    def __init__(self, idle: float):
        self.idle = idle
        self.loop = asyncio.get_running_loop()
        self.last = self.loop.time()

    def touch(self) -> None:
        self.last = self.loop.time()

    async def wait(self, aw, watch: asyncio.Task | None = None):
        """The result of ``aw``; raises :class:`_Idle` once nothing moved for
        ``idle`` seconds, or what ``watch`` (the upload) raised meanwhile."""
        task = asyncio.ensure_future(aw)
        try:
            while True:
                remaining = self.last + self.idle - self.loop.time()
                if remaining <= 0:
                    raise _Idle
                waiting = {task} if watch is None else {task, watch}
                done, _ = await asyncio.wait(waiting, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
                if watch is not None and watch.done():
                    watch.result()  # raises what the upload raised (it ended well: watched no more)
                    watch = None
                if task in done:
                    return task.result()
        finally:
            if not task.done():
                task.cancel()


async def relay_http(
    sock: socket.socket, scope, receive, send, *, max_body: int, idle: float, keep_token: bool = False
) -> tuple[int, str] | None:
    """One request from ``scope``/``receive`` to the connected ``sock``, its
    answer to ``send``, within the limits; ``(status, message)`` to answer
    when it failed before the sandbox answered, else None.  ``keep_token``:
    pass the traffic access token and an asked idle timeout with its key on
    (the cluster's gateway relaying to the node that checks them)."""
    sock.setblocking(False)
    reader, writer = await asyncio.open_connection(sock=sock)
    clock = _Clock(idle)
    conn = h11.Connection(h11.CLIENT)
    path = scope.get("raw_path") or scope["path"].encode()
    if scope.get("query_string"):
        path += b"?" + scope["query_string"]
    hop = _HOP - _NODE_CHECKS if keep_token else _HOP
    headers = [(k, v) for k, v in scope["headers"] if k.lower() not in hop] + [(b"connection", b"close")]
    framed = any(k.lower() in (b"content-length", b"transfer-encoding") for k, _ in headers)
    if not framed and scope["method"] not in ("GET", "HEAD", "OPTIONS", "DELETE"):
        headers.append((b"transfer-encoding", b"chunked"))
        framed = True
    writer.write(conn.send(h11.Request(method=scope["method"], target=path, headers=headers)))

    async def upload() -> None:
        seen = 0
        while True:
            message = await receive()
            clock.touch()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            seen += len(body)
            if seen > max_body:
                raise _TooLarge
            if body and framed:
                writer.write(conn.send(h11.Data(data=body)))
                await writer.drain()
                clock.touch()
            if not message.get("more_body"):
                writer.write(conn.send(h11.EndOfMessage()))
                await writer.drain()
                return

    async def forward(message: dict) -> None:
        await clock.wait(send(message))
        clock.touch()

    uploading = asyncio.create_task(upload())
    started, failed = False, None
    try:
        while True:
            event = conn.next_event()
            if event is h11.PAUSED:  # it switched protocols (a CONNECT's 2xx): not relayed; h11 would
                if not started:  # answer PAUSED forever, and this loop spun the daemon's event loop
                    failed = (502, "The sandbox's port switched protocols (CONNECT or upgrade): not relayed")
                break
            if event is h11.NEED_DATA:
                data = await clock.wait(reader.read(READ_SIZE), uploading)
                clock.touch()
                conn.receive_data(data)
                continue
            if isinstance(event, h11.Response):
                out = [(k, v) for k, v in event.headers if k.lower() not in _HOP | {b"transfer-encoding"}]
                started = True  # from here on no other answer may start
                await forward({"type": "http.response.start", "status": event.status_code, "headers": out})
            elif isinstance(event, h11.Data):
                await forward({"type": "http.response.body", "body": bytes(event.data), "more_body": True})
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                break
    except _Idle:
        failed = (504, f"no byte moved to or from the sandbox's port for {idle:g} s")
    except _TooLarge:
        failed = (413, f"request body larger than {max_body} bytes")
        if not started:
            await drain(receive, True)  # what the client still sends, dropped: so it reads the answer
    except (h11.RemoteProtocolError, OSError):
        failed = (502, "The sandbox's port closed the connection or answered something that is not HTTP/1.1")
    finally:
        uploading.cancel()
        writer.close()
    if not started:
        return failed
    if failed is None:
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    return None  # cut short after the answer began: uvicorn closes the connection
