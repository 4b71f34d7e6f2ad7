"""The cluster's Ray actors, a thin layer over :mod:`weenv.cluster.node` and
:mod:`weenv.cluster.view`.

- **The placement actor** (``weenv-placement`` in Ray namespace ``weenv``,
  detached: it outlives the driver that made it): holds a
  :class:`~weenv.cluster.view.ClusterView`; a thread of its own reconciles it
  with Ray every ``reconcile_s``: a node actor for every alive Ray node that has
  none (nodes joining later get theirs there), ``gone`` for a node Ray reports
  dead or that fell silent (its environments are lost).
- **A node actor per node** (``weenv-node-<node id>``, detached, pinned with
  ``NodeAffinitySchedulingStrategy(soft=False)``, no CPU of the node's): owns
  the node's daemon through a :class:`~weenv.cluster.node.NodeAgent` and sends
  a heartbeat (a :class:`~weenv.cluster.node.NodeReport`) to the placement
  actor every ``heartbeat_s``.

Neither takes a CPU from Ray (``num_cpus=0``): the environments' CPUs are the
daemons' business, not Ray's.
"""

from __future__ import annotations

import logging
import secrets
import threading
import traceback

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from weenv.cluster.config import NAMESPACE, ClusterConfig
from weenv.cluster.node import NodeAgent
from weenv.cluster.peers import PeerPush, peer_settings
from weenv.cluster.placement import Policy
from weenv.cluster.view import ClusterView, NodeStatus, Placed, Route
from weenv.config import Paths
from weenv.errors import WeenvError

log = logging.getLogger(__name__)


def node_actor_name(node_id: str) -> str:
    return f"weenv-node-{node_id}"


