"""weenv on many nodes, on Ray (``pip install 'weenv[cluster]'``).

On a running Ray cluster, :func:`up` starts the placement actor, which starts
one node actor on every node (and on nodes that join later), each owning that
node's weenv daemon; :func:`down` stops every daemon and actor.
:class:`ClusterClient` creates environments through the placement actor and
sends their traffic to the node that owns them; :func:`gateway` is the
cluster's one HTTP address (weenv's API and E2B's, :mod:`weenv.cluster.gateway`),
which ``up`` starts on the head node.  What runs where:
:mod:`weenv.cluster.actors`; placement's scoring: :mod:`weenv.cluster.placement`.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from weenv.cluster.config import NAMESPACE, PLACEMENT_NAME, ClusterConfig
from weenv.errors import ClosedError, DaemonError, ToolMissingError
from weenv.progress import QUIET, Progress

if TYPE_CHECKING:
    from weenv.cluster.client import ClusterClient
    from weenv.cluster.view import NodeStatus

RAY_MISSING = "Ray is not installed: pip install 'weenv[cluster]'"


def _ray():
    try:
        import ray
    except ModuleNotFoundError as exc:
        if exc.name != "ray":
            raise
        raise ToolMissingError(RAY_MISSING) from None
    if not hasattr(ray, "init"):  # a directory named ray on sys.path (Ray's own /tmp/ray), not Ray
        raise ToolMissingError(f"{RAY_MISSING} ('ray' here is {list(getattr(ray, '__path__', []))})")
    return ray


def init_ray(address: str | None = None) -> None:
    """Connect this process to the Ray cluster at ``address`` (None: ``RAY_ADDRESS``
    or the local one), in weenv's namespace; nothing if it is connected already.
    Raises :class:`DaemonError` if no Ray cluster answers there."""
    import os

    from weenv.cluster.loopback import is_loopback_address, keep_on_loopback

    if is_loopback_address(address or os.environ.get("RAY_ADDRESS")):
        keep_on_loopback()  # else Ray rewrites 127.0.0.1 to the machine's interface address
    ray = _ray()
    if ray.is_initialized():
        return
    try:
        ray.init(address=address or "auto", namespace=NAMESPACE, log_to_driver=False, configure_logging=False)
    except ConnectionError as exc:
        raise DaemonError(f"no Ray cluster at {address or 'auto'}: {exc}") from exc


def placement_actor(address: str | None = None):
    """The running cluster's placement actor; :class:`ClosedError` if :func:`up` was not run."""
    ray = _ray()
    init_ray(address)
    try:
        return ray.get_actor(PLACEMENT_NAME, namespace=NAMESPACE)
    except ValueError:
        raise ClosedError("no weenv cluster runs on this Ray cluster (start it: weenv cluster up)") from None


def up(
    config: ClusterConfig | None = None,
    *,
    address: str | None = None,
    timeout: float = 120.0,
    progress: Progress = QUIET,
) -> list[NodeStatus]:
    """Start weenv on every node of the Ray cluster at ``address`` and wait until
    each alive node's daemon sends heartbeats (or its actor failed); the nodes'
    status.  Idempotent: on a cluster already up, it only waits.  The driver's
    ``WEENV_STORE`` and ``WEENV_CACHE`` are the nodes' unless ``config`` names
    them.  ``progress`` hears the task ``nodes`` (each node whose daemon
    answers).  Raises :class:`DaemonError` if a node does not come up within
    ``timeout`` seconds, or its actor failed (naming the node and why)."""
    ray = _ray()
    init_ray(address)
    from weenv.cluster.actors import PlacementActor

    config = config or ClusterConfig()
    config = config.model_copy(update={"store": config.store_url(), "cache": str(config.cache_path())})
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # on the head node: it goes with the Ray cluster itself (its GCS), not with a worker node
    head = [n["NodeID"] for n in ray.nodes() if n["Alive"] and "node:__internal_head__" in n["Resources"]]
    actor = (
        ray.remote(PlacementActor)
        .options(
            name=PLACEMENT_NAME,
            namespace=NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
            num_cpus=0,
            max_concurrency=64,
            scheduling_strategy=NodeAffinitySchedulingStrategy(head[0], soft=False) if head else None,
        )
        .remote(config)
    )
    nodes = wait_ready(actor, timeout=timeout, progress=progress)
    if config.gateway:
        _start_gateway(config, head[0] if head else None, timeout=timeout)
    return nodes


