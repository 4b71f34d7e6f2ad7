"""The SDK's logic, free of I/O, shared by the sync and async faces.

Every operation is a *flow*: a generator that yields effects and receives their
outcome, in the manner of httpx's ``auth_flow``:

- :class:`Call` - an HTTP request.  The driver answers with a :class:`Reply`
  (status, headers, body), or for ``stream=True`` with the first line of the
  NDJSON answer as a dict, then one more line for each :data:`NEXT` the flow
  yields, and :data:`END` after the last.
- :class:`Invoke` - call a user callback (the async driver awaits it if it
  returns an awaitable).

A failed request is thrown into the flow as a weenv error (so a flow may catch
:class:`NotFoundError`, as ``files.exists`` does).  The drivers
(``_sync._Connection.drive``, ``_async._Connection.drive``) are the only code
that touches httpx; both map errors through :func:`error_for_reply` and
:func:`error_for_transport`, the one boundary where HTTP becomes weenv errors:

==================  ================================  =========================
server kind         HTTP status                       raised
==================  ================================  =========================
not_found           404                               NotFoundError
invalid_input       400                               InvalidInputError
authentication      401                               AuthenticationError
timeout             408                               CommandTimeoutError
output_limit        413                               OutputLimitError
too_large           413                               RequestTooLargeError
capacity            503                               CapacityError
(transport)         connection refused, reset...      DaemonError
(transport)         httpx timeout                     CommandTimeoutError
==================  ================================  =========================
"""

from __future__ import annotations

import codecs
import os
import re
import urllib.parse
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticSerializationError

from weenv.api.models import (
    BatchCreateEvent,
    BatchCreateRequest,
    CreateRequest,
    EntryInfo,
    EnvironmentInfo,
    ErrorResponse,
    ExecRequest,
    ExecResult,
    ForkRequest,
    ForkResponse,
    KillRequest,
    NodeStats,
    PauseRequest,
    ProcessEvent,
    ProcessInfo,
    ProcessStdin,
    ProfileReset,
    RenameRequest,
    ResetRequest,
    ResizeRequest,
    ResumeRequest,
    SetPriorityRequest,
    SetTimeoutRequest,
    SnapshotInfo,
    SnapshotRequest,
    TemplateInfo,
    WriteInfo,
)
from weenv.errors import (
    ERROR_KINDS,
    CommandTimeoutError,
    DaemonError,
    InvalidInputError,
    NotFoundError,
    OutputLimitError,
    WeenvError,
)
from weenv.formats.manifest import Resources
from weenv.formats.tax import TaxReport
from weenv.node.provision.models import ProvisionStats

T = TypeVar("T")
API_PREFIX = "/v1"
DEFAULT_REQUEST_TIMEOUT = 600.0
MAX_OUTPUT = 64 << 20
"""Bytes of a command's output (stdout and stderr together) the SDK keeps for
its result, as the daemon's captured commands (``POST .../commands``) do."""


# --- effects ---------------------------------------------------------------------------
@dataclass
class Call:
    method: str
    path: str
    params: dict[str, Any] | None = None
    json: BaseModel | None = None
    content: Any = None
    """Raw body: bytes, or a file object / iterable of bytes the driver streams."""
    stream: bool = False
    """The answer is NDJSON, handed to the flow line by line."""
    timeout: float | None | Literal["default"] = "default"
    """Seconds to wait for the answer (None: no limit; a stream's lines may be far apart)."""


@dataclass
class Invoke:
    fn: Callable[..., Any]
    args: tuple = ()


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    content: bytes


class _Marker:
    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


NEXT = _Marker("NEXT")
"""Yielded by a flow reading a stream: send me its next line."""
END = _Marker("END")
"""Sent to a flow reading a stream: there are no more lines."""

Flow = Generator[Any, Any, T]


