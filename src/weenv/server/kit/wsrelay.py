"""A WebSocket from a client of the daemon to a port inside a sandbox (E2B's
``get_host(port)`` with ``ws://``), for :class:`weenv.server.kit.relay.PortRelay`.

The client's side is uvicorn's (its wsproto protocol: the ASGI ``websocket``
scope); the sandbox's side is a wsproto client over the connection
:meth:`~weenv.node.node.Node.open_port` made:

1. **Handshake.**  The upgrade is sent to the sandbox with the client's path,
   query, ``Host``, subprotocols and other headers (not the hop-by-hop ones,
   the ``Sec-WebSocket-*`` handshake's own, nor the traffic access token).
   The sandbox's ``101`` becomes the client's (the subprotocol it chose, its
   extra headers); a refusal (any other status) is relayed as the HTTP
   answer it was, its body at most :data:`MAX_REFUSAL_BODY` bytes (ASGI's
   ``websocket.http.response``).  No answer within the idle timeout: 504;
   no WebSocket answer: 502.
2. **Messages** pass both ways whole (text stays text, binary binary), at
   most :data:`MAX_WS_MESSAGE` bytes each (uvicorn bounds the client's the
   same: ``ws_max_size``); a larger one from the sandbox closes both sides
   with 1009.  Pings are answered on each side by its own end (uvicorn's,
   wsproto's); no extension (per-message deflate) is negotiated on either.
3. **Close.**  A close from either side is passed on with its code and
   reason (codes that may not be sent, such as 1005 and 1006, as 1000); the
   sandbox's connection ending without a close frame closes the client's
   with 1011.  No message either way for ``idle`` seconds closes both with
   1001 (the relay's idle timeout, ``WEENV_RELAY_IDLE_S``: a quiet WebSocket
   is ended like a quiet HTTP relay).

Source: RFC 6455 (close codes, section 7.4); the ASGI WebSocket spec 2.4.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

from wsproto import ConnectionType, WSConnection
from wsproto.connection import ConnectionState
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Message,
    Ping,
    RejectConnection,
    RejectData,
    Request,
    TextMessage,
)
from wsproto.utilities import LocalProtocolError, RemoteProtocolError

MAX_WS_MESSAGE = 16 << 20
"""Largest WebSocket message relayed either way, bytes."""
MAX_REFUSAL_BODY = 64 << 10
"""Largest body of a sandbox's refusal of an upgrade that is relayed, bytes."""
READ_SIZE = 64 << 10
_NOT_FORWARDED = {
    b"host",
    b"connection",
    b"upgrade",
    b"keep-alive",
    b"proxy-connection",
    b"proxy-authorization",
    b"te",
    b"trailer",
    b"transfer-encoding",
    b"content-length",
    b"sec-websocket-key",
    b"sec-websocket-version",
    b"sec-websocket-extensions",
    b"sec-websocket-protocol",
    b"sec-websocket-accept",
    b"e2b-traffic-access-token",
}
TOKEN = b"e2b-traffic-access-token"
_UNSENDABLE = {1004, 1005, 1006, 1015}


def _code(code: int | None) -> int:
    """A close code that may be sent (RFC 6455 7.4): ``code``, else 1000."""
    return code if code is not None and 1000 <= code < 5000 and code not in _UNSENDABLE else 1000


async def relay_websocket(
    sock: socket.socket,
    scope,
    receive,
    send,
    refuse,
    *,
    idle: float,
    max_message: int = MAX_WS_MESSAGE,
    keep_token: bool = False,
) -> None:
    """Relay the WebSocket of ``scope`` (its ``websocket.connect`` received
    already) to the connected ``sock`` (see the module docstring);
    ``await refuse(status, message)`` answers the client with an HTTP error
    before the WebSocket opens.  ``keep_token``: pass the traffic access token
    on (the cluster's gateway relaying to the node, which checks it)."""
    sock.setblocking(False)
    reader, writer = await asyncio.open_connection(sock=sock, limit=READ_SIZE)
    ws = WSConnection(ConnectionType.CLIENT)
    loop = asyncio.get_running_loop()
    last = [loop.time()]
    try:
        target = scope.get("raw_path") or scope["path"].encode()
        if scope.get("query_string"):
            target += b"?" + scope["query_string"]
        host = next((v for k, v in scope["headers"] if k.lower() == b"host"), b"localhost")
        dropped = _NOT_FORWARDED - {TOKEN} if keep_token else _NOT_FORWARDED
        extra = [(k, v) for k, v in scope["headers"] if k.lower() not in dropped]
        writer.write(
            ws.send(
                Request(
                    host=host.decode("latin-1"),
                    target=target.decode("latin-1"),
                    subprotocols=list(scope.get("subprotocols") or ()),
                    extra_headers=extra,
                )
            )
        )
        try:
            answer = await asyncio.wait_for(_handshake(reader, ws), idle)
        except TimeoutError:
            await refuse(504, f"the sandbox's port did not answer the WebSocket upgrade within {idle:g} s")
            return
        except (OSError, RemoteProtocolError, LocalProtocolError, EOFError):
            await refuse(502, "The sandbox's port closed the connection or did not answer the WebSocket upgrade")
            return
        answer, body = answer
        if isinstance(answer, RejectConnection):
            headers = [(k, v) for k, v in answer.headers if k.lower() not in _NOT_FORWARDED]
            await send(
                {
                    "type": "websocket.http.response.start",
                    "status": answer.status_code,
                    "headers": [*headers, (b"content-length", str(len(body)).encode())],
                }
            )
            await send({"type": "websocket.http.response.body", "body": body})
            return
        await send(
            {
                "type": "websocket.accept",
                "subprotocol": answer.subprotocol,
                "headers": [(k, v) for k, v in answer.extra_headers if k.lower() not in _NOT_FORWARDED],
            }
        )
        await _pass_messages(reader, writer, ws, receive, send, idle=idle, max_message=max_message, last=last)
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