def _start_gateway(config: ClusterConfig, head: str | None, *, timeout: float) -> None:
    """The gateway actor (:mod:`weenv.cluster.front`) on the head node, waited for."""
    ray = _ray()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from weenv.cluster.front import GATEWAY_NAME, GatewayActor

    actor = (
        ray.remote(GatewayActor)
        .options(
            name=GATEWAY_NAME,
            namespace=NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
            num_cpus=0,
            max_concurrency=4,
            scheduling_strategy=NodeAffinitySchedulingStrategy(head, soft=False) if head else None,
        )
        .remote(config)
    )
    try:
        ray.get(actor.info.remote(), timeout=timeout)
    except Exception as exc:
        ray.kill(actor, no_restart=True)
        raise DaemonError(f"the cluster's gateway did not start: {exc}") from exc


def gateway(*, address: str | None = None):
    """The cluster's one address (:class:`~weenv.cluster.address.GatewayInfo`: URL
    and API key).  Raises :class:`ClosedError` if no cluster is up or it has no gateway."""
    ray = _ray()
    placement_actor(address)
    from weenv.cluster.front import GATEWAY_NAME

    try:
        actor = ray.get_actor(GATEWAY_NAME, namespace=NAMESPACE)
    except ValueError:
        raise ClosedError("the weenv cluster runs no gateway (it was brought up with gateway=False)") from None
    return ray.get(actor.info.remote(), timeout=60)


def wait_ready(actor, *, timeout: float = 120.0, progress: Progress = QUIET) -> list[NodeStatus]:
    """Wait until every node Ray reports alive is ``alive`` or ``failed`` in the
    placement actor's view; its status.  ``progress`` hears the task
    ``nodes``.  Raises :class:`DaemonError` on a failed node or after
    ``timeout`` seconds."""
    ray = _ray()
    deadline = time.monotonic() + timeout
    told: set[str] = set()  # the nodes progress has heard of
    progress.start("nodes", total=len([n for n in ray.nodes() if n["Alive"]]), status="starting weenv")
    while True:
        ray.get(actor.reconcile.remote())
        alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        status = {s.node_id: s for s in ray.get(actor.status.remote())}
        for n in sorted(alive - told):
            if n in status and status[n].state == "alive":
                told.add(n)
                progress.advance("nodes", status=f"node {n[:12]} up")
        failed = [s for s in status.values() if s.state == "failed"]
        if failed:
            progress.finish("nodes", status="failed", failed=True)
            raise DaemonError("weenv did not start on " + "; ".join(f"node {s.node_id}: {s.reason}" for s in failed))
        if all(status.get(n) is not None and status[n].state == "alive" for n in alive):
            progress.finish("nodes", status=f"{len(alive)} nodes up")
            return list(status.values())
        if time.monotonic() > deadline:
            progress.finish("nodes", status="timed out", failed=True)
            waiting = sorted(n for n in alive if n not in status or status[n].state != "alive")
            raise DaemonError(f"weenv did not come up within {timeout:.0f} s on nodes {', '.join(waiting)}")
        time.sleep(0.2)


def status(*, address: str | None = None) -> list[NodeStatus]:
    """Every node of the running cluster as the placement actor sees it."""
    return _ray().get(placement_actor(address).status.remote())


def down(*, address: str | None = None) -> bool:
    """Stop every node's daemon (its environments destroyed, its mounts gone) and
    every weenv actor; whether a cluster was up.  Raises :class:`DaemonError`
    naming the nodes whose daemon could not be stopped (gone nodes among them)
    after the actors are gone."""
    ray = _ray()
    try:
        actor = placement_actor(address)
    except ClosedError:
        return False
    _stop_gateway()
    failures = ray.get(actor.shutdown.remote())
    ray.kill(actor, no_restart=True)
    if failures:
        raise DaemonError("weenv cluster down, but these nodes' daemons were not stopped: " + "; ".join(failures))
    return True


def _stop_gateway() -> None:
    ray = _ray()
    from weenv.cluster.front import GATEWAY_NAME

    try:
        actor = ray.get_actor(GATEWAY_NAME, namespace=NAMESPACE)
    except ValueError:
        return
    try:
        ray.get(actor.stop.remote(), timeout=30)
    finally:
        ray.kill(actor, no_restart=True)


def connect_cluster(address: str | None = None) -> ClusterClient:
    """A :class:`~weenv.cluster.client.ClusterClient` on the running cluster."""
    from weenv.cluster.client import ClusterClient

    return ClusterClient(address=address)


__all__ = ["ClusterConfig", "up", "down", "status", "gateway", "connect_cluster", "init_ray", "placement_actor"]
