"""E2B's control-plane REST API (the part the ``e2b`` SDK calls), over weenv sandboxes.

Endpoints (paths and JSON field names as in E2B's public ``spec/openapi.yml``)::

    POST   /sandboxes, /v2/sandboxes          NewSandbox -> Sandbox (201)
    GET    /sandboxes                         -> [ListedSandbox]
    GET    /v2/sandboxes?metadata=&state=&template=&limit=&nextToken=&order=&startedAfter=&startedBefore=
                                              -> [ListedSandbox] (newest first unless order=asc),
                                              header X-Next-Token
    GET    /sandboxes/{id}                    -> SandboxDetail
    DELETE /sandboxes/{id}                    -> 204
    POST   /sandboxes/{id}/timeout            {"timeout": s} -> 204
    POST   /sandboxes/{id}/refreshes          {"duration": s} -> 204 (extends only)
    POST   /sandboxes/{id}/connect, /v2/...   {"timeout": s} -> Sandbox (200; extends only; a paused
                                              sandbox is resumed: 201)
    GET    /sandboxes/{id}/metrics?start=&end= -> [SandboxMetric] (one per provisioning pass)
    POST   /sandboxes/{id}/pause              {"memory": b} -> 204 (the cgroup freezer: processes and
                                              memory kept either way; 409 if paused already)
    POST   /sandboxes/{id}/resume             {"timeout": s} -> Sandbox (201; 409 if not paused)
    POST   /sandboxes/{id}/fork               {"timeout": s, "count": n} -> 201 [SandboxForkResult]
                                              ({"sandbox": Sandbox} or {"error": {"code", "message"}} each)
    POST   /sandboxes/{id}/snapshots          {"name": n} -> 201 SnapshotInfo {"snapshotID", "names"} (409 if
                                              the name is another template's or sandbox's snapshot)
    GET    /snapshots?sandboxID=&name=&limit=&nextToken=  -> [SnapshotInfo]
    DELETE /templates/{snapshotID}            -> 204 (a snapshot; served by the template routes, templates.py)

A snapshot is a template (``POST /sandboxes`` with its id as ``templateID``
starts it, on any node of the store); a fork's children start from the
parent's file system (their processes start anew).

Every request needs the API key in ``X-API-Key`` (E2B's header; the SDK sends
``E2B_API_KEY``) or as ``Authorization: Bearer KEY``.  Errors are E2B's
``{"code": HTTP_STATUS, "message": TEXT}``.  Template: a weenv template name or
digest (E2B's ``templateID``).  Sandbox ids are weenv environment ids.
"""

from __future__ import annotations

import datetime
import hmac
import urllib.parse
from collections.abc import Callable
from typing import Annotated, Any

import anyio.to_thread
from fastapi import APIRouter, Depends, FastAPI, Header, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt
from starlette.exceptions import HTTPException

from weenv.api.models import Envs, Metadata
from weenv.errors import WeenvError
from weenv.server.e2b.readiness import start_and_wait_ready
from weenv.server.e2b.sandboxes import (
    DEFAULT_TIMEOUT_S,
    MAX_TIMEOUT_S,
    Sandbox,
    Sandboxes,
)
from weenv.server.kit.paging import next_token_of, page_start

ENVD_VERSION = "0.6.4"
"""The envd version weenv's in-sandbox services answer as: the ``e2b`` SDK enables
features by it (default user 0.4.0, stdin close 0.5.2, octet-stream uploads
0.5.7, file metadata 0.6.2, watch events with entries 0.6.3, watches of
network mounts when asked 0.6.4: :mod:`weenv.server.e2b.watch`)."""
CLIENT_ID = "weenv"

KIND_STATUS = {
    "not_found": 404,
    "invalid_input": 400,
    "unknown_user": 400,
    "pseudo_file": 400,
    "network_forbidden": 403,
    "timeout": 408,
    "authentication": 401,
    "capacity": 503,
    "store_unavailable": 503,
    "output_limit": 413,
    "disk_full": 507,
    "too_large": 413,
    "closed": 503,
    "busy": 409,
    "state": 409,
    "broken": 502,
}


class E2BError(HTTPException):
    """An E2B API error answer (``{"code", "message"}``)."""


API_METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE"})
"""The HTTP methods of E2B's API: a route weenv lacks under one of them is a
feature not served yet (501); any other method (TRACE, OPTIONS...) on a path
weenv serves is the client's mistake (405, with the methods the path takes)."""


