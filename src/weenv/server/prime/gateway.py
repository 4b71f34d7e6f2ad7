"""The prime gateway: a sandbox's commands and files, reached with its gateway token.

The control plane's ``POST /api/v1/sandbox/{id}/auth`` (and a create's
``gatewayAuth``) names ``{gateway_url}/{user_ns}/{job_id}``: here
``{daemon}/prime/gateway/weenv/{sandbox id}``.  Under it::

    POST /command_session.CommandSession/Start       Connect server stream (binary protobuf):
                                                     start, stdout/stderr data, end events
    POST /command_session.CommandSession/Connect     the same events of a running command, from now
    POST /command_session.CommandSession/SendInput   stdin for a command started with ``stdin``
    POST /command_session.CommandSession/SendSignal  SIGTERM or SIGKILL to it
    POST /upload?path=                          multipart part ``file`` -> FileUploadResponse
    GET  /download?path=                        the file's bytes
    GET  /read-file?path=&offset=&length=       {"content": text, "size": n, ...} (offset < 0: the tail)

Each request needs ``Authorization: Bearer TOKEN`` (the sandbox's gateway
token, :class:`~weenv.server.prime.sandboxes.Tokens`): 401 otherwise.  A
sandbox that is gone answers 410 ``{"error": "sandbox_terminated"}`` (the
client then raises its sandbox-not-running error) and, to a command, Connect's
``not_found``.

A command runs as the client sends it, ``/bin/bash -c COMMAND`` (``/bin/sh``
when the image has no bash), as the spec's ``user`` (default: the template's),
in ``cwd`` (default: the template's working directory, else the user's home),
with the spec's variables over the sandbox's; it is killed at the call's
``Connect-Timeout-Ms`` (the client's ``timeout``), which must be a positive
number of milliseconds.  A command started with a ``session_uuid`` is tagged
with it: ``Connect``, ``SendInput`` and ``SendSignal`` name it so (or by pid),
and a ``Start`` repeating it attaches to the running command instead of
starting another (the client's retry).  Its events are field for field E2B's process events,
so the stream is envd's (:mod:`weenv.server.e2b.processes`) re-encoded.
"""

from __future__ import annotations

import datetime
import posixpath
from collections.abc import AsyncIterator

import anyio.to_thread
from google.protobuf.message import Message
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from weenv.errors import (
    InvalidInputError,
    NotFoundError,
    RequestTooLargeError,
    UnknownUserError,
    WeenvError,
)
from weenv.node.runtime.process import Process
from weenv.server.auth import presented_key
from weenv.server.e2b import files, multipart
from weenv.server.e2b.connect import CODE_STATUS, CallContext, Method, RpcError, serve
from weenv.server.e2b.envd import _chunks
from weenv.server.e2b.processes import _follow, _write_stdin, send_signal
from weenv.server.e2b.sandboxes import Sandbox, Sandboxes
from weenv.server.prime.proto import command_pb
from weenv.server.prime.sandboxes import Tokens

MAX_READ_FILE = 16 << 20
"""Most bytes one ``read-file`` answers (a longer read is truncated and says so)."""
SERVICE = "command_session.CommandSession"


def _gone(sid: str) -> JSONResponse:
    return JSONResponse({"error": "sandbox_terminated", "message": f"sandbox {sid} is gone"}, status_code=410)


def _rpc_error(err: RpcError) -> JSONResponse:
    """A Connect error answered before a stream starts: its HTTP status and
    ``{"code", "message"}`` (the client reads a non-200 answer so, whatever its codec)."""
    return JSONResponse(err.to_json(), status_code=CODE_STATUS[err.code])


def _detail(status: int, text: str) -> JSONResponse:
    return JSONResponse({"detail": text}, status_code=status)


def command_timeout(raw: str | None) -> float | None:
    """Seconds from ``Connect-Timeout-Ms`` (None without the header); raises
    :class:`RpcError` ``invalid_argument`` for 0 or anything but a positive
    whole number of milliseconds (a NaN, a negative, a fraction)."""
    if raw is None:
        return None
    if not raw.isdigit() or len(raw) > 10 or int(raw) == 0:
        raise RpcError(
            "invalid_argument", f"command timeout of {raw!r} ms: a timeout is a positive whole number of milliseconds"
        )
    return int(raw) / 1000


