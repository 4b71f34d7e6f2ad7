"""The cluster's dashboard at the gateway's ``/ui``, behind the cluster's API key::

    GET  /ui/login, POST /ui/login, POST /ui/logout, GET /ui/static/{name}
                          as on a node (:func:`weenv.server.ui.routes.add_access_routes`)
    GET  /ui/             the node table: each node's id, state (alive, lost, ...), address,
                          environments, cached bytes and cache hit rate, admissions that
                          waited and were refused, runtime; each row links to its node's page
    GET  /ui/nodes/{id}   that node's environments, asked of the node through the gateway;
                          a node that left the cluster: 410, a page saying so; an unknown id: 404

The key is the node dashboard's (:mod:`weenv.server.ui.access`): the
``weenv_key`` cookie the login form sets, or ``X-API-Key``; a page asked
without it redirects to the login form.  The figures are those the gateway
already has: the placement actor's view of the nodes (state, address, cached
bytes) and each alive node's ``/v1/stats`` and ``/v1/stats/provision``.  A node
that does not answer keeps its row, its figures shown as ``-``.
"""

from __future__ import annotations

import asyncio
import time

import httpx
from fastapi import APIRouter, Request
from fastapi.responses import RedirectResponse, Response

from weenv.api.models import EnvironmentInfo, NodeStats
from weenv.cluster import proxy
from weenv.errors import DaemonError
from weenv.node.provision.models import ProvisionStats
from weenv.server.auth import ApiKey
from weenv.server.ui import views
from weenv.server.ui.access import PATH, form_token, key_source
from weenv.server.ui.routes import NO_STORE, add_access_routes, renderer

PAGES = (("nodes", f"{PATH}/", "Nodes"),)
KEY_WHERE = "the output of 'weenv cluster status'"
"""Where the login form says the cluster's key is."""
STATES = {"gone": "lost"}
"""A node's state in the placement view -> the word the table shows."""


def cluster_ui_router(gw, api_key: ApiKey) -> APIRouter:
    """The ``/ui`` routes of the gateway over ``gw`` (:class:`weenv.cluster.gateway.Gateway`)."""
    render = renderer(PAGES)
    r = APIRouter(prefix=PATH, tags=["dashboard"])
    add_access_routes(r, render, api_key, key_where=KEY_WHERE)

    def allowed(request: Request) -> bool:
        return key_source(request.headers, request.cookies, api_key) is not None

    def login() -> Response:
        return RedirectResponse(f"{PATH}/login", status_code=303, headers=NO_STORE)

    @r.get("/")
    async def nodes_page(request: Request) -> Response:
        """The cluster dashboard's node table (HTML): state, address, environments, cache, admission, runtime."""
        if not allowed(request):
            return login()
        return render("nodes.html", request, token=form_token(api_key), rows=await node_rows(gw))

    @r.get("/nodes/{node_id}")
    async def node_page(request: Request, node_id: str) -> Response:
        """One node's environments (HTML), asked of it through the gateway; 410 if it left the cluster."""
        if not allowed(request):
            return login()
        status = {s.node_id: s for s in await gw.directory.call("status")}
        known = status.get(node_id)
        if known is None:
            return render(
                "error.html", request, 404, token=form_token(api_key), error=f"no node {node_id!r} in the cluster"
            )
        route = next((x for x in await gw.routes() if x.node_id == node_id), None)
        if route is None:
            why = f" ({known.reason})" if known.reason else ""
            state = STATES.get(known.state, known.state)
            return render(
                "error.html",
                request,
                410 if known.state == "gone" else 503,
                token=form_token(api_key),
                error=f"node {node_id} left the cluster{why}: its environments are lost"
                if known.state == "gone"
                else f"node {node_id} is {state}{why}: it has no environments to show now",
            )
        try:
            answer = await proxy.call(gw.client, route, "GET", "/v1/environments", e2b=False)
            answer.raise_for_status()
        except (DaemonError, httpx.HTTPStatusError) as exc:
            return render(
                "error.html", request, 502, token=form_token(api_key), error=f"node {node_id} did not answer: {exc}"
            )
        now = time.time()
        rows = [
            {
                "id": e.id,
                "template": e.template,
                "state": e.state,
                "age": views.age(now - e.created_at),
                "cpus": e.resources.cpus,
                "memory": views.size(e.resources.memory_bytes),
                "address": e.address or "-",
            }
            for e in sorted(map(EnvironmentInfo.model_validate, answer.json()), key=lambda e: e.created_at)
        ]
        return render(
            "cluster_node.html", request, token=form_token(api_key), node_id=node_id, api_url=route.api_url, rows=rows
        )

    return r


async def node_rows(gw) -> list[dict]:
    """One row per node the cluster has known (alive first), with each alive node's figures."""
    status = await gw.directory.call("status")
    routes = {x.node_id: x for x in await gw.routes()}

    async def figures(node_id: str) -> tuple[NodeStats, ProvisionStats] | None:
        route = routes.get(node_id)
        if route is None:
            return None
        try:
            stats, provision = await asyncio.gather(
                proxy.call(gw.client, route, "GET", "/v1/stats", e2b=False),
                proxy.call(gw.client, route, "GET", "/v1/stats/provision", e2b=False),
            )
            return NodeStats.model_validate(stats.json()), ProvisionStats.model_validate(provision.json())
        except (DaemonError, ValueError):  # no answer, or not the node's shapes: the row says "-"
            return None

    found = await asyncio.gather(*(figures(s.node_id) for s in status))
    rows = []
    for s, got in zip(status, found, strict=True):
        row = {
            "id": s.node_id,
            "state": STATES.get(s.state, s.state),
            "reason": s.reason,
            "address": s.api_url or "-",
            "environments": s.environments,
            "cached": views.size(s.cached_bytes),
            "hit_rate": "-",
            "waited": "-",
            "refused": "-",
            "admitting": None,
            "runtime": "-",
        }
        if got is not None:
            stats, provision = got
            reads = stats.cache_reads_hit + stats.cache_reads_missed
            waited, refused = views.admissions(provision)
            row.update(
                environments=stats.environments,
                hit_rate=f"{stats.cache_reads_hit / reads:.1%}" if reads else "-",
                waited=waited,
                refused=refused,
                admitting=provision.totals.admitting,
                runtime=stats.runtime,
            )
        rows.append(row)
    rows.sort(key=lambda x: (x["state"] != "alive", x["id"]))
    return rows
