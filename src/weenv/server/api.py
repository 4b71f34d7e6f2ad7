"""The weenv API (``/v1``): FastAPI routes over a :class:`~weenv.node.node.Node`.

JSON bodies are the models of :mod:`weenv.api.models`; streamed answers are
NDJSON (``application/x-ndjson``: one JSON object per line, sent as it is
ready, bytes base64-encoded)::

    GET    /v1/health                                 -> {"status": "ok", "environments": N}   (no key needed;
                                                      without one, only {"status": "ok"})
    GET    /v1/metrics                                -> Prometheus text format
    GET    /v1/stats                                  -> NodeStats
    PUT    /v1/peers                                  PeerUpdate -> 204 (a cluster node's peers, weenv.node.data.peers)
    GET    /v1/stats/provision?env=ID                 -> ProvisionStats (quotas, usage history, events)
    GET    /v1/templates                              -> [TemplateInfo]
    GET    /v1/templates/{name}                       -> TemplateInfo
    DELETE /v1/templates/{name}/profile               -> ProfileReset (its usage profile forgotten)
    POST   /v1/environments                           CreateRequest -> 201 EnvironmentInfo
    POST   /v1/environments/batch                     BatchCreateRequest -> NDJSON BatchCreateEvent, as each is ready
    GET    /v1/environments                           -> [EnvironmentInfo]
    GET    /v1/environments/{id}                      -> EnvironmentInfo
    DELETE /v1/environments/{id}                      -> 204
    POST   /v1/environments/{id}/timeout              SetTimeoutRequest -> EnvironmentInfo
    POST   /v1/environments/{id}/priority             SetPriorityRequest -> EnvironmentInfo
    PATCH  /v1/environments/{id}                      ResizeRequest -> EnvironmentInfo (resized live; 409 if
                                                      paused, 503 if the node cannot hold it: nothing changed)
    POST   /v1/environments/{id}/snapshots            SnapshotRequest -> 201 SnapshotInfo (captured, published;
                                                      409 if the name is another template's, 503 if the
                                                      node's disk cannot keep the capture)
    POST   /v1/environments/{id}/fork                 ForkRequest -> 201 ForkResponse (each child or its error)
    POST   /v1/environments/{id}/reset                ResetRequest -> EnvironmentInfo (the template's or a
                                                      snapshot's state, in place)
    POST   /v1/environments/{id}/pause                -> EnvironmentInfo (frozen; 409 if not running)
           {"release_memory": true}                      (processes ended, files kept: memory released)
    POST   /v1/environments/{id}/resume               ResumeRequest -> EnvironmentInfo (409 if not paused)
    GET    /v1/paused/{id}                            -> EnvironmentInfo as paused, published by a node
                                                      (weenv.node.state.handoff; 404 if none)
    POST   /v1/paused/{id}/resume                     ResumePublishedRequest -> 201 EnvironmentInfo (resumed
                                                      here with its id; 409 if it is on this node)
    GET    /v1/snapshots                              -> [SnapshotInfo]
    DELETE /v1/snapshots/{name}                       -> 204
    POST   /v1/environments/{id}/commands             ExecRequest -> ExecResult (captured; 413 past the output limit;
                                                      killed if the client leaves)
    POST   /v1/environments/{id}/commands/stream      ExecRequest -> NDJSON ProcessEvent (killed if the client leaves)
    POST   /v1/environments/{id}/processes            ExecRequest -> 201 ProcessInfo (runs in the background)
    GET    /v1/environments/{id}/processes            -> [ProcessInfo]
    GET    /v1/environments/{id}/processes/{pid}      -> ProcessInfo
    GET    /v1/environments/{id}/processes/{pid}/output  -> NDJSON ProcessEvent: kept output, then live, to the end
    POST   /v1/environments/{id}/processes/{pid}/wait?timeout=S  -> ProcessInfo (when ended, or after S seconds)
    POST   /v1/environments/{id}/processes/{pid}/kill    KillRequest -> 204
    POST   /v1/environments/{id}/processes/{pid}/stdin   ProcessStdin -> 204
    GET    /v1/environments/{id}/files?path=P         -> the file's bytes, streamed
    PUT    /v1/environments/{id}/files?path=P         body streamed to the file -> WriteInfo
    DELETE /v1/environments/{id}/files?path=P         -> 204 (a file, link or whole tree)
    GET    /v1/environments/{id}/files/stat?path=P    -> EntryInfo
    GET    /v1/environments/{id}/files/list?path=P    -> [EntryInfo]
    POST   /v1/environments/{id}/files/mkdir?path=P   -> 204 (parents too; fine if it exists)
    POST   /v1/environments/{id}/files/rename         RenameRequest -> 204
    POST   /v1/tax                                    TaxBatch -> 204 (an SDK meter's batch, weenv.formats.tax)
    GET    /v1/tax                                    -> TaxReport (the node's seconds by phase, the batches)
    POST   /v1/cache/drop                             -> 204
    POST   /v1/shutdown                               -> 202

File names are bytes on Linux and need not be UTF-8.  In a URL (``?path=``)
a path is its bytes percent-encoded (``%FF`` for the byte 0xFF); in JSON (the
answers of ``files/list``, ``files/stat``, ``PUT files`` and errors, the body
of ``files/rename``) a name that is not UTF-8 is the string ``os.fsdecode``
makes of it, each byte that is not UTF-8 a lone surrogate ``\udc80``-``\udcff``,
written as a JSON escape (``"\udcff"``).  Python's ``json`` reads and writes
these as they are (the SDK does), so a name read from a listing names the same
file when it is sent back; JSON parsers that refuse lone surrogates (Rust's,
pydantic's) or replace them (Go's) do not round-trip such names.

Errors: ``{"error": {"kind": KIND, "message": TEXT}}`` (:class:`ErrorResponse`)
with the status of :data:`weenv.server.kit.errors.STATUS`.  A failure after a stream
began is its last line: ``{"type": "error", "error": {...}}`` for commands,
``{"index": I, "error": {...}}`` per failed item of a batch.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import errno
import functools
import logging
import os
import threading
import urllib.parse
from collections.abc import AsyncIterator, Callable

import anyio
from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import StreamingResponse

from weenv.api.models import (
    BatchCreateEvent,
    BatchCreateRequest,
    CreateRequest,
    EntryInfo,
    EnvironmentInfo,
    ErrorInfo,
    ExecRequest,
    ExecResult,
    ForkChild,
    ForkRequest,
    ForkResponse,
    KillRequest,
    NodeStats,
    PauseRequest,
    ProcessInfo,
    ProcessStdin,
    ProfileReset,
    RenameRequest,
    ResetRequest,
    ResizeRequest,
    ResumePublishedRequest,
    ResumeRequest,
    SetPriorityRequest,
    SetTimeoutRequest,
    SnapshotInfo,
    SnapshotRequest,
    TemplateInfo,
    WriteInfo,
)
from weenv.errors import AuthenticationError, DiskFullError, InvalidInputError, WeenvError
from weenv.formats.manifest import Resources
from weenv.formats.tax import TaxBatch, TaxReport
from weenv.node.data.peers import PeerUpdate
from weenv.node.node import Node
from weenv.node.provision import ProvisionStats
from weenv.node.runtime.process import Process
from weenv.node.runtime.spec import CommandSpec
from weenv.node.state.fork import ForkResult
from weenv.server.auth import ApiKey, presented_key
from weenv.server.kit.errors import NamesJSONResponse
from weenv.server.kit.stream import NDJSON, ClosingStream, batch_lines
from weenv.server.metrics import CONTENT_TYPE, Metrics
from weenv.server.tax import COMMAND_KEY

log = logging.getLogger(__name__)

PREFIX = "/v1"
PATH_DOC = (
    "a path inside the environment; its bytes percent-encoded as UTF-8 "
    "(a name that is not UTF-8: its own bytes, e.g. %FF)"
)
FILE_CHUNK = 1 << 20
DEFAULT_BATCH_CONCURRENCY = 8
ERROR_RESPONSES = {
    400: {"description": "bad request (kind invalid_input)"},
    401: {"description": "no or wrong API key (kind authentication)"},
    404: {"description": "unknown environment, template, command or path (kind not_found)"},
}


def api_router(
    node: Node,
    metrics: Metrics,
    *,
    api_key: ApiKey | None,
    trusted_socket: str | None,
    on_shutdown: Callable[[], None] | None = None,
    max_output: int = 64 << 20,
) -> APIRouter:
    """The ``/v1`` routes.  ``api_key``: required from every client not on the
    Unix socket ``trusted_socket`` (None: no key, every client refused there).
    ``max_output``: bytes of output a captured command may write."""

    def require_key(request: Request) -> None:
        server = request.scope.get("server")
        if trusted_socket is not None and server and server[1] is None and server[0] == trusted_socket:
            return  # the Unix socket: its file mode (0600) decides who connects
        if api_key is None or not api_key.matches(presented_key(request.headers)):
            raise AuthenticationError(
                "missing or wrong API key: send it as 'X-API-Key: KEY' or 'Authorization: Bearer KEY' "
                "(the key is in $WEENV_HOME/run/api-key)"
            )

    open_r = APIRouter(prefix=PREFIX)
    r = APIRouter(dependencies=[Depends(require_key)], responses=ERROR_RESPONSES)

    @open_r.get("/health")
    def health(request: Request) -> dict:
        try:
            require_key(request)
        except AuthenticationError:  # open, but it tells nothing of the node without the key
            return {"status": "ok"}
        return {"status": "ok", "environments": node.count()}

    @r.get("/metrics", response_class=Response)
    def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @r.get("/stats")
    def stats() -> NodeStats:
        return node.stats()

    @r.post("/tax", status_code=204)
    def report_tax(batch: TaxBatch) -> Response:
        metrics.tax.report_batch(batch)
        return Response(status_code=204)

    @r.get("/tax")
    def tax() -> TaxReport:
        return metrics.tax.report()

    @r.put("/peers", status_code=204)
    def set_peers(update: PeerUpdate) -> Response:
        node.peers.update(update)
        return Response(status_code=204)

    @r.get("/stats/provision")
    def provision_stats(env: str | None = None) -> ProvisionStats:
        return node.provision_stats(env)

    # --- templates -------------------------------------------------------------------
    @r.get("/templates")
    def list_templates() -> list[TemplateInfo]:
        return node.templates()

    @r.get("/templates/{name}")
    def get_template(name: str) -> TemplateInfo:
        return node.template(name)

    @r.delete("/templates/{name}/profile")
    def reset_profile(name: str) -> ProfileReset:
        return node.reset_profile(name)

    # --- environments ----------------------------------------------------------------
    def create_one(req: CreateRequest) -> EnvironmentInfo:
        """``node.create`` of ``req``, marked undelivered (:meth:`Node.delivered` once answered)."""
        check_capacity(node, req.resources)
        try:
            info = node.create(req, undelivered=True)
        except BaseException:
            metrics.creates.labels("error").inc()
            raise
        metrics.creates.labels("ok").inc()
        metrics.create_seconds.observe(info.timing.total_s)
        return info

    @r.post("/environments", status_code=201)
    def create(req: CreateRequest) -> EnvironmentInfo:
        info = create_one(req)
        # Delivered as the answer goes out, not after it: a crash in between
        # leaves one environment to its timeout, where a mark removed after
        # the answer could make recovery destroy one its client holds.
        node.delivered(info.id)
        return info

    @r.post(
        "/environments/batch",
        response_class=StreamingResponse,
        responses={200: {"content": {NDJSON: {}}, "description": "BatchCreateEvent lines"}},
    )
    async def create_batch(req: BatchCreateRequest) -> StreamingResponse:
        for i, item in enumerate(req.items):  # refuse the whole batch before any create starts
            check_capacity(node, item.resources, where=f"items.{i}.resources")
        workers = req.concurrency or min(DEFAULT_BATCH_CONCURRENCY, len(req.items))
        return ClosingStream(_batch(create_one, node, req.items, workers), media_type=NDJSON)

    @r.get("/environments")
    def list_environments() -> list[EnvironmentInfo]:
        return node.list()

    @r.get("/environments/{env_id}")
    def get_environment(env_id: str) -> EnvironmentInfo:
        return node.get(env_id)

    @r.delete("/environments/{env_id}", status_code=204)
    def destroy(env_id: str) -> Response:
        node.destroy(env_id)
        return Response(status_code=204)

    @r.post("/environments/{env_id}/timeout")
    def set_timeout(env_id: str, req: SetTimeoutRequest) -> EnvironmentInfo:
        return node.set_timeout(env_id, req.timeout)

    @r.post("/environments/{env_id}/priority")
    def set_priority(env_id: str, req: SetPriorityRequest) -> EnvironmentInfo:
        return node.set_priority(env_id, req.priority)

    @r.patch("/environments/{env_id}")
    def set_resources(env_id: str, req: ResizeRequest) -> EnvironmentInfo:
        return node.set_resources(env_id, req.resources)

    # --- state: snapshot, fork, reset, pause ----------------------------------------
    @r.post("/environments/{env_id}/snapshots", status_code=201)
    def snapshot(env_id: str, req: SnapshotRequest | None = None) -> SnapshotInfo:
        return node.snapshot(env_id, req.name if req else None)

    @r.get("/snapshots")
    def list_snapshots() -> list[SnapshotInfo]:
        return node.snapshots()

    @r.delete("/snapshots/{name}", status_code=204)
    def delete_snapshot(name: str) -> Response:
        node.delete_snapshot(name)
        return Response(status_code=204)

    @r.post("/environments/{env_id}/fork", status_code=201)
    def fork(env_id: str, req: ForkRequest | None = None) -> ForkResponse:
        req = req or ForkRequest()
        return fork_response(node.fork(env_id, req.count, timeout=req.timeout))

    @r.post("/environments/{env_id}/reset")
    def reset(env_id: str, req: ResetRequest | None = None) -> EnvironmentInfo:
        return node.reset(env_id, req.snapshot if req else None)

    @r.post("/environments/{env_id}/pause")
    def pause(env_id: str, req: PauseRequest | None = None) -> EnvironmentInfo:
        return node.pause(env_id, release_memory=req.release_memory if req else False)

    @r.post("/environments/{env_id}/resume")
    def resume(env_id: str, req: ResumeRequest | None = None) -> EnvironmentInfo:
        return node.resume(env_id, timeout=req.timeout if req else None)

    @r.get("/paused/{env_id}")
    def published_pause(env_id: str) -> EnvironmentInfo:
        return node.published_pause(env_id)

    @r.post("/paused/{env_id}/resume", status_code=201)
    def resume_published(env_id: str, req: ResumePublishedRequest | None = None) -> EnvironmentInfo:
        req = req or ResumePublishedRequest()
        return node.resume_published(env_id, timeout=req.timeout, metadata=req.metadata)

    # --- commands --------------------------------------------------------------------
    def spawn(env_id: str, req: ExecRequest, *, primary: bool) -> Process:
        return node.spawn(env_id, CommandSpec.of(req), primary_reader=primary)

    @r.post("/environments/{env_id}/commands")
    async def run_command(env_id: str, req: ExecRequest, request: Request) -> ExecResult:
        metrics.commands.labels("captured").inc()
        # captured: its stdin is the request's bytes or nothing, never a pipe left open
        spec = dataclasses.replace(CommandSpec.of(req), stdin_open=False, tag=None)
        p = await anyio.to_thread.run_sync(functools.partial(node.spawn, env_id, spec, primary_reader=True))
        request.scope[COMMAND_KEY] = p  # its run time is not the node's overhead (weenv.server.tax)
        error: Exception | None = None
        async with anyio.create_task_group() as tg:
            tg.start_soon(_kill_when_gone, request, p)  # a command does not outlive its caller
            try:
                result = await anyio.to_thread.run_sync(node.collect, p, max_output)
            except Exception as exc:  # noqa: BLE001 - re-raised past the group, unwrapped (no ExceptionGroup)
                error = exc
            finally:
                tg.cancel_scope.cancel()
        if error is not None:
            raise error
        return result

    @r.post(
        "/environments/{env_id}/commands/stream",
        response_class=StreamingResponse,
        responses={200: {"content": {NDJSON: {}}, "description": "ProcessEvent lines"}},
    )
    async def stream_command(env_id: str, req: ExecRequest, request: Request) -> StreamingResponse:
        p = await anyio.to_thread.run_sync(functools.partial(spawn, env_id, req, primary=True))
        request.scope[COMMAND_KEY] = p
        metrics.commands.labels("stream").inc()
        assert p.primary is not None
        return StreamingResponse(_events(p, p.primary, kill_on_close=True), media_type=NDJSON)

    @r.post("/environments/{env_id}/processes", status_code=201)
    def start_process(env_id: str, req: ExecRequest) -> ProcessInfo:
        p = spawn(env_id, req, primary=False)
        metrics.commands.labels("background").inc()
        return p.info()

    @r.get("/environments/{env_id}/processes")
    def list_processes(env_id: str) -> list[ProcessInfo]:
        return node.processes(env_id)

    @r.get("/environments/{env_id}/processes/{pid}")
    def get_process(env_id: str, pid: int) -> ProcessInfo:
        return node.process(env_id, pid).info()

    @r.get(
        "/environments/{env_id}/processes/{pid}/output",
        response_class=StreamingResponse,
        responses={200: {"content": {NDJSON: {}}, "description": "ProcessEvent lines"}},
    )
    def process_output(env_id: str, pid: int, request: Request) -> StreamingResponse:
        p = node.process(env_id, pid)
        request.scope[COMMAND_KEY] = p
        return StreamingResponse(_events(p, p.log.attach(), kill_on_close=False), media_type=NDJSON)

    @r.post("/environments/{env_id}/processes/{pid}/wait")
    def wait_process(
        env_id: str, pid: int, request: Request, timeout: float = Query(default=60.0, gt=0, le=3600)
    ) -> ProcessInfo:
        p = node.process(env_id, pid)
        request.scope[COMMAND_KEY] = p
        p.wait(timeout)
        return p.info()

    @r.post("/environments/{env_id}/processes/{pid}/kill", status_code=204)
    def kill_process(env_id: str, pid: int, req: KillRequest | None = None) -> Response:
        node.process(env_id, pid).kill((req or KillRequest()).signal)
        return Response(status_code=204)

    @r.post("/environments/{env_id}/processes/{pid}/stdin", status_code=204)
    def write_stdin(env_id: str, pid: int, req: ProcessStdin) -> Response:
        node.process(env_id, pid).write_stdin(req.data, eof=req.eof)
        return Response(status_code=204)

    # --- files -----------------------------------------------------------------------
    @r.get(
        "/environments/{env_id}/files",
        response_class=StreamingResponse,
        responses={200: {"content": {"application/octet-stream": {}}}},
    )
    def download(env_id: str, path: str = Depends(fs_path)) -> StreamingResponse:
        f = node.files(env_id).open_read(path)
        size = os.fstat(f.fileno()).st_size

        def chunks():
            with f:
                left = size
                while left > 0 and (data := f.read(min(FILE_CHUNK, left))):
                    left -= len(data)
                    yield data

        return StreamingResponse(chunks(), media_type="application/octet-stream", headers={"content-length": str(size)})

    @r.put(
        "/environments/{env_id}/files",
        response_class=NamesJSONResponse,
        openapi_extra={
            "requestBody": {"content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}
        },
    )
    async def upload(
        env_id: str,
        request: Request,
        path: str = Depends(fs_path),
        user: str | None = Query(default=None, min_length=1, max_length=256, description=USER_DOC),
    ) -> WriteInfo:
        fs = node.files(env_id)
        owner = await anyio.to_thread.run_sync(_owner, node, env_id, user)
        length = request.headers.get("content-length", "")
        if length.isdigit():  # a body that can never fit is refused before a byte is written
            _used, limit = await anyio.to_thread.run_sync(node.disk_usage, env_id)
            if int(length) > limit:
                raise DiskFullError(
                    errno.EDQUOT,
                    f"{path}: {length} bytes do not fit the environment's "
                    f"disk limit of {limit} bytes (resources.disk_bytes)",
                )
        f = await anyio.to_thread.run_sync(
            functools.partial(fs.open_write, path, owner=owner, own_existing=user is not None)
        )
        size = 0
        buf = bytearray()
        try:
            async for chunk in request.stream():
                buf += chunk
                if len(buf) >= FILE_CHUNK:
                    await anyio.to_thread.run_sync(f.write, bytes(buf))
                    size += len(buf)
                    buf.clear()
            if buf:
                await anyio.to_thread.run_sync(f.write, bytes(buf))
                size += len(buf)
        finally:
            f.close()
        return WriteInfo(path=path, size=size)

    @r.delete("/environments/{env_id}/files", status_code=204)
    def remove(env_id: str, path: str = Depends(fs_path)) -> Response:
        node.files(env_id).remove(path)
        return Response(status_code=204)

    @r.get("/environments/{env_id}/files/stat", response_class=NamesJSONResponse)
    def stat(env_id: str, path: str = Depends(fs_path)) -> EntryInfo:
        return node.files(env_id).stat(path)

    @r.get("/environments/{env_id}/files/list", response_class=NamesJSONResponse)
    def list_dir(env_id: str, path: str = Depends(fs_path_or_root)) -> list[EntryInfo]:
        return node.files(env_id).list_dir(path)

    @r.post("/environments/{env_id}/files/mkdir", status_code=204)
    def make_dir(
        env_id: str,
        path: str = Depends(fs_path),
        user: str | None = Query(default=None, min_length=1, max_length=256, description=USER_DOC),
    ) -> Response:
        node.files(env_id).make_dir(path, owner=_owner(node, env_id, user))
        return Response(status_code=204)

    @r.post("/environments/{env_id}/files/rename", status_code=204)  # JSON src/dst: \udcXX escapes kept
    def rename(env_id: str, req: RenameRequest) -> Response:
        node.files(env_id).rename(req.src, req.dst)
        return Response(status_code=204)

    # --- the node --------------------------------------------------------------------
    @r.post("/cache/drop", status_code=204)
    def drop_cache() -> Response:
        node.drop_caches()
        return Response(status_code=204)

    @r.post("/shutdown", status_code=202)
    def shutdown() -> dict:
        if on_shutdown is not None:
            on_shutdown()
        return {"status": "stopping"}

    open_r.include_router(r)
    return open_r


USER_DOC = (
    "Who owns what is created, and the file an upload replaces: a user of the environment's /etc/passwd or "
    "'UID[:GID]' (default: as written, root's; a replaced file keeps its owner)"
)


def _owner(node: Node, env_id: str, user: str | None) -> tuple[int, int] | None:
    """``(uid, gid)`` of ``user`` in the environment (None: no user named)."""
    if user is None:
        return None
    who = node.user(env_id, user)
    return (who.uid, who.gid)


def _query_path(request: Request) -> str | None:
    """The ``path`` query parameter, percent-decoded as UTF-8 with surrogate
    escapes (``%FF`` -> ``"\\udcff"``): lossless for any byte string, where
    Starlette's own decoding replaces bytes that are not UTF-8."""
    raw = request.scope.get("query_string", b"").decode("utf-8", "surrogateescape")
    for key, value in urllib.parse.parse_qsl(raw, keep_blank_values=True, encoding="utf-8", errors="surrogateescape"):
        if key == "path":
            return value
    return None