# --- connection settings ---------------------------------------------------------------
@dataclass(frozen=True)
class ConnectionConfig:
    """Where the daemon is: ``api_url`` (TCP, with ``api_key``) or the Unix ``socket``."""

    api_url: str | None = None
    api_key: str | None = None
    socket: str | None = None
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT

    @classmethod
    def resolve(
        cls,
        api_url: str | None = None,
        api_key: str | None = None,
        request_timeout: float | None = None,
        socket: str | os.PathLike | None = None,
    ) -> ConnectionConfig:
        """Arguments first, then ``WEENV_API_URL`` and ``WEENV_API_KEY``; with no
        URL, the local daemon's Unix socket (``$WEENV_HOME/run/weenv.sock``).
        ``socket``: that Unix socket (a given home's daemon), whatever the
        environment names; it needs no key."""
        from weenv.config import Paths, settings

        timeout = DEFAULT_REQUEST_TIMEOUT if request_timeout is None else request_timeout
        if socket is not None:
            return cls(socket=str(socket), api_key=api_key, request_timeout=timeout)
        client = settings().client
        api_url = api_url or client.api_url
        api_key = api_key or client.api_key
        if api_url:
            if not api_url.startswith(("http://", "https://")):
                raise InvalidInputError(f"WEENV_API_URL {api_url!r} is not an http(s) URL")
            return cls(api_url=api_url.rstrip("/"), api_key=api_key, request_timeout=timeout)
        return cls(socket=str(Paths.from_env().socket), api_key=api_key, request_timeout=timeout)

    @property
    def base_url(self) -> str:
        return (self.api_url or "http://weenv") + API_PREFIX

    @property
    def headers(self) -> dict[str, str]:
        return {"x-api-key": self.api_key} if self.api_key else {}

    @property
    def where(self) -> str:
        return self.api_url or f"unix:{self.socket}"


# --- the error boundary ----------------------------------------------------------------
def error_for_reply(status: int, content: bytes) -> WeenvError:
    """The weenv error for an error answer (``{"error": {"kind", "message"}}``);
    an answer of another shape (a proxy's, a route outside the API) becomes
    one line naming its status and its message or first line of text."""
    try:
        err = parse(ErrorResponse, content).error
    except (ValidationError, ValueError):
        return DaemonError(f"the weenv daemon answered {status}: {_one_line(content)}")
    return error_for_kind(err.kind, err.message)


def _one_line(content: bytes) -> str:
    import json

    text = content[:2000].decode(errors="replace")
    try:
        doc = json.loads(content)
    except ValueError:
        doc = None
    if isinstance(doc, dict):
        for key in ("message", "detail", "error"):
            if isinstance(doc.get(key), str):
                text = doc[key]
                break
    line = " ".join(text.split())
    return (line[:300] + "...") if len(line) > 300 else (line or "(no body)")


def parse(model: type[T], content: bytes | str) -> T:
    """``model`` from a JSON answer, read by Python's ``json`` (which keeps the
    ``\\udcXX`` escapes of names that are not UTF-8; pydantic's parser refuses them)."""
    import json

    return model.model_validate(json.loads(content))  # type: ignore[attr-defined]


def json_body(model: BaseModel) -> bytes:
    """``model`` as a JSON request body; a string holding surrogate escapes (a
    path that is not UTF-8) is sent as ``\\udcXX`` escapes."""
    try:
        return model.model_dump_json().encode()
    except PydanticSerializationError:
        import json

        return json.dumps(model.model_dump(mode="json"), ensure_ascii=True).encode()


def path_query(path: str) -> str:
    """``path=P`` for a URL: ``path``'s bytes (UTF-8, surrogate escapes as the
    bytes they stand for) percent-encoded, so any file name round-trips."""
    import urllib.parse

    if not isinstance(path, str):
        raise InvalidInputError(f"bad path {path!r}")
    return "path=" + urllib.parse.quote(path.encode("utf-8", "surrogateescape"), safe="/")


def error_for_kind(kind: str, message: str) -> WeenvError:
    return ERROR_KINDS.get(kind, WeenvError)(message)


def error_for_transport(exc: Exception, where: str) -> WeenvError:
    """A transport failure (an ``httpx.TransportError``) as a weenv error."""
    name = type(exc).__name__
    if "Timeout" in name:
        return CommandTimeoutError(f"no answer from the weenv daemon at {where} in time ({name})")
    return DaemonError(f"weenv daemon at {where}: {name}: {exc}")


def parse_line(line: str) -> dict | None:
    """One NDJSON line as a dict (None for a blank line)."""
    import json

    line = line.strip()
    if not line:
        return None
    try:
        return json.loads(line)
    except ValueError as exc:
        raise DaemonError(f"the weenv daemon sent a line that is not JSON: {line[:200]!r}") from exc


