"""The gateway's Ray actor: ``weenv-gateway`` in namespace ``weenv``, detached,
pinned to the head node beside the placement actor, serving
:func:`weenv.cluster.gateway.create_gateway_app` with uvicorn on
``gateway_host:gateway_port`` (default: the head node's address, port
:data:`~weenv.cluster.config.GATEWAY_PORT`) from a thread of its own.

Started by :func:`weenv.cluster.up` once the nodes answer, stopped by
:func:`weenv.cluster.down` before the nodes' daemons.  Its API key is
``gateway_key`` of the config, else made at its start (40 hex digits);
:func:`weenv.cluster.gateway` gives the URL and key (``weenv cluster status``
prints them).  It takes no CPU from Ray (``num_cpus=0``).
"""

from __future__ import annotations

import asyncio
import secrets
import socket
import threading
import time
from typing import Any

import ray
import uvicorn

from weenv.cluster.address import GatewayInfo
from weenv.cluster.config import NAMESPACE, PLACEMENT_NAME, ClusterConfig
from weenv.errors import DaemonError
from weenv.server.auth import ApiKey

GATEWAY_NAME = "weenv-gateway"


class RayDirectory:
    """The placement actor for the gateway's event loop: ``await call(method, *args)``,
    an actor's own weenv error raised as itself."""

    def __init__(self, actor):
        self.actor = actor

    async def call(self, method: str, *args: Any) -> Any:
        ref = getattr(self.actor, method).remote(*args)
        try:
            return await asyncio.wrap_future(ref.future())
        except ray.exceptions.RayTaskError as exc:
            if isinstance(exc.cause, Exception):
                raise exc.cause from None
            raise
        except ray.exceptions.RayActorError as exc:
            raise DaemonError(f"the weenv placement actor is gone: {exc}") from exc


class GatewayActor:
    """See the module docstring."""

    def __init__(self, config: ClusterConfig):
        from weenv.cluster.gateway import create_gateway_app

        host = config.gateway_host or ray.util.get_node_ip_address()
        try:
            self._socket = socket.create_server((host, config.gateway_port), backlog=2048)
        except OSError as exc:
            raise DaemonError(
                f"the cluster's gateway cannot listen on {host}:{config.gateway_port}: {exc.strerror}"
            ) from exc
        bound_host, port = self._socket.getsockname()[:2]
        self.url = f"http://{bound_host}:{port}"
        self.key = ApiKey(config.gateway_key or secrets.token_hex(20))
        placement = ray.get_actor(PLACEMENT_NAME, namespace=NAMESPACE)
        app = create_gateway_app(RayDirectory(placement), api_key=self.key, queue_timeout_s=config.batch_queue_s)
        from weenv.server.kit.wsrelay import MAX_WS_MESSAGE

        # WebSockets for get_host's relay (weenv.cluster.ports), no per-message deflate (none on the nodes either)
        self._server = uvicorn.Server(
            uvicorn.Config(
                app,
                log_level="warning",
                lifespan="on",
                ws="wsproto",
                ws_per_message_deflate=False,
                ws_max_size=MAX_WS_MESSAGE,
                timeout_graceful_shutdown=5,
            )
        )
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, name="weenv-gateway", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise DaemonError(f"the cluster's gateway did not start on {self.url}")
            time.sleep(0.01)

    def info(self) -> GatewayInfo:
        return GatewayInfo(self.url, self.key.value)

    def stop(self) -> None:
        """Stop serving (streams in progress end, within 5 s) and close the socket."""
        self._server.should_exit = True
        self._thread.join(timeout=15)
        self._socket.close()
