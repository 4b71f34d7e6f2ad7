"""E2B's ``get_host(port)`` through the cluster's gateway: HTTP and WebSocket
traffic to a sandbox's port, relayed to the node that owns the sandbox.

The SDK names a sandbox's port as the host ``PORT-SANDBOXID.DOMAIN``
(:mod:`weenv.server.e2b.ports`).  :class:`ClusterPorts` (ASGI middleware,
outermost on the gateway's app) takes a request or WebSocket whose ``Host``
is ``PORT-ID.anything`` (``PORT`` not envd's), finds the sandbox's node with
the placement actor, opens a TCP connection to that node's API address and
relays the request there unchanged (its ``Host``, path, headers, body
streamed; the traffic access token passed on), with the same code the node
uses towards the sandbox (:class:`~weenv.server.kit.relay.PortRelay`).  The node's
:class:`~weenv.server.e2b.ports.PortProxy` then does what it does for a
client of its own: the private sandbox's token check (403), the body bound
(413), the port's answer or refusal (502), the idle end (504).

Limits at the gateway: at most ``max_relays`` relays at once (one more: 503
at once); ``idle_timeout`` seconds with no byte either way ends one (the
node's own idle timeout usually ends it first; an HTTP request asking its
own, :data:`~weenv.server.kit.relay.IDLE_HEADER`, gets it here too: the node
checks the key that must come with it and refuses at once without it);
``max_body`` bytes of a request body.  A sandbox the cluster does not know
(or lost with its node) is E2B's 502 ``{"code", "message", "sandboxId", "port"}``, as on one node;
a node that cannot be reached, 502 too.
"""

from __future__ import annotations

import asyncio
import socket
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from weenv.errors import LostError, NotFoundError, WeenvError
from weenv.server.kit.relay import RELAY_IDLE_S, PortRelay
from weenv.server.limits import MAX_BODY

if TYPE_CHECKING:
    from weenv.cluster.gateway import Gateway

MAX_RELAYS = 1024
"""Relays the gateway runs at once by default."""
CONNECT_S = 10.0
"""Seconds to connect to a node."""


class ClusterPorts(PortRelay):
    """ASGI middleware relaying ``PORT-ID.`` hosts to the sandbox's node (see the module docstring)."""

    who = "the cluster's gateway"

    def __init__(
        self,
        app,
        gateway: Gateway,
        *,
        max_relays: int = MAX_RELAYS,
        max_body: int = MAX_BODY,
        idle_timeout: float = RELAY_IDLE_S,
    ):
        super().__init__(app, max_relays=max_relays, max_body=max_body, idle_timeout=idle_timeout, keep_token=True)
        self.gateway = gateway

    async def connect(self, scope, sandbox_id: str, port: int, refuse) -> socket.socket | None:
        """A connection to the API address of the sandbox's node, or None once
        ``refuse`` answered why not (unknown or lost sandbox, node unreachable: 502)."""
        try:
            route = await self.gateway.route(sandbox_id)
        except LostError as exc:
            await refuse(502, f"The sandbox {sandbox_id} was not found: {exc}")
            return None
        except NotFoundError:
            await refuse(502, f"The sandbox {sandbox_id} was not found")
            return None
        except WeenvError as exc:
            await refuse(502, f"the cluster cannot find the sandbox's node: {exc}")
            return None
        where = urlsplit(route.api_url)
        host, node_port = where.hostname or "127.0.0.1", where.port or 80
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(host, node_port, type=socket.SOCK_STREAM)
            family, kind, proto, _, address = infos[0]
            sock = socket.socket(family, kind, proto)
        except OSError as exc:
            await refuse(502, f"node {route.node_id[:12]} ({route.api_url}) cannot be reached: {exc}")
            return None
        sock.setblocking(False)
        try:
            await asyncio.wait_for(loop.sock_connect(sock, address), CONNECT_S)
        except (TimeoutError, OSError) as exc:
            sock.close()
            await refuse(
                502, f"node {route.node_id[:12]} ({route.api_url}) cannot be reached: {exc or type(exc).__name__}"
            )
            return None
        return sock