def fs_path(request: Request, path: str = Query(description=PATH_DOC)) -> str:
    return _query_path(request) or path


def fs_path_or_root(request: Request, path: str = Query("/", description=PATH_DOC)) -> str:
    return _query_path(request) or path


def fork_response(result: ForkResult) -> ForkResponse:
    """The answer of a fork: each child's info, or its error's kind and message."""
    children = [
        ForkChild(error=ErrorInfo(kind=c.kind, message=str(c)))
        if isinstance(c, WeenvError)
        else ForkChild(environment=c)
        for c in result.children
    ]
    return ForkResponse(parent=result.parent, children=children, pause_s=result.pause_s, total_s=result.total_s)


def check_capacity(node: Node, resources: Resources | None, *, where: str = "resources") -> None:
    """Refuse ``resources`` one environment of this node could never have:
    ``cpus`` above the node's cores, ``memory_bytes`` above the memory it gives
    environments (the provisioner's capacity: MemTotal minus its reserve),
    ``pids`` above the kernel's ``pid_max``.  Raises :class:`InvalidInputError` (400)."""
    if resources is None:
        return
    cpus, memory = node.provisioner.cpu_capacity, node.provisioner.memory_capacity
    if resources.cpus > cpus:
        raise InvalidInputError(f"{where}.cpus: {resources.cpus:g} is more than the node's {cpus:g} cores")
    if resources.memory_bytes > memory:
        raise InvalidInputError(
            f"{where}.memory_bytes: {resources.memory_bytes} is more than the "
            f"{memory} bytes the node gives environments"
        )
    pid_max = _pid_max()
    if resources.pids > pid_max:
        raise InvalidInputError(f"{where}.pids: {resources.pids} is more than the kernel's pid_max ({pid_max})")


