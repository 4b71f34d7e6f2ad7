"""The prime control plane (the REST part the ``prime-sandboxes`` client calls), over weenv environments.

Endpoints, under ``/api/v1`` (the client joins them to ``PRIME_API_BASE_URL``)::

    POST   /sandbox                     CreateSandboxRequest -> Sandbox (with ``gatewayAuth``)
    GET    /sandbox?page=&per_page=&status=&labels=&is_active=   -> SandboxListResponse
    DELETE /sandbox                     {"sandbox_ids": [...]} or {"labels": [...]} -> BulkDeleteSandboxResponse
    POST   /sandbox/status:batchGet     {"sandbox_ids": [...]} -> BatchSandboxStatusResponse
    GET    /sandbox/{id}                -> Sandbox
    DELETE /sandbox/{id}                -> {"success": true}
    POST   /sandbox/{id}/auth           -> gateway auth (gateway_url, user_ns, job_id, token, expires_at)
    GET    /sandbox/{id}/error-context  -> {"status", "errorType", "errorMessage"}
    GET    /sandbox/{id}/logs           -> {"logs": ""}

Every request needs the daemon's API key as ``Authorization: Bearer KEY``
(the client sends ``PRIME_API_KEY``).  Errors are ``{"detail": TEXT}`` with
the status of the failure, as the client reads them.
"""

from __future__ import annotations

import json
import time
from typing import Annotated

import anyio.to_thread
from fastapi import APIRouter, Depends, FastAPI, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from weenv.api.models import MAX_TIMEOUT_S
from weenv.errors import InvalidInputError, NotFoundError, WeenvError
from weenv.formats.manifest import Resources
from weenv.server.auth import ApiKey, presented_key
from weenv.server.prime.images import Images
from weenv.server.prime.sandboxes import (
    IMAGE_KEY,
    LABELS_KEY,
    NAME_KEY,
    TOKEN_TTL_S,
    IdempotencyKeys,
    Tokens,
    iso,
    labels_of,
    status_of,
    view,
)

KIND_STATUS = {
    "not_found": 404,
    "invalid_input": 400,
    "unknown_user": 400,
    "timeout": 408,
    "authentication": 401,
    "capacity": 503,
    "store_unavailable": 503,
    "disk_full": 507,
    "too_large": 413,
    "closed": 503,
    "busy": 409,
    "state": 409,
    "network_forbidden": 403,
}
USER_NS = "weenv"
"""The gateway namespace every sandbox of this daemon is under (prime's ``user_ns``)."""
MAX_BATCH = 100
"""Most sandboxes one batch request names (prime's limit too)."""


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StartCommand(_Body):
    executable: str
    args: list[str] = Field(default_factory=list)