class Gateway:
    """The gateway's routes over the E2B face's :class:`Sandboxes` (shared: the
    same environments, the same runtime configs)."""

    def __init__(self, sandboxes: Sandboxes, tokens: Tokens):
        self.sandboxes = sandboxes
        self.node = sandboxes.node
        self.tokens = tokens
        pb = command_pb
        self._methods = {
            "Start": Method(pb.StartRequest, pb.StartResponse, self._run, streaming=True),
            "Connect": Method(pb.ConnectRequest, pb.ConnectResponse, self._connect, streaming=True),
            "SendInput": Method(pb.SendInputRequest, pb.SendInputResponse, self._send_input),
            "SendSignal": Method(pb.SendSignalRequest, pb.SendSignalResponse, self._send_signal),
        }

    def routes(self) -> list[Route]:
        base = "/{ns}/{sid}"
        return [
            Route(f"{base}/{SERVICE}/{{method}}", self.rpc, methods=["POST"]),
            Route(f"{base}/upload", self.upload, methods=["POST"]),
            Route(f"{base}/download", self.download, methods=["GET"]),
            Route(f"{base}/read-file", self.read_file, methods=["GET"]),
        ]

    def credentialed(self, scope: dict) -> bool:
        """Whether a gateway request carries its sandbox's token (for the daemon's body limit)."""
        parts = scope.get("path", "").split("/")
        # /prime/gateway/NS/SID/...
        if len(parts) < 6 or parts[1:3] != ["prime", "gateway"]:
            return False
        from starlette.datastructures import Headers

        return self.tokens.matches(parts[4], presented_key(Headers(scope=scope)))

    async def _sandbox(self, request: Request) -> Sandbox | Response:
        sid = request.path_params["sid"]
        if not self.tokens.matches(sid, presented_key(request.headers)):
            return _detail(401, "missing or wrong gateway token (Authorization: Bearer TOKEN)")
        sb = await anyio.to_thread.run_sync(self.sandboxes.find, sid)
        return _gone(sid) if sb is None else sb

    # --- commands -----------------------------------------------------------------------
    async def rpc(self, request: Request) -> Response:
        sid = request.path_params["sid"]
        method = self._methods.get(request.path_params["method"])
        if method is None:
            return _rpc_error(
                RpcError("unimplemented", f"{SERVICE}/{request.path_params['method']} is not served by weenv")
            )
        if not self.tokens.matches(sid, presented_key(request.headers)):
            return _rpc_error(RpcError("unauthenticated", "missing or wrong gateway token"))
        try:
            timeout = command_timeout(request.headers.get("connect-timeout-ms"))
        except RpcError as exc:
            return _rpc_error(exc)
        sb = await anyio.to_thread.run_sync(self.sandboxes.find, sid)
        if sb is None:
            return _rpc_error(RpcError("not_found", f"sandbox {sid} is gone"))
        return await serve(request, method, {"sandbox": sb, "node": self.node, "timeout": timeout})

    async def _run(self, req, ctx: CallContext) -> AsyncIterator[Message]:
        """``Start``: a new command; with a ``session_uuid`` already running, that
        command again (the client's create-or-attach retry)."""
        sb: Sandbox = ctx.state["sandbox"]
        if req.HasField("session_uuid") and req.session_uuid:
            p = await anyio.to_thread.run_sync(self._session, sb, req.session_uuid)
            if p is not None:
                async for item in self._attach(p, ctx, command_pb.StartResponse):
                    yield item
                return
        p = await anyio.to_thread.run_sync(self._spawn, sb, req, ctx.state["timeout"])
        assert p.primary is not None
        async for item in _follow(p, p.primary, ctx, _wrapper(command_pb.StartResponse)):
            yield item

    async def _connect(self, req, ctx: CallContext) -> AsyncIterator[Message]:
        """``Connect``: the events of a running (or just ended) command from now on."""
        p = await anyio.to_thread.run_sync(self._selected, ctx.state["sandbox"], req.session)
        async for item in self._attach(p, ctx, command_pb.ConnectResponse):
            yield item

    async def _attach(self, p: Process, ctx: CallContext, response) -> AsyncIterator[Message]:
        reader = p.log.attach()
        # output already kept is not replayed (as the client expects); its end is
        tail = [e for e in (p.log.read(reader, 0) or []) if e.type in ("end", "error")]
        start = command_pb.CommandSessionEvent(start=command_pb.CommandSessionEvent.StartEvent(pid=p.pid or 0))
        yield response(event=start)
        async for item in _follow(p, reader, ctx, _wrapper(response), sent_start=True, pending=tail):
            yield item

    async def _send_input(self, req, ctx: CallContext) -> Message:
        p = await anyio.to_thread.run_sync(self._selected, ctx.state["sandbox"], req.session)
        if req.input.WhichOneof("input") != "stdin":
            raise RpcError("invalid_argument", "only stdin input is served (no PTY)")
        if not p.stdin_open:
            raise RpcError("failed_precondition", "the command's stdin is not open (start it with stdin)")
        await _write_stdin(p, req.input.stdin, eof=False)
        return command_pb.SendInputResponse()

    async def _send_signal(self, req, ctx: CallContext) -> Message:
        p = await anyio.to_thread.run_sync(self._selected, ctx.state["sandbox"], req.session)
        await send_signal(p, req.signal)
        return command_pb.SendSignalResponse()

    def _session(self, sb: Sandbox, session_uuid: str) -> Process | None:
        """The command started with ``session_uuid`` (its tag), running or kept after its end."""
        for info in sorted(self.node.processes(sb.id), key=lambda i: not i.running):
            if info.tag == session_uuid:
                try:
                    return self.node.process(sb.id, info.pid)
                except NotFoundError:
                    return None
        return None

    def _selected(self, sb: Sandbox, selector) -> Process:
        kind = selector.WhichOneof("selector")
        if kind is None:
            raise RpcError("invalid_argument", "no session selected (pid or session_uuid)")
        try:
            p = self.node.process(sb.id, selector.pid) if kind == "pid" else self._session(sb, selector.session_uuid)
        except NotFoundError:
            p = None
        if p is None:
            what = f"pid {selector.pid}" if kind == "pid" else f"session {selector.session_uuid!r}"
            raise RpcError("not_found", f"no command with {what}")
        return p

    def _spawn(self, sb: Sandbox, req, timeout: float | None):
        spec = req.command
        if not spec.cmd:
            raise RpcError("invalid_argument", "no command (command.cmd)")
        if req.HasField("pty"):
            raise RpcError("unimplemented", "commands on a pseudo-terminal are not served by weenv's prime gateway")
        try:
            who = self.node.user(sb.id, spec.user if spec.HasField("user") and spec.user else None)
        except UnknownUserError as exc:
            raise RpcError("invalid_argument", str(exc)) from exc
        fs = files.fs_of(self.node, sb)
        cwd = files.resolve(sb, spec.cwd, who) if spec.HasField("cwd") and spec.cwd else sb.start_dir(who)
        if not fs.exists(cwd):
            raise RpcError("invalid_argument", f"working directory '{cwd}' does not exist")
        cmd = spec.cmd
        if cmd == "/bin/bash" and not fs.exists(cmd):  # the client always asks bash; small images have sh
            cmd = "/bin/sh"
        try:
            return self.node.spawn(
                sb.id,
                [cmd, *spec.args],
                env=dict(spec.envs),
                cwd=cwd,
                timeout=timeout,
                primary_reader=True,
                user=who,
                stdin_open=req.HasField("stdin") and req.stdin,
                tag=req.session_uuid if req.HasField("session_uuid") and req.session_uuid else None,
            )
        except InvalidInputError as exc:
            raise RpcError("invalid_argument", str(exc)) from exc

    # --- files --------------------------------------------------------------------------
    async def upload(self, request: Request) -> Response:
        sb = await self._sandbox(request)
        if isinstance(sb, Response):
            return sb
        path = request.query_params.get("path")
        if not path:
            return _detail(400, "missing path")
        ctype = request.headers.get("content-type", "")
        if not ctype.startswith("multipart/form-data"):
            return _detail(400, "an upload is multipart/form-data with a part named 'file'")
        written: list[int] = []

        def open_target(target: str):
            who = self.node.user(sb.id, None)
            f, entry = files.open_write(self.node, sb, target, who)
            return _Counting(f, written), entry

        try:
            entries = await multipart.write_parts(ctype, request.stream(), open_target, path)
        except NotFoundError as exc:
            return _detail(404, str(exc))
        except RequestTooLargeError as exc:
            return _detail(413, str(exc))
        except (InvalidInputError, RpcError) as exc:
            return _detail(400, str(exc))
        except WeenvError as exc:
            return _detail(500, str(exc))
        if not entries:
            return _detail(400, "the upload has no part named 'file'")
        return JSONResponse(
            {
                "success": True,
                "path": entries[0]["path"],
                "size": sum(written),
                "timestamp": datetime.datetime.now(datetime.UTC).isoformat(),
            }
        )

    async def download(self, request: Request) -> Response:
        sb = await self._sandbox(request)
        if isinstance(sb, Response):
            return sb
        path = request.query_params.get("path")
        if not path:
            return _detail(400, "missing path")
        try:
            who = await anyio.to_thread.run_sync(self.node.user, sb.id, None)
            f = await anyio.to_thread.run_sync(files.open_read, self.node, sb, path, who)
        except NotFoundError as exc:
            return _detail(404, str(exc))
        except (InvalidInputError, RpcError) as exc:
            return _detail(400, str(exc))
        return StreamingResponse(
            _chunks(f),
            media_type="application/octet-stream",
            headers={"content-disposition": f'attachment; filename="{posixpath.basename(path)}"'},
        )

    async def read_file(self, request: Request) -> Response:
        sb = await self._sandbox(request)
        if isinstance(sb, Response):
            return sb
        q = request.query_params
        path = q.get("path")
        if not path:
            return _detail(400, "missing path")
        try:
            offset = int(q.get("offset", "0"))
            length = int(q["length"]) if "length" in q else None
            if length is not None and length < 0:
                raise ValueError
        except ValueError:
            return _detail(400, "offset is a whole number of bytes (negative: from the end), length one not negative")

        def read() -> tuple[bytes, int, int]:
            who = self.node.user(sb.id, None)
            with files.open_read(self.node, sb, path, who) as f:
                total = f.seek(0, 2)
                start = max(0, total + offset) if offset < 0 else min(offset, total)  # negative: the file's tail
                f.seek(start)
                want = MAX_READ_FILE if length is None else min(length, MAX_READ_FILE)
                return f.read(want), total, start

        try:
            data, total, start = await anyio.to_thread.run_sync(read)
        except NotFoundError as exc:
            return _detail(404, str(exc))
        except (InvalidInputError, RpcError) as exc:
            return _detail(400, str(exc))
        return JSONResponse(
            {
                "content": data.decode("utf-8", errors="replace"),
                "size": len(data),
                "total_size": total,
                "offset": start,
                "truncated": start > 0 or start + len(data) < total,
            }
        )


def _wrapper(response):
    """E2B process events (:func:`weenv.server.e2b.processes._follow`) as ``response``
    messages: the two event messages are the same on the wire, field for field."""
    return lambda ev: response(event=command_pb.CommandSessionEvent.FromString(ev.SerializeToString()))


class _Counting:
    """A file being written that adds the bytes written to ``counts``."""

    def __init__(self, f, counts: list[int]):
        self._f = f
        self._counts = counts

    def write(self, data) -> int:
        self._counts.append(len(data))
        return self._f.write(data)

    def __getattr__(self, name: str):
        return getattr(self._f, name)