# --- results ---------------------------------------------------------------------------
@dataclass
class CommandResult:
    """What a command did: ``exit_code`` (128 + signal if killed; 137 after a
    timeout), its output as bytes and decoded (UTF-8, errors replaced)."""

    exit_code: int
    stdout_bytes: bytes = b""
    stderr_bytes: bytes = b""
    duration_s: float = 0.0
    timed_out: bool = False
    pid: int = 0

    @property
    def stdout(self) -> str:
        return self.stdout_bytes.decode(errors="replace")

    @property
    def stderr(self) -> str:
        return self.stderr_bytes.decode(errors="replace")


@dataclass
class _Output:
    """Folds a command's events into a result; decodes chunks for callbacks
    (incrementally: a UTF-8 character split between chunks stays whole).
    Keeps at most ``limit`` bytes of output: the event that would pass it
    raises :class:`OutputLimitError` (before its bytes are kept or given to a callback)."""

    on_stdout: Callable[[str], Any] | None = None
    on_stderr: Callable[[str], Any] | None = None
    limit: int = MAX_OUTPUT
    out: bytearray = field(default_factory=bytearray)
    err: bytearray = field(default_factory=bytearray)
    end: ProcessEvent | None = None
    pid: int = 0

    def __post_init__(self):
        self._dec = {
            "stdout": codecs.getincrementaldecoder("utf-8")("replace"),
            "stderr": codecs.getincrementaldecoder("utf-8")("replace"),
        }

    def feed(self, e: ProcessEvent) -> list[Invoke]:
        """Take one event; the callbacks to call for it."""
        if e.type == "start":
            self.pid = e.pid or 0
        elif e.type in ("stdout", "stderr"):
            data = e.data or b""
            if len(self.out) + len(self.err) + len(data) > self.limit:
                raise OutputLimitError(
                    f"the command wrote more than {self.limit} bytes of output, more than the SDK keeps "
                    "(redirect it to a file in the sandbox and read that, or run it in the background)"
                )
            (self.out if e.type == "stdout" else self.err).extend(data)
            cb = self.on_stdout if e.type == "stdout" else self.on_stderr
            text = self._dec[e.type].decode(data)
            if cb is not None and text:
                return [Invoke(cb, (text,))]
        elif e.type == "end":
            self.end = e
        elif e.type == "error":
            assert e.error is not None
            raise error_for_kind(e.error.kind, e.error.message)
        return []

    def result(self, *, raise_on_timeout: bool = True) -> CommandResult:
        if self.end is None:
            raise DaemonError("the command's output stream ended before the command did")
        r = CommandResult(
            exit_code=self.end.exit_code if self.end.exit_code is not None else -1,
            stdout_bytes=bytes(self.out),
            stderr_bytes=bytes(self.err),
            duration_s=self.end.duration_s or 0.0,
            timed_out=bool(self.end.timed_out),
            pid=self.pid,
        )
        if r.timed_out and raise_on_timeout:
            exc = CommandTimeoutError(f"the command timed out after {r.duration_s:.1f} s and was killed")
            exc.result = r  # type: ignore[attr-defined]
            raise exc
        return r


def _follow(out: _Output, first: Any) -> Flow[None]:
    """Feed NDJSON ProcessEvent lines (starting with ``first``) into ``out``."""
    line = first
    while line is not END:
        if line is not None:
            for invoke in out.feed(ProcessEvent.model_validate(line)):  # noqa: UP028 (a send() generator: `yield from` would pass sends on)
                yield invoke
        line = yield NEXT


# --- flows: environments ---------------------------------------------------------------
ENV_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
"""What an environment id may be (the node makes 12 hex digits)."""


def env_path(env_id: str) -> str:
    """``/environments/ID``; :class:`InvalidInputError` for an id that is not one
    (``../../etc``: it would name another route)."""
    if not isinstance(env_id, str) or not ENV_ID_RE.match(env_id):
        raise InvalidInputError(f"bad environment id {env_id!r}: want letters, digits, '-' or '_'")
    return f"/environments/{env_id}"


_env = env_path


