"""Environments through the cluster: create, exec, files, destroy, each sent to
the node that owns the environment.

A create asks the placement actor for a node (:meth:`ClusterView.place
<weenv.cluster.view.ClusterView.place>`), creates on that node's daemon over
TCP with its API key, then tells the placement actor the create is done (made,
or failed: its reservation is released either way).  Every other call looks
the environment's node up (a node that went makes the call raise
:class:`~weenv.errors.LostError`).  Errors raised in an actor reach the caller
as themselves (mapped once, in :func:`_get`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from weenv.api.models import EnvironmentInfo, ExecResult, WriteInfo
from weenv.cluster import _ray, placement_actor
from weenv.cluster.view import Route
from weenv.errors import DaemonError, LostError
from weenv.formats.manifest import Resources
from weenv.node.data.peers import PEERS_HINT
from weenv.sdk import NodeClient


@dataclass(frozen=True)
class ClusterEnvironment:
    """An environment made through the cluster, with the Ray id of the node it runs on
    (for a trainer's ``NodeAffinitySchedulingStrategy(node_id, soft=True)``)."""

    info: EnvironmentInfo
    node_id: str

    @property
    def id(self) -> str:
        return self.info.id


def _get(ref, timeout: float | None = 60.0):
    """``ray.get(ref)``, an actor's own weenv error raised as itself."""
    ray = _ray()
    try:
        return ray.get(ref, timeout=timeout)
    except ray.exceptions.RayTaskError as exc:
        cause = exc.cause
        if isinstance(cause, Exception):
            raise cause from None
        raise
    except ray.exceptions.RayActorError as exc:
        raise DaemonError(f"the weenv placement actor is gone: {exc}") from exc


class ClusterClient:
    """The cluster at Ray ``address`` (None: ``RAY_ADDRESS`` or the local one).
    Thread-safe.  ``request_timeout``: seconds a node's request may take."""

    def __init__(self, *, address: str | None = None, request_timeout: float = 600.0):
        self._placement = placement_actor(address)
        self._timeout = request_timeout
        self._lock = threading.Lock()
        self._clients: dict[str, tuple[Route, NodeClient]] = {}

    def _client(self, route: Route) -> NodeClient:
        with self._lock:
            found = self._clients.get(route.node_id)
            if found is not None and found[0] == route:
                return found[1]
            client = NodeClient(api_url=route.api_url, api_key=route.api_key, request_timeout=self._timeout)
            self._clients[route.node_id] = (route, client)
            return client

    def create(
        self,
        template: str,
        *,
        resources: Resources | None = None,
        node: str | None = None,
        near: str | None = None,
        timeout: float | None = None,
        first_command: bool = True,
    ) -> ClusterEnvironment:
        """One environment of ``template`` on the node placement chooses (``node``:
        a node id to prefer; ``near``: an environment whose node to prefer).
        Raises what placement raises (:class:`InvalidInputError` for an unknown
        node, :class:`NotFoundError` / :class:`LostError` for ``near``,
        :class:`CapacityError` when the cluster is full) and what the node's
        create raises."""
        placed = _get(
            self._placement.place.remote(
                template,
                resources.cpus if resources else None,
                resources.memory_bytes if resources else None,
                node,
                near,
            )
        )
        env_id = None
        try:
            hint = {PEERS_HINT: ",".join(placed.peers)} if placed.peers else None  # who else fetches it now
            info = self._client(placed.route).create(
                template, resources=resources, timeout=timeout, first_command=first_command, metadata=hint
            )
            env_id = info.id
        finally:
            _get(self._placement.done.remote(placed.token, placed.route.node_id, env_id))
        return ClusterEnvironment(info, placed.route.node_id)

    def route(self, env_id: str) -> Route:
        """The node of ``env_id``, asked of the placement actor at every call (an
        environment written off as lost is never used again, even where its
        node's daemon still answers); :class:`LostError` if it went,
        :class:`NotFoundError` if unknown."""
        return _get(self._placement.route.remote(env_id))

    def _call(self, env_id: str, method: str, *args: Any, **kwargs: Any) -> Any:
        route = self.route(env_id)
        try:
            return getattr(self._client(route), method)(env_id, *args, **kwargs)
        except DaemonError:
            self.route(env_id)  # LostError if its node went meanwhile
            raise

    def get(self, env_id: str) -> EnvironmentInfo:
        return self._call(env_id, "get")

    def exec(self, env_id: str, command: list[str] | str, **kwargs: Any) -> ExecResult:
        """Run ``command`` in ``env_id`` to its end (:meth:`NodeClient.exec <weenv.sdk.NodeClient.exec>`'s arguments)."""
        return self._call(env_id, "exec", command, **kwargs)

    def read_file(self, env_id: str, path: str) -> bytes:
        return self._call(env_id, "read_file", path)

    def write_file(self, env_id: str, path: str, data: bytes) -> WriteInfo:
        return self._call(env_id, "write_file", path, data)

    def destroy(self, env_id: str) -> None:
        """Destroy ``env_id``; a lost one is forgotten (:class:`LostError` still tells the caller it was lost)."""
        try:
            self._call(env_id, "destroy")
        except LostError:
            _get(self._placement.forget.remote(env_id))
            raise
        _get(self._placement.forget.remote(env_id))

    def environments(self) -> dict[str, str]:
        """Environment id -> node id, of every environment the cluster runs."""
        return _get(self._placement.environments.remote())

    def lost(self) -> dict[str, str]:
        """Environment id -> node id, of every environment lost with its node."""
        return _get(self._placement.lost.remote())

    def close(self) -> None:
        with self._lock:
            for _, client in self._clients.values():
                client.close()
            self._clients.clear()

    def __enter__(self) -> ClusterClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
