"""E2B's ``get_host(port)``: HTTP to a port inside a sandbox, through the daemon.

The SDK names a sandbox's port as the host ``PORT-SANDBOXID.DOMAIN``; E2B's
edge proxy routes by it.  :class:`PortProxy` (ASGI middleware, outermost on
the daemon's app) does the same: a request whose ``Host`` is
``PORT-ID.anything`` with ``PORT`` not envd's (:data:`ENVD_PORT`, which stays
the envd face's) is relayed, streamed both ways, to ``127.0.0.1:PORT`` inside
that sandbox's own network namespace (:meth:`weenv.node.node.Node.open_port`:
environments with and without network alike, none of them reachable from
another; a namespace without network is reached through a pidfd of the
sandbox's process, never a bare process number).  HTTP/1.1, one request
per connection to the sandbox (``Connection: close``).  A WebSocket upgrade
(``ws://PORT-ID...``) is relayed too (:mod:`weenv.server.e2b.wsrelay`): the
daemon opens the WebSocket to the sandbox's port with the client's path,
headers and subprotocols, answers the client's upgrade with what the
sandbox chose (or relays its refusal as the HTTP answer it was), then passes
messages both ways, pings answered on each side, close codes passed on.

Who may: as E2B's default (``allowPublicTraffic`` true), no credentials are
asked, the sandbox id is the capability.  A sandbox created with
``network.allowPublicTraffic`` false (``EnvironmentInfo.public_traffic``)
answers only requests carrying its traffic access token
(:meth:`~weenv.server.e2b.sandboxes.Sandboxes.traffic_token`, the create's
``trafficAccessToken``) in the :data:`TOKEN_HEADER` header, compared in
constant time; others get 403 and the sandbox is not reached.  The header is
not passed on to the sandbox.

Limits (a relay holds one of the daemon's TCP connections, uncounted by its
idle checks once the request's head is in, and one connection into the sandbox):

- **Relays at once**: at most ``max_relays`` (default a quarter of the
  daemon's TCP connection cap, ``WEENV_RELAY_MAX``); one more is answered 503
  at once, so relays, which need no key, never take the connections the API
  needs.
- **Request body**: at most ``max_body`` bytes (default the API's
  :data:`~weenv.server.limits.MAX_BODY`), streamed, never held whole: a
  ``Content-Length`` above it is answered 413 before the sandbox is reached;
  a chunked body passing it cuts the relay (413 unless the sandbox already
  answered).
- **Idle**: a relay in which no byte moved either way for ``idle_timeout``
  seconds (default :data:`RELAY_IDLE_S`, ``WEENV_RELAY_IDLE_S``) ends: 504 if
  the sandbox had not answered yet, else its answer is cut short.  An HTTP
  request may ask another idle timeout, up to :data:`MAX_RELAY_IDLE_S`, in
  the :data:`IDLE_HEADER` header (seconds) if it carries the daemon's API key
  in :data:`KEY_HEADER` (a server in the sandbox that answers only when a
  long command ends, as SWE-ReX's does: :mod:`weenv.adapters.swerex`); a bad
  value is answered 400, a missing or wrong key 403.  Neither header reaches
  the sandbox.

Errors carry E2B's ``{"code", "message"}``: 502 for an unknown sandbox or a
port nothing listens on (``The sandbox is running but port is not open``),
403, 413, 503, 504 as above.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket

import anyio.to_thread
import h11
from starlette.datastructures import Headers
from starlette.responses import JSONResponse

from weenv.config import settings
from weenv.errors import InvalidInputError, NotFoundError
from weenv.server.e2b.wsrelay import MAX_WS_MESSAGE, relay_websocket  # noqa: F401 - MAX_WS_MESSAGE for the daemon
from weenv.server.limits import DRAIN_BYTES, MAX_BODY, drain

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
CONNECT_THREADS = 8
"""Relayed connects running at once (threads of the relay's own limiter, not anyio's shared 40)."""


def relay_settings(tcp_cap: int) -> dict[str, float | int]:
    """:class:`PortProxy`'s ``max_relays`` and ``idle_timeout`` for a daemon
    serving ``tcp_cap`` TCP connections: ``WEENV_RELAY_MAX`` (default a quarter
    of ``tcp_cap``, at most ``tcp_cap - 8``) and ``WEENV_RELAY_IDLE_S``
    (default :data:`RELAY_IDLE_S`).  Raises :class:`InvalidInputError` naming
    the variable for a value that is not a positive number."""
    server = settings().server
    max_relays = server.relay_max or max(1, tcp_cap // 4)
    return {"max_relays": max(1, min(max_relays, tcp_cap - 8)), "idle_timeout": server.relay_idle_s}


class PortProxy:
    """ASGI middleware relaying ``PORT-ID.`` hosts to sandbox ports (see the
    module docstring).  ``sandboxes``: the E2B face's registry, whose traffic
    tokens a private sandbox's requests must carry; ``max_relays``,
    ``max_body`` (bytes), ``idle_timeout`` (seconds): the limits; ``api_key``:
    the daemon's (:class:`~weenv.server.auth.ApiKey`), which a request asking
    its own idle timeout must carry (None: no request may)."""

    def __init__(
        self,
        app,
        node,
        sandboxes,
        *,
        max_relays: int = 256,
        max_body: int = MAX_BODY,
        idle_timeout: float = RELAY_IDLE_S,
        api_key=None,
    ):
        self.app = app
        self.api_key = api_key
        self.node = node
        self.sandboxes = sandboxes
        self.max_relays = max_relays
        self.max_body = max_body
        self.idle_timeout = idle_timeout
        self.relays = 0
        """Relays running now (the event loop's only: no lock)."""
        self.connects = anyio.CapacityLimiter(CONNECT_THREADS)
        """The threads connecting relays to sandboxes (each may wait up to 5 s on a
        port): bounded apart from anyio's shared pool, so many relayed connects
        never starve the server's other thread work (routes, uploads)."""

    async def __call__(self, scope, receive, send) -> None:
        named = port_named(scope)
        if named is None:
            await self.app(scope, receive, send)
            return
        port, sandbox_id = named
        if scope["type"] == "websocket":
            await self._websocket(scope, receive, send, sandbox_id, port)
            return

        async def answer(status: int, message: str) -> None:
            await _answer(scope, receive, send, status, message, sandbox_id, port)

        try:
            idle = asked_idle(scope, self.idle_timeout)
        except InvalidInputError as exc:
            await answer(400, str(exc))
            return
        if idle != self.idle_timeout and (
            self.api_key is None or not self.api_key.matches(Headers(scope=scope).get(KEY_HEADER))
        ):
            await answer(403, f"{IDLE_HEADER} needs the daemon's API key in the {KEY_HEADER} header")
            return
        length = Headers(scope=scope).get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            if length.isdigit() and int(length) <= DRAIN_BYTES:
                await drain(receive, True)  # dropped, not kept: so the client reads the answer
            await answer(413, f"request body larger than {self.max_body} bytes")
            return
        if self.relays >= self.max_relays:
            await answer(503, f"the daemon relays {self.max_relays} connections to sandbox ports already")
            return
        self.relays += 1
        try:
            sock = await self._connect(scope, sandbox_id, port, answer)
            if sock is None:
                return
            try:
                status = await relay_http(sock, scope, receive, send, max_body=self.max_body, idle=idle)
            finally:
                sock.close()
            if status is not None:
                await answer(*status)
        finally:
            self.relays -= 1

    async def _connect(self, scope, sandbox_id: str, port: int, refuse):
        """A connected socket to ``port`` of the sandbox (in the relay's own
        thread limiter), or None once ``refuse(status, message)`` has answered
        why not: no such sandbox or a paused one (502), no traffic token (403), port closed (502)."""
        try:
            return await anyio.to_thread.run_sync(
                self._open, sandbox_id, port, Headers(scope=scope).get(TOKEN_HEADER), limiter=self.connects
            )
        except NotFoundError:
            await refuse(502, f"The sandbox {sandbox_id} was not found")
        except _NoToken:
            await refuse(403, f"The sandbox {sandbox_id} needs its traffic access token ({TOKEN_HEADER} header)")
        except OSError:
            await refuse(502, "The sandbox is running but port is not open")
        return None

    async def _websocket(self, scope, receive, send, sandbox_id: str, port: int) -> None:
        """A WebSocket to ``port`` of the sandbox, relayed message by message
        (see the module docstring); a refusal before it opens is an HTTP answer."""

        async def refuse(status: int, message: str) -> None:
            await ws_refusal(send, status, message, sandbox_id, port)

        if (await receive())["type"] != "websocket.connect":
            return
        if self.relays >= self.max_relays:
            await refuse(503, f"the daemon relays {self.max_relays} connections to sandbox ports already")
            return
        self.relays += 1
        try:
            sock = await self._connect(scope, sandbox_id, port, refuse)
            if sock is None:
                return
            try:
                await relay_websocket(sock, scope, receive, send, refuse, idle=self.idle_timeout)
            finally:
                sock.close()
        finally:
            self.relays -= 1

    def _open(self, sandbox_id: str, port: int, token: str | None) -> socket.socket:
        """A connection to ``port`` of the sandbox; :class:`_NoToken` when it is
        private and ``token`` is not its traffic token (blocking)."""
        info = self.node.table.get(sandbox_id).info  # NotFoundError
        if info.state == "paused":  # E2B's proxy finds no running sandbox behind it: 502, until a connect or resume
            raise NotFoundError(f"sandbox {sandbox_id} is paused")
        if not info.public_traffic and not self.sandboxes.traffic_token_matches(sandbox_id, token):
            raise _NoToken
        return self.node.open_port(sandbox_id, port)


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


async def _answer(scope, receive, send, status: int, message: str, sandbox_id: str, port: int) -> None:
    await JSONResponse({"code": status, "message": message, "sandboxId": sandbox_id, "port": port}, status_code=status)(
        scope, receive, send
    )


class _NoToken(Exception):
    """A private sandbox's port asked without its traffic access token."""


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
