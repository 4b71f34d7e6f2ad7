"""Relaying one request of the cluster's gateway to the node daemon that owns
its environment, streamed both ways (httpx over TCP to the node's ``api_url``).

- **Bodies** are streamed as they come (never held whole); their bound is the
  gateway's :class:`~weenv.server.limits.BodyLimit`, and again the node's own.
- **Answers** are streamed back as the node sends them (NDJSON commands,
  Connect RPC streams of envd: process output, PTY, directory watches), bytes
  as they are (``Content-Encoding`` kept), until the node ends them or the
  client leaves (the node's request is closed then: the node sees its client
  go, as it would without the gateway).
- **Credentials**: the gateway's API key is taken off and the node's put on
  (``X-API-Key``) for the control-plane routes; envd's requests go with their
  own headers (the sandbox's ``X-Access-Token``, ``Authorization: Basic`` for
  the user), which the node checks.
- **Timeouts** (:class:`Timeouts`): connecting to a node, a pause in its
  answer (a stream silent longer ends: set it above the longest command's
  silence, default 1 h), a pause in sending it the body.

A node that cannot be reached is :class:`~weenv.errors.DaemonError` (the
gateway's 502); the caller asks placement whether the node went (then the
environment is lost).
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from weenv.cluster.view import Route
from weenv.errors import DaemonError

HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "host",
}
"""Headers of one connection (RFC 9110 §7.6.1), never relayed; ``host`` is the node's."""
CREDENTIALS = {"x-api-key", "authorization"}
"""The gateway's credentials: replaced by the node's on control-plane routes."""


@dataclass(frozen=True)
class Timeouts:
    """Seconds: to connect to a node, of silence in its answer, of a stalled body sent to it."""

    connect: float = 10.0
    read: float = 3600.0
    write: float = 60.0

    def httpx(self) -> httpx.Timeout:
        return httpx.Timeout(connect=self.connect, read=self.read, write=self.write, pool=self.connect)


def new_client(timeouts: Timeouts = Timeouts(), *, max_connections: int = 1024) -> httpx.AsyncClient:
    """The gateway's pool of connections to the nodes."""
    return httpx.AsyncClient(
        timeout=timeouts.httpx(),
        follow_redirects=False,
        trust_env=False,
        limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=256),
    )


def node_key(route: Route, *, e2b: bool) -> str:
    """The node's API key as its weenv API (``KEY``) or its E2B face (``e2b_KEY``) takes it."""
    return ("e2b_" if e2b else "") + route.api_key


def relayed_headers(request: Request, *, keep_credentials: bool) -> list[tuple[bytes, bytes]]:
    """``request``'s headers as they go on to the node: without those of the
    connection, and without the gateway's credentials unless ``keep_credentials``."""
    drop = HOP_BY_HOP if keep_credentials else HOP_BY_HOP | CREDENTIALS
    return [(k, v) for k, v in request.headers.raw if k.decode("latin-1").lower() not in drop]


def keyed_headers(request: Request, route: Route, *, e2b: bool) -> list[tuple[bytes, bytes]]:
    """``request``'s headers with the gateway's key replaced by ``route``'s node's."""
    return [*relayed_headers(request, keep_credentials=False), (b"x-api-key", node_key(route, e2b=e2b).encode())]


async def relay(
    client: httpx.AsyncClient,
    request: Request,
    route: Route,
    path: str,
    *,
    headers: list[tuple[bytes, bytes]],
    body: bytes | None = None,
) -> Response:
    """Send ``request`` (its method, query string, ``headers``, its body streamed
    or ``body`` if given) to ``path`` on ``route``'s node; the node's answer,
    streamed.  Raises :class:`DaemonError` if the node cannot be reached or
    stops answering before its status line."""
    url = httpx.URL(route.api_url + path, query=request.scope.get("query_string", b""))
    has_body = request.method not in ("GET", "HEAD", "DELETE") or "content-length" in request.headers
    content = body if body is not None else (request.stream() if has_body else None)
    if body is not None:
        headers = [(k, v) for k, v in headers if k.lower() != b"content-length"]
    out = client.build_request(request.method, url, headers=headers, content=content)
    try:
        answer = await client.send(out, stream=True)
    except httpx.TimeoutException as exc:
        raise DaemonError(
            f"node {route.node_id[:12]} ({route.api_url}) did not answer in time: {type(exc).__name__}"
        ) from exc
    except httpx.HTTPError as exc:
        raise DaemonError(f"node {route.node_id[:12]} ({route.api_url}) cannot be reached: {exc}") from exc
    back = [(k, v) for k, v in answer.headers.raw if k.decode("latin-1").lower() not in HOP_BY_HOP]
    response = StreamingResponse(_raw(answer), status_code=answer.status_code, background=BackgroundTask(answer.aclose))
    response.raw_headers = back  # the node's, content-length and content-encoding as they are
    return response


async def _raw(answer: httpx.Response):
    """The answer's bytes as they come; a node that breaks off mid-answer ends it short."""
    try:
        async for chunk in answer.aiter_raw():
            yield chunk
    except httpx.HTTPError:
        return  # the client sees the answer cut short, as from the node itself
    finally:
        await answer.aclose()


async def call(
    client: httpx.AsyncClient,
    route: Route,
    method: str,
    path: str,
    *,
    e2b: bool = False,
    json: object | None = None,
    params: dict | None = None,
) -> httpx.Response:
    """One whole request of the gateway's own to ``route``'s node with its key
    (its answer read whole: small JSON).  Raises :class:`DaemonError` if the
    node cannot be reached."""
    try:
        return await client.request(
            method, route.api_url + path, json=json, params=params, headers={"x-api-key": node_key(route, e2b=e2b)}
        )
    except httpx.HTTPError as exc:
        raise DaemonError(f"node {route.node_id[:12]} ({route.api_url}) cannot be reached: {exc}") from exc