def create(
    template: str,
    *,
    timeout: float | None = None,
    envs: dict[str, str] | None = None,
    metadata: dict[str, str] | None = None,
    resources: Resources | dict | None = None,
    priority: int = 0,
    first_command: bool = True,
) -> Flow[EnvironmentInfo]:
    req = create_request(
        template,
        timeout=timeout,
        envs=envs,
        metadata=metadata,
        resources=resources,
        priority=priority,
        first_command=first_command,
    )
    reply = yield Call("POST", "/environments", json=req)
    return EnvironmentInfo.model_validate_json(reply.content)


def create_request(
    template: str,
    *,
    timeout=None,
    envs=None,
    metadata=None,
    resources=None,
    priority: int = 0,
    first_command: bool = True,
) -> CreateRequest:
    try:
        return CreateRequest(
            template=template,
            timeout=timeout,
            envs=envs or {},
            metadata=metadata or {},
            priority=priority,
            first_command=first_command,
            resources=Resources.model_validate(resources) if isinstance(resources, dict) else resources,
        )
    except ValidationError as exc:
        raise InvalidInputError(f"bad create arguments: {exc.errors()[0]['loc']}: {exc.errors()[0]['msg']}") from None


def create_many(
    items: list[CreateRequest],
    *,
    concurrency: int | None = None,
    on_ready: Callable[[int, EnvironmentInfo], Any] | None = None,
    return_exceptions: bool = False,
) -> Flow[list[EnvironmentInfo | WeenvError]]:
    """Create ``items`` in one batch; a list in ``items`` order of infos (or, with
    ``return_exceptions``, errors).  Without it, the first failure destroys the
    environments that were created and is raised."""
    if not items:
        return []
    req = BatchCreateRequest(items=items, concurrency=concurrency)
    results: list[EnvironmentInfo | WeenvError | None] = [None] * len(items)
    line = yield Call("POST", "/environments/batch", json=req, stream=True, timeout=None)
    while line is not END:
        if line is not None:
            ev = BatchCreateEvent.model_validate(line)
            if ev.environment is not None:
                results[ev.index] = ev.environment
                if on_ready is not None:
                    yield Invoke(on_ready, (ev.index, ev.environment))
            else:
                assert ev.error is not None
                results[ev.index] = error_for_kind(ev.error.kind, ev.error.message)
        line = yield NEXT
    for i, r in enumerate(results):
        if r is None:
            results[i] = DaemonError(f"the batch answer ended without item {i}")
    failed = [r for r in results if isinstance(r, WeenvError)]
    if failed and not return_exceptions:
        for r in results:
            if isinstance(r, EnvironmentInfo):
                try:
                    yield Call("DELETE", _env(r.id))
                except NotFoundError:
                    pass
        raise failed[0]
    return results  # type: ignore[return-value]


def batch_events(
    items: list[CreateRequest],
    *,
    concurrency: int | None = None,
    on_event: Callable[[BatchCreateEvent], Any] | None = None,
) -> Flow[list[BatchCreateEvent]]:
    """Create ``items`` in one batch: ``on_event(event)`` as the daemon finishes
    each item, then every event in the order they came.  A failed item is an
    event (nothing else is destroyed); a broken answer raises (:class:`DaemonError`)."""
    try:
        req = BatchCreateRequest(items=items, concurrency=concurrency)
    except ValidationError as exc:
        raise InvalidInputError(f"bad batch: {exc.errors()[0]['loc']}: {exc.errors()[0]['msg']}") from None
    events: list[BatchCreateEvent] = []
    line = yield Call("POST", "/environments/batch", json=req, stream=True, timeout=None)
    while line is not END:
        if line is not None:
            events.append(BatchCreateEvent.model_validate(line))
            if on_event is not None:
                yield Invoke(on_event, (events[-1],))
        line = yield NEXT
    return events


def get(env_id: str) -> Flow[EnvironmentInfo]:
    reply = yield Call("GET", _env(env_id))
    return EnvironmentInfo.model_validate_json(reply.content)


def list_environments() -> Flow[list[EnvironmentInfo]]:
    import json

    reply = yield Call("GET", "/environments")
    return [EnvironmentInfo.model_validate(e) for e in json.loads(reply.content)]


def kill(env_id: str, *, missing_ok: bool = True) -> Flow[bool]:
    """Destroy the environment; whether it existed."""
    try:
        yield Call("DELETE", _env(env_id))
    except NotFoundError:
        if not missing_ok:
            raise
        return False
    return True


