"""E2B's template API at the cluster's address (what ``e2b.Template.build`` calls),
served by the gateway (:mod:`weenv.cluster.gateway`) over the nodes' own
(:mod:`weenv.server.e2b.templates`).

An E2B template's records (its id, name, tags, builds and their logs) live on
the one node that took its build request; what a build makes is published to
the store every node reads, its ref ``templates/NAME`` following the latest
ready build, as on one node.  So:

- ``POST /v3/templates`` goes to the node holding the template of that name
  already (a rebuild), else to the node placement chooses for one
  environment of the build's size (load, as for a create; the reservation is
  given back at once: the build's environment is the node's business);
- every route naming a template (``/templates/{id}/...``, ``/v2/templates/{id}/...``,
  aliases, tags) goes to the node holding it, found by asking the nodes
  (``GET /templates/{id}`` of each) and then remembered (:class:`TemplateOwners`);
- the file upload link a node answers names the gateway, not the node; the
  upload (no API key, the node's upload token) is checked at the gateway for
  the node's token before its body is taken (:meth:`TemplateOwners.upload_authorised`),
  then relayed to the node, which checks it again;
- ``GET /templates`` and ``GET /v2/templates`` list every alive node's, oldest
  first (v2's pages cut at the gateway);
- ``DELETE /templates/{id}`` of no node's template goes to any node: a
  snapshot, which lives in the store;
- a sandbox's ``templateID`` (:meth:`TemplateOwners.start_ref`): a plain name
  starts the store's template of that name on whichever node placement
  chooses, as any template; an E2B template id, ``NAME:TAG`` or
  ``NAME:BUILD_ID`` is turned into the weenv template digest it names by the
  node holding the template (``GET /e2b/weenv/templates/{ref}``), and that
  digest is placed and started on any node.

Errors are E2B's ``{"code", "message"}``: an unknown template is 404, a node
that cannot be reached 502.
"""

from __future__ import annotations

import json
import re
from urllib.parse import quote

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from weenv.cluster import proxy
from weenv.cluster.view import Route
from weenv.errors import InvalidInputError, NotFoundError
from weenv.server.e2b.sandboxes import token_secret
from weenv.server.e2b.templates import UPLOAD_HEADER
from weenv.server.e2b.uploads import UploadTokens, upload_route
from weenv.server.kit.paging import page_answer, page_of

E2B_ID_RE = re.compile(r"^[a-z0-9]{20}$")
"""The form of an E2B template id (:func:`weenv.server.e2b.builds._template_id`)."""
MAX_REMEMBERED = 100_000
"""Template ids and names the gateway remembers the node of (then it forgets them all and asks again)."""


class TemplateOwners:
    """Which node holds each E2B template (see the module docstring): remembered
    from the answers relayed, else asked of every alive node."""

    def __init__(self, gw):
        self.gw = gw
        self._node: dict[str, str] = {}  # template id or name -> node id
        self._routes: dict[str, Route] = {}  # node id -> its route, as last seen

    def note(self, node_id: str, *refs: str) -> None:
        if len(self._node) >= MAX_REMEMBERED:
            self._node.clear()
        for ref in refs:
            self._node[ref] = node_id

    def forget_node(self, node_id: str) -> None:
        """Forget every template remembered on ``node_id`` (asked again when named)."""
        self._node = {ref: n for ref, n in self._node.items() if n != node_id}

    async def find(self, ref: str) -> Route | None:
        """The node holding the E2B template ``ref`` (id or name, a ``:TAG`` ignored)
        names; None if no alive node has it."""
        base = ref.partition(":")[0]
        routes = {r.node_id: r for r in await self.gw.routes()}
        self._routes = routes
        node = self._node.get(base)
        if node in routes:
            return routes[node]
        for route, answer in await self.gw.fan_out("GET", f"/e2b/templates/{quote(base, safe='')}", e2b=True):
            if answer.status_code == 200:
                doc = answer.json()
                self.note(route.node_id, doc["templateID"], *doc.get("names", []))
                return route
        return None

    async def owner(self, ref: str) -> Route:
        route = await self.find(ref)
        if route is None:
            raise NotFoundError(f"template {ref!r} not found")
        return route

    async def start_ref(self, ref: str) -> str:
        """What a create of ``templateID`` ``ref`` starts on any node: the digest of
        the E2B template build an id or ``NAME:TAG`` names (asked of its node), else
        ``ref`` itself.  Raises :class:`NotFoundError` for a tag or build not ready."""
        if ":" not in ref and not E2B_ID_RE.match(ref):
            return ref
        route = await self.find(ref)
        if route is None:
            return ref  # a weenv template or snapshot (NAME:VERSION, a digest): the node's to find
        answer = await proxy.call(self.gw.client, route, "GET", f"/e2b/weenv/templates/{quote(ref, safe='')}", e2b=True)
        if answer.status_code == 404:
            raise NotFoundError(_message(answer))
        if answer.status_code != 200:
            raise InvalidInputError(_message(answer))
        return answer.json()["template"]

    def upload_authorised(self, scope: dict) -> bool:
        """Whether ``scope`` is a template upload carrying a live token of the node
        holding that template (known from the link the gateway relayed)."""
        route_of = upload_route(scope.get("method", ""), scope.get("path", ""))
        if route_of is None:
            return False
        node = self._node.get(route_of[0])
        route = self._routes.get(node) if node else None
        if route is None:
            return False
        token = dict(scope.get("headers") or ()).get(UPLOAD_HEADER.encode(), b"").decode("latin-1")
        tokens = UploadTokens(token_secret(proxy.node_key(route, e2b=True)))
        return tokens.authorises(token, scope["method"], scope["path"])


