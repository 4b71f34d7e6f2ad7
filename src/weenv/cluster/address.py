"""The cluster's one address as a client holds it (no Ray needed):
:func:`connect` checks that a URL is a weenv cluster's gateway and gives a
:class:`GatewayInfo`, whose calls are :class:`weenv.Sandbox`'s against it::

    import weenv
    cluster = weenv.connect_cluster("http://HEAD:8790", api_key=KEY)  # or () on a Ray node
    sb = cluster.create("task")                  # weenv.Sandbox, placed by the cluster
    sb.info.metadata["weenv.node"]               # the Ray node id it runs on
    many = cluster.create_many(["t1", "t2"], count=64)
    os.environ.update(cluster.environ())         # the e2b SDK, unchanged, on the cluster
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from weenv.config import settings
from weenv.errors import AuthenticationError, DaemonError, InvalidInputError


@dataclass(frozen=True)
class GatewayInfo:
    """Where the cluster answers: ``url`` (weenv's API at ``url/v1``, E2B's at
    ``url/e2b``, envd at ``url/e2b/envd``) and the ``api_key`` clients send."""

    url: str
    api_key: str

    def environ(self) -> dict[str, str]:
        """The variables pointing weenv's SDK and the ``e2b`` SDK at the cluster."""
        return {
            "WEENV_API_URL": self.url,
            "WEENV_API_KEY": self.api_key,
            "E2B_API_URL": self.url + "/e2b",
            "E2B_SANDBOX_URL": self.url + "/e2b/envd",
            "E2B_API_KEY": "e2b_" + self.api_key,
        }

    def _where(self, kwargs: dict) -> dict:
        return {"api_url": self.url, "api_key": self.api_key, **kwargs}

    def create(self, template: str, **kwargs: Any):
        """:meth:`weenv.Sandbox.create` on the cluster (hints: ``metadata={"weenv.node": ID}``)."""
        from weenv.sdk import Sandbox

        return Sandbox.create(template, **self._where(kwargs))

    def create_many(self, templates, **kwargs: Any):
        """:meth:`weenv.Sandbox.create_many` on the cluster: one batch across its nodes."""
        from weenv.sdk import Sandbox

        return Sandbox.create_many(templates, **self._where(kwargs))

    def connect(self, sandbox_id: str, **kwargs: Any):
        from weenv.sdk import Sandbox

        return Sandbox.connect(sandbox_id, **self._where(kwargs))

    def list(self):
        """Every environment of every node."""
        from weenv.sdk import Sandbox

        return Sandbox.list(api_url=self.url, api_key=self.api_key)

    def client(self):
        """A :class:`weenv.sdk.NodeClient` on the cluster (environments by id)."""
        from weenv.sdk import NodeClient

        return NodeClient(api_url=self.url, api_key=self.api_key)


def connect(url: str, api_key: str, *, timeout: float = 10.0) -> GatewayInfo:
    """The cluster whose gateway is at ``url``, checked: it must answer weenv's
    ``/v1/health`` as a cluster does and take ``api_key``.  Raises
    :class:`InvalidInputError` for a URL that is not a cluster's (not http(s),
    not weenv, or one node's daemon), :class:`DaemonError` when nothing answers
    there, :class:`AuthenticationError` for a key it refuses."""
    import httpx

    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise InvalidInputError(f"the cluster URL {url!r} is not an http(s) URL")
    url = url.rstrip("/")
    try:
        answer = httpx.get(url + "/v1/health", headers={"x-api-key": api_key}, timeout=timeout, trust_env=False)
    except httpx.HTTPError as exc:
        raise DaemonError(f"nothing answers at the cluster URL {url}: {type(exc).__name__}: {exc}") from exc
    try:
        doc = answer.json()
    except ValueError:
        doc = None
    if answer.status_code != 200 or not isinstance(doc, dict) or doc.get("status") != "ok":
        raise InvalidInputError(
            f"{url} is not a weenv cluster's address: GET /v1/health answered {answer.status_code}, not weenv's health"
        )
    if doc.get("cluster") is not True:
        raise InvalidInputError(
            f"{url} is not a weenv cluster's address but a single weenv node's daemon: use the "
            f"gateway's URL (weenv cluster status prints it)"
        )
    if "nodes" not in doc:
        raise AuthenticationError(f"the cluster at {url} refuses this API key (weenv cluster status prints its key)")
    return GatewayInfo(url, api_key)


def connect_cluster(url: str | None = None, *, api_key: str | None = None, address: str | None = None) -> GatewayInfo:
    """The cluster at gateway ``url`` (None: ``WEENV_CLUSTER_URL``, else the
    gateway of the Ray cluster at ``address`` this process can reach), with
    ``api_key`` (None: ``WEENV_CLUSTER_KEY``, else the gateway's own, asked of
    Ray).  Raises as :func:`connect`."""
    client = settings().client
    url = url or client.cluster_url
    api_key = api_key or client.cluster_key
    if url is None or api_key is None:
        from weenv import cluster

        found = cluster.gateway(address=address)
        url, api_key = url or found.url, api_key or found.api_key
    return connect(url, api_key)