def set_priority(env_id: str, priority: int) -> Flow[EnvironmentInfo]:
    try:
        req = SetPriorityRequest(priority=priority)
    except ValidationError as exc:
        raise InvalidInputError(f"bad priority {priority!r}: {exc.errors()[0]['msg']}") from None
    reply = yield Call("POST", _env(env_id) + "/priority", json=req)
    return EnvironmentInfo.model_validate_json(reply.content)


def set_resources(
    env_id: str,
    *,
    cpus: float | None = None,
    memory_bytes: int | None = None,
    pids: int | None = None,
    disk_bytes: int | None = None,
) -> Flow[EnvironmentInfo]:
    given = {
        k: v
        for k, v in dict(cpus=cpus, memory_bytes=memory_bytes, pids=pids, disk_bytes=disk_bytes).items()
        if v is not None
    }
    if not given:
        raise InvalidInputError("set_resources: give at least one of cpus, memory_bytes, pids, disk_bytes")
    try:
        req = ResizeRequest(resources=given)
    except ValidationError as exc:
        err = exc.errors()[0]
        raise InvalidInputError(f"bad {err['loc'][-1]} {err.get('input')!r}: {err['msg']}") from None
    reply = yield Call("PATCH", _env(env_id), json=req)
    return EnvironmentInfo.model_validate_json(reply.content)


def set_timeout(env_id: str, timeout: float) -> Flow[EnvironmentInfo]:
    try:
        req = SetTimeoutRequest(timeout=timeout)
    except ValidationError as exc:
        raise InvalidInputError(f"bad timeout {timeout!r}: {exc.errors()[0]['msg']}") from None
    reply = yield Call("POST", _env(env_id) + "/timeout", json=req)
    return EnvironmentInfo.model_validate_json(reply.content)


def _model(model: type[T], what: str, **fields) -> T:
    try:
        return model(**fields)
    except ValidationError as exc:
        raise InvalidInputError(f"bad {what}: {exc.errors()[0]['msg']}") from None


def snapshot(env_id: str, name: str | None = None) -> Flow[SnapshotInfo]:
    reply = yield Call("POST", _env(env_id) + "/snapshots", json=_model(SnapshotRequest, "snapshot name", name=name))
    return SnapshotInfo.model_validate_json(reply.content)


def list_snapshots() -> Flow[list[SnapshotInfo]]:
    import json

    reply = yield Call("GET", "/snapshots")
    return [SnapshotInfo.model_validate(s) for s in json.loads(reply.content)]


def delete_snapshot(name: str) -> Flow[bool]:
    """Remove snapshot ``name``; whether it existed."""
    try:
        yield Call("DELETE", "/snapshots/" + urllib.parse.quote(name, safe=""))
    except NotFoundError:
        return False
    return True


def fork_answer(env_id: str, count: int, *, timeout: float | None = None) -> Flow[ForkResponse]:
    """The node's answer to a fork into ``count`` children: each child's info or error, and timings."""
    req = _model(ForkRequest, f"fork count {count!r} or timeout {timeout!r}", count=count, timeout=timeout)
    reply = yield Call("POST", _env(env_id) + "/fork", json=req)
    return ForkResponse.model_validate_json(reply.content)


def fork(env_id: str, count: int, *, timeout: float | None = None) -> Flow[list[EnvironmentInfo | WeenvError]]:
    """``count`` children of the environment: each one's info or its error, in order."""
    answer = yield from fork_answer(env_id, count, timeout=timeout)
    return [
        c.environment
        if c.environment is not None
        else error_for_kind(c.error.kind if c.error else "weenv", c.error.message if c.error else "no child")
        for c in answer.children
    ]


def reset(env_id: str, snapshot: str | None = None) -> Flow[EnvironmentInfo]:
    reply = yield Call("POST", _env(env_id) + "/reset", json=_model(ResetRequest, "snapshot", snapshot=snapshot))
    return EnvironmentInfo.model_validate_json(reply.content)


def pause(env_id: str, release_memory: bool = False) -> Flow[EnvironmentInfo]:
    reply = yield Call(
        "POST", _env(env_id) + "/pause", json=PauseRequest(release_memory=True) if release_memory else None
    )
    return EnvironmentInfo.model_validate_json(reply.content)


