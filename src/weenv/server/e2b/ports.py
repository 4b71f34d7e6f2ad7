"""E2B's ``get_host(port)``: HTTP to a port inside a sandbox, through the daemon.

The SDK names a sandbox's port as the host ``PORT-SANDBOXID.DOMAIN``; E2B's
edge proxy routes by it.  :class:`PortProxy` (ASGI middleware, outermost on
the daemon's app) does the same: a request whose ``Host`` is
``PORT-ID.anything`` with ``PORT`` not envd's (:data:`ENVD_PORT`, which stays
the envd face's) is relayed, streamed both ways, to ``127.0.0.1:PORT`` inside
that sandbox's own network namespace (:meth:`weenv.node.node.Node.open_port`:
environments with and without network alike, none of them reachable from
another; a namespace without network is reached through a pidfd of the
sandbox's process, never a bare process number).  HTTP/1.1, one request
per connection to the sandbox (``Connection: close``).  A WebSocket upgrade
(``ws://PORT-ID...``) is relayed too (:mod:`weenv.server.kit.wsrelay`): the
daemon opens the WebSocket to the sandbox's port with the client's path,
headers and subprotocols, answers the client's upgrade with what the
sandbox chose (or relays its refusal as the HTTP answer it was), then passes
messages both ways, pings answered on each side, close codes passed on.

Who may: as E2B's default (``allowPublicTraffic`` true), no credentials are
asked, the sandbox id is the capability.  A sandbox created with
``network.allowPublicTraffic`` false (``EnvironmentInfo.public_traffic``)
answers only requests carrying its traffic access token
(:meth:`~weenv.server.e2b.sandboxes.Sandboxes.traffic_token`, the create's
``trafficAccessToken``) in the :data:`TOKEN_HEADER` header, compared in
constant time; others get 403 and the sandbox is not reached.  The header is
not passed on to the sandbox.

Limits (a relay holds one of the daemon's TCP connections, uncounted by its
idle checks once the request's head is in, and one connection into the sandbox):

- **Relays at once**: at most ``max_relays`` (default a quarter of the
  daemon's TCP connection cap, ``WEENV_RELAY_MAX``); one more is answered 503
  at once, so relays, which need no key, never take the connections the API
  needs.
- **Request body**: at most ``max_body`` bytes (default the API's
  :data:`~weenv.server.limits.MAX_BODY`), streamed, never held whole: a
  ``Content-Length`` above it is answered 413 before the sandbox is reached;
  a chunked body passing it cuts the relay (413 unless the sandbox already
  answered).
- **Idle**: a relay in which no byte moved either way for ``idle_timeout``
  seconds (default :data:`RELAY_IDLE_S`, ``WEENV_RELAY_IDLE_S``) ends: 504 if
  the sandbox had not answered yet, else its answer is cut short.  An HTTP
  request may ask another idle timeout, up to :data:`MAX_RELAY_IDLE_S`, in
  the :data:`IDLE_HEADER` header (seconds) if it carries the daemon's API key
  in :data:`KEY_HEADER` (a server in the sandbox that answers only when a
  long command ends, as SWE-ReX's does: :mod:`weenv.adapters.swerex`); a bad
  value is answered 400, a missing or wrong key 403.  Neither header reaches
  the sandbox.

Errors carry E2B's ``{"code", "message"}``: 502 for an unknown sandbox or a
port nothing listens on (``The sandbox is running but port is not open``),
403, 413, 503, 504 as above.
"""

from __future__ import annotations

import socket

import anyio.to_thread
from starlette.datastructures import Headers

from weenv.config import settings
from weenv.errors import NotFoundError
from weenv.server.kit.relay import IDLE_HEADER, KEY_HEADER, RELAY_IDLE_S, TOKEN_HEADER, PortRelay
from weenv.server.limits import DRAIN_BYTES, MAX_BODY, drain

CONNECT_THREADS = 8
"""Relayed connects running at once (threads of the relay's own limiter, not anyio's shared 40)."""


