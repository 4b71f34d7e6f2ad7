"""The server side of the Connect RPC protocol (unary and server-streaming calls).

Protocol: https://connectrpc.com/docs/protocol (Connect, version 1).  A call is
``POST {prefix}/{package.Service}/{Method}``:

- unary: the body is one message, ``Content-Type: application/json`` (proto3
  JSON) or ``application/proto`` (binary); the answer is one message of the same
  type, or an error: the HTTP status of its code and a JSON body
  ``{"code": "not_found", "message": "..."}``;
- client streaming (``StreamInput``): the body is envelopes, the answer one
  message envelope and the end-of-stream envelope;
- server streaming: ``Content-Type: application/connect+json`` or
  ``application/connect+proto``; the body and the answer are *envelopes*, each a
  flags byte, a 4-byte big-endian length and a message; the answer ends with an
  end-of-stream envelope (flags ``0x02``) holding ``{}`` or
  ``{"error": {"code": ..., "message": ...}}``, always with HTTP status 200.

``Connect-Timeout-Ms`` is passed to handlers as :attr:`CallContext.timeout`
(seconds).  Compressed messages are refused (the ``e2b`` SDK sends none).
Handlers raise :class:`RpcError` for a Connect error; a :class:`WeenvError` is
mapped by its kind (:data:`KIND_CODES`); any other exception becomes
``internal`` and is logged.
"""

from __future__ import annotations

import json
import logging
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import DecodeError, Message
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from weenv.errors import WeenvError

log = logging.getLogger(__name__)

CODE_STATUS = {
    "canceled": 499,
    "unknown": 500,
    "invalid_argument": 400,
    "deadline_exceeded": 504,
    "not_found": 404,
    "already_exists": 409,
    "permission_denied": 403,
    "resource_exhausted": 429,
    "failed_precondition": 400,
    "aborted": 409,
    "out_of_range": 400,
    "unimplemented": 501,
    "internal": 500,
    "unavailable": 503,
    "data_loss": 500,
    "unauthenticated": 401,
}
"""Connect error code -> HTTP status of a unary error answer (the protocol's table)."""

KIND_CODES = {
    "not_found": "not_found",
    "invalid_input": "invalid_argument",
    "timeout": "deadline_exceeded",
    "daemon": "unavailable",
    "disk_full": "resource_exhausted",
    "closed": "unavailable",
    "capacity": "unavailable",
    "busy": "aborted",
    "state": "failed_precondition",
}
"""weenv error kind -> Connect code (other kinds: ``internal``)."""

_END_STREAM = 0x02
_COMPRESSED = 0x01
MAX_MESSAGE = 16 << 20
"""Largest request message accepted, in bytes."""


class RpcError(Exception):
    """A Connect error: ``code`` (a key of :data:`CODE_STATUS`) and a message."""

    def __init__(self, code: str, message: str):
        if code not in CODE_STATUS:
            raise ValueError(f"unknown Connect code {code!r}")
        super().__init__(message)
        self.code = code
        self.message = message

    def to_json(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message}


def as_rpc_error(exc: BaseException) -> RpcError:
    """The Connect error for an exception raised by a handler."""
    if isinstance(exc, RpcError):
        return exc
    if isinstance(exc, WeenvError):
        return RpcError(KIND_CODES.get(exc.kind, "internal"), str(exc))
    log.error("Connect handler failed", exc_info=exc)
    return RpcError("internal", f"{type(exc).__name__}: {exc}")


@dataclass
class CallContext:
    """What a handler knows of its call besides the request message."""

    request: Request
    timeout: float | None
    """Seconds from ``Connect-Timeout-Ms``; None without the header."""
    state: dict[str, Any] = field(default_factory=dict)
    """Set by the caller of :func:`serve` (e.g. the sandbox the call is for)."""

    def header(self, name: str) -> str | None:
        return self.request.headers.get(name)


Unary = Callable[[Message, CallContext], Awaitable[Message]]
ServerStream = Callable[[Message, CallContext], AsyncIterator[Message]]


ClientStream = Callable[[AsyncIterator[Message], CallContext], Awaitable[Message]]


@dataclass(frozen=True)
class Method:
    """One RPC: its request and response classes and its handler
    (``async def`` returning a message, or an async generator of messages;
    with ``client_streaming``, ``async def`` taking an async iterator of the
    request messages and returning one)."""

    input: type[Message]
    output: type[Message]
    handler: Unary | ServerStream | ClientStream
    streaming: bool = False
    client_streaming: bool = False


class _Codec:
    def __init__(self, name: str):
        self.name = name

    def decode(self, data: bytes, cls: type[Message]) -> Message:
        msg = cls()
        try:
            if self.name == "json":
                json_format.Parse(data or b"{}", msg, ignore_unknown_fields=True)
            else:
                msg.ParseFromString(data)
        except (json_format.ParseError, DecodeError, UnicodeDecodeError, ValueError) as exc:
            raise RpcError("invalid_argument", f"cannot decode {cls.DESCRIPTOR.full_name}: {exc}") from exc
        return msg

    def encode(self, msg: Message) -> bytes:
        if self.name == "json":
            return json_format.MessageToJson(msg, indent=None).encode()
        return msg.SerializeToString()


def _codec_of(content_type: str, prefix: str) -> _Codec | None:
    ct = content_type.split(";", 1)[0].strip().lower()
    if not ct.startswith(prefix):
        return None
    name = ct[len(prefix) :]
    return _Codec(name) if name in ("json", "proto") else None


def _timeout(request: Request) -> float | None:
    raw = request.headers.get("connect-timeout-ms")
    if raw is None:
        return None
    if not raw.isdigit() or len(raw) > 10:
        raise RpcError("invalid_argument", f"bad Connect-Timeout-Ms {raw!r}")
    return int(raw) / 1000 or None


