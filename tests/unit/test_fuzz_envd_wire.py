"""Fuzzed envd requests: the Connect framing (envelopes, headers), the
protobuf and JSON messages of ``process.Process`` and ``filesystem.Filesystem``,
and the multipart upload parser answer any bytes with a Connect error or
weenv's own error, never an exception of the parser (``struct.error``,
``DecodeError``, ``UnicodeDecodeError``, ``RecursionError``...) nor a hang.

The calls go through :func:`weenv.server.e2b.connect.serve` with starlette's
own ``Request`` over the fuzzed body; the handlers answer an empty message (the
sandbox side is not what is fuzzed here).  Seeds are messages the ``e2b`` SDK
sends (its JSON, the same as protobuf binary) and multipart bodies as httpx
(the SDK's client) writes them."""

from __future__ import annotations

import asyncio
import io
import json

import httpx
import pytest
from fuzzing import corpus, fuzz_settings, json_mutated, mutated
from google.protobuf import json_format
from hypothesis import given
from hypothesis import strategies as st
from starlette.requests import Request
from starlette.responses import StreamingResponse

from weenv.errors import WeenvError
from weenv.server.e2b import connect
from weenv.server.e2b.connect import Method, envelope
from weenv.server.e2b.multipart import write_parts
from weenv.server.e2b.proto import filesystem_pb, process_pb

pytestmark = pytest.mark.timeout(120)

SDK_MESSAGES = {
    "process.Process/Start": (
        process_pb.StartRequest,
        {
            "process": {"cmd": "/bin/bash", "args": ["-l", "-c", "echo hi"], "envs": {"A": "b"}, "cwd": "/home/user"},
            "pty": {"size": {"cols": 80, "rows": 24}},
            "tag": "t",
            "stdin": True,
        },
    ),
    "process.Process/Connect": (process_pb.ConnectRequest, {"process": {"pid": 12}}),
    "process.Process/SendInput": (process_pb.SendInputRequest, {"process": {"tag": "t"}, "input": {"stdin": "aGkK"}}),
    "process.Process/SendSignal": (process_pb.SendSignalRequest, {"process": {"pid": 3}, "signal": "SIGNAL_SIGKILL"}),
    "process.Process/StreamInput": (process_pb.StreamInputRequest, {"data": {"input": {"pty": "aGkK"}}}),
    "process.Process/Update": (
        process_pb.UpdateRequest,
        {"process": {"pid": 3}, "pty": {"size": {"cols": 1, "rows": 2}}},
    ),
    "filesystem.Filesystem/ListDir": (filesystem_pb.ListDirRequest, {"path": "/home/user", "depth": 2}),
    "filesystem.Filesystem/Move": (filesystem_pb.MoveRequest, {"source": "/a", "destination": "/b"}),
    "filesystem.Filesystem/WatchDir": (
        filesystem_pb.WatchDirRequest,
        {"path": "/tmp", "recursive": True, "includeEntry": True},
    ),
    "filesystem.Filesystem/CreateWatcher": (filesystem_pb.CreateWatcherRequest, {"path": "/", "recursive": False}),
}
"""A call of each kind the SDK makes, by Connect path: (request message type, its JSON)."""
STREAMING = {"process.Process/Start", "process.Process/Connect", "filesystem.Filesystem/WatchDir"}
CLIENT_STREAMING = {"process.Process/StreamInput"}


def _message(call: str):
    cls, doc = SDK_MESSAGES[call]
    return json_format.ParseDict(doc, cls())


JSON_SEEDS = [json_format.MessageToJson(_message(c), indent=None).encode() for c in SDK_MESSAGES] + corpus("envd-json")
PROTO_SEEDS = [_message(c).SerializeToString() for c in SDK_MESSAGES] + corpus("envd-proto")
ENVELOPED = [envelope(0, m) + envelope(2, b"{}") for m in JSON_SEEDS[:3] + PROTO_SEEDS[:3]]


def _method(call: str) -> Method:
    cls, _ = SDK_MESSAGES[call]
    out = {
        "process.Process/Start": process_pb.StartResponse,
        "process.Process/Connect": process_pb.ConnectResponse,
        "filesystem.Filesystem/WatchDir": filesystem_pb.WatchDirResponse,
    }.get(call, process_pb.ListResponse)

    async def unary(msg, ctx):
        return out()

    async def stream(msg, ctx):
        yield out()

    async def client_stream(messages, ctx):
        async for _ in messages:
            pass
        return out()

    if call in CLIENT_STREAMING:
        return Method(cls, out, client_stream, client_streaming=True)
    return Method(cls, out, stream if call in STREAMING else unary, streaming=call in STREAMING)


def _request(headers: dict[str, str], chunks: list[bytes], method: str = "POST") -> Request:
    messages = [{"type": "http.request", "body": c, "more_body": True} for c in chunks]
    messages.append({"type": "http.request", "body": b"", "more_body": False})

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    scope = {
        "type": "http",
        "method": method,
        "path": "/",
        "query_string": b"",
        "root_path": "",
        "headers": [(k.lower().encode(), v.encode("latin-1")) for k, v in headers.items()],
    }
    return Request(scope, receive)