class NodeActor:
    """The weenv of one node (see the module docstring)."""

    def __init__(self, config: ClusterConfig, placement_actor):
        self.node_id = ray.get_runtime_context().get_node_id()
        paths = Paths(home=config.home_of(self.node_id), cache=config.cache_path(), store_url=config.store_url())
        self.agent = NodeAgent(
            self.node_id,
            paths,
            host=ray.util.get_node_ip_address(),
            cache_scan_s=config.cache_scan_s,
            settings=config.node_settings(),
        )
        self.placement, self.interval = placement_actor, config.heartbeat_s
        self.peer_push = PeerPush(paths) if config.peers else None
        self._stop = threading.Event()
        self.beat()
        threading.Thread(target=self._beat_forever, name="weenv-heartbeat", daemon=True).start()

    def beat(self) -> None:
        """Send one heartbeat now (the placement actor has it when this returns),
        and hand its answer, this node's peer table, to the daemon."""
        answer = ray.get(self.placement.heartbeat.remote(self.agent.report()))
        if self.peer_push is not None and answer is not None:
            peers, settings = answer
            self.peer_push.push(peers, settings)

    def _beat_forever(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.beat()
            except Exception as exc:  # the daemon or the placement actor did not answer: skip this beat
                log.warning("node %s: heartbeat failed: %s", self.node_id, exc)

    def info(self) -> dict:
        return {"node_id": self.node_id, "home": str(self.agent.paths.home), "api_url": self.agent.api_url}

    def stop(self) -> None:
        """Stop heartbeats and the daemon (every environment destroyed, every mount gone)."""
        self._stop.set()
        if self.peer_push is not None:
            self.peer_push.close()
        self.agent.stop()


class PlacementActor:
    """The cluster's view and its reconciliation with Ray (see the module docstring)."""

    def __init__(self, config: ClusterConfig):
        self.config = config
        self.view = ClusterView(
            policy=Policy(k=config.sample_k),
            max_environments=config.max_environments,
            heartbeat_timeout_s=config.heartbeat_timeout_s,
            expect_s=config.placed_expect_s,
        )
        self._actors: dict[str, tuple[object, object]] = {}  # node id -> (actor handle, its ready ref)
        self._self = ray.get_runtime_context().current_actor
        self._peer_settings = peer_settings(config, secrets.token_hex(20)) if config.peers else None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        threading.Thread(target=self._reconcile_forever, name="weenv-reconcile", daemon=True).start()

    # --- called by node actors and clients -------------------------------------------------
    def heartbeat(self, report):
        """Take ``report``; answer the node's peer table and the peer settings (None without peers)."""
        self.view.heartbeat(report)
        if self._peer_settings is None:
            return None
        return self.view.peers(report.node_id), self._peer_settings

    def peer_settings(self):
        """The cluster's :class:`~weenv.node.data.peers.PeerSettings` (None without peer sharing)."""
        return self._peer_settings

    def peers(self, node_id: str) -> list:
        """``node_id``'s peer table as its next heartbeat gets it."""
        return self.view.peers(node_id)

    def place(
        self,
        template: str,
        cpus: float | None = None,
        memory_bytes: int | None = None,
        node: str | None = None,
        near: str | None = None,
    ) -> Placed:
        return self.view.place(template, cpus=cpus, memory_bytes=memory_bytes, node=node, near=near)

    def done(self, token: int, node_id: str, env_id: str | None) -> None:
        self.view.done(token, node_id, env_id)

    def route(self, env_id: str) -> Route:
        return self.view.route(env_id)

    def routes(self) -> list[Route]:
        return self.view.routes()

    def room(self, items: list[tuple[str, float | None, int | None]]) -> int:
        return self.view.room(items)

    def forget(self, env_id: str) -> None:
        self.view.forget(env_id)

    def environments(self) -> dict[str, str]:
        return self.view.environments()

    def lost(self) -> dict[str, str]:
        return self.view.lost()

    def status(self) -> list[NodeStatus]:
        return self.view.status()

    def reconcile(self) -> None:
        """One pass: node actors for new nodes, gone for dead or silent ones, failures recorded."""
        with self._lock:
            alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
            for node_id in alive - set(self._actors):
                self.view.starting(node_id)
                actor = (
                    ray.remote(NodeActor)
                    .options(
                        name=node_actor_name(node_id),
                        namespace=NAMESPACE,
                        lifetime="detached",
                        num_cpus=0,
                        max_concurrency=8,
                        get_if_exists=True,
                        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
                    )
                    .remote(self.config, self._self)
                )
                self._actors[node_id] = (actor, actor.info.remote())
            for node_id in set(self._actors) - alive:
                if self.view.gone(node_id, "ray reports the node dead"):
                    log.warning("node %s is gone; its environments are lost", node_id)
            for node_id, (actor, ready) in list(self._actors.items()):
                if ready is None or node_id not in alive:
                    continue
                done, _ = ray.wait([ready], timeout=0)
                if done:
                    try:
                        ray.get(ready)
                        self._actors[node_id] = (actor, None)
                    except Exception as exc:
                        self.view.failed(node_id, _reason(exc))
                        self._actors[node_id] = (actor, None)
            self.view.expire()

    def _reconcile_forever(self) -> None:
        while not self._stop.is_set():
            try:
                self.reconcile()
            except Exception:
                log.exception("reconcile failed")
            self._stop.wait(self.config.reconcile_s)

    def shutdown(self) -> list[str]:
        """Stop every node actor's daemon and kill the node actors; returns the node
        ids whose daemon could not be stopped (with why).  The caller kills this actor."""
        self._stop.set()
        with self._lock:
            refs = {node_id: actor.stop.remote() for node_id, (actor, _) in self._actors.items()}
            failures = []
            for node_id, ref in refs.items():
                try:
                    ray.get(ref, timeout=180)
                except Exception as exc:
                    failures.append(f"{node_id}: {_reason(exc)}")
            for actor, _ in self._actors.values():
                ray.kill(actor, no_restart=True)
            self._actors.clear()
            return failures


def _reason(exc: BaseException) -> str:
    cause = getattr(exc, "cause", None)
    if isinstance(cause, WeenvError):
        return f"{type(cause).__name__}: {cause}"
    text = str(exc).strip().splitlines()
    return text[-1] if text else "".join(traceback.format_exception_only(exc)).strip()
