"""A client of the node daemon over its Unix socket (httpx).

Its methods mirror :class:`weenv.node.node.Node`'s, one request each, and take
and return the same models.  Error responses become the same exceptions the
node raised (by their ``kind``).
"""

from __future__ import annotations

import httpx

from weenv.config import Paths
from weenv.errors import ERROR_KINDS, DaemonError, WeenvError
from weenv.node.models import (
    CreateRequest,
    EnvironmentInfo,
    ExecRequest,
    ExecResult,
    NodeStats,
)
from weenv.packaging.manifest import Resources
from weenv.server import daemon

_JSON = {"content-type": "application/json"}


class NodeClient:
    """Talks to the daemon of ``paths.home``; ``autostart`` starts one if none answers.

    Raises :class:`DaemonError` when the daemon cannot be reached or started.
    """

    def __init__(self, paths: Paths | None = None, *, autostart: bool = True, timeout: float = 900.0):
        self.paths = paths or Paths.from_env()
        if not daemon.is_running(self.paths):
            if not autostart:
                raise DaemonError(f"no weenv daemon serves {self.paths.home} (start one: weenv serve)")
            daemon.start_background(self.paths)
        self._http = httpx.Client(
            transport=httpx.HTTPTransport(uds=str(self.paths.socket)),
            base_url="http://weenv",
            timeout=httpx.Timeout(timeout, connect=10.0),
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "NodeClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _request(self, method: str, url: str, **kw) -> httpx.Response:
        try:
            r = self._http.request(method, url, **kw)
        except httpx.HTTPError as exc:
            raise DaemonError(f"weenv daemon at {self.paths.socket}: {exc}") from exc
        if r.status_code >= 400:
            try:
                err = r.json()["error"]
                cls = ERROR_KINDS.get(err["kind"], WeenvError)
                raise cls(err["message"])
            except (ValueError, KeyError, TypeError):
                raise DaemonError(f"weenv daemon answered {r.status_code}: {r.text[:500]}") from None
        return r

    def create(self, template: str, *, resources: Resources | None = None, first_command: bool = True) -> EnvironmentInfo:
        req = CreateRequest(template=template, resources=resources, first_command=first_command)
        r = self._request("POST", "/environments", content=req.model_dump_json(), headers=_JSON)
        return EnvironmentInfo.model_validate_json(r.content)

    def list(self) -> list[EnvironmentInfo]:
        return [EnvironmentInfo.model_validate(e) for e in self._request("GET", "/environments").json()]

    def get(self, env_id: str) -> EnvironmentInfo:
        return EnvironmentInfo.model_validate_json(self._request("GET", f"/environments/{env_id}").content)

    def destroy(self, env_id: str) -> None:
        self._request("DELETE", f"/environments/{env_id}")

    def exec(self, env_id: str, command: list[str] | str, *, env: dict[str, str] | None = None,
             cwd: str | None = None, timeout: float | None = None, stdin: bytes | None = None) -> ExecResult:
        req = ExecRequest(command=command, env=env or {}, cwd=cwd, timeout=timeout, stdin=stdin)
        r = self._request("POST", f"/environments/{env_id}/commands", content=req.model_dump_json(), headers=_JSON)
        return ExecResult.model_validate_json(r.content)

    def read_file(self, env_id: str, path: str) -> bytes:
        return self._request("GET", f"/environments/{env_id}/files", params={"path": path}).content

    def write_file(self, env_id: str, path: str, data: bytes) -> None:
        self._request("PUT", f"/environments/{env_id}/files", params={"path": path}, content=data)

    def stats(self) -> NodeStats:
        return NodeStats.model_validate_json(self._request("GET", "/stats").content)

    def drop_cache(self) -> None:
        self._request("POST", "/cache/drop")