class CreateSandbox(_Body):
    """Prime's ``CreateSandboxRequest`` (the fields weenv serves; others are ignored)."""

    name: str = Field(min_length=1, max_length=256)
    docker_image: str | None = None
    checkpoint_id: str | None = None
    start_command: StartCommand | None = None
    cpu_cores: float = Field(default=1.0, gt=0, allow_inf_nan=False)
    memory_gb: float = Field(default=1.0, gt=0, allow_inf_nan=False)
    disk_size_gb: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    gpu_count: int = Field(default=0, ge=0)
    network_allowlist: list[str] | None = Field(default=None, max_length=1024)
    network_denylist: list[str] | None = Field(default=None, max_length=1024)
    timeout_minutes: int = Field(default=60, ge=-1, le=int(MAX_TIMEOUT_S // 60))
    """Minutes the sandbox lives; -1 (what ``verifiers`` sends): the longest weenv allows."""
    environment_vars: dict[str, str] | None = None
    secrets: dict[str, str] | None = None
    labels: list[str] = Field(default_factory=list, max_length=64)
    idempotency_key: str | None = Field(default=None, max_length=256)


class SandboxIds(_Body):
    sandbox_ids: list[str] = Field(max_length=MAX_BATCH)


class BulkDelete(_Body):
    sandbox_ids: list[str] | None = Field(default=None, max_length=MAX_BATCH)
    labels: list[str] | None = None


def error(status: int, detail: str) -> JSONResponse:
    return JSONResponse({"detail": detail}, status_code=status)


def install_error_handlers(app: FastAPI) -> None:
    """Prime's ``{"detail": TEXT}`` error bodies for weenv errors and invalid requests."""

    @app.exception_handler(WeenvError)
    async def weenv_error(request: Request, exc: WeenvError) -> JSONResponse:
        return error(KIND_STATUS.get(exc.kind, 500), str(exc))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        parts = [
            f"{'.'.join(str(x) for x in e.get('loc', ()) if x != 'body') or 'body'}: {e.get('msg')}"
            for e in exc.errors()[:5]
        ]
        return error(422, "; ".join(parts))


def key_dependency(api_key: ApiKey):
    def check(request: Request) -> None:
        if not api_key.matches(presented_key(request.headers)):
            raise HTTPException(401, "missing or wrong API key (Authorization: Bearer KEY)")

    return Depends(check)


def make_api(node, images: Images, tokens: Tokens, api_key: ApiKey) -> APIRouter:
    """The control-plane routes over ``node``."""
    router = APIRouter(prefix="/api/v1", dependencies=[key_dependency(api_key)])
    creates = IdempotencyKeys()

    def gateway_auth(request: Request, sandbox_id: str) -> dict:
        # this app's own address as the client reached it (the daemon mounts it at /prime)
        path = request.url.path
        mount = path[: path.index("/api/v1/")] if "/api/v1/" in path else ""
        base = str(request.url.replace(path=mount + "/gateway", query=""))
        return {
            "gateway_url": base,
            "user_ns": USER_NS,
            "job_id": sandbox_id,
            "token": tokens.token(sandbox_id),
            "expires_at": iso(time.time() + TOKEN_TTL_S),
        }

    def create_blocking(body: CreateSandbox) -> dict:
        if body.checkpoint_id is not None:
            raise InvalidInputError("checkpoint_id: creating from a prime checkpoint is not served by weenv")
        if body.start_command is not None:
            raise InvalidInputError("start_command is not served by weenv: run it with execute_command")
        if body.gpu_count:
            raise InvalidInputError("gpu_count: weenv sandboxes have no GPUs")
        if not body.docker_image:
            raise InvalidInputError("docker_image is required (a weenv template name)")
        if body.timeout_minutes == 0:
            raise InvalidInputError("timeout_minutes must be at least 1 (or -1: the longest lifetime weenv allows)")
        template = images.template(body.docker_image)
        try:
            resources = Resources(
                cpus=body.cpu_cores,
                memory_bytes=int(body.memory_gb * (1 << 30)),
                **({"disk_bytes": int(body.disk_size_gb * (1 << 30))} if body.disk_size_gb else {}),
            )
        except ValidationError as exc:
            raise InvalidInputError(f"resources: {exc.errors()[0].get('msg')}") from None
        metadata = {NAME_KEY: body.name, IMAGE_KEY: body.docker_image}
        if body.labels:
            metadata[LABELS_KEY] = json.dumps(body.labels)
        network = {}
        if body.network_allowlist is not None:
            network = {"network": False, "allow_out": body.network_allowlist}
        elif body.network_denylist is not None:
            network = {"network": True, "deny_out": body.network_denylist}
        lifetime = MAX_TIMEOUT_S if body.timeout_minutes == -1 else float(body.timeout_minutes * 60)
        info = node.create(
            template,
            timeout=lifetime,
            resources=resources,
            envs={**(body.environment_vars or {}), **(body.secrets or {})},
            metadata=metadata,
            **network,
        )
        return view(info)

    def create_once(body: CreateSandbox) -> dict:
        key = body.idempotency_key
        if not key:
            return create_blocking(body)
        with creates.lock(key):
            done = creates.get(key)
            if done is not None:
                return view(node.get(done))
            sandbox = create_blocking(body)
            creates.put(key, sandbox["id"])
            return sandbox

    @router.post("/sandbox")
    async def create(body: CreateSandbox, request: Request) -> dict:
        """A new sandbox (a weenv environment) from ``docker_image``, with its gateway auth."""
        sandbox = await anyio.to_thread.run_sync(create_once, body)
        return {**sandbox, "gatewayAuth": gateway_auth(request, sandbox["id"])}

    @router.get("/sandbox")
    async def list_(
        page: Annotated[int, Query(ge=1)] = 1,
        per_page: Annotated[int, Query(ge=1, le=1000)] = 50,
        status: str | None = None,
        labels: Annotated[list[str] | None, Query()] = None,
        is_active: bool | None = None,
    ) -> dict:
        """The sandboxes, newest first, filtered by status and labels, a page of them."""
        infos = await anyio.to_thread.run_sync(node.list)
        infos = sorted(infos, key=lambda i: i.created_at, reverse=True)
        if status:
            infos = [i for i in infos if status_of(i) == status.upper()]
        if labels:
            infos = [i for i in infos if set(labels) <= set(labels_of(i))]
        total = len(infos)
        chosen = infos[(page - 1) * per_page : page * per_page]
        return {
            "sandboxes": [view(i) for i in chosen],
            "total": total,
            "page": page,
            "perPage": per_page,
            "hasNext": page * per_page < total,
        }

    @router.post("/sandbox/status:batchGet")
    async def statuses(body: SandboxIds) -> dict:
        """The status of each named sandbox, or why it has none."""
        found, errors = [], []
        for sid in body.sandbox_ids:
            try:
                info = await anyio.to_thread.run_sync(node.get, sid)
            except NotFoundError:
                errors.append({"sandbox_id": sid, "code": "NOT_FOUND", "message": f"sandbox {sid} not found"})
                continue
            found.append({"sandbox_id": sid, "status": status_of(info)})
        return {"statuses": found, "errors": errors}

    @router.delete("/sandbox")
    async def bulk_delete(request: Request) -> dict:
        """Delete the named sandboxes, or those with all the labels."""
        try:
            body = BulkDelete.model_validate(json.loads(await request.body() or b"{}"))
        except (ValueError, ValidationError) as exc:
            raise InvalidInputError(f"bad bulk delete request: {exc}") from None
        if not body.sandbox_ids and not body.labels:
            raise InvalidInputError("bulk delete needs sandbox_ids or labels")
        ids = list(body.sandbox_ids or [])
        if body.labels:
            infos = await anyio.to_thread.run_sync(node.list)
            ids += [i.id for i in infos if set(body.labels) <= set(labels_of(i)) and i.id not in ids]
        succeeded, failed = [], []
        for sid in ids:
            try:
                await anyio.to_thread.run_sync(node.destroy, sid)
                succeeded.append(sid)
            except WeenvError as exc:
                failed.append({"sandbox_id": sid, "error": str(exc)})
        return {"succeeded": succeeded, "failed": failed, "message": f"{len(succeeded)} deleted, {len(failed)} failed"}

    @router.get("/sandbox/{sandbox_id}")
    async def get(sandbox_id: str) -> dict:
        """One sandbox."""
        return view(await anyio.to_thread.run_sync(node.get, sandbox_id))

    @router.delete("/sandbox/{sandbox_id}")
    async def delete(sandbox_id: str) -> dict:
        """Delete one sandbox."""
        await anyio.to_thread.run_sync(node.destroy, sandbox_id)
        return {"success": True, "sandbox_id": sandbox_id}

    @router.post("/sandbox/{sandbox_id}/auth")
    async def auth(sandbox_id: str, request: Request) -> dict:
        """The sandbox's gateway address and token."""
        await anyio.to_thread.run_sync(node.get, sandbox_id)
        return gateway_auth(request, sandbox_id)

    @router.get("/sandbox/{sandbox_id}/error-context")
    async def error_context(sandbox_id: str) -> dict:
        """Why a sandbox is not running (``TERMINATED`` once gone)."""
        try:
            info = await anyio.to_thread.run_sync(node.get, sandbox_id)
        except NotFoundError:
            return {"status": "TERMINATED", "errorType": None, "errorMessage": f"sandbox {sandbox_id} is gone"}
        return {"status": status_of(info), "errorType": None, "errorMessage": None}

    @router.get("/sandbox/{sandbox_id}/logs")
    async def logs(sandbox_id: str) -> dict:
        """Its console log: empty (weenv keeps none)."""
        await anyio.to_thread.run_sync(node.get, sandbox_id)
        return {"logs": ""}

    return router
