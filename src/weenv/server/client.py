"""A client of the node daemon over its Unix socket (httpx), for the CLI.

Its methods mirror :class:`weenv.node.node.Node`'s, one request each, and take
and return the same models.  Error responses become the same exceptions the
node raised (by their ``kind``, mapped by :func:`weenv.sdk._core.error_for_reply`,
the SDK's one boundary).  Programs should use the SDK (:class:`weenv.Sandbox`).
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
from pydantic import BaseModel, ValidationError

from weenv.config import Paths
from weenv.errors import DaemonError, InvalidInputError
from weenv.node.models import (
    BatchCreateEvent,
    BatchCreateRequest,
    CreateRequest,
    EnvironmentInfo,
    ExecRequest,
    ExecResult,
    ForkRequest,
    ForkResponse,
    NodeStats,
    ResetRequest,
    ResumeRequest,
    SnapshotInfo,
    SnapshotRequest,
)
from weenv.node.provision import ProvisionStats
from weenv.packaging.manifest import Resources
from weenv.sdk._core import env_path, path_query
from weenv.server import daemon

_JSON = {"content-type": "application/json"}


def _build(model: type[BaseModel], **fields) -> BaseModel:
    """``model(**fields)``; invalid fields raise :class:`InvalidInputError` (one line)."""
    try:
        return model(**fields)
    except ValidationError as exc:
        parts = [f"{'.'.join(str(x) for x in e.get('loc', ()))}: {e.get('msg', 'invalid')}" for e in exc.errors()[:5]]
        raise InvalidInputError("bad request: " + "; ".join(parts)) from None


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
            base_url="http://weenv/v1",
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
            from weenv.sdk._core import error_for_reply

            raise error_for_reply(r.status_code, r.content)
        return r

    def create(self, template: str, *, resources: Resources | None = None, first_command: bool = True,
               timeout: float | None = None, priority: int = 0) -> EnvironmentInfo:
        req = _build(CreateRequest, template=template, resources=resources, first_command=first_command,
                     timeout=timeout, priority=priority)
        r = self._request("POST", "/environments", content=req.model_dump_json(), headers=_JSON)
        return EnvironmentInfo.model_validate_json(r.content)

    def create_many(self, items: list[CreateRequest], *, concurrency: int | None = None) -> Iterator[BatchCreateEvent]:
        """One batch create; yields each item's event as the daemon finishes it."""
        req = _build(BatchCreateRequest, items=items, concurrency=concurrency)
        try:
            with self._http.stream("POST", "/environments/batch", content=req.model_dump_json(), headers=_JSON,
                                   timeout=httpx.Timeout(None, connect=10.0)) as r:
                if r.status_code >= 400:
                    r.read()
                    from weenv.sdk._core import error_for_reply

                    raise error_for_reply(r.status_code, r.content)
                for line in r.iter_lines():
                    if line.strip():
                        yield BatchCreateEvent.model_validate_json(line)
        except httpx.HTTPError as exc:
            raise DaemonError(f"weenv daemon at {self.paths.socket}: {exc}") from exc

    def set_timeout(self, env_id: str, timeout: float) -> EnvironmentInfo:
        r = self._request("POST", env_path(env_id) + "/timeout", content=f'{{"timeout": {timeout}}}', headers=_JSON)
        return EnvironmentInfo.model_validate_json(r.content)

    def _post(self, env_id: str, verb: str, req=None) -> bytes:
        body = req.model_dump_json() if req is not None else None
        return self._request("POST", env_path(env_id) + verb, content=body, headers=_JSON).content

    def snapshot(self, env_id: str, name: str | None = None) -> SnapshotInfo:
        return SnapshotInfo.model_validate_json(self._post(env_id, "/snapshots", _build(SnapshotRequest, name=name)))

    def fork(self, env_id: str, count: int, *, timeout: float | None = None) -> ForkResponse:
        req = _build(ForkRequest, count=count, timeout=timeout)
        return ForkResponse.model_validate_json(self._post(env_id, "/fork", req))

    def reset(self, env_id: str, snapshot: str | None = None) -> EnvironmentInfo:
        return EnvironmentInfo.model_validate_json(self._post(env_id, "/reset", _build(ResetRequest, snapshot=snapshot)))

    def pause(self, env_id: str) -> EnvironmentInfo:
        return EnvironmentInfo.model_validate_json(self._post(env_id, "/pause"))

    def resume(self, env_id: str, *, timeout: float | None = None) -> EnvironmentInfo:
        return EnvironmentInfo.model_validate_json(self._post(env_id, "/resume", _build(ResumeRequest, timeout=timeout)))

    def list(self) -> list[EnvironmentInfo]:
        return [EnvironmentInfo.model_validate(e) for e in self._request("GET", "/environments").json()]

    def get(self, env_id: str) -> EnvironmentInfo:
        return EnvironmentInfo.model_validate_json(self._request("GET", env_path(env_id)).content)

    def destroy(self, env_id: str) -> None:
        self._request("DELETE", env_path(env_id))

    def exec(self, env_id: str, command: list[str] | str, *, env: dict[str, str] | None = None,
             cwd: str | None = None, timeout: float | None = None, stdin: bytes | None = None) -> ExecResult:
        req = _build(ExecRequest, command=command, env=env or {}, cwd=cwd, timeout=timeout, stdin=stdin)
        r = self._request("POST", env_path(env_id) + "/commands", content=req.model_dump_json(), headers=_JSON)
        return ExecResult.model_validate_json(r.content)

    def read_file(self, env_id: str, path: str) -> bytes:
        return self._request("GET", env_path(env_id) + "/files?" + path_query(path)).content

    def write_file(self, env_id: str, path: str, data: bytes) -> None:
        self._request("PUT", env_path(env_id) + "/files?" + path_query(path), content=data)

    def stats(self) -> NodeStats:
        return NodeStats.model_validate_json(self._request("GET", "/stats").content)

    def provision_stats(self, env_id: str | None = None) -> ProvisionStats:
        params = {"env": env_id} if env_id else {}
        return ProvisionStats.model_validate_json(self._request("GET", "/stats/provision", params=params).content)

    def drop_cache(self) -> None:
        self._request("POST", "/cache/drop")