def resume(env_id: str, timeout: float | None = None) -> Flow[EnvironmentInfo]:
    reply = yield Call("POST", _env(env_id) + "/resume", json=_model(ResumeRequest, "timeout", timeout=timeout))
    return EnvironmentInfo.model_validate_json(reply.content)


def reset_profile(name: str) -> Flow[ProfileReset]:
    """Forget the usage profile of template ``name`` (``DELETE /templates/{name}/profile``)."""
    reply = yield Call("DELETE", "/templates/" + urllib.parse.quote(name, safe="") + "/profile")
    return ProfileReset.model_validate_json(reply.content)


def templates() -> Flow[list[TemplateInfo]]:
    import json

    reply = yield Call("GET", "/templates")
    return [TemplateInfo.model_validate(t) for t in json.loads(reply.content)]


# --- flows: the node -------------------------------------------------------------------
def health() -> Flow[bool]:
    """Whether the daemon answers ``GET /health`` with 200."""
    reply = yield Call("GET", "/health")
    return reply.status == 200


def shutdown() -> Flow[None]:
    """Ask the daemon to stop (it destroys every environment, then exits)."""
    yield Call("POST", "/shutdown")


def node_stats() -> Flow[NodeStats]:
    reply = yield Call("GET", "/stats")
    return NodeStats.model_validate_json(reply.content)


def provision_stats(env_id: str | None = None) -> Flow[ProvisionStats]:
    """Quotas, usage history and events of every environment (or of ``env_id``)."""
    reply = yield Call("GET", "/stats/provision", params={"env": env_id} if env_id else None)
    return ProvisionStats.model_validate_json(reply.content)


def tax_report() -> Flow[TaxReport]:
    """The node's environment seconds by phase and the batches meters posted (:mod:`weenv.formats.tax`)."""
    reply = yield Call("GET", "/tax")
    return TaxReport.model_validate_json(reply.content)


def drop_cache() -> Flow[None]:
    """Empty the node's chunk cache (what no environment uses)."""
    yield Call("POST", "/cache/drop")


def exec_captured(env_id: str, req: ExecRequest) -> Flow[ExecResult]:
    """A command run to its end, its output captured by the daemon (``POST .../commands``)."""
    reply = yield Call("POST", _env(env_id) + "/commands", json=req)
    return ExecResult.model_validate_json(reply.content)


# --- flows: commands -------------------------------------------------------------------
def exec_request(
    cmd: str | list[str], *, envs=None, cwd=None, timeout=None, stdin=None, stdin_open=False, tag=None, user=None
) -> ExecRequest:
    if isinstance(stdin, str):
        stdin = stdin.encode()
    try:
        return ExecRequest(
            command=cmd,
            env=envs or {},
            cwd=cwd,
            timeout=timeout,
            stdin=stdin,
            stdin_open=stdin_open,
            tag=tag,
            user=user,
        )
    except ValidationError as exc:
        raise InvalidInputError(f"bad command arguments: {exc.errors()[0]['loc']}: {exc.errors()[0]['msg']}") from None


def run(env_id: str, req: ExecRequest, *, on_stdout=None, on_stderr=None) -> Flow[CommandResult]:
    """A foreground command: its output streamed to the callbacks as it comes,
    and kept for the result up to :data:`MAX_OUTPUT` bytes; past that the
    command is killed and :class:`OutputLimitError` raised (callbacks do not
    lift the cap: the result holds the output too)."""
    out = _Output(on_stdout, on_stderr)
    first = yield Call("POST", _env(env_id) + "/commands/stream", json=req, stream=True, timeout=None)
    try:
        yield from _follow(out, first)
    except OutputLimitError:
        # The next request closes the stream (the daemon kills a streamed command
        # whose client leaves); kill it by its pid as well, not to rely on that alone.
        if out.pid:
            try:
                yield Call("POST", _env(env_id) + f"/processes/{out.pid}/kill", json=KillRequest(signal="KILL"))
            except WeenvError:
                pass  # it ended already
        raise
    return out.result()


def start(env_id: str, req: ExecRequest) -> Flow[ProcessInfo]:
    reply = yield Call("POST", _env(env_id) + "/processes", json=req)
    return ProcessInfo.model_validate_json(reply.content)