async def _call(call: str, headers: dict[str, str], body: bytes, cuts: list[int]) -> int:
    chunks, pos = [], 0
    for cut in sorted(cuts) + [len(body)]:
        chunks.append(body[pos:cut])
        pos = max(pos, cut)
    response = await connect.serve(_request(headers, chunks), _method(call))
    if isinstance(response, StreamingResponse):
        async for _ in response.body_iterator:
            pass
    return response.status_code


CONTENT_TYPES = st.sampled_from(
    [
        "application/json",
        "application/proto",
        "application/connect+json",
        "application/connect+proto",
        "application/JSON; charset=utf-8",
        "text/plain",
        "",
        "application/connect+",
        "application/",
    ]
)
HEADERS = st.fixed_dictionaries(
    {"content-type": CONTENT_TYPES},
    optional={
        "connect-timeout-ms": st.sampled_from(["0", "1000", "-1", "99999999999", "1e3", "", " 5"]),
        "connect-protocol-version": st.sampled_from(["1", "2", ""]),
        "connect-content-encoding": st.sampled_from(["identity", "gzip"]),
        "content-encoding": st.sampled_from(["identity", "br"]),
    },
)
BODIES = (
    mutated(JSON_SEEDS + PROTO_SEEDS + ENVELOPED)
    | json_mutated(JSON_SEEDS)
    | json_mutated(JSON_SEEDS).map(lambda m: envelope(0, m))
    | mutated(PROTO_SEEDS).map(lambda m: envelope(0, m))
)


@fuzz_settings(400)
@given(
    call=st.sampled_from(sorted(SDK_MESSAGES)),
    headers=HEADERS,
    body=BODIES,
    cuts=st.lists(st.integers(0, 600), max_size=3),
)
def test_connect_calls_answer_any_body_with_a_connect_error_never_raise(call, headers, body, cuts):
    status = asyncio.run(_call(call, headers, body, cuts))
    assert status < 500 or status == 501, status  # 501: an unsupported compression, the protocol's unimplemented


@fuzz_settings(300)
@given(
    cls=st.sampled_from([SDK_MESSAGES[c][0] for c in sorted(SDK_MESSAGES)]),
    data=mutated(PROTO_SEEDS) | json_mutated(JSON_SEEDS),
    codec=st.sampled_from(["json", "proto"]),
)
def test_protobuf_and_json_messages_decode_or_raise_a_connect_error(cls, data, codec):
    try:
        connect._Codec(codec).decode(data, cls)
    except connect.RpcError as err:
        assert err.code == "invalid_argument"


def _multipart_seeds() -> list[tuple[str, bytes]]:
    out = []
    for files in (
        [("file", ("hello.txt", b"hello\n"))],
        [("file", ("a/b.bin", bytes(range(256)))), ("file", ("c.txt", b"c" * 100))],
        [("file", ("\u00e9t\u00e9.txt", b"x"))],
    ):
        req = httpx.Request("POST", "http://sandbox/files", files=files, data={"note": "x"})
        out.append((req.headers["content-type"], req.read()))
    return out


MULTIPART = _multipart_seeds()


async def _upload(content_type: str, body: bytes, cuts: list[int], path: str | None) -> list[dict]:
    written = []

    def open_target(target: str):
        written.append(target)
        return io.BytesIO(), {"path": target}

    async def chunks():
        pos = 0
        for cut in sorted(cuts) + [len(body)]:
            yield body[pos:cut]
            pos = max(pos, cut)

    return await write_parts(content_type, chunks(), open_target, path)


@fuzz_settings(300)
@given(
    seed=st.sampled_from(range(len(MULTIPART))),
    body=mutated([b for _, b in MULTIPART]),
    content_type=st.none() | mutated([c.encode() for c, _ in MULTIPART], max_ops=2),
    cuts=st.lists(st.integers(0, 700), max_size=3),
    path=st.none() | st.just("/home/user/f"),
)
def test_multipart_upload_parser_raises_only_weenv_errors(seed, body, content_type, cuts, path):
    ctype = MULTIPART[seed][0] if content_type is None else content_type.decode("latin-1")
    try:
        entries = asyncio.run(_upload(ctype, body, cuts, path))
    except WeenvError:
        return
    assert entries and all(isinstance(e["path"], str) for e in entries)


def test_seeds_are_answered_as_good_calls():
    """The unmutated seeds are good calls (the fuzzing starts from requests that reach the handlers)."""
    for call in SDK_MESSAGES:
        body = json.dumps(SDK_MESSAGES[call][1]).encode()
        ctype = "application/json"
        if call in STREAMING or call in CLIENT_STREAMING:
            body, ctype = (
                envelope(0, body) + (envelope(2, b"{}") if call in CLIENT_STREAMING else b""),
                "application/connect+json",
            )
        assert asyncio.run(_call(call, {"content-type": ctype}, body, [])) == 200, call
    for ctype, body in MULTIPART:
        assert asyncio.run(_upload(ctype, body, [], None))
