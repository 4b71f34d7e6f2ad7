"""How a weenv cluster is set up (a pydantic model, passed to every actor)."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from weenv.cluster.view import EXPECT_S
from weenv.config import Paths
from weenv.node.data.peers import PASS_OVER_S

NAMESPACE = "weenv"
"""The Ray namespace of weenv's actors."""
PLACEMENT_NAME = "weenv-placement"
"""The placement actor's name in :data:`NAMESPACE`."""
GATEWAY_PORT = 8790
"""The cluster gateway's default TCP port (:mod:`weenv.cluster.front`)."""


class ClusterConfig(BaseModel):
    """One cluster's settings (the same for every node)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    home: str = "/var/lib/weenv"
    """Each node's ``WEENV_HOME``; ``{node}`` in it becomes the first 12 characters
    of the node's Ray id (several nodes on one machine need distinct homes)."""
    store: str | None = None
    """The store every node reads (``file://``, ``oci://``); None: the driver's ``WEENV_STORE``."""
    cache: str | None = None
    """Each node's ``WEENV_CACHE``; None: the driver's."""
    heartbeat_s: float = Field(default=1.0, gt=0, le=60)
    """Seconds between two heartbeats of a node."""
    heartbeat_timeout_s: float = Field(default=10.0, gt=0, le=600)
    """A node silent this long is gone (its environments lost)."""
    reconcile_s: float = Field(default=1.0, gt=0, le=60)
    """Seconds between two looks at Ray's node list."""
    max_environments: int | None = Field(default=None, ge=1)
    """Per node: at most this many environments placed (None: capacity alone bounds them)."""
    cache_scan_s: float = Field(default=5.0, gt=0, le=600)
    """Seconds between two scans of a node's chunk cache for its heartbeats."""
    sample_k: int = Field(default=3, ge=1, le=64)
    """Nodes sampled per placement."""
    gateway: bool = True
    """Serve the cluster's one address (:mod:`weenv.cluster.gateway`) on the head node."""
    gateway_host: str | None = None
    """The address the gateway listens on (None: the head node's Ray address)."""
    gateway_port: int = Field(default=GATEWAY_PORT, ge=0, le=65535)
    """Its TCP port (0: any free one)."""
    gateway_key: str | None = Field(default=None, pattern=r"^[0-9a-f]{32,128}$")
    """Its API key, hex (None: a new one each time it starts)."""
    batch_queue_s: float = Field(default=120.0, gt=0, le=3600)
    """Seconds an item of a batch waits at the gateway for a node with room (then its line is a ``capacity`` error)."""
    peers: bool = True
    """Nodes fetch chunks from each other before the store (:mod:`weenv.cluster.peers`)."""
    peer_timeout_s: float = Field(default=2.0, gt=0, le=60)
    """Seconds a peer has to serve one chunk before the next peer, then the store."""
    peer_tries: int = Field(default=2, ge=1, le=8)
    """Peers asked for one chunk before the store."""
    peer_serve_concurrency: int = Field(default=8, ge=1, le=256)
    """Per node: chunks served to peers at once (more are refused)."""
    peer_serve_bytes_per_s: int | None = Field(default=None, ge=1)
    """Per node: bytes a second served to peers (None: no bound)."""
    peer_pass_over_s: float = Field(default=PASS_OVER_S, gt=0, le=600)
    """Seconds a peer that was slow, gone or wrong is not asked again."""
    placed_expect_s: float = Field(default=EXPECT_S, gt=0, le=3600)
    """Seconds a node counts as holding a template placed there (named in the
    create hints of that template's creates placed elsewhere meanwhile)."""

    publish_paused: bool = True
    """A node releasing a paused environment's memory publishes its files to the
    store, so that another node resumes it when its own is gone or full
    (:mod:`weenv.node.state.handoff`; the nodes' ``WEENV_PAUSE_PUBLISH``)."""

    @field_validator("home")
    @classmethod
    def _absolute(cls, v: str) -> str:
        if not Path(v.replace("{node}", "x")).is_absolute():
            raise ValueError(f"home {v!r} is not an absolute path")
        return v

    def node_settings(self) -> dict[str, str]:
        """The ``WEENV_*`` settings a node's daemon is started with, from this config."""
        return {"WEENV_PAUSE_PUBLISH": "1" if self.publish_paused else "0"}

    def home_of(self, node_id: str) -> Path:
        return Path(self.home.replace("{node}", node_id[:12]))

    def store_url(self) -> str:
        return self.store or Paths.from_env().store_url

    def cache_path(self) -> Path:
        return Path(self.cache) if self.cache else Paths.from_env().cache