def _pid_max() -> int:
    try:
        with open("/proc/sys/kernel/pid_max") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 1 << 22


def _line(model) -> bytes:
    return model.model_dump_json(exclude_none=True).encode() + b"\n"


async def _kill_when_gone(request: Request, p: Process, interval: float = 0.5) -> None:
    """Kill ``p`` if the client of ``request`` disconnects while it runs."""
    while p.running:
        if await request.is_disconnected():
            log.info("client of %s left: killing command %s", request.url.path, p.pid)
            with contextlib.suppress(WeenvError):
                p.kill()
            return
        await anyio.sleep(interval)


async def _events(p: Process, reader: int, *, kill_on_close: bool) -> AsyncIterator[bytes]:
    """NDJSON lines of ``p``'s events from ``reader``'s cursor to the end.  If
    the client leaves first (the generator is closed) and ``kill_on_close``, the
    command is killed: a foreground command does not outlive its caller."""
    ended = False
    try:
        while True:
            batch = await anyio.to_thread.run_sync(p.log.read, reader, 1.0)
            if batch is None:
                ended = True
                return
            if batch:
                yield b"".join(_line(e) for e in batch)
    finally:
        p.log.detach(reader)
        if kill_on_close and not ended and p.running:
            with contextlib.suppress(WeenvError):
                p.kill()


