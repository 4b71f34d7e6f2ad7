"""What the E2B face adds to the node's environments: a view of each as an E2B
sandbox, and the access token its in-sandbox services (envd) require.

Everything else lives in the node: a sandbox is an environment, its lifetime is
the environment's timeout (the daemon's reaper destroys it), its metadata and
default command variables are the environment's ``metadata`` and ``envs``, its
commands are the node's streamed processes.  Environments created through
weenv's own API are sandboxes too.

A sandbox's access token is ``HMAC-SHA256(secret, sandbox id)`` (32 hex
digits): nothing is stored per sandbox, a token can be checked for an id
whether or not that sandbox exists (so envd answers a wrong token the same for
a live sandbox and an unknown one, :mod:`weenv.server.e2b.envd`), and the
daemon derives ``secret`` from its API key, so tokens outlive a daemon restart
(its environments are adopted) and change when the key is rotated.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
from dataclasses import dataclass

from weenv.api.models import EnvironmentInfo
from weenv.errors import NotFoundError
from weenv.formats.manifest import RuntimeConfig
from weenv.node.node import Node
from weenv.node.runtime.users import Identity
from weenv.packaging.template import load_template

DEFAULT_TIMEOUT_S = 300
"""A sandbox's lifetime when create names none (E2B's default too), seconds."""
MAX_TIMEOUT_S = 7 * 86400
"""The longest lifetime accepted (the node's limit), seconds."""


def token_secret(e2b_key: str) -> bytes:
    """The key of a daemon's envd access tokens, from its E2B API key (the first it accepts)."""
    return hmac.new(e2b_key.encode(), b"weenv envd access token", hashlib.sha256).digest()


def access_token(secret: bytes, sandbox_id: str) -> str:
    """The envd access token of ``sandbox_id`` under ``secret`` (32 hex digits)."""
    return hmac.new(secret, sandbox_id.encode(errors="surrogateescape"), hashlib.sha256).hexdigest()[:32]


@dataclass
class Sandbox:
    """One sandbox as the E2B face sees it: the node's info, the template's
    runtime config, the envd access token and the traffic access token."""

    info: EnvironmentInfo
    runtime: RuntimeConfig
    access_token: str
    traffic_token: str = ""
    """Its traffic access token (:meth:`Sandboxes.traffic_token`)."""

    @property
    def id(self) -> str:
        return self.info.id

    def start_dir(self, who: Identity) -> str:
        """Where relative paths and commands of the user ``who`` start: the
        template's working directory if it names one (envd's default workdir),
        else the user's home (envd's)."""
        wd = self.runtime.working_dir or "/"
        return wd if wd != "/" else who.home


class Sandboxes:
    """The node's environments as E2B sandboxes.  Thread-safe; blocking calls."""

    def __init__(self, node: Node, *, token_secret: bytes | None = None):
        """``token_secret``: the key of the access tokens (default: random, so
        tokens last as long as this object)."""
        self.node = node
        self._secret = token_secret or secrets.token_bytes(32)
        self._runtimes: dict[str, RuntimeConfig] = {}
        self._lock = threading.Lock()

    def create(
        self,
        template: str,
        *,
        timeout: int,
        metadata: dict[str, str],
        envs: dict[str, str],
        undelivered: bool = False,
        network: bool | None = None,
        allow_out: list[str] | None = None,
        deny_out: list[str] | None = None,
        public_traffic: bool = True,
        on_timeout: str = "kill",
    ) -> Sandbox:
        """A new environment from ``template`` living ``timeout`` seconds
        (``undelivered``: as :meth:`Node.create`'s, until ``node.delivered``;
        ``network``, ``allow_out``, ``deny_out``, ``public_traffic``,
        ``on_timeout``: as ``CreateRequest``'s).  Raises what :meth:`Node.create` raises."""
        info = self.node.create(
            template,
            timeout=float(timeout),
            envs=envs,
            metadata=metadata,
            undelivered=undelivered,
            network=network,
            allow_out=allow_out or None,
            deny_out=deny_out or None,
            public_traffic=public_traffic,
            on_timeout=on_timeout,
        )
        return self._view(info)

    def get(self, sandbox_id: str) -> Sandbox:
        """The running sandbox ``sandbox_id``; raises :class:`NotFoundError`."""
        return self._view(self.node.get(sandbox_id))

    def find(self, sandbox_id: str) -> Sandbox | None:
        """Like :meth:`get`, None if there is no such sandbox."""
        try:
            return self.get(sandbox_id)
        except NotFoundError:
            return None

    def list(self) -> list[Sandbox]:
        return [self._view(info) for info in self.node.list()]

    def set_timeout(self, sandbox_id: str, timeout: int, *, only_extend: bool = False) -> Sandbox:
        """End ``sandbox_id`` ``timeout`` seconds from now (with ``only_extend``, only
        if that is later than its current end, as E2B's connect does)."""
        import time

        info = self.node.get(sandbox_id)
        if not only_extend or time.time() + timeout > info.expires_at:
            info = self.node.set_timeout(sandbox_id, float(timeout))
        return self._view(info)

    def metrics(self, sandbox_id: str, start: float | None = None, end: float | None = None) -> list[dict]:
        """E2B's ``SandboxMetric`` list for ``sandbox_id`` between Unix times
        ``start`` and ``end`` (seconds; default: its whole recorded history, one
        point per provisioning pass, the last 900): CPU used as a percentage of
        its cores, memory used (its cgroup's usage; ``memCache`` the part the
        kernel may reclaim) of its limit, disk written (its overlay upper dir)
        of the host file system holding it.  Raises :class:`NotFoundError`."""
        import datetime
        import math

        stats = self.node.provision_stats(sandbox_id).environments[0]
        disk_used, disk_total = self.node.disk_usage(sandbox_id)
        cores = max(1, math.ceil(stats.cpu_ceiling))
        out = []
        for h in stats.history:
            if (start is not None and h.t < start) or (end is not None and h.t > end):
                continue
            out.append(
                {
                    "timestamp": datetime.datetime.fromtimestamp(h.t, datetime.UTC).isoformat().replace("+00:00", "Z"),
                    "timestampUnix": int(h.t),
                    "cpuCount": cores,
                    "cpuUsedPct": round(
                        min(100.0, 100.0 * h.cpu_used / cores), 2
                    ),  # sampling jitter: never above its cores
                    "memUsed": h.memory_usage,
                    "memTotal": h.memory_limit or stats.memory_ceiling,
                    "memCache": max(0, h.memory_usage - h.working_set),
                    "diskUsed": disk_used,
                    "diskTotal": disk_total,
                }
            )
        return out

    def kill(self, sandbox_id: str) -> None:
        """Destroy ``sandbox_id``; raises :class:`NotFoundError` if unknown."""
        self.node.destroy(sandbox_id)

    def access_token(self, sandbox_id: str) -> str:
        """The envd access token of ``sandbox_id`` (32 hex digits), whether or not it exists."""
        return access_token(self._secret, sandbox_id)

    def token_matches(self, sandbox_id: str, presented: str | None) -> bool:
        """Whether ``presented`` is the access token of ``sandbox_id``, in constant time."""
        return hmac.compare_digest(
            (presented or "").encode(errors="surrogateescape"), self.access_token(sandbox_id).encode()
        )

    def traffic_token(self, sandbox_id: str) -> str:
        """The traffic access token of ``sandbox_id`` (32 hex digits, E2B's
        ``trafficAccessToken``): what requests to its ports must carry when it
        was created with ``allowPublicTraffic`` false (:mod:`weenv.server.e2b.ports`).
        Derived as the access token is, apart from it: one does not give the other."""
        return hmac.new(
            self._secret, b"traffic\0" + sandbox_id.encode(errors="surrogateescape"), hashlib.sha256
        ).hexdigest()[:32]

    def traffic_token_matches(self, sandbox_id: str, presented: str | None) -> bool:
        """Whether ``presented`` is the traffic access token of ``sandbox_id``, in constant time."""
        return hmac.compare_digest(
            (presented or "").encode(errors="surrogateescape"), self.traffic_token(sandbox_id).encode()
        )

    def _view(self, info: EnvironmentInfo) -> Sandbox:
        token = self.access_token(info.id)
        with self._lock:
            runtime = self._runtimes.get(info.template_digest)
        if runtime is None:
            _, manifest = load_template(self.node.store, info.template_digest)
            runtime = manifest.runtime
            with self._lock:
                self._runtimes[info.template_digest] = runtime
        return Sandbox(info=info, runtime=runtime, access_token=token, traffic_token=self.traffic_token(info.id))
