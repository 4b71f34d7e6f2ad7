"""One cluster node's weenv: its daemon, and what it reports (no Ray here; the
node actor of :mod:`weenv.cluster.actors` wraps a :class:`NodeAgent`).

A :class:`NodeAgent` owns the daemon of one home: it adopts the daemon that
already serves the home (its environments live on), else starts one serving
TCP on the node's address (:func:`weenv.server.daemon.start_background`, port
0), and reads the daemon's URL and API key from the home.  :meth:`report` is
one heartbeat's content, a :class:`NodeReport`: the daemon's capacity,
reservations and usage, its environments, and what its chunk cache holds per
group (read from the home: the group manifests the node keeps in
``node/known`` and the chunk files of ``node/cache``), with the templates the
node knows (name or digest -> groups and default resources).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from weenv.config import Paths
from weenv.errors import DaemonError, WeenvError
from weenv.formats.manifest import GroupManifest, manifest_kind, parse_group_manifest, parse_template_manifest
from weenv.sdk import NodeClient
from weenv.server import daemon

log = logging.getLogger(__name__)


@dataclass
class TemplateFacts:
    """What a node knows of a template: its group digests (bottom first) and default resources."""

    groups: list[str]
    cpus: float
    memory_bytes: int


@dataclass
class NodeReport:
    """One heartbeat of one node.  CPU in cores, memory in bytes, times Unix seconds."""

    node_id: str
    home: str
    api_url: str
    api_key: str
    at: float
    cpu_capacity: float
    memory_capacity: int
    cpu_reserved: float
    memory_reserved: int
    cpu_used: float
    memory_used: int
    environments: list[str]
    group_bytes: dict[str, int] = field(default_factory=dict)
    """Group digest -> plaintext bytes of its chunks in the node's cache."""
    group_sizes: dict[str, int] = field(default_factory=dict)
    """Group digest -> plaintext bytes of all its chunks."""
    templates: dict[str, TemplateFacts] = field(default_factory=dict)
    """Template name and digest -> what the node knows of it."""
    reservations: dict[str, tuple[float, int]] = field(default_factory=dict)
    """Environment id -> (cores, memory bytes) it holds of ``cpu_reserved`` and
    ``memory_reserved`` (its part of those sums, from the same reading)."""


class NodeAgent:
    """The daemon of ``paths.home`` on node ``node_id``, serving TCP on ``host``;
    its chunk cache scanned at most every ``cache_scan_s`` seconds (a heartbeat
    in between repeats the last scan).

    Raises :class:`DaemonError` if the daemon cannot be started, or one already
    serves the home without TCP (it cannot be reached from other nodes)."""

    def __init__(
        self,
        node_id: str,
        paths: Paths,
        *,
        host: str,
        cache_scan_s: float = 5.0,
        settings: dict[str, str] | None = None,
    ):
        self.node_id, self.paths, self.host, self.cache_scan_s = node_id, paths, host, cache_scan_s
        paths.home.mkdir(parents=True, exist_ok=True)
        if daemon.is_running(paths):
            log.info("node %s: adopting the daemon serving %s", node_id, paths.home)
        else:
            daemon.start_background(paths, host=host, port=0, settings=settings)
        try:
            self.api_url = paths.api_url.read_text().strip()
        except FileNotFoundError:
            raise DaemonError(
                f"the weenv daemon of {paths.home} serves no TCP port, so other nodes cannot reach "
                f"it: stop it (WEENV_HOME={paths.home} weenv stop) and bring the cluster up again"
            ) from None
        self.api_key = paths.api_key.read_text().strip()
        self.client = NodeClient(socket=paths.socket, request_timeout=30)
        self._groups: dict[str, GroupManifest] = {}
        self._scan: tuple[float, dict[str, int], dict[str, int], dict[str, TemplateFacts]] | None = None

    def report(self) -> NodeReport:
        """This moment's :class:`NodeReport`.  Raises :class:`DaemonError` if the daemon does not answer."""
        provision = self.client.provision_stats()
        totals = provision.totals
        envs = [e.id for e in self.client.list()]
        if self._scan is None or time.monotonic() - self._scan[0] >= self.cache_scan_s:
            self._scan = (time.monotonic(), *self._cache_contents())
        _, held, sizes, templates = self._scan
        return NodeReport(
            node_id=self.node_id,
            home=str(self.paths.home),
            api_url=self.api_url,
            api_key=self.api_key,
            at=time.time(),
            cpu_capacity=totals.cpu_capacity,
            memory_capacity=totals.memory_capacity,
            cpu_reserved=totals.cpu_reservation_sum,
            memory_reserved=totals.memory_limit_sum,
            cpu_used=totals.cpu_used,
            memory_used=totals.working_set,
            environments=envs,
            group_bytes=held,
            group_sizes=sizes,
            templates=templates,
            reservations={e.id: (e.cpu_reservation or 0.0, e.memory_limit or 0) for e in provision.environments},
        )

    def _cache_contents(self) -> tuple[dict[str, int], dict[str, int], dict[str, TemplateFacts]]:
        """``(held, sizes, templates)`` from the home: bytes held and total per group the
        node knows, and its templates by name and digest."""
        known = self.paths.node / "known"
        templates: dict[str, TemplateFacts] = {}
        for path in sorted((known / "manifests" / "sha256").glob("*")):
            digest = "sha256:" + path.name
            if digest in self._groups:
                continue
            try:
                data = path.read_bytes()
                if manifest_kind(data) == "group":
                    self._groups[digest] = parse_group_manifest(data)
                else:
                    t = parse_template_manifest(data)
                    templates[digest] = TemplateFacts(
                        list(t.groups), t.runtime.resources.cpus, t.runtime.resources.memory_bytes
                    )
            except (OSError, WeenvError) as exc:  # being written, or evicted meanwhile
                log.debug("skipping manifest %s: %s", path, exc)
        try:
            names = json.loads((known / "names.json").read_text()).get("names", {})
        except (OSError, ValueError):
            names = {}
        for name, entry in names.items():
            facts = templates.get(entry.get("digest", "")) if isinstance(entry, dict) else None
            if facts is not None:
                templates[name] = facts
        held, sizes = {}, {}
        for digest, group in self._groups.items():
            sizes[digest] = sum(c.size for c in group.chunks)
            held[digest] = sum(c.size for c in group.chunks if _chunk_path(self.paths, c.digest).exists())
        return held, sizes, templates

    def stop(self) -> None:
        """Stop the daemon: every environment destroyed, every mount gone (:func:`weenv.server.daemon.stop`)."""
        self.client.close()
        daemon.stop(self.paths)


def _chunk_path(paths: Paths, digest: str) -> Path:
    hex_ = digest.split(":", 1)[1]
    return paths.chunk_cache / "sha256" / hex_[:2] / hex_
