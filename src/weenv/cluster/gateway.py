"""One address for the whole cluster: weenv's HTTP API (``/v1``) and the
E2B-compatible API (``/e2b``, envd at ``/e2b/envd``) over every node.

The gateway (an ASGI app; :mod:`weenv.cluster.front` runs it in a Ray actor on
the head node, started by ``weenv cluster up``) does what needs the whole
cluster itself and relays everything else to the node that owns the
environment (:mod:`weenv.cluster.proxy`, streamed both ways)::

    create   POST /v1/environments, /e2b/sandboxes, /e2b/v2/sandboxes
             -> a node from the placement actor, then that node's create
    batch    POST /v1/environments/batch  (:mod:`weenv.cluster.batch`)
    list     GET  /v1/environments, /e2b/sandboxes, /e2b/v2/sandboxes
             -> every alive node's, merged (E2B's filters, order and pages kept)
    per environment  /v1/environments/{id}/..., /e2b/sandboxes/{id}/...,
             /e2b/v2/sandboxes/{id}/...  -> its node (a kill also tells placement)
    resume   POST /v1/environments/{id}/resume, /e2b[/v2]/sandboxes/{id}/resume|connect of
             one lost with its node (or unknown) -> from its published pause, on a node
             placement chooses (:mod:`weenv.cluster.resume`)
    envd     /e2b/envd/... (and signed ``/files`` URLs at the root, as on one
             node) -> the node of the sandbox ``E2b-Sandbox-Id`` (or the host
             ``PORT-ID.``) names; a signed URL's signature names it
    templates GET /v1/templates[/{name}] -> any alive node (they read one store)
    E2B templates /e2b/v3/templates, /e2b/templates/..., /e2b/v2/templates/... (builds,
             uploads, tags, list) -> the node holding the template; a build to the
             node placement chooses (:mod:`weenv.cluster.templates`)
    stats    GET  /v1/stats (summed over the alive nodes), /v1/stats/nodes (per node),
             /v1/stats/provision?env=ID (its node), /v1/metrics (every node's,
             labelled ``node``), /v1/tax (summed; POST /v1/tax: an SDK meter's
             batch, kept by the gateway): :mod:`weenv.cluster.stats`
    snapshots GET /v1/snapshots, DELETE /v1/snapshots/{name}, GET /e2b/snapshots
             -> any alive node (snapshots are in the store)
    ports    a ``PORT-ID.`` host (E2B's ``get_host``), HTTP or WebSocket -> the
             sandbox's node, relayed as is (:mod:`weenv.cluster.ports`)
    health   GET  /v1/health -> {"status": "ok", "cluster": true[, "nodes": N, "environments": N]}
    node admin POST /v1/cache/drop -> every alive node (``?node=ID``: that one), 204 when all
             dropped theirs (a node that did not: 502, named); POST /v1/shutdown and
             PUT /v1/peers, a node's own, are refused (400, saying what to do instead)

**Placement hints** ride in an environment's metadata, the same for both APIs:
``weenv.node`` (a node id to prefer) and ``weenv.near`` (an environment whose
node to prefer).  The gateway then sets ``weenv.node`` to the node chosen, so
every environment's info (get, list, E2B's metadata) names its node.

**Authentication** as on one node: the gateway's API key (``X-API-Key`` or
``Authorization: Bearer``; ``e2b_KEY`` for E2B clients) on every route but
``/v1/health`` and envd's, where the sandbox's access token (issued by its
node) is checked by the gateway for the node's secret before relaying (a
wrong token is 401 whether the sandbox exists or not, as on one node).

Errors are the API's own: weenv's ``{"error": {"kind", "message"}}`` under
``/v1`` (an environment lost with its node: kind ``lost``, 410), E2B's
``{"code", "message"}`` under ``/e2b``.  A node that cannot be reached is
502.  Bodies are bounded as on one node (:class:`~weenv.server.limits.BodyLimit`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable
from typing import Any, Protocol

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.datastructures import Headers, QueryParams
from starlette.exceptions import HTTPException as StarletteHTTPException

from weenv.api.models import MAX_METADATA_ENTRIES, BatchCreateRequest, CreateRequest, NodeStats
from weenv.cluster import proxy
from weenv.cluster import stats as cluster_stats
from weenv.cluster.view import Route
from weenv.errors import (
    AuthenticationError,
    ClosedError,
    DaemonError,
    InvalidInputError,
    LostError,
    NotFoundError,
    WeenvError,
)
from weenv.formats.tax import TaxBatch, TaxReport
from weenv.node.data.peers import PEERS_HINT
from weenv.server.auth import ApiKey, presented_key
from weenv.server.e2b import signed
from weenv.server.e2b.envd import sandbox_id_in
from weenv.server.e2b.sandboxes import access_token, token_secret
from weenv.server.kit.errors import STATUS, describe_errors, error_response
from weenv.server.kit.paging import page_answer, page_of
from weenv.server.limits import MAX_BODY, MAX_UPLOAD, BodyLimit
from weenv.server.metrics import CONTENT_TYPE as METRICS_TYPE
from weenv.server.tax import TaxBook

log = logging.getLogger(__name__)

NODE_HINT = "weenv.node"
"""Metadata key: the node to prefer (a hint); set by the gateway to the node chosen."""
NEAR_HINT = "weenv.near"
"""Metadata key: an environment whose node to prefer."""
# PEERS_HINT (weenv.node.data.peers): set by the gateway to the nodes that hold or fetch the template (Placed.peers)
LOST_STATUS = 410
MAX_LIST_PAGES = 100
"""Pages of 1,000 asked of one node for one E2B listing (100,000 sandboxes)."""


class Directory(Protocol):
    """The placement actor as the gateway calls it: ``await call(method, *args)``
    (:class:`weenv.cluster.front.RayDirectory`), raising the actor's own errors."""

    def call(self, method: str, *args: Any) -> Awaitable[Any]: ...


