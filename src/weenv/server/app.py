"""The node daemon's HTTP app (FastAPI), served by uvicorn on the Unix socket
``$WEENV_HOME/run/weenv.sock`` and, optionally, on TCP (:mod:`weenv.server.daemon`).

The weenv API is under ``/v1`` (:mod:`weenv.server.api` lists every endpoint);
its OpenAPI document is at ``/openapi.json`` (browsable at ``/docs``).  Other
routers (the E2B-compatible API) are mounted beside it on the same app and share
its :class:`~weenv.node.node.Node`; the dashboard is at ``/ui``
(:mod:`weenv.server.ui`).

Errors of ``/v1`` requests are ``{"error": {"kind": KIND, "message": TEXT}}``
with a status from the kind (:data:`~weenv.server.kit.errors.STATUS`); malformed JSON and invalid fields
are ``invalid_input`` (400), unknown routes ``not_found`` (404), bodies past
the limits of :mod:`weenv.server.limits` ``too_large`` (413).  Requests to
other routers keep FastAPI's default error bodies.

While the app runs, a reaper task destroys environments whose timeout passed
(every ``reap_interval`` seconds), so an environment whose client vanished
lives at most its timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from contextlib import asynccontextmanager

import anyio
from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler, request_validation_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from weenv.errors import WeenvError
from weenv.node.node import Node
from weenv.server.api import PREFIX, api_router
from weenv.server.auth import ApiKey, presented_key
from weenv.server.kit.errors import describe_errors, error_response
from weenv.server.limits import MAX_BODY, MAX_UPLOAD, BodyLimit
from weenv.server.metrics import Metrics
from weenv.server.peers import peer_router
from weenv.server.tax import EnvSeconds
from weenv.server.ui import ui_router

log = logging.getLogger(__name__)

WORKER_THREADS = 512
"""Threads for blocking handlers (FastAPI's default, 40, is too few when many
streams wait on commands)."""


def create_app(
    node: Node,
    *,
    on_shutdown: Callable[[], None] | None = None,
    api_key: ApiKey | None = None,
    trusted_socket: str | None = None,
    reap_interval: float = 1.0,
    max_output: int = 64 << 20,
    max_body: int = MAX_BODY,
    max_upload: int = MAX_UPLOAD,
) -> FastAPI:
    """The app over ``node``: it starts the node when it starts and closes it
    when it stops; ``on_shutdown`` is called by ``POST /v1/shutdown``.

    ``api_key``: the key TCP clients must send; ``trusted_socket``: the Unix
    socket path whose clients need none.  ``reap_interval``: seconds between
    reaper passes.  ``max_output``: bytes a captured command may write.
    ``max_body``, ``max_upload``: bytes of a request body, of a file upload
    (:class:`~weenv.server.limits.BodyLimit`, for every router mounted on the app)."""
    metrics = Metrics(node)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        anyio.to_thread.current_default_thread_limiter().total_tokens = WORKER_THREADS
        await anyio.to_thread.run_sync(node.start)
        reaper = asyncio.create_task(_reap(node, metrics, reap_interval))
        try:
            yield
        finally:
            reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reaper
            await anyio.to_thread.run_sync(node.close)

    app = FastAPI(
        title="weenv node",
        version="1",
        lifespan=lifespan,
        description="Environments for agentic RL: templates, environments, commands, files.",
    )

    def credentialed(scope: dict) -> bool:
        """Whether a request carries valid credentials (checked before its body
        is read, :class:`~weenv.server.limits.BodyLimit`): it came on the
        trusted Unix socket, carries the API key, or credentials that
        ``app.state.envd_credentialed(scope)`` (set by the daemon: an envd
        access token, an upload's token on its own route) accepts."""
        server = scope.get("server")
        if trusted_socket is not None and server and server[1] is None and server[0] == trusted_socket:
            return True
        headers = Headers(scope=scope)
        if api_key is not None and api_key.matches(presented_key(headers)):
            return True
        envd = getattr(app.state, "envd_credentialed", None)
        return envd is not None and envd(scope)

    app.add_middleware(BodyLimit, max_body=max_body, max_upload=max_upload, credentialed=credentialed)
    app.add_middleware(EnvSeconds, book=metrics.tax)  # outermost: a request's whole time, limits included
    app.state.node = node
    app.state.metrics = metrics
    app.state.api_key = api_key  # for other routers (E2B): ApiKey.matches accepts "e2b_" + the key

    @app.exception_handler(WeenvError)
    async def weenv_error(request: Request, exc: WeenvError) -> JSONResponse:
        return error_response(exc.kind, str(exc))

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError):
        if not request.url.path.startswith(PREFIX + "/"):
            return await request_validation_exception_handler(request, exc)
        return error_response("invalid_input", "bad request: " + describe_errors(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        if not request.url.path.startswith(PREFIX + "/"):
            return await http_exception_handler(request, exc)
        kind = {404: "not_found", 401: "authentication"}.get(exc.status_code, "invalid_input")
        return error_response(kind, f"{request.method} {request.url.path}: {exc.detail}", exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        response = error_response("weenv", f"internal error: {type(exc).__name__}: {exc}", 500)
        # Starlette re-raises after this answer and uvicorn then closes the
        # connection: tell the client not to reuse it for its next request.
        response.headers["connection"] = "close"
        return response

    app.include_router(
        api_router(
            node,
            metrics,
            api_key=api_key,
            trusted_socket=trusted_socket,
            on_shutdown=on_shutdown,
            max_output=max_output,
        )
    )
    app.include_router(peer_router(node))
    app.include_router(ui_router(node, metrics, api_key=api_key, trusted_socket=trusted_socket))
    return app


async def _reap(node: Node, metrics: Metrics, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        try:
            reaped = await anyio.to_thread.run_sync(node.reap_expired)
        except Exception:  # keep reaping: one failed destroy must not stop the others later
            log.exception("reaper pass")
            continue
        if reaped:
            metrics.reaped.inc(len(reaped))
