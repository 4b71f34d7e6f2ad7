"""E2B's ``get_host(port)``: HTTP to a port inside a sandbox, through the daemon.

The SDK names a sandbox's port as the host ``PORT-SANDBOXID.DOMAIN``; E2B's
edge proxy routes by it.  :class:`PortProxy` (ASGI middleware, outermost on
the daemon's app) does the same: a request whose ``Host`` is
``PORT-ID.anything`` with ``PORT`` not envd's (:data:`ENVD_PORT`, which stays
the envd face's) is relayed, streamed both ways, to ``127.0.0.1:PORT`` inside
that sandbox's own network namespace (:meth:`weenv.node.node.Node.open_port`:
environments with and without network alike, none of them reachable from
another).  HTTP/1.1 only, one request per connection to the sandbox
(``Connection: close``); WebSocket upgrades are not relayed.  As E2B's
default (``allowPublicTraffic``), no credentials are asked: the sandbox id is
the capability.  Errors are 502 with E2B's words: an unknown sandbox, or a
port nothing listens on (``The sandbox is running but port is not open``).
"""

from __future__ import annotations

import asyncio
import re
import socket

import anyio.to_thread
import h11
from starlette.datastructures import Headers
from starlette.responses import JSONResponse

from weenv.errors import NotFoundError

ENVD_PORT = 49983
"""envd's port in E2B sandboxes: hosts naming it go to the envd face (:mod:`weenv.server.e2b.envd`)."""
_HOST = re.compile(r"^(\d{1,5})-([0-9a-f]{12})\.")
_HOP = {b"connection", b"keep-alive", b"proxy-connection", b"proxy-authenticate", b"proxy-authorization",
        b"te", b"trailer", b"upgrade"}  # fmt: skip
READ_SIZE = 64 << 10


class PortProxy:
    """ASGI middleware relaying ``PORT-ID.`` hosts to sandbox ports (see the module docstring)."""

    def __init__(self, app, node):
        self.app = app
        self.node = node

    async def __call__(self, scope, receive, send) -> None:
        m = _HOST.match(Headers(scope=scope).get("host", "")) if scope["type"] == "http" else None
        if m is None or int(m.group(1)) == ENVD_PORT or not 0 < int(m.group(1)) < 65536:
            await self.app(scope, receive, send)
            return
        port, sandbox_id = int(m.group(1)), m.group(2)
        try:
            sock = await anyio.to_thread.run_sync(self.node.open_port, sandbox_id, port)
        except NotFoundError:
            await _answer(scope, receive, send, 502, f"The sandbox {sandbox_id} was not found", sandbox_id, port)
            return
        except OSError:
            await _answer(scope, receive, send, 502, "The sandbox is running but port is not open", sandbox_id, port)
            return
        try:
            await _relay(sock, scope, receive, send)
        finally:
            sock.close()


async def _answer(scope, receive, send, status: int, message: str, sandbox_id: str, port: int) -> None:
    await JSONResponse({"code": status, "message": message, "sandboxId": sandbox_id, "port": port},
                       status_code=status)(scope, receive, send)


async def _relay(sock: socket.socket, scope, receive, send) -> None:
    """One request from ``scope``/``receive`` to the connected ``sock``, its answer to ``send``."""
    sock.setblocking(False)
    reader, writer = await asyncio.open_connection(sock=sock)
    conn = h11.Connection(h11.CLIENT)
    path = scope.get("raw_path") or scope["path"].encode()
    if scope.get("query_string"):
        path += b"?" + scope["query_string"]
    headers = [(k, v) for k, v in scope["headers"] if k.lower() not in _HOP] + [(b"connection", b"close")]
    framed = any(k.lower() in (b"content-length", b"transfer-encoding") for k, _ in headers)
    if not framed and scope["method"] not in ("GET", "HEAD", "OPTIONS", "DELETE"):
        headers.append((b"transfer-encoding", b"chunked"))
        framed = True
    writer.write(conn.send(h11.Request(method=scope["method"], target=path, headers=headers)))

    async def upload() -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            if body and framed:
                writer.write(conn.send(h11.Data(data=body)))
                await writer.drain()
            if not message.get("more_body"):
                writer.write(conn.send(h11.EndOfMessage()))
                await writer.drain()
                return

    uploading = asyncio.create_task(upload())
    started = False
    try:
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await reader.read(READ_SIZE)
                conn.receive_data(data)
                continue
            if isinstance(event, h11.Response):
                out = [(k, v) for k, v in event.headers if k.lower() not in _HOP | {b"transfer-encoding"}]
                await send({"type": "http.response.start", "status": event.status_code, "headers": out})
                started = True
            elif isinstance(event, h11.Data):
                await send({"type": "http.response.body", "body": bytes(event.data), "more_body": True})
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                break
    except (h11.RemoteProtocolError, OSError):
        if not started:
            await send({"type": "http.response.start", "status": 502, "headers": []})
            started = True
    finally:
        uploading.cancel()
        writer.close()
    if started:
        await send({"type": "http.response.body", "body": b"", "more_body": False})
