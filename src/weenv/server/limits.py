"""The daemon's limits on what clients may hold: file descriptors, TCP
connections, request bodies.

- **File descriptors.**  :func:`raise_nofile_limit` raises the soft
  ``RLIMIT_NOFILE`` to the hard one at daemon start (the soft limit a shell or
  service manager hands down is often 1,024, less than the environments,
  mounts, pipes and connections of a busy node need).
- **TCP connections** (:func:`tcp_protocol`): at most ``max_connections``
  connections on TCP at once; one past it is answered ``503`` and closed as it
  is accepted, so its descriptor is freed at once.  The Unix socket is not
  counted and never refused: a flood of TCP connections cannot starve it, nor
  the environments' commands and files served through it.  A connection,
  TCP or Unix, that has not sent a whole request head (request line and
  headers) ``idle_timeout`` seconds after it was made or after its last
  answer is closed, however it trickles bytes: uvicorn's keep-alive timeout
  stops at the first byte, so a client sending one header byte every few
  seconds would hold its connection, and 1,024 such clients the whole TCP
  cap, for ever (slowloris).  A request's body, and the time its route
  takes, are not timed here (a keyless body is, :class:`BodyLimit`).  uvicorn's own
  ``limit_concurrency`` is not used: it counts the connections of every
  listener together, so a TCP flood would make it refuse the Unix socket too.
- **Request bodies** (:class:`BodyLimit`): at most :data:`MAX_BODY` bytes, a
  file upload (``PUT /v1/environments/{id}/files``, ``POST /e2b/envd/files``, a template's COPY files)
  at most :data:`MAX_UPLOAD`.  A ``Content-Length`` above the limit is answered
  413 before any of the body is kept; a body without one (chunked) is counted
  as it arrives: past the limit, a JSON request is answered 413 having kept at
  most the limit, an upload fails with :class:`RequestTooLargeError` (413)
  from the route reading it.  Before a JSON request is refused, what the
  client still sends is read and dropped (at most 64 MiB, for 2 s), so it
  reads the answer rather than a connection reset.  Errors are the error body of the API the path belongs
  to (weenv's ``{"error": {"kind": "too_large", ...}}`` or E2B's ``{"code",
  "message"}``).  A body announced larger than 64 MiB is not read at all: a
  client that does not read the answer while it sends (or send ``Expect:
  100-continue``) sees the connection reset instead.
- **Bodies before credentials.**  Routes check the API key (or an envd access
  token) after the body is read, so :class:`BodyLimit` checks credentials
  first (``credentialed``): a request without valid ones may send at most
  :data:`ANONYMOUS_BODY` bytes, enough for the route to answer 401, within
  :data:`ANONYMOUS_BODY_S` seconds (else 408 and the connection closed: a
  keyless body trickled a byte at a time must not hold its connection).  A
  flood of keyless TCP connections thus holds at most ``MAX_TCP_CONNECTIONS`` ×
  64 KiB, not × :data:`MAX_BODY`, and each for seconds.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import resource
import socket
from collections.abc import Callable

import anyio
import h11
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.websockets.wsproto_impl import WSProtocol

from weenv.errors import RequestTooLargeError

MAX_BODY = 8 << 20
"""Largest request body but a file upload, bytes (JSON requests: a command's
``stdin`` inline, a batch of creates)."""
MAX_UPLOAD = 8 << 30
"""Largest file upload, bytes."""
ANONYMOUS_BODY = 64 << 10
"""Largest request body of a client without valid credentials, bytes."""
ANONYMOUS_BODY_S = 5.0
"""Seconds a client without valid credentials has to send its whole body."""
MAX_TCP_CONNECTIONS = 1024
"""TCP connections served at once (at most a quarter of the descriptor limit, see :func:`tcp_connection_cap`)."""
DRAIN_BYTES = 64 << 20
DRAIN_S = 2.0
"""What is read and dropped of a body refused mid-stream before the connection closes."""
IDLE_TIMEOUT_S = 5
"""Seconds a connection may stay silent (before its first request or between requests)."""

_UPLOADS = (
    ("PUT", re.compile(r"^/v1/environments/[^/]+/files$")),
    ("POST", re.compile(r"^(/e2b/envd)?/files$")),
    ("PUT", re.compile(r"^/e2b/templates/[^/]+/files/[0-9a-f]{64}/upload$")),
    ("POST", re.compile(r"^/e2b/envd/process\.Process/StreamInput$")),
    ("POST", re.compile(r"^/prime/gateway/[^/]+/[^/]+/upload$")),
)  # client-streamed: counted as it arrives


def raise_nofile_limit() -> tuple[int, int]:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit; the soft
    limit ``(before, after)``."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        return soft, target
    return soft, soft


def tcp_connection_cap(nofile: int | None = None) -> int:
    """TCP connections to serve at once with a soft descriptor limit ``nofile``
    (default: this process's): :data:`MAX_TCP_CONNECTIONS`, but at most a
    quarter of ``nofile`` and at least 16."""
    if nofile is None:
        nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return max(16, min(MAX_TCP_CONNECTIONS, nofile // 4))


_BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
    b"content-length: %d\r\n\r\n%s"
)


def tcp_protocol(max_connections: int, idle_timeout: float = IDLE_TIMEOUT_S) -> type[H11Protocol]:
    """uvicorn's h11 protocol (pass as ``uvicorn.Config(http=...)``) bounded as
    the module docstring says: at most ``max_connections`` TCP connections
    (the count is this class's: make one class per server), every connection
    closed after ``idle_timeout`` seconds of silence.  Its ``ws_protocol``
    (pass as ``uvicorn.Config(ws=...)``): uvicorn's wsproto protocol, to which
    a WebSocket upgrade hands the connection, counted on until it closes."""
    open_tcp: set[object] = set()
    body = json.dumps(
        {"error": {"kind": "capacity", "message": f"the daemon serves {max_connections} TCP connections already"}}
    ).encode()
    busy = _BUSY % (len(body), body)

    class BoundedH11Protocol(H11Protocol):
        _refused = False
        _head_deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            sock = transport.get_extra_info("socket")
            if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
                if len(open_tcp) >= max_connections:
                    self._refused = True
                    transport.write(busy)
                    transport.close()
                    return
                open_tcp.add(self)
            super().connection_made(transport)
            self._arm_head_deadline()

        def _arm_head_deadline(self) -> None:
            """Close the connection unless a whole request head arrives within
            ``idle_timeout`` seconds (not pushed back by the bytes that come)."""
            self._cancel_head_deadline()
            self._head_deadline = self.loop.call_later(idle_timeout, self.timeout_keep_alive_handler)

        def _cancel_head_deadline(self) -> None:
            if self._head_deadline is not None:
                self._head_deadline.cancel()
                self._head_deadline = None

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:  # a request's head is in: its route runs untimed
                self._cancel_head_deadline()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self._arm_head_deadline()  # the next request's head, unless one came pipelined

        def connection_lost(self, exc: Exception | None) -> None:
            if self._refused:
                return
            self._cancel_head_deadline()
            open_tcp.discard(self)
            super().connection_lost(exc)

        def handle_websocket_upgrade(self, event: h11.Request) -> None:
            self._cancel_head_deadline()
            open_tcp.discard(self)  # the connection is counted on as its WebSocket protocol's
            super().handle_websocket_upgrade(event)

    class BoundedWSProtocol(WSProtocol):
        """A connection upgraded to WebSocket, still counted among the TCP connections until it closes."""

        def connection_made(self, transport) -> None:  # type: ignore[override]
            sock = transport.get_extra_info("socket")
            if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
                open_tcp.add(self)
            super().connection_made(transport)

        def connection_lost(self, exc: Exception | None) -> None:
            open_tcp.discard(self)
            super().connection_lost(exc)

    BoundedH11Protocol.open_tcp = open_tcp  # type: ignore[attr-defined]  # for tests and stats
    BoundedH11Protocol.ws_protocol = BoundedWSProtocol  # type: ignore[attr-defined]  # uvicorn.Config(ws=...)
    return BoundedH11Protocol


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
"""A control character in a request path (percent-decoded): no route of weenv's or E2B's
API takes one, and Starlette's route patterns end in ``$``, which matches before a final
newline: ``/e2b/templates/%0A`` reached the E2B app as ``templates/`` (answered 501)."""


def _error_body(path: str, status: int, kind: str, message: str) -> tuple[int, bytes]:
    """``(status, body)``: the error body of the API ``path`` belongs to (E2B's or weenv's)."""
    if path.startswith("/e2b/"):
        return status, json.dumps({"code": status, "message": message}).encode()
    return status, json.dumps({"error": {"kind": kind, "message": message}}).encode()


def _too_large(path: str, limit: int) -> tuple[int, bytes]:
    return _error_body(path, 413, RequestTooLargeError.kind, f"request body larger than {limit} bytes")


def _too_slow(path: str, seconds: float) -> tuple[int, bytes]:
    return _error_body(
        path, 408, "timeout", f"request body not sent within {seconds:g} s (a request without credentials)"
    )


class BodyLimit:
    """ASGI middleware bounding request bodies (see the module docstring):
    ``max_body`` bytes, ``max_upload`` for the file upload routes, and
    :data:`ANONYMOUS_BODY` for a request ``credentialed(scope)`` finds without
    valid credentials (None: every request is taken as credentialed), which
    must send its body within ``anonymous_body_s`` seconds."""

    def __init__(
        self,
        app,
        *,
        max_body: int = MAX_BODY,
        max_upload: int = MAX_UPLOAD,
        credentialed: Callable[[dict], bool] | None = None,
        anonymous_body_s: float = ANONYMOUS_BODY_S,
    ):
        self.app = app
        self.anonymous_body_s = anonymous_body_s
        self.max_body = max_body
        self.max_upload = max_upload
        self.credentialed = credentialed

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        if _CONTROL.search(path):  # routes match with "$", which passes a trailing newline: refused before routing
            status, body = _error_body(
                path, 400, "invalid_input", f"request path {path[:200]!r} holds a control character"
            )
            await send(
                {
                    "type": "http.response.start",
                    "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return
        upload = any(scope["method"] == m and r.match(path) for m, r in _UPLOADS)
        limit = self.max_upload if upload else self.max_body
        anonymous = self.credentialed is not None and not self.credentialed(scope)
        if anonymous:
            limit = min(limit, ANONYMOUS_BODY)
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            if length.isdigit() and int(length) <= DRAIN_BYTES:
                await drain(receive, True)  # dropped, not kept: so the client reads the answer
            await self._refuse(send, path, limit)
            return
        if upload:
            await self.app(scope, _counting(receive, limit), send)
            return
        # Read the body here (the routes read it whole anyway), at most the limit, then replay it.
        chunks, size, more, left = [], 0, True, None
        with anyio.move_on_after(self.anonymous_body_s if anonymous else math.inf) as deadline:
            while more and size <= limit:
                message = await receive()
                if message["type"] != "http.request":
                    left = message
                    break
                chunks.append(message.get("body", b""))
                size += len(chunks[-1])
                more = message.get("more_body", False)
        if left is not None:
            await self.app(scope, _replay([left], receive), send)  # the client left: let the app see it
            return
        if deadline.cancelled_caught:
            await self._refuse(send, path, limit, slow=self.anonymous_body_s)
            return
        if size > limit:
            await drain(receive, more)  # before answering: the answer completes the request
            await self._refuse(send, path, limit)
            return
        whole = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([whole], receive), send)

    @staticmethod
    async def _refuse(send, path: str, limit: int, *, slow: float | None = None) -> None:
        status, body = _too_slow(path, slow) if slow is not None else _too_large(path, limit)
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


async def drain(receive, more: bool, *, budget: int = DRAIN_BYTES, seconds: float = DRAIN_S) -> None:
    """Read and drop what the client still sends of a refused body, at most
    ``budget`` bytes for at most ``seconds``: closing with unread data makes the
    kernel reset the connection, and the client would lose the 413 answer."""
    with anyio.move_on_after(seconds):
        while more and budget > 0:
            message = await receive()
            if message["type"] != "http.request":
                return
            budget -= len(message.get("body", b""))
            more = message.get("more_body", False)


def _replay(messages: list[dict], receive):
    """A ``receive`` that gives ``messages`` first, then what ``receive`` gives."""
    pending = list(messages)

    async def replayed() -> dict:
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed


def _counting(receive, limit: int):
    """A ``receive`` raising :class:`RequestTooLargeError` once the body passes ``limit`` bytes."""
    seen = 0

    async def counted() -> dict:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise RequestTooLargeError(f"request body larger than {limit} bytes")
        return message

    return counted
