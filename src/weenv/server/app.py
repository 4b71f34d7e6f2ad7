"""The node daemon's HTTP API (FastAPI), served by uvicorn on ``$WEENV_HOME/run/weenv.sock``.

Endpoints (JSON bodies are the models of :mod:`weenv.node.models`)::

    GET    /health
    GET    /stats
    POST   /environments                    CreateRequest -> EnvironmentInfo (201)
    GET    /environments                    -> [EnvironmentInfo]
    GET    /environments/{id}               -> EnvironmentInfo
    DELETE /environments/{id}               -> 204
    POST   /environments/{id}/commands      ExecRequest -> ExecResult
    GET    /environments/{id}/files?path=P  -> bytes
    PUT    /environments/{id}/files?path=P  bytes -> 204
    POST   /cache/drop                      -> 204 (empties the node chunk cache)
    POST   /shutdown                        -> 202

Errors are ``{"error": {"kind": KIND, "message": TEXT}}`` with a status from the
kind (see :data:`STATUS`).  Handlers are plain ``def``: the node's calls block,
so FastAPI runs them in its worker threads and the event loop stays free.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from weenv.errors import WeenvError
from weenv.node.models import (
    CreateRequest,
    EnvironmentInfo,
    ExecRequest,
    ExecResult,
    NodeStats,
)
from weenv.node.node import Node

log = logging.getLogger(__name__)

STATUS = {
    "not_found": 404,
    "invalid_input": 400,
    "timeout": 408,
    "digest_mismatch": 502,
    "mount": 500,
    "runtime": 500,
    "tool_missing": 500,
}


def create_app(node: Node, *, on_shutdown: Callable[[], None] | None = None) -> FastAPI:
    """The API over ``node``.  The app starts the node when it starts and closes
    it when it stops; ``on_shutdown`` is called by ``POST /shutdown``."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        node.start()
        try:
            yield
        finally:
            node.close()

    app = FastAPI(title="weenv node", lifespan=lifespan)

    @app.exception_handler(WeenvError)
    async def weenv_error(request: Request, exc: WeenvError) -> JSONResponse:
        return JSONResponse(
            status_code=STATUS.get(exc.kind, 500),
            content={"error": {"kind": exc.kind, "message": str(exc)}},
        )

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok"}

    @app.get("/stats")
    def stats() -> NodeStats:
        return node.stats()

    @app.post("/environments", status_code=201)
    def create(req: CreateRequest) -> EnvironmentInfo:
        return node.create(req.template, resources=req.resources, first_command=req.first_command)

    @app.get("/environments")
    def list_environments() -> list[EnvironmentInfo]:
        return node.list()

    @app.get("/environments/{env_id}")
    def get_environment(env_id: str) -> EnvironmentInfo:
        return node.get(env_id)

    @app.delete("/environments/{env_id}", status_code=204)
    def destroy(env_id: str) -> Response:
        node.destroy(env_id)
        return Response(status_code=204)

    @app.post("/environments/{env_id}/commands")
    def run_command(env_id: str, req: ExecRequest) -> ExecResult:
        return node.exec(
            env_id, req.command, env=req.env, cwd=req.cwd, timeout=req.timeout, stdin=req.stdin
        )

    @app.get("/environments/{env_id}/files")
    def read_file(env_id: str, path: str) -> Response:
        data = node.files(env_id).read_file(path)
        return Response(content=data, media_type="application/octet-stream")

    @app.put("/environments/{env_id}/files", status_code=204)
    async def write_file(env_id: str, path: str, request: Request) -> Response:
        import anyio

        data = await request.body()
        await anyio.to_thread.run_sync(lambda: node.files(env_id).write_file(path, data))
        return Response(status_code=204)

    @app.post("/cache/drop", status_code=204)
    def drop_cache() -> Response:
        node.drop_caches()
        return Response(status_code=204)

    @app.post("/shutdown", status_code=202)
    def shutdown() -> dict:
        if on_shutdown is not None:
            on_shutdown()
        return {"status": "stopping"}

    return app