def relay_settings(tcp_cap: int) -> dict[str, float | int]:
    """:class:`PortProxy`'s ``max_relays`` and ``idle_timeout`` for a daemon
    serving ``tcp_cap`` TCP connections: ``WEENV_RELAY_MAX`` (default a quarter
    of ``tcp_cap``, at most ``tcp_cap - 8``) and ``WEENV_RELAY_IDLE_S``
    (default :data:`RELAY_IDLE_S`).  Raises :class:`InvalidInputError` naming
    the variable for a value that is not a positive number."""
    server = settings().server
    max_relays = server.relay_max or max(1, tcp_cap // 4)
    return {"max_relays": max(1, min(max_relays, tcp_cap - 8)), "idle_timeout": server.relay_idle_s}


class PortProxy(PortRelay):
    """ASGI middleware relaying ``PORT-ID.`` hosts to sandbox ports (see the
    module docstring).  ``sandboxes``: the E2B face's registry, whose traffic
    tokens a private sandbox's requests must carry; ``max_relays``,
    ``max_body`` (bytes), ``idle_timeout`` (seconds): the limits; ``api_key``:
    the daemon's (:class:`~weenv.server.auth.ApiKey`), which a request asking
    its own idle timeout must carry (None: no request may)."""

    def __init__(
        self,
        app,
        node,
        sandboxes,
        *,
        max_relays: int = 256,
        max_body: int = MAX_BODY,
        idle_timeout: float = RELAY_IDLE_S,
        api_key=None,
    ):
        super().__init__(app, max_relays=max_relays, max_body=max_body, idle_timeout=idle_timeout)
        self.api_key = api_key
        self.node = node
        self.sandboxes = sandboxes
        self.connects = anyio.CapacityLimiter(CONNECT_THREADS)
        """The threads connecting relays to sandboxes (each may wait up to 5 s on a
        port): bounded apart from anyio's shared pool, so many relayed connects
        never starve the server's other thread work (routes, uploads)."""

    async def admit_http(self, scope, receive, refuse, idle: float) -> bool:
        """An asked idle timeout needs the daemon's key (403); a declared body past
        ``max_body`` is refused before the sandbox is reached (413)."""
        if idle != self.idle_timeout and (
            self.api_key is None or not self.api_key.matches(Headers(scope=scope).get(KEY_HEADER))
        ):
            await refuse(403, f"{IDLE_HEADER} needs the daemon's API key in the {KEY_HEADER} header")
            return False
        length = Headers(scope=scope).get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            if length.isdigit() and int(length) <= DRAIN_BYTES:
                await drain(receive, True)  # dropped, not kept: so the client reads the answer
            await refuse(413, f"request body larger than {self.max_body} bytes")
            return False
        return True

    async def connect(self, scope, sandbox_id: str, port: int, refuse) -> socket.socket | None:
        """A connected socket to ``port`` of the sandbox (in the relay's own
        thread limiter), or None once ``refuse(status, message)`` has answered
        why not: no such sandbox or a paused one (502), no traffic token (403), port closed (502)."""
        try:
            return await anyio.to_thread.run_sync(
                self._open, sandbox_id, port, Headers(scope=scope).get(TOKEN_HEADER), limiter=self.connects
            )
        except NotFoundError:
            await refuse(502, f"The sandbox {sandbox_id} was not found")
        except _NoToken:
            await refuse(403, f"The sandbox {sandbox_id} needs its traffic access token ({TOKEN_HEADER} header)")
        except OSError:
            await refuse(502, "The sandbox is running but port is not open")
        return None

    def _open(self, sandbox_id: str, port: int, token: str | None) -> socket.socket:
        """A connection to ``port`` of the sandbox; :class:`_NoToken` when it is
        private and ``token`` is not its traffic token (blocking)."""
        info = self.node.table.get(sandbox_id).info  # NotFoundError
        if info.state == "paused":  # E2B's proxy finds no running sandbox behind it: 502, until a connect or resume
            raise NotFoundError(f"sandbox {sandbox_id} is paused")
        if not info.public_traffic and not self.sandboxes.traffic_token_matches(sandbox_id, token):
            raise _NoToken
        return self.node.open_port(sandbox_id, port)


class _NoToken(Exception):
    """A private sandbox's port asked without its traffic access token."""