def envelope(flags: int, payload: bytes) -> bytes:
    return struct.pack(">BI", flags, len(payload)) + payload


def error_response(err: RpcError, *, streaming: bool) -> Response:
    """An answer carrying only ``err`` (for failures before a handler runs)."""
    if streaming:
        body = envelope(_END_STREAM, json.dumps({"error": err.to_json()}).encode())
        return Response(body, media_type="application/connect+json")
    return JSONResponse(err.to_json(), status_code=CODE_STATUS[err.code])


async def serve(request: Request, method: Method, state: dict[str, Any] | None = None) -> Response:
    """Answer one Connect call of ``method`` (see the module docstring)."""
    if method.client_streaming:
        return await _serve_client_stream(request, method, state)
    streaming = method.streaming
    if request.method != "POST":
        return error_response(RpcError("unimplemented", "Connect calls are POST requests"), streaming=streaming)
    codec = _codec_of(request.headers.get("content-type", ""), "application/connect+" if streaming else "application/")
    if codec is None:
        return Response(status_code=415, headers={"Accept-Post": _accept(streaming)})
    try:
        if request.headers.get("connect-protocol-version", "1") != "1":
            raise RpcError("invalid_argument", "connect-protocol-version must be 1")
        encoding = request.headers.get("connect-content-encoding" if streaming else "content-encoding")
        if encoding not in (None, "identity"):
            raise RpcError("unimplemented", f"compression {encoding!r} is not supported")
        ctx = CallContext(request=request, timeout=_timeout(request), state=dict(state or {}))
        body = await _read_body(request)
        if streaming:
            body = _unwrap(body)
        msg = codec.decode(body, method.input)
    except RpcError as err:
        return error_response(err, streaming=streaming)

    if not streaming:
        try:
            result = await method.handler(msg, ctx)  # type: ignore[misc]
        except Exception as exc:  # noqa: BLE001  # every failure is answered as a Connect error
            return error_response(as_rpc_error(exc), streaming=False)
        return Response(codec.encode(result), media_type=f"application/{codec.name}")

    stream = method.handler(msg, ctx)

    async def body_iter() -> AsyncIterator[bytes]:
        end: dict[str, Any] = {}
        try:
            async for item in stream:  # type: ignore[union-attr]
                yield envelope(0, codec.encode(item))
        except Exception as exc:  # noqa: BLE001  # sent as the stream's end message
            end = {"error": as_rpc_error(exc).to_json()}
        finally:
            await stream.aclose()  # type: ignore[union-attr]
        yield envelope(_END_STREAM, json.dumps(end).encode())

    return StreamingResponse(body_iter(), media_type=f"application/connect+{codec.name}")


async def _serve_client_stream(request: Request, method: Method, state: dict[str, Any] | None) -> Response:
    """A client-streaming call: the body is envelopes, read and decoded one by
    one as they arrive (each at most :data:`MAX_MESSAGE` bytes); the answer is
    one message envelope and the end-of-stream envelope, or the end-of-stream
    envelope with the error."""
    codec = _codec_of(request.headers.get("content-type", ""), "application/connect+")
    if request.method != "POST" or codec is None:
        return Response(status_code=415, headers={"Accept-Post": _accept(True)})
    try:
        if request.headers.get("connect-content-encoding") not in (None, "identity"):
            raise RpcError("unimplemented", "compression is not supported")
        ctx = CallContext(request=request, timeout=_timeout(request), state=dict(state or {}))
        result = await method.handler(_envelopes(request, codec, method.input), ctx)  # type: ignore[call-arg]
        body = envelope(0, codec.encode(result)) + envelope(_END_STREAM, b"{}")
    except Exception as exc:  # noqa: BLE001  # answered as the stream's end message
        body = envelope(_END_STREAM, json.dumps({"error": as_rpc_error(exc).to_json()}).encode())
    return Response(body, media_type=f"application/connect+{codec.name}")


async def _envelopes(request: Request, codec: _Codec, cls: type[Message]) -> AsyncIterator[Message]:
    """The messages of a streamed request body, each as soon as it is whole."""
    buf = bytearray()
    async for chunk in request.stream():
        buf += chunk
        while len(buf) >= 5:
            flags, size = struct.unpack(">BI", buf[:5])
            if size > MAX_MESSAGE:
                raise RpcError("resource_exhausted", f"message larger than {MAX_MESSAGE} bytes")
            if flags & _COMPRESSED:
                raise RpcError("unimplemented", "compressed messages are not supported")
            if len(buf) < 5 + size:
                break
            payload = bytes(buf[5 : 5 + size])
            del buf[: 5 + size]
            if not flags & _END_STREAM:
                yield codec.decode(payload, cls)
    if buf:
        raise RpcError("invalid_argument", "the request ended inside an envelope")


def _accept(streaming: bool) -> str:
    return "application/connect+json, application/connect+proto" if streaming else "application/json, application/proto"


async def _read_body(request: Request) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_MESSAGE + 5:
            raise RpcError("resource_exhausted", f"request larger than {MAX_MESSAGE} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _unwrap(body: bytes) -> bytes:
    """The one message of a server-streaming request's enveloped body."""
    if len(body) < 5:
        raise RpcError("invalid_argument", "streaming request without an envelope")
    flags, size = struct.unpack(">BI", body[:5])
    if flags & _COMPRESSED:
        raise RpcError("unimplemented", "compressed messages are not supported")
    if len(body) != 5 + size:
        raise RpcError("invalid_argument", "streaming request must hold exactly one message")
    return body[5:]