async def _handshake(
    reader: asyncio.StreamReader, ws: WSConnection
) -> tuple[AcceptConnection | RejectConnection, bytes]:
    """The sandbox's answer to the upgrade: ``(its accept, b"")``, or ``(its
    refusal, its body)`` (at most :data:`MAX_REFUSAL_BODY` bytes)."""
    refusal: RejectConnection | None = None
    body = b""
    while True:
        for event in ws.events():
            if isinstance(event, AcceptConnection):
                return event, b""
            if isinstance(event, RejectConnection):
                refusal = event
                if not event.has_body:
                    return refusal, b""
            elif isinstance(event, RejectData) and refusal is not None:
                body = (body + bytes(event.data))[:MAX_REFUSAL_BODY]
                if event.body_finished:
                    return refusal, body
        data = await reader.read(READ_SIZE)
        if not data:
            if refusal is not None:
                return refusal, body
            raise EOFError
        ws.receive_data(data)


async def _pass_messages(
    reader, writer, ws: WSConnection, receive, send, *, idle: float, max_message: int, last: list[float]
) -> None:
    loop = asyncio.get_running_loop()

    def touch() -> None:
        last[0] = loop.time()

    async def close_client(code: int, reason: str = "") -> None:
        with contextlib.suppress(Exception):
            await send({"type": "websocket.close", "code": _code(code), "reason": reason})

    def close_sandbox(code: int, reason: str = "") -> None:
        if ws.state is ConnectionState.OPEN:
            with contextlib.suppress(LocalProtocolError, OSError):
                writer.write(ws.send(CloseConnection(code=_code(code), reason=reason)))

    async def down() -> None:
        """The sandbox's messages to the client."""
        parts: list = []
        size = 0
        while True:
            for event in ws.events():
                if isinstance(event, (TextMessage, BytesMessage)):
                    size += len(event.data)
                    if size > max_message:
                        close_sandbox(1009, "message too big")
                        await close_client(1009, f"a message from the sandbox passed {max_message} bytes")
                        return
                    parts.append(event.data)
                    if event.message_finished:
                        key = "text" if isinstance(event, TextMessage) else "bytes"
                        whole = "".join(parts) if key == "text" else b"".join(parts)
                        parts, size = [], 0
                        await send({"type": "websocket.send", key: whole})
                        touch()
                elif isinstance(event, Ping):
                    writer.write(ws.send(event.response()))
                elif isinstance(event, CloseConnection):
                    if ws.state is ConnectionState.REMOTE_CLOSING:
                        writer.write(ws.send(event.response()))
                    await close_client(event.code, event.reason or "")
                    return
            data = await reader.read(READ_SIZE)
            if not data:
                await close_client(1011, "the sandbox's port closed the connection")
                return
            touch()
            ws.receive_data(data)

    async def up() -> None:
        """The client's messages to the sandbox."""
        while True:
            message = await receive()
            touch()
            if message["type"] == "websocket.receive":
                data = message.get("bytes")
                if data is None:
                    data = message.get("text") or ""
                writer.write(ws.send(Message(data=data)))
                await writer.drain()
            elif message["type"] == "websocket.disconnect":
                close_sandbox(message.get("code", 1000), message.get("reason") or "")
                with contextlib.suppress(OSError):
                    await writer.drain()
                return

    tasks = {asyncio.ensure_future(down()), asyncio.ensure_future(up())}
    try:
        while True:
            remaining = last[0] + idle - loop.time()
            if remaining <= 0:
                close_sandbox(1001, "idle")
                await close_client(1001, f"no message either way for {idle:g} s")
                return
            done, _ = await asyncio.wait(tasks, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
            if done:
                for t in done:
                    if (
                        not t.cancelled()
                        and t.exception() is not None
                        and not isinstance(t.exception(), (OSError, LocalProtocolError, RemoteProtocolError))
                    ):
                        raise t.exception()
                    if not t.cancelled() and t.exception() is not None:  # the sandbox's side broke
                        await close_client(1011, "the sandbox's port broke the WebSocket")
                return
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
