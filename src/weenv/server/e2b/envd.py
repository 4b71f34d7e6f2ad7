"""E2B's in-sandbox services (envd) for every sandbox of the node, at one URL.

E2B runs an ``envd`` inside each sandbox behind a proxy that picks the sandbox
by the ``E2b-Sandbox-Id`` header (the SDK sets it, with ``E2b-Sandbox-Port``, when
``E2B_SANDBOX_URL`` names one URL for all sandboxes) or by the host name
``PORT-SANDBOXID.DOMAIN``.  weenv serves them itself, on the host, routing each
request the same way.  Every request, ``/health`` included, must carry the
sandbox's access token (``X-Access-Token``, from the create/connect answer; the
SDK sends it on every envd request).

Endpoints (under this app's prefix)::

    GET  /health                              204 (the sandbox runs; 502 while it is paused, as
                                              every endpoint: the SDK's ``is_running`` is false)
    GET  /files?path=P                        the file's bytes
    POST /files?path=P                        multipart/form-data (``file`` parts; the part's
                                              file name is the path when ``path`` is absent)
                                              or application/octet-stream (gzip allowed), streamed
                                              -> [{"name", "type": "file", "path"[, "metadata"]}]
                                              (``X-Metadata-KEY`` headers: user.e2b.KEY xattrs)
    POST /process.Process/{Start,Connect,List,SendSignal,SendInput,StreamInput,CloseStdin,Update}
    POST /filesystem.Filesystem/{Stat,ListDir,MakeDir,Move,Remove}
    POST /filesystem.Filesystem/{WatchDir,CreateWatcher,GetWatcherEvents,RemoveWatcher}
                                              (inotify: :mod:`weenv.server.e2b.watch`)

The RPCs speak the Connect protocol (:mod:`weenv.server.e2b.connect`).  Errors
of the HTTP endpoints and of routing are envd's ``{"code": STATUS, "message"}``.
No existence oracle: a missing or wrong token is 401 whether the sandbox exists
or not; only with its right token (a client that had it) is a sandbox that is
gone a 502 whose message says it "was not found", which the SDK turns into
``SandboxNotRunningException``.
"""

from __future__ import annotations

import base64
import binascii
import re
import zlib
from collections.abc import Iterator
from functools import partial

import anyio.to_thread
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from weenv.errors import (
    DiskFullError,
    InvalidInputError,
    NotFoundError,
    RequestTooLargeError,
    UnknownUserError,
    WeenvError,
)
from weenv.node.runtime.users import Identity
from weenv.server.e2b import files, multipart, signed
from weenv.server.e2b.connect import Method, RpcError, error_response, serve
from weenv.server.e2b.processes import ProcessService
from weenv.server.e2b.proto import filesystem_pb, process_pb
from weenv.server.e2b.sandboxes import Sandbox, Sandboxes
from weenv.server.e2b.watch import Watches, WatchService
from weenv.server.limits import MAX_UPLOAD

_HOST_RE = re.compile(r"^\d+-([A-Za-z0-9]+)\.")


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"code": status, "message": message}, status_code=status)


def _paused(sb: Sandbox) -> Response | None:
    """The answer for a paused sandbox (None: it runs).  E2B's proxy finds no
    running sandbox behind a paused one and answers 502 "The sandbox was not
    found", which the SDK reads as not running (``is_running`` false,
    ``SandboxNotRunningException``).  A connect or resume makes it answer again."""
    if sb.info.state == "paused":
        return _error(502, f"The sandbox {sb.id} was not found: it is paused (connect to it or resume it)")
    return None


def sandbox_id_of(request: Request) -> str | None:
    """The sandbox a request names: ``E2b-Sandbox-Id``, else ``PORT-ID.`` in ``Host``."""
    return sandbox_id_in(request.headers)


