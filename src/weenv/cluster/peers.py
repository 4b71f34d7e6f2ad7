"""Peer chunk sharing, the cluster's side (the node's side: :mod:`weenv.node.data.peers`).

The placement actor makes the cluster's peer token (random, per cluster: it
opens only the peers' chunk route) and answers each heartbeat with the
sender's peer table (:meth:`weenv.cluster.view.ClusterView.peers`: every other
alive node, its daemon's URL and the groups it holds or was placed lately).
The node actor hands the table to its daemon (``PUT /v1/peers`` on the Unix
socket) after every heartbeat, and the settings (:func:`peer_settings`: the
token, the timeout, the serving bounds of :class:`ClusterConfig`) once.
"""

from __future__ import annotations

import httpx

from weenv.cluster.config import ClusterConfig
from weenv.config import Paths
from weenv.errors import DaemonError
from weenv.node.data.peers import PeerInfo, PeerSettings, PeerUpdate


def peer_settings(config: ClusterConfig, token: str) -> PeerSettings:
    return PeerSettings(
        token=token,
        timeout_s=config.peer_timeout_s,
        tries=config.peer_tries,
        serve_concurrency=config.peer_serve_concurrency,
        serve_bytes_per_s=config.peer_serve_bytes_per_s,
        pass_over_s=config.peer_pass_over_s,
    )


class PeerPush:
    """Hands peer updates to the daemon of ``paths`` over its Unix socket."""

    def __init__(self, paths: Paths):
        self._http = httpx.Client(
            transport=httpx.HTTPTransport(uds=str(paths.socket)), base_url="http://weenv", timeout=10
        )
        self._settings_sent = False

    def push(self, peers: list[PeerInfo], settings: PeerSettings | None) -> None:
        """Send ``peers`` (and ``settings`` the first time).  Raises :class:`DaemonError`."""
        update = PeerUpdate(peers=peers, settings=None if self._settings_sent else settings)
        try:
            r = self._http.put(
                "/v1/peers", content=update.model_dump_json(), headers={"content-type": "application/json"}
            )
        except httpx.HTTPError as exc:
            raise DaemonError(f"the node's daemon did not take its peer table: {exc}") from exc
        if r.status_code != 204:
            raise DaemonError(f"the node's daemon refused its peer table: HTTP {r.status_code} {r.text[:300]}")
        if settings is not None:
            self._settings_sent = True

    def close(self) -> None:
        self._http.close()