def error_json(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"code": status, "message": message}, status_code=status, headers=headers)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class NetworkConfig(_Body):
    """E2B's ``SandboxNetworkConfig`` (the parts weenv enforces: IPv4 CIDRs, addresses
    and, in ``allowOut``, domain names; ``dnsServers``, with a domain in ``allowOut``,
    as more allowed addresses, E2B's meaning: the sandbox's own resolver answers its
    allowed names either way, and no server is opened when none is named)."""

    allow_out: list[str] = Field(default_factory=list, alias="allowOut", max_length=1024)
    deny_out: list[str] = Field(default_factory=list, alias="denyOut", max_length=1024)
    dns_servers: list[str] = Field(default_factory=list, alias="dnsServers", max_length=16)

    def allowed(self) -> list[str]:
        """``allowOut``, with ``dnsServers`` when it names a domain."""
        from weenv.api.names import domain

        has_name = any(len(a) <= 253 and domain(a) is not None for a in self.allow_out)
        return [*self.allow_out, *(self.dns_servers if has_name else [])]

    allow_public_traffic: bool = Field(default=True, alias="allowPublicTraffic")
    """False: requests to its ports (``get_host``) need its ``trafficAccessToken``."""


class NewSandbox(_Body):
    template_id: str = Field(alias="templateID", min_length=1)
    timeout: int = Field(default=DEFAULT_TIMEOUT_S, ge=0, le=MAX_TIMEOUT_S)
    """Seconds the sandbox lives (0: the default)."""
    metadata: Metadata | None = None
    env_vars: Envs | None = Field(default=None, alias="envVars")
    auto_pause: bool = Field(default=False, alias="autoPause")
    """At its timeout the sandbox is paused (its memory released, its files kept) instead of killed."""
    allow_internet_access: bool | None = None
    """Outbound network (weenv: none unless asked or the template's default)."""
    network: NetworkConfig | None = None


class TimeoutBody(_Body):
    timeout: int = Field(gt=0, le=MAX_TIMEOUT_S)


class ConnectBody(_Body):
    timeout: int | None = Field(default=None, ge=0, le=MAX_TIMEOUT_S)


class ResumeBody(_Body):
    timeout: int | None = Field(default=None, ge=0, le=MAX_TIMEOUT_S)


class ForkBody(_Body):
    timeout: int | None = Field(default=None, ge=0, le=MAX_TIMEOUT_S)
    count: StrictInt = Field(default=1, ge=1, le=10_000)


class SnapshotBody(_Body):
    name: str | None = Field(default=None, max_length=128)


class RefreshBody(_Body):
    duration: int = Field(default=0, ge=0, le=3600)


def _iso(t: float) -> str:
    return _when(t).isoformat().replace("+00:00", "Z")


def created_json(sb: Sandbox) -> dict[str, Any]:
    """E2B's ``Sandbox`` (the answer to create and connect): ``trafficAccessToken``
    only for a sandbox whose ports are not public (``allowPublicTraffic`` false)."""
    return {
        "templateID": sb.info.template,
        "sandboxID": sb.id,
        "clientID": CLIENT_ID,
        "envdVersion": ENVD_VERSION,
        "envdAccessToken": sb.access_token,
        "alias": sb.info.template,
        "domain": None,
        "trafficAccessToken": None if sb.info.public_traffic else sb.traffic_token,
    }


def listed_json(sb: Sandbox) -> dict[str, Any]:
    """E2B's ``ListedSandbox``."""
    info = sb.info
    return {
        "templateID": info.template,
        "sandboxID": info.id,
        "clientID": CLIENT_ID,
        "alias": info.template,
        "startedAt": _iso(info.created_at),
        "endAt": _iso(info.expires_at),
        "cpuCount": max(1, round(info.resources.cpus)),
        "memoryMB": info.resources.memory_bytes >> 20,
        "diskSizeMB": info.resources.disk_bytes >> 20,
        "state": "paused" if info.state == "paused" else "running",
        "envdVersion": ENVD_VERSION,
        "metadata": info.metadata,
    }


def detail_json(sb: Sandbox) -> dict[str, Any]:
    """E2B's ``SandboxDetail``."""
    return {**listed_json(sb), "envdAccessToken": sb.access_token, "domain": None}