def _message(answer) -> str:
    try:
        return str(answer.json().get("message"))
    except ValueError:
        return answer.text[:500]


def install_template_routes(app: FastAPI, gw, owners: TemplateOwners, require_key) -> None:
    """Add E2B's template routes (under ``/e2b``) to the gateway's ``app``."""
    client = gw.client

    async def relay(request: Request, route: Route, *, body: bytes | None = None) -> Response:
        return await proxy.relay(
            client, request, route, request.url.path, headers=proxy.keyed_headers(request, route, e2b=True), body=body
        )

    async def json_of(request: Request) -> tuple[bytes, dict]:
        raw = await request.body()
        try:
            doc = json.loads(raw or b"{}")
        except ValueError:
            doc = None
        if not isinstance(doc, dict):
            raise InvalidInputError("bad request: the body is not a JSON object")
        return raw, doc

    @app.post("/e2b/v3/templates")
    async def request_build(request: Request) -> Response:
        require_key(request)
        raw, doc = await json_of(request)
        name = doc.get("name") or doc.get("alias")
        if not isinstance(name, str) or not name:
            raise InvalidInputError("name: a template name is required")
        route = await owners.find(name)
        if route is None:
            cpus, memory = doc.get("cpuCount"), doc.get("memoryMB")
            placed = await gw.place(
                name.partition(":")[0],
                float(cpus) if isinstance(cpus, int) else None,
                memory << 20 if isinstance(memory, int) else None,
                {},
            )
            await gw.done(placed.token, placed.route.node_id, None)
            route = placed.route
        answer = await proxy.call(client, route, "POST", "/e2b/v3/templates", e2b=True, json=doc)
        if answer.status_code == 202:
            made = answer.json()
            owners.note(route.node_id, made["templateID"], *made.get("names", []))
        return Response(answer.content, status_code=answer.status_code, media_type="application/json")

    @app.get("/e2b/templates/{template_id}/files/{files_hash}")
    async def file_link(request: Request, template_id: str, files_hash: str) -> Response:
        require_key(request)
        route = await owners.owner(template_id)
        answer = await proxy.call(client, route, "GET", request.url.path, e2b=True)
        doc = answer.json()
        if answer.status_code == 201 and isinstance(doc.get("url"), str):
            # the node's link names the node: the gateway's names the gateway
            here = str(request.url.replace(query=""))
            doc["url"] = (
                f"{here[: here.rindex('/templates/')]}/templates/{quote(template_id, safe='')}"
                f"/files/{files_hash}/upload"
            )
        return JSONResponse(doc, status_code=answer.status_code)

    @app.put("/e2b/templates/{template_id}/files/{files_hash}/upload")
    async def upload(request: Request, template_id: str, files_hash: str) -> Response:
        route = await owners.owner(template_id)
        return await proxy.relay(
            client, request, route, request.url.path, headers=proxy.relayed_headers(request, keep_credentials=False)
        )

    @app.get("/e2b/templates")
    @app.get("/e2b/v2/templates")
    async def listing(request: Request) -> Response:
        """Every alive node's templates, oldest first; v2 a page of them."""
        require_key(request)
        v2 = request.url.path.startswith("/e2b/v2/")
        start, limit = page_of(request.query_params, max_limit=100) if v2 else (0, None)
        found = await gw.merged("/e2b/templates", e2b=True, order=("createdAt", "templateID"))
        return page_answer(found, start, limit) if v2 else JSONResponse(found)

    @app.get("/e2b/templates/aliases/{alias}")
    async def alias(request: Request, alias: str) -> Response:
        require_key(request)
        route = await owners.find(alias)
        if route is None:
            raise NotFoundError(f"template alias {alias!r} not found")
        return await relay(request, route)

    @app.api_route("/e2b/templates/tags", methods=["POST", "DELETE"])
    async def tags(request: Request) -> Response:
        require_key(request)
        raw, doc = await json_of(request)
        ref = doc.get("target" if request.method == "POST" else "name")
        if not isinstance(ref, str) or not ref:
            raise InvalidInputError(f"{'target' if request.method == 'POST' else 'name'}: a template name is required")
        return await relay(request, await owners.owner(ref), body=raw)

    @app.delete("/e2b/templates/{template_id}")
    async def delete(request: Request, template_id: str) -> Response:
        require_key(request)
        route = await owners.find(template_id) or await gw.any_route()  # no node's: a snapshot, in the store
        response = await relay(request, route)
        if response.status_code == 204:
            owners.forget_node(route.node_id)
        return response

    @app.api_route("/e2b/templates/{template_id}", methods=["GET", "PATCH"])
    @app.api_route("/e2b/v2/templates/{template_id}", methods=["PATCH"])
    @app.api_route("/e2b/v2/templates/{template_id}/builds/{build_id}", methods=["POST"])
    @app.api_route("/e2b/templates/{template_id}/{rest:path}", methods=["GET"])
    async def per_template(request: Request, template_id: str) -> Response:
        require_key(request)
        return await relay(request, await owners.owner(template_id))


__all__ = ["TemplateOwners", "install_template_routes"]