class Gateway:
    """What the routes share: the placement ``directory``, the connections to the nodes."""

    def __init__(self, directory: Directory, client: httpx.AsyncClient):
        self.directory, self.client = directory, client

    async def route(self, env_id: str) -> Route:
        return await self.directory.call("route", env_id)

    async def routes(self) -> list[Route]:
        return await self.directory.call("routes")

    async def any_route(self) -> Route:
        routes = await self.routes()
        if not routes:
            raise ClosedError("no node of the cluster is alive")
        return routes[0]

    async def place(self, template: str, cpus: float | None, memory_bytes: int | None, metadata: dict) -> Any:
        """A placement (:class:`~weenv.cluster.view.Placed`) for one environment, its hints from ``metadata``."""
        node, near = metadata.get(NODE_HINT) or None, metadata.get(NEAR_HINT) or None
        for name, value in ((NODE_HINT, node), (NEAR_HINT, near)):
            if value is not None and not isinstance(value, str):
                raise InvalidInputError(f"metadata.{name} must be a string")
        return await self.directory.call("place", template, cpus, memory_bytes, node, near)

    async def done(self, token: int, node_id: str, env_id: str | None) -> None:
        await self.directory.call("done", token, node_id, env_id)

    async def create(
        self,
        body: dict,
        *,
        template: str,
        cpus: float | None,
        memory_bytes: int | None,
        path: str,
        e2b: bool,
        id_field: str,
    ) -> tuple[httpx.Response, str]:
        """Place one environment and create it on its node (``body`` sent to ``path``
        there, its metadata's ``weenv.node`` set to the node and ``weenv.peers`` to
        the nodes placed with the template lately or holding it, which the node
        takes off and asks for its chunks first); the node's answer and
        the node id.  Placement's reservation is released whatever happens."""
        metadata = body.get("metadata") or {}
        if not isinstance(metadata, dict):
            raise InvalidInputError("metadata must be an object")
        placed = await self.place(template, cpus, memory_bytes, metadata)
        node_id = placed.route.node_id
        hints = {NODE_HINT: node_id}
        if placed.peers and len(metadata) + 2 <= MAX_METADATA_ENTRIES:  # a hint never makes a create invalid
            hints[PEERS_HINT] = ",".join(placed.peers)
        body = {**body, "metadata": {**metadata, **hints}}
        made = None
        try:
            answer = await proxy.call(self.client, placed.route, "POST", path, e2b=e2b, json=body)
            if answer.status_code in (200, 201):
                made = answer.json().get(id_field)
        finally:
            await self.done(placed.token, node_id, made)
        return answer, node_id

    async def fan_out(
        self, method: str, path: str, *, e2b: bool, params: dict | None = None
    ) -> list[tuple[Route, httpx.Response]]:
        """``method path`` on every alive node at once; the answers of those that
        answered (a node that cannot be reached is left out, and logged)."""
        routes = await self.routes()

        async def one(route: Route):
            try:
                return route, await proxy.call(self.client, route, method, path, e2b=e2b, params=params)
            except DaemonError as exc:
                log.warning("listing skips node %s: %s", route.node_id, exc)
                return None

        return [r for r in await asyncio.gather(*(one(r) for r in routes)) if r is not None]

    async def merged(self, path: str, *, e2b: bool, order: tuple[str, str]) -> list:
        """The JSON lists every alive node answers to ``GET path``, as one, sorted by the fields ``order`` names."""
        out: list = []
        for _, answer in await self.fan_out("GET", path, e2b=e2b):
            if answer.status_code == 200:
                out.extend(answer.json())
        return sorted(out, key=lambda e: tuple(str(e.get(k, "")) for k in order))

    async def record(self, node_id: str, env_ids: list[str]) -> None:
        """Tell placement of environments its node made itself (a fork's children)."""
        for env_id in env_ids:
            await self.done(0, node_id, env_id)