def wait(
    env_id: str, info: ProcessInfo, *, on_stdout=None, on_stderr=None, raise_on_timeout: bool = True
) -> Flow[CommandResult]:
    """A background command's output (what is kept, then live) until it ends;
    :class:`OutputLimitError` past :data:`MAX_OUTPUT` bytes (the command is
    left running: it is the handle's to kill)."""
    if info.pid == 0:  # never started: nothing to follow
        return CommandResult(exit_code=info.exit_code if info.exit_code is not None else 127)
    out = _Output(on_stdout, on_stderr)
    first = yield Call("GET", _env(env_id) + f"/processes/{info.pid}/output", stream=True, timeout=None)
    yield from _follow(out, first)
    return out.result(raise_on_timeout=raise_on_timeout)


def process(env_id: str, pid: int) -> Flow[ProcessInfo]:
    reply = yield Call("GET", _env(env_id) + f"/processes/{pid}")
    return ProcessInfo.model_validate_json(reply.content)


def processes(env_id: str) -> Flow[list[ProcessInfo]]:
    import json

    reply = yield Call("GET", _env(env_id) + "/processes")
    return [ProcessInfo.model_validate(p) for p in json.loads(reply.content)]


def kill_process(env_id: str, pid: int, signal: str | int = "KILL") -> Flow[bool]:
    """Signal a command; whether it was known."""
    try:
        yield Call("POST", _env(env_id) + f"/processes/{pid}/kill", json=KillRequest(signal=signal))
    except NotFoundError:
        return False
    return True


def send_stdin(env_id: str, pid: int, data: bytes | str, *, eof: bool = False) -> Flow[None]:
    if isinstance(data, str):
        data = data.encode()
    yield Call("POST", _env(env_id) + f"/processes/{pid}/stdin", json=ProcessStdin(data=data, eof=eof))


# --- flows: files ----------------------------------------------------------------------
def read_file(env_id: str, path: str, *, format: Literal["text", "bytes"] = "text") -> Flow[str | bytes]:
    reply = yield Call("GET", _env(env_id) + "/files?" + path_query(path), timeout=None)
    return reply.content.decode() if format == "text" else reply.content


def _user_query(user: str | None) -> str:
    import urllib.parse

    return "" if user is None else "&user=" + urllib.parse.quote(user, safe="")


def write_file(env_id: str, path: str, data: Any, user: str | None = None) -> Flow[WriteInfo]:
    """``data``: str (UTF-8), bytes, a binary file object or an iterable of bytes (streamed);
    ``user``: who owns the file and the parents made for it (default root)."""
    if isinstance(data, str):
        data = data.encode()
    reply = yield Call(
        "PUT", _env(env_id) + "/files?" + path_query(path) + _user_query(user), content=data, timeout=None
    )
    return parse(WriteInfo, reply.content)


def list_dir(env_id: str, path: str) -> Flow[list[EntryInfo]]:
    """The entries of ``path``; a name that is not UTF-8 is a ``str`` with
    surrogate escapes (as ``os.listdir`` gives it), usable as a path as it is."""
    import json

    reply = yield Call("GET", _env(env_id) + "/files/list?" + path_query(path))
    return [EntryInfo.model_validate(e) for e in json.loads(reply.content)]


def stat(env_id: str, path: str) -> Flow[EntryInfo]:
    reply = yield Call("GET", _env(env_id) + "/files/stat?" + path_query(path))
    return parse(EntryInfo, reply.content)


def exists(env_id: str, path: str) -> Flow[bool]:
    try:
        yield from stat(env_id, path)
    except (NotFoundError, InvalidInputError):
        return False
    return True


def remove(env_id: str, path: str) -> Flow[None]:
    yield Call("DELETE", _env(env_id) + "/files?" + path_query(path))


def rename(env_id: str, src: str, dst: str) -> Flow[None]:
    yield Call("POST", _env(env_id) + "/files/rename", json=RenameRequest(src=src, dst=dst))


def make_dir(env_id: str, path: str, user: str | None = None) -> Flow[None]:
    yield Call("POST", _env(env_id) + "/files/mkdir?" + path_query(path) + _user_query(user))


def download_path(env_id: str, path: str) -> tuple[str, dict[str, str] | None]:
    """URL path (with its query) and params of a file's streamed download (for the drivers' ``download``)."""
    return _env(env_id) + "/files?" + path_query(path), None