def _metadata_filter(raw: str | None) -> dict[str, str]:
    """``metadata`` of ``GET /v2/sandboxes``: ``k=v&k2=v2``, each part percent-encoded."""
    if not raw:
        return {}
    return {urllib.parse.unquote(k): urllib.parse.unquote(v) for k, v in urllib.parse.parse_qsl(raw)}


def _when(t: float) -> datetime.datetime:
    """Unix time ``t`` as the aware datetime ``startedAt`` reports (microseconds)."""
    return datetime.datetime.fromtimestamp(t, datetime.UTC)


def _timestamp(name: str, raw: str | None) -> datetime.datetime | None:
    """A time filter of ``GET /v2/sandboxes`` (RFC 3339, e.g. ``2024-01-02T03:04:05Z``
    or with an offset; the SDK sends ``datetime.isoformat()``), None when absent
    (compared with :func:`_when` of a start: a time read from ``startedAt``
    matches that very sandbox).  Raises :class:`E2BError` 400 when it does not parse
    or names no zone (an ambiguous time)."""
    if raw is None:
        return None
    try:
        t = datetime.datetime.fromisoformat(raw.strip().replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        t = None
    if t is None or t.tzinfo is None:
        raise E2BError(400, f"bad {name} {raw!r}: an RFC 3339 time with a zone, e.g. 2024-01-02T03:04:05Z")
    return t


def key_dependency(check_key: Callable[[str], bool]):
    """A FastAPI dependency refusing (401) a request without an accepted API key."""

    def authenticated(
        x_api_key: Annotated[str | None, Header()] = None,
        authorization: Annotated[str | None, Header()] = None,
    ) -> None:
        key = x_api_key
        if key is None and authorization and authorization.lower().startswith("bearer "):
            key = authorization[7:].strip()
        if not key:
            raise E2BError(401, "missing API key (X-API-Key header)")
        if not check_key(key):
            raise E2BError(401, "invalid API key")

    return Depends(authenticated)


def make_api(
    sandboxes: Sandboxes,
    check_key: Callable[[str], bool],
    resolve: Callable[[str], str | None] | None = None,
    ready_timeout: float = 120.0,
) -> APIRouter:
    """The REST endpoints (see the module docstring); ``check_key(key)`` says
    whether an API key is accepted; ``resolve(templateID)``: the weenv template
    an E2B template reference starts (None: the reference is a weenv template
    name or digest itself); ``ready_timeout``: seconds a create waits for the
    template's ready command."""
    router = APIRouter(dependencies=[key_dependency(check_key)])

    def running(sandbox_id: str) -> Sandbox:
        sb = sandboxes.find(sandbox_id)
        if sb is None:
            raise E2BError(404, f"sandbox {sandbox_id!r} not found")
        return sb

    @router.post("/sandboxes", status_code=201)
    @router.post("/v2/sandboxes", status_code=201)
    async def create(body: NewSandbox) -> dict:
        def create_blocking() -> Sandbox:
            net = body.network or NetworkConfig()
            template = (resolve(body.template_id) if resolve else None) or body.template_id
            sb = sandboxes.create(
                template,
                timeout=body.timeout or DEFAULT_TIMEOUT_S,
                metadata=body.metadata or {},
                envs=body.env_vars or {},
                undelivered=True,
                network=body.allow_internet_access,
                allow_out=net.allowed(),
                deny_out=net.deny_out,
                public_traffic=net.allow_public_traffic,
                on_timeout="pause" if body.auto_pause else "kill",
            )
            try:
                start_and_wait_ready(sandboxes.node, sb, ready_timeout)
            except BaseException:
                sandboxes.node.destroy(sb.info.id)
                raise
            sandboxes.node.delivered(sb.info.id)  # as the answer goes out (see weenv's own create)
            return sb

        return created_json(await anyio.to_thread.run_sync(create_blocking))

    @router.get("/sandboxes")
    def list_v1() -> list[dict]:
        return [listed_json(sb) for sb in sorted(sandboxes.list(), key=lambda s: s.info.created_at)]

    @router.get("/v2/sandboxes")
    def list_v2(
        response: Response,
        metadata: str | None = None,
        state: str | None = None,
        template: str | None = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
        next_token: Annotated[str | None, Query(alias="nextToken")] = None,
        order: str | None = None,
        started_after: Annotated[str | None, Query(alias="startedAfter")] = None,
        started_before: Annotated[str | None, Query(alias="startedBefore")] = None,
    ) -> list[dict]:
        wanted = _metadata_filter(metadata)
        states = {s for s in (state or "").split(",") if s}
        if states - {"running", "paused"}:
            raise E2BError(400, f"bad state {state!r}: running, paused")
        if order not in (None, "asc", "desc"):
            raise E2BError(400, f"bad order {order!r}: asc, desc")
        after = _timestamp("startedAfter", started_after)
        before = _timestamp("startedBefore", started_before)
        found = [
            sb
            for sb in sandboxes.list()
            if all(sb.info.metadata.get(k) == v for k, v in wanted.items())
            and (not states or ("paused" if sb.info.state == "paused" else "running") in states)
            and (template is None or template in (sb.info.template, sb.info.template_digest))
            and (after is None or _when(sb.info.created_at) >= after)
            and (before is None or _when(sb.info.created_at) <= before)
        ]
        found.sort(key=lambda s: (s.info.created_at, s.id), reverse=order != "asc")  # E2B: newest first
        start = page_start(next_token)
        token = next_token_of(start, limit, len(found))
        if token is not None:
            response.headers["X-Next-Token"] = token
        return [listed_json(sb) for sb in found[start : start + limit]]

    @router.get("/sandboxes/{sandbox_id}")
    def get(sandbox_id: str) -> dict:
        return detail_json(running(sandbox_id))

    @router.delete("/sandboxes/{sandbox_id}", status_code=204)
    def kill(sandbox_id: str) -> Response:
        running(sandbox_id)
        sandboxes.kill(sandbox_id)
        return Response(status_code=204)

    @router.post("/sandboxes/{sandbox_id}/timeout", status_code=204)
    def set_timeout(sandbox_id: str, body: TimeoutBody) -> Response:
        running(sandbox_id)
        sandboxes.set_timeout(sandbox_id, body.timeout)
        return Response(status_code=204)

    @router.post("/sandboxes/{sandbox_id}/refreshes", status_code=204)
    def refresh(sandbox_id: str, body: RefreshBody | None = None) -> Response:
        running(sandbox_id)
        sandboxes.set_timeout(sandbox_id, (body.duration if body else 0) or 60, only_extend=True)
        return Response(status_code=204)

    @router.post("/sandboxes/{sandbox_id}/connect")
    @router.post("/v2/sandboxes/{sandbox_id}/connect")
    def connect(sandbox_id: str, body: ConnectBody | None = None) -> Response:
        sb = running(sandbox_id)
        if sb.info.state == "paused":  # auto-resume, as E2B's connect does
            sandboxes.node.resume(sandbox_id, timeout=float(body.timeout) if body and body.timeout else None)
            return JSONResponse(created_json(sandboxes.get(sandbox_id)), status_code=201)
        if body is not None and body.timeout:
            sb = sandboxes.set_timeout(sandbox_id, body.timeout, only_extend=True)
        return JSONResponse(created_json(sb))

    @router.get("/sandboxes/{sandbox_id}/metrics")
    def metrics(sandbox_id: str, start: int | None = None, end: int | None = None) -> list[dict]:
        running(sandbox_id)
        return sandboxes.metrics(sandbox_id, start, end)

    @router.post("/sandboxes/{sandbox_id}/pause", status_code=204)
    def pause(sandbox_id: str) -> Response:
        running(sandbox_id)
        sandboxes.node.pause(sandbox_id)
        return Response(status_code=204)

    @router.post("/sandboxes/{sandbox_id}/resume", status_code=201)
    def resume(sandbox_id: str, body: ResumeBody | None = None) -> dict:
        running(sandbox_id)
        sandboxes.node.resume(sandbox_id, timeout=float(body.timeout) if body and body.timeout else None)
        return created_json(sandboxes.get(sandbox_id))

    @router.post("/sandboxes/{sandbox_id}/fork", status_code=201)
    def fork(sandbox_id: str, body: ForkBody | None = None) -> list[dict]:
        running(sandbox_id)
        body = body or ForkBody()
        result = sandboxes.node.fork(sandbox_id, body.count, timeout=float(body.timeout) if body.timeout else None)
        return [
            {"error": {"code": KIND_STATUS.get(c.kind, 500), "message": str(c)}}
            if isinstance(c, WeenvError)
            else {"sandbox": created_json(sandboxes.get(c.id))}
            for c in result.children
        ]

    @router.post("/sandboxes/{sandbox_id}/snapshots", status_code=201)
    def create_snapshot(sandbox_id: str, body: SnapshotBody | None = None) -> dict:
        running(sandbox_id)
        info = sandboxes.node.snapshot(sandbox_id, body.name if body and body.name else None)
        return {"snapshotID": info.name, "names": [info.name]}

    @router.get("/snapshots")
    def list_snapshots(
        sandbox_id: Annotated[str | None, Query(alias="sandboxID")] = None,
        name: str | None = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
        next_token: Annotated[str | None, Query(alias="nextToken")] = None,
    ) -> list[dict]:
        found = [
            s
            for s in sandboxes.node.snapshots()
            if (sandbox_id is None or s.environment == sandbox_id) and (name is None or s.name == name)
        ]
        start = int(next_token) if next_token and next_token.isdigit() else 0
        return [{"snapshotID": s.name, "names": [s.name]} for s in found[start : start + limit]]

    return router


UNSERVED_FEATURES = (
    ("/templates", "templates (build, tags, aliases)"),
    ("/v2/templates", "templates (build, tags, aliases)"),
    ("/v3/templates", "templates (build, tags, aliases)"),
    ("/default-templates", "default templates"),
    ("/snapshots", "snapshots"),
    ("/volumes", "volumes"),
    ("/secrets", "secrets"),
    ("/sandboxes/metrics", "metrics of many sandboxes at once"),
)
"""Path prefix -> the E2B feature it belongs to, for the 501 of a route weenv does not serve."""
_SANDBOX_FEATURES = {
    "logs": "sandbox logs",
    "network": "changing a running sandbox's network",
    "fork": "fork",
    "snapshots": "snapshots",
    "pause": "pause and resume",
    "resume": "pause and resume",
}


def unserved_message(method: str, path: str) -> str:
    """The message of the 501 answering ``method path`` (a path of E2B's API,
    e.g. ``/templates/x``, or ``/envd/...``) that no route of weenv's E2B face
    serves, naming the E2B feature it belongs to.  (A 404 would read as
    "sandbox not found" to the SDK, which a route weenv lacks is not.)"""
    parts = [p for p in path.split("/") if p]
    feature = next((f for prefix, f in UNSERVED_FEATURES if path == prefix or path.startswith(prefix + "/")), None)
    if parts[:1] == ["envd"]:
        feature = "this envd endpoint"
    elif feature is None and parts[:1] in (["sandboxes"], ["v2"]) and len(parts) > 2:
        feature = _SANDBOX_FEATURES.get(parts[-1])
    return f"weenv does not serve {method} {path} ({feature or 'this E2B API route'}) yet"


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error of ``app`` in E2B's ``{"code", "message"}`` form."""

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        if not isinstance(exc, E2BError) and exc.status_code == 405 and request.method not in API_METHODS:
            return error_json(
                405,
                f"{request.method} is not a method of E2B's API (this path takes "
                f"{(exc.headers or {}).get('Allow', 'others')})",
                headers=exc.headers,
            )
        if not isinstance(exc, E2BError) and exc.status_code in (404, 405):  # no route: not "not found"
            return error_json(501, unserved_message(request.method, _api_path(request)))
        return error_json(exc.status_code, str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        parts = []
        for err in exc.errors():
            where = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
            parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
        return error_json(400, "; ".join(parts) or "bad request")

    @app.exception_handler(WeenvError)
    async def weenv_error(request: Request, exc: WeenvError) -> JSONResponse:
        return error_json(KIND_STATUS.get(exc.kind, 500), str(exc))


def _api_path(request: Request) -> str:
    """The request's path inside the E2B face (without the prefix it is mounted at)."""
    path, root = request.url.path, request.scope.get("root_path", "")
    if root.endswith("/envd"):  # answered inside the envd mount: keep its prefix
        root = root[: -len("/envd")]
    return path[len(root) :] if root and path.startswith(root) else path


def key_checker(keys: list[str]) -> Callable[[str], bool]:
    """A constant-time check of a presented key against ``keys``."""
    encoded = [k.encode() for k in keys]

    def check(key: str) -> bool:
        presented = key.encode()
        return any(hmac.compare_digest(presented, k) for k in encoded)

    return check