async def _batch(
    create_one: Callable[[CreateRequest], EnvironmentInfo], node: Node, items: list[CreateRequest], workers: int
) -> AsyncIterator[bytes]:
    """NDJSON :class:`BatchCreateEvent` lines in the order creates finish
    (:func:`~weenv.server.kit.stream.batch_lines`).
    Environments created for a client that left before receiving them are
    destroyed: those still being created, and those done but not yet written.
    A line written to the connection counts as received: the server cannot
    tell it from one the client read before it went.  Until its line is
    handed to the connection, an environment is marked undelivered on disk
    (:meth:`Node.delivered`), so a node restarted after a crash removes what no
    client heard of (a crash in the instant between the mark and the write
    leaves one environment to its timeout)."""
    pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="weenv-create")
    submitted = [pool.submit(create_one, item) for item in items]

    def done_line(i: int, info: EnvironmentInfo) -> bytes:
        # marked just before its line goes out: the middleware may write the line and the
        # client act on it (even kill this daemon) before this generator runs again
        node.delivered(info.id)
        return _line(BatchCreateEvent(index=i, environment=info))

    def undo(unwritten: list[int]) -> None:
        # the client left: undo what it will never hear of, those still running and
        # those done but not sent (several creates can finish at once)
        for i in unwritten:
            submitted[i].cancel()  # one not started yet never runs
            submitted[i].add_done_callback(functools.partial(_destroy_result, node))
        pool.shutdown(wait=False, cancel_futures=True)

    jobs = {asyncio.wrap_future(cf): i for i, cf in enumerate(submitted)}
    async with contextlib.aclosing(batch_lines(jobs, done_line, undo)) as lines:  # closed with this one
        async for line in lines:
            yield line


def _destroy_result(node: Node, f: concurrent.futures.Future) -> None:
    """Destroy the environment ``f`` created, if it did, in a thread of its own (a
    future already done runs this at once, on the event loop's thread)."""
    if f.cancelled() or f.exception() is not None:
        return

    def destroy() -> None:
        with contextlib.suppress(WeenvError):
            node.destroy(f.result().id)

    threading.Thread(target=destroy, name="weenv-batch-undo", daemon=True).start()