def basic_user(headers) -> str | None:
    """The user an envd RPC names: the user name of ``Authorization: Basic``
    (the SDK sends ``USER:``), None without one (the template's user)."""
    auth = headers.get("authorization", "")
    if auth[:6].lower() != "basic ":
        return None
    try:
        decoded = base64.b64decode(auth[6:].strip(), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        raise RpcError("unauthenticated", "bad basic authorization header") from None
    return decoded.partition(":")[0] or None


def sandbox_id_in(headers) -> str | None:
    """:func:`sandbox_id_of` from a request's headers (a mapping with ``get``)."""
    sid = headers.get("e2b-sandbox-id")
    if sid:
        return sid
    m = _HOST_RE.match(headers.get("host", ""))
    return m.group(1) if m else None


def signed_sandbox_id(sandboxes: Sandboxes, method: str, headers, query) -> str | None:
    """The sandbox whose token signed a ``/files`` request of a signed URL
    (:mod:`weenv.server.e2b.signed`), None when the request is not one (it has
    an ``X-Access-Token`` or no ``signature``).  Raises
    :class:`~weenv.server.e2b.signed.SignatureError` for a bad, expired or
    foreign signature."""
    presented = query.get("signature")
    if presented is None or headers.get("x-access-token") is not None:
        return None
    expiration = signed.expiration_of(query.get("signature_expiration"))
    sid = sandbox_id_in(headers)
    candidates = [sid] if sid else sandboxes.node.ids()  # the node's table: no runc call
    return signed.signer(
        presented,
        query.get("path") or "",
        "read" if method == "GET" else "write",
        query.get("username") or "",
        expiration,
        candidates,
        sandboxes.access_token,
    )


class Envd:
    """The envd endpoints of every sandbox in ``sandboxes`` (see the module docstring)."""

    def __init__(self, sandboxes: Sandboxes):
        self.sandboxes = sandboxes
        node = sandboxes.node
        proc = ProcessService(node)
        self.watches = Watches(node)
        """The directory watchers of every sandbox (:mod:`weenv.server.e2b.watch`)."""
        watch = WatchService(self.watches)
        pb, fb = process_pb, filesystem_pb

        def fs_call(fn):
            async def handler(req, ctx):
                return await anyio.to_thread.run_sync(fn, node, ctx.state["sandbox"], req, ctx.state["user"])

            return handler

        self.methods: dict[str, Method] = {
            "process.Process/Start": Method(pb.StartRequest, pb.StartResponse, proc.start, streaming=True),
            "process.Process/Connect": Method(pb.ConnectRequest, pb.ConnectResponse, proc.connect, streaming=True),
            "process.Process/List": Method(pb.ListRequest, pb.ListResponse, proc.list),
            "process.Process/SendSignal": Method(pb.SendSignalRequest, pb.SendSignalResponse, proc.send_signal),
            "process.Process/SendInput": Method(pb.SendInputRequest, pb.SendInputResponse, proc.send_input),
            "process.Process/StreamInput": Method(
                pb.StreamInputRequest, pb.StreamInputResponse, proc.stream_input, client_streaming=True
            ),
            "process.Process/CloseStdin": Method(pb.CloseStdinRequest, pb.CloseStdinResponse, proc.close_stdin),
            "process.Process/Update": Method(pb.UpdateRequest, pb.UpdateResponse, proc.update),
            "filesystem.Filesystem/Stat": Method(fb.StatRequest, fb.StatResponse, fs_call(files.stat)),
            "filesystem.Filesystem/ListDir": Method(fb.ListDirRequest, fb.ListDirResponse, fs_call(files.list_dir)),
            "filesystem.Filesystem/MakeDir": Method(fb.MakeDirRequest, fb.MakeDirResponse, fs_call(files.make_dir)),
            "filesystem.Filesystem/Move": Method(fb.MoveRequest, fb.MoveResponse, fs_call(files.move)),
            "filesystem.Filesystem/Remove": Method(fb.RemoveRequest, fb.RemoveResponse, fs_call(files.remove)),
            "filesystem.Filesystem/WatchDir": Method(
                fb.WatchDirRequest, fb.WatchDirResponse, watch.watch_dir, streaming=True
            ),
            "filesystem.Filesystem/CreateWatcher": Method(
                fb.CreateWatcherRequest, fb.CreateWatcherResponse, watch.create_watcher
            ),
            "filesystem.Filesystem/GetWatcherEvents": Method(
                fb.GetWatcherEventsRequest, fb.GetWatcherEventsResponse, watch.get_watcher_events
            ),
            "filesystem.Filesystem/RemoveWatcher": Method(
                fb.RemoveWatcherRequest, fb.RemoveWatcherResponse, watch.remove_watcher
            ),
        }

    def routes(self) -> list[Route]:
        return [
            Route("/health", self.health, methods=["GET"]),
            Route("/files", self.files, methods=["GET", "POST"]),
            Route("/{service:str}/{method:str}", self.rpc, methods=["POST", "GET"]),
        ]

    # --- routing ----------------------------------------------------------------------
    async def _sandbox(self, request: Request) -> Sandbox | Response:
        """The sandbox the request names, or the error answer.  The access
        token is checked before the sandbox is looked up, and a token is
        checkable for any id (:meth:`Sandboxes.token_matches`): without the
        right token, a live sandbox and an unknown one get the same 401 after
        the same work, so the answer tells nothing of which ids exist."""
        sid = sandbox_id_of(request)
        if not sid:
            return _error(400, "no sandbox named: send the E2b-Sandbox-Id header")
        if not self.sandboxes.token_matches(sid, request.headers.get("x-access-token")):
            return _error(401, "missing or wrong access token (X-Access-Token)")
        sb = await anyio.to_thread.run_sync(self.sandboxes.find, sid)
        if sb is None:
            return _error(502, f"The sandbox {sid} was not found")
        return _paused(sb) or sb

    async def health(self, request: Request) -> Response:
        sb = await self._sandbox(request)
        return sb if isinstance(sb, Response) else Response(status_code=204)

    async def rpc(self, request: Request) -> Response:
        name = f"{request.path_params['service']}/{request.path_params['method']}"
        method = self.methods.get(name)
        streaming = request.headers.get("content-type", "").startswith("application/connect+")
        if method is None:
            return error_response(RpcError("unimplemented", f"{name} is not implemented by weenv"), streaming=streaming)
        sb = await self._sandbox(request)
        if isinstance(sb, Response):
            return sb
        try:  # as envd's authentication middleware: an unknown user is refused before the call
            name = basic_user(request.headers)
            who = await anyio.to_thread.run_sync(self._user, sb, name)
        except UnknownUserError:
            return error_response(RpcError("unauthenticated", f"invalid username: '{name}'"), streaming=streaming)
        except InvalidInputError as exc:
            return error_response(RpcError("unauthenticated", str(exc)), streaming=streaming)
        except RpcError as exc:
            return error_response(exc, streaming=streaming)
        except NotFoundError:
            return _error(502, f"The sandbox {sb.id} was not found")
        return await serve(request, method, {"sandbox": sb, "user": who, "node": self.sandboxes.node})

    def _user(self, sb: Sandbox, name: str | None) -> Identity:
        """The sandbox's user ``name`` (None: the template's); raises as :meth:`Node.user`."""
        return self.sandboxes.node.user(sb.id, name)

    # --- /files -------------------------------------------------------------------------
    async def files(self, request: Request) -> Response:
        try:  # a signed URL (download_url / upload_url) carries no token: its signature names the sandbox
            sid = await anyio.to_thread.run_sync(
                signed_sandbox_id, self.sandboxes, request.method, request.headers, request.query_params
            )
        except signed.SignatureError as exc:
            return _error(401, str(exc))
        if sid is None:
            sb = await self._sandbox(request)
        else:
            sb = await anyio.to_thread.run_sync(self.sandboxes.find, sid)
            if sb is None:
                return _error(502, f"The sandbox {sid} was not found")
            sb = _paused(sb) or sb
        if isinstance(sb, Response):
            return sb
        path = request.query_params.get("path")
        name = request.query_params.get("username") or None
        try:
            who = await anyio.to_thread.run_sync(self._user, sb, name)
        except UnknownUserError:  # envd's words and status (the SDK raises AuthenticationException)
            return _error(401, f"error looking up user '{name}': user: unknown user {name}")
        except InvalidInputError as exc:
            return _error(401, f"error looking up user '{name}': {exc}")
        except NotFoundError:
            return _error(502, f"The sandbox {sb.id} was not found")
        try:
            if request.method == "GET":
                if not path:
                    return _error(400, "missing path")
                f = await anyio.to_thread.run_sync(files.open_read, self.sandboxes.node, sb, path, who)
                return StreamingResponse(_chunks(f), media_type="application/octet-stream")
            return JSONResponse(await self._upload(request, sb, path, who))
        except NotFoundError as exc:
            return _error(404, str(exc))
        except RequestTooLargeError as exc:
            return _error(413, str(exc))
        except (InvalidInputError, RpcError) as exc:
            return _error(400, str(exc))
        except DiskFullError as exc:  # envd's "not enough disk space"
            return _error(507, str(exc))
        except WeenvError as exc:
            return _error(500, str(exc))
        except OSError as exc:
            return _error(507 if exc.errno == 28 else 500, f"{exc.strerror or exc}")

    async def _upload(self, request: Request, sb: Sandbox, path: str | None, who: Identity) -> list[dict[str, str]]:
        """Write the files of an upload as ``who`` (its files and new parents are
        its own); the answer's entries."""
        node = self.sandboxes.node
        ctype = request.headers.get("content-type", "")
        write = partial(files.open_write, node, sb, who=who, metadata=files.upload_metadata(request.headers))
        if ctype.startswith("multipart/form-data"):  # streamed part by part into the sandbox
            return await multipart.write_parts(ctype, request.stream(), write, path)
        if not path:
            raise InvalidInputError("an octet-stream upload needs the path parameter")
        gzipped = request.headers.get("content-encoding", "").lower() == "gzip"
        f, entry = await anyio.to_thread.run_sync(write, path)
        try:
            inflate = zlib.decompressobj(wbits=31) if gzipped else None
            size = 0
            async for chunk in request.stream():
                for piece in inflated(inflate, chunk) if inflate is not None else (chunk,):
                    size += len(piece)
                    if size > MAX_UPLOAD:  # the body is bounded before (limits.BodyLimit), a gzipped one inflated here
                        raise RequestTooLargeError(f"upload larger than {MAX_UPLOAD} bytes")
                    await anyio.to_thread.run_sync(f.write, piece)
        finally:
            await anyio.to_thread.run_sync(f.close)
        return [entry]


INFLATE_PIECE = 1 << 20
"""Most bytes one step of a gzipped upload's inflation makes (its memory per upload)."""


def inflated(inflate, chunk: bytes, piece: int = INFLATE_PIECE) -> Iterator[bytes]:
    """What the ``zlib`` decompressor ``inflate`` makes of ``chunk``, in pieces
    of at most ``piece`` bytes: a 64 KiB chunk of a gzip bomb inflates to
    64 MiB, which one ``decompress`` call would hold at once.  Raises
    :class:`InvalidInputError` for bytes that are not gzip."""
    try:
        while True:
            out = inflate.decompress(chunk, piece)
            chunk = inflate.unconsumed_tail
            if out:
                yield out
            if not chunk and len(out) < piece:  # a full piece may leave output inside zlib
                return
    except zlib.error as exc:
        raise InvalidInputError(f"bad gzip body: {exc}") from exc


async def _chunks(f, size: int = 1 << 20):
    """The content of the open file ``f``, read in worker threads, then closed."""
    try:
        while chunk := await anyio.to_thread.run_sync(f.read, size):
            yield chunk
    finally:
        await anyio.to_thread.run_sync(f.close)