def create_gateway_app(
    directory: Directory,
    *,
    api_key: ApiKey,
    timeouts: proxy.Timeouts = proxy.Timeouts(),
    queue_timeout_s: float = 120.0,
    max_body: int = MAX_BODY,
    max_upload: int = MAX_UPLOAD,
) -> FastAPI:
    """The gateway's app over ``directory`` (see the module docstring).

    ``api_key``: the key clients send; ``timeouts``: of the relayed requests;
    ``queue_timeout_s``: seconds an item of a batch may wait for a node with
    room for it to create (then its line is a ``capacity`` error);
    ``max_body``, ``max_upload``: bytes of a request body, of a file upload."""
    from weenv.cluster.batch import batch_stream
    from weenv.cluster.dashboard import cluster_ui_router
    from weenv.cluster.resume import is_resume, resume_elsewhere
    from weenv.cluster.templates import TemplateOwners, install_template_routes

    client = proxy.new_client(timeouts)
    gw = Gateway(directory, client)
    owners = TemplateOwners(gw)

    async def close_client() -> None:
        await client.aclose()

    app = FastAPI(title="weenv cluster gateway", version="1", docs_url=None, redoc_url=None, on_shutdown=[close_client])

    def has_key(headers) -> bool:
        return api_key.matches(presented_key(headers))

    def credentialed(scope: dict) -> bool:
        headers = Headers(scope=scope)
        # envd's requests carry a sandbox's token, checked before relaying (and by its node)
        return (
            has_key(headers)
            or bool(headers.get("x-access-token"))
            or owners.upload_authorised(scope)
            or scope.get("path") in ("/files", "/e2b/envd/files")
        )

    app.add_middleware(BodyLimit, max_body=max_body, max_upload=max_upload, credentialed=credentialed)

    def is_e2b(request: Request) -> bool:
        return request.url.path.startswith("/e2b/") or request.url.path == "/files"

    def refuse(request: Request, exc: WeenvError) -> Response:
        """``exc`` as the answer of the API ``request`` belongs to."""
        status = LOST_STATUS if isinstance(exc, LostError) else STATUS.get(exc.kind, 500)
        if isinstance(exc, DaemonError):
            status = 502
        if not is_e2b(request):
            return error_response(exc.kind, str(exc), status)
        if request.url.path.startswith("/e2b/envd/") or request.url.path == "/files":
            if isinstance(exc, NotFoundError):  # envd's answer for a sandbox that is gone (the SDK's "not running")
                return _e2b_error(502, f"The sandbox was not found: {exc}")
        return _e2b_error(404 if isinstance(exc, NotFoundError) else status, str(exc))

    @app.exception_handler(WeenvError)
    async def weenv_error(request: Request, exc: WeenvError) -> Response:
        return refuse(request, exc)

    @app.exception_handler(_EnvdRefusal)
    async def envd_refusal(request: Request, exc: _EnvdRefusal) -> Response:
        return _e2b_error(exc.status, str(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        message = f"{request.method} {request.url.path}: the cluster's gateway does not serve this"
        if is_e2b(request):
            return _e2b_error(501 if exc.status_code in (404, 405) else exc.status_code, message)
        return error_response("not_found" if exc.status_code == 404 else "invalid_input", message, exc.status_code)

    def require_key(request: Request) -> None:
        if not has_key(request.headers):
            if is_e2b(request):
                raise AuthenticationError("missing or invalid API key (X-API-Key header)")
            raise AuthenticationError(
                "missing or wrong API key of the cluster's gateway: send it as "
                "'X-API-Key: KEY' or 'Authorization: Bearer KEY' (weenv cluster status prints it)"
            )

    async def json_body(request: Request) -> dict:
        raw = await request.body()
        try:
            data = json.loads(raw or b"{}")
        except ValueError as exc:
            raise InvalidInputError(f"bad request: the body is not JSON ({exc})") from None
        if not isinstance(data, dict):
            raise InvalidInputError("bad request: the body is not a JSON object")
        return data

    def node_answer(answer: httpx.Response) -> Response:
        return Response(
            answer.content,
            status_code=answer.status_code,
            media_type=answer.headers.get("content-type", "application/json"),
        )

    # --- weenv's API -------------------------------------------------------------------
    @app.get("/v1/health")
    async def health(request: Request) -> dict:
        out: dict[str, Any] = {"status": "ok", "cluster": True}
        if has_key(request.headers):
            routes = await gw.routes()
            envs = await directory.call("environments")
            out.update(nodes=len(routes), environments=len(envs))
        return out

    @app.get("/v1/cluster")
    async def cluster_status(request: Request) -> list[dict]:
        require_key(request)
        import dataclasses

        return [{k: v for k, v in dataclasses.asdict(s).items()} for s in await directory.call("status")]

    @app.api_route("/v1/templates", methods=["GET"])
    @app.api_route("/v1/templates/{name}", methods=["GET"])
    async def templates(request: Request) -> Response:
        require_key(request)
        route = await gw.any_route()
        return await proxy.relay(
            client, request, route, request.url.path, headers=proxy.keyed_headers(request, route, e2b=False)
        )

    async def per_node(path: str) -> dict[str, httpx.Response]:
        return {
            route.node_id: answer
            for route, answer in await gw.fan_out("GET", path, e2b=False)
            if answer.status_code == 200
        }

    @app.get("/v1/stats")
    async def stats(request: Request) -> NodeStats:
        require_key(request)
        return cluster_stats.summed({n: a.json() for n, a in (await per_node("/v1/stats")).items()})

    @app.get("/v1/stats/nodes")
    async def stats_by_node(request: Request) -> dict[str, NodeStats]:
        require_key(request)
        return {n: NodeStats.model_validate(a.json()) for n, a in (await per_node("/v1/stats")).items()}

    @app.get("/v1/stats/provision")
    async def provision_stats(request: Request, env: str | None = None) -> Response:
        require_key(request)
        if env is None:
            raise InvalidInputError(
                "GET /v1/stats/provision at the cluster's address needs ?env=ID: "
                "each node provisions its own (its figures: that node's address)"
            )
        route = await gw.route(env)
        return await proxy.relay(
            client, request, route, request.url.path, headers=proxy.keyed_headers(request, route, e2b=False)
        )

    tax_book = TaxBook()

    @app.post("/v1/tax", status_code=204)
    async def report_tax(request: Request) -> Response:
        require_key(request)
        tax_book.report_batch(_validated(TaxBatch, await json_body(request)))
        return Response(status_code=204)

    @app.get("/v1/tax")
    async def tax(request: Request) -> TaxReport:
        require_key(request)
        return cluster_stats.summed_tax(
            {n: a.json() for n, a in (await per_node("/v1/tax")).items()}, tax_book.report().batches
        )

    @app.get("/v1/snapshots")
    @app.delete("/v1/snapshots/{name}")
    @app.get("/e2b/snapshots")
    async def snapshots(request: Request) -> Response:
        require_key(request)
        route = await gw.any_route()
        return await proxy.relay(
            client, request, route, request.url.path, headers=proxy.keyed_headers(request, route, e2b=is_e2b(request))
        )

    @app.post("/v1/cache/drop")
    async def drop_cache(request: Request, node: str | None = None) -> Response:
        """Each node's own call, made on every alive node (``?node=ID``: that one):
        204 once all have dropped their caches; a node that could not is 502, named."""
        require_key(request)
        routes = await gw.routes()
        if node is not None:
            routes = [r for r in routes if r.node_id == node]
            if not routes:
                known = [s.node_id for s in await directory.call("status")]
                if node in known:
                    raise ClosedError(f"node {node!r} is not alive: its cache cannot be dropped now")
                raise InvalidInputError(f"no node {node!r} in the cluster (nodes: {', '.join(known) or 'none'})")
        if not routes:
            raise ClosedError("no node of the cluster is alive")

        async def one(route: Route) -> tuple[bool, str] | None:
            """None: dropped; else (whether the node refused, rather than could not be reached; why)."""
            try:
                answer = await proxy.call(client, route, "POST", request.url.path, e2b=False)
            except DaemonError as exc:
                return False, str(exc)
            if answer.status_code == 204:
                return None
            return 400 <= answer.status_code < 500, f"node {route.node_id}: {_message_of(answer)}"

        failed = [f for f in await asyncio.gather(*(one(r) for r in routes)) if f is not None]
        if failed:
            text = f"{len(failed)} of {len(routes)} nodes did not drop their caches: " + "; ".join(w for _, w in failed)
            raise InvalidInputError(text) if all(refused for refused, _ in failed) else DaemonError(text)
        return Response(status_code=204)

    @app.post("/v1/shutdown")
    @app.put("/v1/peers")
    async def node_only(request: Request) -> Response:
        """A node's own, not the cluster's: refused with what to do instead."""
        require_key(request)
        if request.url.path == "/v1/shutdown":
            raise InvalidInputError(
                "POST /v1/shutdown at the cluster's address: the cluster's node daemons are "
                "owned by its Ray actors; take the whole cluster down with 'weenv cluster down'"
            )
        raise InvalidInputError(
            "PUT /v1/peers at the cluster's address: each node's peer table is set by its "
            "node actor from the placement actor's view, not by clients"
        )

    @app.get("/v1/metrics")
    async def metrics(request: Request) -> Response:
        require_key(request)
        texts = {n: a.text for n, a in (await per_node("/v1/metrics")).items()}
        alive = len(await gw.routes())
        return Response(cluster_stats.labelled_metrics(texts, alive), media_type=METRICS_TYPE)

    @app.post("/v1/environments")
    async def create(request: Request) -> Response:
        require_key(request)
        data = await json_body(request)
        req = _validated(CreateRequest, data)
        res = req.resources
        answer, _ = await gw.create(
            data,
            template=req.template,
            cpus=res.cpus if res else None,
            memory_bytes=res.memory_bytes if res else None,
            path="/v1/environments",
            e2b=False,
            id_field="id",
        )
        return node_answer(answer)

    @app.post("/v1/environments/batch")
    async def create_batch(request: Request) -> Response:
        require_key(request)
        data = await json_body(request)
        req = _validated(BatchCreateRequest, data)
        return await batch_stream(gw, req, data["items"], queue_timeout_s=queue_timeout_s)

    @app.get("/v1/environments")
    async def list_environments(request: Request) -> list:
        require_key(request)
        return await gw.merged("/v1/environments", e2b=False, order=("created_at", "id"))

    async def per_environment(request: Request, env_id: str, *, e2b: bool) -> Response:
        require_key(request)
        try:
            route = await gw.route(env_id)
        except (LostError, NotFoundError) as exc:  # a resume of it may find its published pause
            if not is_resume(request.method, request.url.path, env_id, e2b=e2b):
                raise
            return await resume_elsewhere(gw, env_id, await json_body(request), e2b=e2b, why=exc)
        try:
            response = await proxy.relay(
                client, request, route, request.url.path, headers=proxy.keyed_headers(request, route, e2b=e2b)
            )
        except DaemonError:
            await gw.route(env_id)  # LostError if its node went meanwhile
            raise
        parts = request.url.path.rstrip("/").split("/")
        if request.method == "DELETE" and parts[-1] == env_id and response.status_code in (204, 404):
            await directory.call("forget", env_id)
        elif request.method == "POST" and parts[-1] == "fork" and response.status_code == 201:
            return await _forked(gw, route, response, e2b=e2b)
        return response

    @app.api_route("/v1/environments/{env_id}", methods=["GET", "DELETE"])
    @app.api_route("/v1/environments/{env_id}/{rest:path}", methods=["GET", "POST", "PUT", "DELETE"])
    async def v1_environment(request: Request, env_id: str) -> Response:
        return await per_environment(request, env_id, e2b=False)

    # --- E2B's API --------------------------------------------------------------------
    @app.post("/e2b/sandboxes")
    @app.post("/e2b/v2/sandboxes")
    async def e2b_create(request: Request) -> Response:
        require_key(request)
        data = await json_body(request)
        template = data.get("templateID")
        if not isinstance(template, str) or not template:
            raise InvalidInputError("templateID: a template name is required")
        template = await owners.start_ref(template)  # an E2B template's id or tag: its build's digest
        answer, _ = await gw.create(
            {**data, "templateID": template},
            template=template,
            cpus=None,
            memory_bytes=None,
            path=request.url.path,
            e2b=True,
            id_field="sandboxID",
        )
        return node_answer(answer)

    @app.get("/e2b/sandboxes")
    async def e2b_list_v1(request: Request) -> list:
        require_key(request)
        return await gw.merged("/e2b/sandboxes", e2b=True, order=("startedAt", "sandboxID"))

    @app.get("/e2b/v2/sandboxes")
    async def e2b_list_v2(request: Request) -> Response:
        require_key(request)
        return await _e2b_list_v2(gw, request.query_params)

    @app.api_route("/e2b/sandboxes/{env_id}", methods=["GET", "DELETE"])
    @app.api_route("/e2b/sandboxes/{env_id}/{rest:path}", methods=["GET", "POST"])
    @app.api_route("/e2b/v2/sandboxes/{env_id}/{rest:path}", methods=["GET", "POST"])
    async def e2b_sandbox(request: Request, env_id: str) -> Response:
        return await per_environment(request, env_id, e2b=True)

    async def envd(request: Request) -> Response:
        """envd's request, to the node of the sandbox it names (checked token first)."""
        route, sid = await _envd_route(gw, request)
        headers = proxy.relayed_headers(request, keep_credentials=True)
        headers = [(k, v) for k, v in headers if k.lower() != b"e2b-sandbox-id"]
        if sid is not None:
            headers.append((b"e2b-sandbox-id", sid.encode()))
        path = request.url.path if request.url.path.startswith("/e2b/envd/") else "/e2b/envd/files"
        return await proxy.relay(client, request, route, path, headers=headers)

    app.add_api_route("/e2b/envd/{rest:path}", envd, methods=["GET", "POST"])
    app.add_api_route("/files", envd, methods=["GET", "POST"])  # signed URLs, as on one node
    install_template_routes(app, gw, owners, require_key)  # E2B's template API: weenv.cluster.templates
    app.include_router(cluster_ui_router(gw, api_key))  # the dashboard at /ui: weenv.cluster.dashboard

    from weenv.cluster.ports import ClusterPorts

    # outermost (added last): PORT-ID. hosts need no key and bound their bodies themselves
    app.add_middleware(ClusterPorts, gateway=gw, max_body=max_body)
    return app


def _message_of(answer: httpx.Response) -> str:
    """A node's error answer in words (weenv's ``error.message``, else its text)."""
    try:
        doc = answer.json()
        return str(doc["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return f"{answer.status_code} {answer.text[:300]}"


def _e2b_error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"code": status, "message": message}, status_code=status)


def _validated(model, data: dict):
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise InvalidInputError("bad request: " + describe_errors(exc.errors())) from None


async def _forked(gw: Gateway, route: Route, response: Response, *, e2b: bool) -> Response:
    """A fork's answer (read whole: it is small), its children recorded as on the parent's node."""
    body = b"".join([chunk async for chunk in response.body_iterator])
    if response.background is not None:
        await response.background()
    doc = json.loads(body)
    if e2b:
        children = [c["sandbox"]["sandboxID"] for c in doc if isinstance(c, dict) and c.get("sandbox")]
    else:
        children = [c["environment"]["id"] for c in doc.get("children", []) if c.get("environment")]
    await gw.record(route.node_id, children)
    return Response(body, status_code=201, media_type="application/json")


async def _e2b_list_v2(gw: Gateway, query: QueryParams) -> Response:
    """E2B's ``GET /v2/sandboxes`` over every node: each node's matches (its
    filters passed on, all its pages), merged in E2B's order (newest first unless
    ``order=asc``), then the page ``limit`` and ``nextToken`` ask."""
    start, limit = page_of(query, max_limit=1000)
    params = {k: v for k, v in query.items() if k not in ("limit", "nextToken")}
    found: list[dict] = []
    for route in await gw.routes():
        page_token = None
        for _ in range(MAX_LIST_PAGES):
            asked = {**params, "limit": "1000", **({"nextToken": page_token} if page_token else {})}
            try:
                answer = await proxy.call(gw.client, route, "GET", "/e2b/v2/sandboxes", e2b=True, params=asked)
            except DaemonError as exc:
                log.warning("listing skips node %s: %s", route.node_id, exc)
                break
            if answer.status_code != 200:  # a bad filter: the node's words
                return Response(answer.content, status_code=answer.status_code, media_type="application/json")
            found.extend(answer.json())
            page_token = answer.headers.get("x-next-token")
            if not page_token:
                break
    found.sort(key=lambda s: (s.get("startedAt", ""), s.get("sandboxID", "")), reverse=query.get("order") != "asc")
    return page_answer(found, start, limit)


async def _envd_route(gw: Gateway, request: Request) -> tuple[Route, str | None]:
    """The node of the sandbox an envd request names, and that sandbox's id
    (None: a signed URL, which its node finds by the signature itself).
    The access token is checked against the node's secret first: a missing or
    wrong one is 401 whether the sandbox exists or not; the right token of a
    sandbox the cluster no longer has is :class:`NotFoundError` (502)."""
    headers, query = request.headers, request.query_params
    sid = sandbox_id_in(headers)
    if query.get("signature") is not None and headers.get("x-access-token") is None:
        return await _signed_route(gw, request.method, sid, query), sid
    if not sid:
        raise _EnvdRefusal(400, "no sandbox named: send the E2b-Sandbox-Id header")
    presented = headers.get("x-access-token") or ""
    try:
        route = await gw.route(sid)
    except LostError:
        raise
    except NotFoundError:
        # a token one of the nodes issued for this id: a sandbox that was there
        if any(presented == access_token(token_secret(proxy.node_key(r, e2b=True)), sid) for r in await gw.routes()):
            raise NotFoundError(f"The sandbox {sid} was not found") from None
        raise _EnvdRefusal(401, "missing or wrong access token (X-Access-Token)") from None
    if presented != access_token(token_secret(proxy.node_key(route, e2b=True)), sid):
        raise _EnvdRefusal(401, "missing or wrong access token (X-Access-Token)")
    return route, sid


async def _signed_route(gw: Gateway, method: str, sid: str | None, query: QueryParams) -> Route:
    """The node of the sandbox whose token signed a ``/files`` URL (:mod:`weenv.server.e2b.signed`)."""
    try:
        expiration = signed.expiration_of(query.get("signature_expiration"))
        where = await gw.directory.call("environments")  # env id -> node id
        routes = {r.node_id: r for r in await gw.routes()}
        secrets_ = {n: token_secret(proxy.node_key(r, e2b=True)) for n, r in routes.items()}
        candidates = [sid] if sid else [e for e, n in where.items() if n in secrets_]
        if sid and where.get(sid) not in secrets_:
            raise signed.SignatureError("invalid signature for this path, operation and user")
        found = signed.signer(
            query.get("signature") or "",
            query.get("path") or "",
            "read" if method == "GET" else "write",
            query.get("username") or "",
            expiration,
            candidates,
            lambda e: access_token(secrets_[where[e]], e),
        )
    except signed.SignatureError as exc:
        raise _EnvdRefusal(401, str(exc)) from None
    return routes[where[found]]


class _EnvdRefusal(InvalidInputError):
    """An envd answer of the gateway's own (``status``, envd's message)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


__all__ = ["NEAR_HINT", "NODE_HINT", "Directory", "Gateway", "create_gateway_app"]
