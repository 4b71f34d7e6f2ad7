"""The asyncio face of the SDK: :class:`AsyncSandbox` on ``httpx.AsyncClient``.

Only the I/O edge lives here (the driver and one-line methods); the logic is in
:mod:`weenv.sdk._core`.  This is the one source of both faces: the blocking one,
:mod:`weenv.sdk._sync`, is generated from it by ``scripts/gen_sync.py``
(unasync: ``async``/``await`` dropped, ``AsyncSandbox`` -> ``Sandbox``,
``aclose`` -> ``close``, ...); edit this module, then run the script
(``tests/unit/test_sdk_generated.py`` fails while the copy is stale).  Callbacks
may be plain functions or coroutine functions.
"""

from __future__ import annotations

import inspect
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, BinaryIO, Literal

import httpx

from weenv.api.models import (
    BatchCreateEvent,
    CreateRequest,
    EntryInfo,
    EnvironmentInfo,
    ExecResult,
    ForkResponse,
    NodeStats,
    ProcessInfo,
    ProfileReset,
    SnapshotInfo,
    TemplateInfo,
    WriteInfo,
)
from weenv.errors import WeenvError
from weenv.formats.tax import TaxReport
from weenv.node.provision.models import ProvisionStats
from weenv.sdk import _core
from weenv.sdk import _meter as meter
from weenv.sdk._core import END, NEXT, Call, CommandResult, ConnectionConfig, Flow, Invoke, Reply

CHUNK = 1 << 20


class _Connection:
    """One ``httpx.Client`` to the daemon, shared by the sandboxes made together
    (reference-counted: the last :meth:`release` closes it)."""

    def __init__(self, config: ConnectionConfig):
        self.config = config
        transport = httpx.AsyncHTTPTransport(uds=config.socket) if config.socket else None
        self.http = httpx.AsyncClient(
            base_url=config.base_url,
            headers=config.headers,
            transport=transport,
            timeout=httpx.Timeout(config.request_timeout, connect=10.0),
        )
        self._refs = 1
        self._lock = threading.Lock()

    def retain(self) -> _Connection:
        with self._lock:
            self._refs += 1
        return self

    async def release(self) -> None:
        with self._lock:
            self._refs -= 1
            last = self._refs == 0
        if last:
            await self.http.aclose()

    async def drive(self, flow: Flow[Any]) -> Any:
        """Run ``flow``, performing its effects (see :mod:`weenv.sdk._core`).
        While a meter is open (:mod:`weenv.sdk.meter`), the seconds waited
        (callbacks left out) count for the phase of the flow's first request."""
        stream = None
        lines = None
        started = time.monotonic()
        in_callbacks = 0.0
        first: Call | None = None
        outcome: Any = None
        failure: BaseException | None = None
        try:
            effect = next(flow)
            while True:
                value: Any = None
                error: WeenvError | None = None
                try:
                    if isinstance(effect, Call):
                        first = first or effect
                        if stream is not None:
                            await stream.aclose()
                            stream = None
                        if effect.stream:
                            stream = await self._open_stream(effect)
                            lines = stream.aiter_lines()
                            value = await self._next_line(lines)
                        else:
                            value = await self._request(effect)
                    elif effect is NEXT:
                        value = await self._next_line(lines)
                    elif isinstance(effect, Invoke):
                        called = time.monotonic()
                        try:
                            value = effect.fn(*effect.args)
                            if inspect.isawaitable(value):  # a coroutine function's (the sync face: nothing to do)
                                value = await value
                        finally:
                            in_callbacks += time.monotonic() - called
                    else:
                        raise TypeError(f"unknown effect {effect!r}")
                except httpx.HTTPError as exc:
                    error = _core.error_for_transport(exc, self.config.where)
                    error.__cause__ = exc
                except WeenvError as exc:
                    error = exc
                effect = flow.throw(error) if error is not None else flow.send(value)
        except StopIteration as stop:
            outcome = stop.value
            return stop.value
        except BaseException as exc:
            failure = exc
            raise
        finally:
            if stream is not None:
                await stream.aclose()
            flow.close()
            if first is not None and meter.metering():
                meter.record_call(
                    self.config,
                    first.method,
                    first.path,
                    started,
                    time.monotonic() - started - in_callbacks,
                    outcome=outcome,
                    error=failure,
                )

    def _kw(self, call: Call) -> dict[str, Any]:
        kw: dict[str, Any] = {"params": call.params}
        if call.json is not None:
            kw["content"] = _core.json_body(call.json)
            kw["headers"] = {"content-type": "application/json"}
        elif call.content is not None:
            kw["content"] = _body(call.content)
            kw["headers"] = {"content-type": "application/octet-stream"}
        if call.timeout != "default":
            kw["timeout"] = httpx.Timeout(call.timeout, connect=10.0)
        return kw

    async def _request(self, call: Call) -> Reply:
        r = await self.http.request(call.method, call.path, **self._kw(call))
        if r.status_code >= 400:
            raise _core.error_for_reply(r.status_code, r.content)
        return Reply(r.status_code, dict(r.headers), r.content)

    async def _open_stream(self, call: Call) -> httpx.Response:
        req = self.http.build_request(call.method, call.path, **self._kw(call))
        r = await self.http.send(req, stream=True)
        if r.status_code >= 400:
            try:
                await r.aread()
            finally:
                await r.aclose()
            raise _core.error_for_reply(r.status_code, r.content)
        return r

    @staticmethod
    async def _next_line(lines) -> Any:
        async for line in lines:
            parsed = _core.parse_line(line)
            if parsed is not None:
                return parsed
        return END

    async def download(self, path: str, params: dict, dest: BinaryIO) -> int:
        started = time.monotonic()
        try:
            async with self.http.stream("GET", path, params=params, timeout=httpx.Timeout(None, connect=10.0)) as r:
                if r.status_code >= 400:
                    await r.aread()
                    raise _core.error_for_reply(r.status_code, r.content)
                n = 0
                async for chunk in r.aiter_bytes(CHUNK):
                    dest.write(chunk)
                    n += len(chunk)
                return n
        except httpx.HTTPError as exc:
            raise _core.error_for_transport(exc, self.config.where) from exc
        finally:
            if meter.metering():
                meter.record_call(self.config, "GET", path, started, time.monotonic() - started)


def _body(content: Any) -> Any:
    """bytes as they are; a binary file object read in ``CHUNK`` pieces; an
    iterable of bytes streamed as it is (on the async face an async one too, or an
    async file object)."""
    if isinstance(content, (bytes, bytearray, memoryview)):
        return bytes(content)
    if hasattr(content, "read") and not inspect.iscoroutinefunction(content.read):
        return _aiter(iter(lambda: content.read(CHUNK), b""))
    if hasattr(content, "__aiter__"):
        return content
    return _aiter(content)


async def _aiter(chunks: Iterable[bytes]) -> AsyncIterator[bytes]:
    """``chunks`` one by one, as the iterator kind this face's httpx client sends."""
    for chunk in chunks:
        yield chunk


class AsyncCommandHandle:
    """A command running in the background (``commands.run(..., background=True)``)."""

    def __init__(self, sandbox: AsyncSandbox, info: ProcessInfo):
        self.sandbox = sandbox
        self.info = info

    @property
    def pid(self) -> int:
        return self.info.pid

    async def wait(
        self,
        *,
        on_stdout: Callable[[str], Any] | None = None,
        on_stderr: Callable[[str], Any] | None = None,
    ) -> CommandResult:
        """Follow its output (kept output first) until it ends; its result.
        Raises :class:`CommandTimeoutError` if its timeout killed it, and
        :class:`OutputLimitError` past 64 MiB of output (the command runs on)."""
        return await self.sandbox._drive(
            _core.wait(self.sandbox.id, self.info, on_stdout=on_stdout, on_stderr=on_stderr)
        )

    async def kill(self, signal: str | int = "KILL") -> bool:
        return await self.sandbox._drive(_core.kill_process(self.sandbox.id, self.pid, signal))

    async def send_stdin(self, data: bytes | str, *, eof: bool = False) -> None:
        await self.sandbox._drive(_core.send_stdin(self.sandbox.id, self.pid, data, eof=eof))

    async def refresh(self) -> ProcessInfo:
        self.info = await self.sandbox._drive(_core.process(self.sandbox.id, self.pid))
        return self.info


class AsyncCommands:
    def __init__(self, sandbox: AsyncSandbox):
        self._s = sandbox

    async def run(
        self,
        cmd: str | list[str],
        *,
        background: bool = False,
        on_stdout: Callable[[str], Any] | None = None,
        on_stderr: Callable[[str], Any] | None = None,
        timeout: float | None = None,
        envs: dict[str, str] | None = None,
        cwd: str | None = None,
        stdin: bytes | str | None = None,
        stdin_open: bool = False,
        tag: str | None = None,
        user: str | None = None,
    ) -> Any:
        """Run ``cmd`` (a shell string or argv) and return its :class:`CommandResult`;
        output reaches ``on_stdout``/``on_stderr`` as it comes.  With
        ``background``, return a :class:`CommandHandle` at once.  ``timeout``
        (seconds) kills the command: :class:`CommandTimeoutError`.  The result
        keeps at most 64 MiB of output (stdout and stderr together,
        ``_core.MAX_OUTPUT``), callbacks or not: past it the command is killed
        and :class:`OutputLimitError` raised, so the client's memory stays
        bounded; redirect bigger output to a file inside and read that.  ``user``:
        who it runs as (a user of the environment or ``"UID[:GID]"``; default the
        template's user): :class:`UnknownUserError` for one it does not have."""
        req = _core.exec_request(
            cmd, envs=envs, cwd=cwd, timeout=timeout, stdin=stdin, stdin_open=stdin_open, tag=tag, user=user
        )
        if background:
            return AsyncCommandHandle(self._s, await self._s._drive(_core.start(self._s.id, req)))
        return await self._s._drive(_core.run(self._s.id, req, on_stdout=on_stdout, on_stderr=on_stderr))

    async def list(self) -> list[ProcessInfo]:
        return await self._s._drive(_core.processes(self._s.id))

    async def connect(self, pid: int) -> AsyncCommandHandle:
        return AsyncCommandHandle(self._s, await self._s._drive(_core.process(self._s.id, pid)))

    async def kill(self, pid: int, signal: str | int = "KILL") -> bool:
        return await self._s._drive(_core.kill_process(self._s.id, pid, signal))

    async def send_stdin(self, pid: int, data: bytes | str, *, eof: bool = False) -> None:
        await self._s._drive(_core.send_stdin(self._s.id, pid, data, eof=eof))


class AsyncFiles:
    def __init__(self, sandbox: AsyncSandbox):
        self._s = sandbox

    async def read(self, path: str, *, format: Literal["text", "bytes"] = "text") -> Any:
        return await self._s._drive(_core.read_file(self._s.id, path, format=format))

    async def write(
        self, path: str, data: str | bytes | BinaryIO | Iterable[bytes], *, user: str | None = None
    ) -> WriteInfo:
        """``user``: who owns the file and the parents made for it (default root)."""
        return await self._s._drive(_core.write_file(self._s.id, path, data, user))

    async def upload(self, local_path: str | os.PathLike, path: str) -> WriteInfo:
        """Stream the local file ``local_path`` to ``path`` inside."""
        with open(local_path, "rb") as f:
            return await self.write(path, f)

    async def download(self, path: str, local_path: str | os.PathLike) -> int:
        """Stream ``path`` inside to the local file ``local_path``; bytes written."""
        url, params = _core.download_path(self._s.id, path)
        with open(local_path, "wb") as f:
            return await self._s._conn.download(url, params, f)

    async def list(self, path: str = "/") -> list[EntryInfo]:
        return await self._s._drive(_core.list_dir(self._s.id, path))

    async def stat(self, path: str) -> EntryInfo:
        return await self._s._drive(_core.stat(self._s.id, path))

    async def exists(self, path: str) -> bool:
        return await self._s._drive(_core.exists(self._s.id, path))

    async def remove(self, path: str) -> None:
        await self._s._drive(_core.remove(self._s.id, path))

    async def rename(self, src: str, dst: str) -> None:
        await self._s._drive(_core.rename(self._s.id, src, dst))

    async def make_dir(self, path: str, *, user: str | None = None) -> None:
        await self._s._drive(_core.make_dir(self._s.id, path, user))


class AsyncSandbox:
    """One weenv environment, reached through the daemon's API.

    Make one with :meth:`create` (or :meth:`create_many`, :meth:`connect`).
    The daemon is found by ``api_url``/``api_key``, else ``WEENV_API_URL`` and
    ``WEENV_API_KEY``, else the local Unix socket.  As a context manager it
    kills the environment on exit.  Errors are :mod:`weenv.errors` kinds:
    :class:`NotFoundError`, :class:`InvalidInputError` (bad request),
    :class:`CommandTimeoutError`, :class:`AuthenticationError`,
    :class:`CapacityError`, :class:`DaemonError` (unreachable).
    """

    def __init__(self, info: EnvironmentInfo, connection: _Connection):
        self.info = info
        self._conn = connection
        self._closed = False
        self.commands = AsyncCommands(self)
        self.files = AsyncFiles(self)

    @property
    def id(self) -> str:
        return self.info.id

    sandbox_id = id

    @property
    def node(self) -> str:
        """The node it runs on: its daemon's address (``http://HOST:PORT`` or ``unix:SOCKET``)."""
        return self._conn.config.where

    async def _drive(self, flow: Flow[Any]) -> Any:
        return await self._conn.drive(flow)

    # --- making sandboxes ------------------------------------------------------------
    @classmethod
    async def create(
        cls,
        template: str,
        *,
        timeout: float | None = None,
        envs: dict[str, str] | None = None,
        metadata: dict[str, str] | None = None,
        resources: Any = None,
        api_url: str | None = None,
        api_key: str | None = None,
        request_timeout: float | None = None,
        priority: int = 0,
    ) -> AsyncSandbox:
        """Create an environment from ``template``; ``timeout``: seconds it lives
        (default 300, see :meth:`set_timeout`); ``envs``: variables of every
        command; ``metadata``: labels; ``resources``: a
        :class:`~weenv.formats.manifest.Resources` or dict overriding the template's;
        ``priority``: for elastic provisioning (higher grows first, is frozen last)."""
        conn = _Connection(ConnectionConfig.resolve(api_url, api_key, request_timeout))
        try:
            info = await conn.drive(
                _core.create(
                    template, timeout=timeout, envs=envs, metadata=metadata, resources=resources, priority=priority
                )
            )
        except BaseException:
            await conn.release()
            raise
        return cls(info, conn)

    @classmethod
    async def create_many(
        cls,
        templates: str | list[str],
        count: int | None = None,
        *,
        timeout: float | None = None,
        envs: dict[str, str] | None = None,
        metadata: dict[str, str] | None = None,
        resources: Any = None,
        concurrency: int | None = None,
        on_ready: Callable[[int, AsyncSandbox], Any] | None = None,
        return_exceptions: bool = False,
        api_url: str | None = None,
        api_key: str | None = None,
        request_timeout: float | None = None,
    ) -> list[Any]:
        """Create many environments in one request (``templates`` as a list, or
        one template ``count`` times), concurrently on the node; ``on_ready(i,
        sandbox)`` is called as each is ready.  Returns sandboxes in request
        order.  If one fails, the others are killed and its error raised, unless
        ``return_exceptions`` (then the list holds the error in its place)."""
        items = [
            _core.create_request(t, timeout=timeout, envs=envs, metadata=metadata, resources=resources)
            for t in _templates(templates, count)
        ]
        conn = _Connection(ConnectionConfig.resolve(api_url, api_key, request_timeout))
        made: dict[int, AsyncSandbox] = {}
        started = time.monotonic()

        def ready(i: int, info: EnvironmentInfo):
            meter.note_created(conn.config, info.id, started)
            made[i] = cls(info, conn.retain())
            return on_ready(i, made[i]) if on_ready is not None else None  # the driver awaits a coroutine

        try:
            results = await conn.drive(
                _core.create_many(items, concurrency=concurrency, on_ready=ready, return_exceptions=return_exceptions)
            )
        except BaseException:
            for s in made.values():
                await s.aclose()
            raise
        finally:
            await conn.release()
        return [made[i] if isinstance(r, EnvironmentInfo) else r for i, r in enumerate(results)]

    @classmethod
    async def connect(
        cls,
        sandbox_id: str,
        *,
        api_url: str | None = None,
        api_key: str | None = None,
        request_timeout: float | None = None,
    ) -> AsyncSandbox:
        conn = _Connection(ConnectionConfig.resolve(api_url, api_key, request_timeout))
        try:
            return cls(await conn.drive(_core.get(sandbox_id)), conn)
        except BaseException:
            await conn.release()
            raise

    @classmethod
    async def list(cls, *, api_url: str | None = None, api_key: str | None = None) -> list[EnvironmentInfo]:
        conn = _Connection(ConnectionConfig.resolve(api_url, api_key))
        try:
            return await conn.drive(_core.list_environments())
        finally:
            await conn.release()

    @classmethod
    async def templates(cls, *, api_url: str | None = None, api_key: str | None = None) -> list[TemplateInfo]:
        conn = _Connection(ConnectionConfig.resolve(api_url, api_key))
        try:
            return await conn.drive(_core.templates())
        finally:
            await conn.release()

    # --- this sandbox ----------------------------------------------------------------
    async def get_info(self) -> EnvironmentInfo:
        self.info = await self._drive(_core.get(self.id))
        return self.info

    async def is_running(self) -> bool:
        try:
            await self.get_info()
        except _core.NotFoundError:
            return False
        return True

    async def set_timeout(self, timeout: float) -> None:
        """Destroy the environment ``timeout`` seconds from now."""
        self.info = await self._drive(_core.set_timeout(self.id, timeout))

    async def set_priority(self, priority: int) -> None:
        """Its priority for elastic provisioning (-1000..1000; higher grows first, is frozen last)."""
        self.info = await self._drive(_core.set_priority(self.id, priority))

    async def set_resources(
        self,
        *,
        cpus: float | None = None,
        memory_bytes: int | None = None,
        pids: int | None = None,
        disk_bytes: int | None = None,
    ) -> None:
        """Resize it live (CPU cores, memory limit, pids limit, disk limit; those
        not given stay), within what the node can hold: :class:`CapacityError`
        when it cannot, :class:`InvalidInputError` for a bad value or one beyond
        the node, :class:`StateError` when it is paused; nothing changes then."""
        self.info = await self._drive(
            _core.set_resources(self.id, cpus=cpus, memory_bytes=memory_bytes, pids=pids, disk_bytes=disk_bytes)
        )

    # --- state: snapshot, fork, reset, pause --------------------------------------------
    async def create_snapshot(self, name: str | None = None) -> SnapshotInfo:
        """Capture the environment's file system (it is frozen for milliseconds)
        and publish it as a template named ``name`` (default ``snapshot-<hex>``):
        :meth:`create` of that name starts it, on any node of the store."""
        return await self._drive(_core.snapshot(self.id, name))

    snapshot = create_snapshot

    @classmethod
    async def list_snapshots(cls, *, api_url: str | None = None, api_key: str | None = None) -> list[SnapshotInfo]:
        conn = _Connection(ConnectionConfig.resolve(api_url, api_key))
        try:
            return await conn.drive(_core.list_snapshots())
        finally:
            await conn.release()

    @classmethod
    async def delete_snapshot(cls, name: str, *, api_url: str | None = None, api_key: str | None = None) -> bool:
        """Remove snapshot ``name`` from the store; whether it existed."""
        conn = _Connection(ConnectionConfig.resolve(api_url, api_key))
        try:
            return await conn.drive(_core.delete_snapshot(name))
        finally:
            await conn.release()

    async def fork(self, count: int = 1, *, timeout: float | None = None) -> list[Any]:
        """``count`` new sandboxes whose file systems start as this one's is now
        (each one's first process starts anew); each child or the error that
        kept it from starting, in order.  ``timeout``: each child's (default this one's)."""
        children = await self._drive(_core.fork(self.id, count, timeout=timeout))
        return [type(self)(c, self._conn.retain()) if isinstance(c, EnvironmentInfo) else c for c in children]

    async def reset(self, snapshot: str | None = None) -> None:
        """Back to the template's state, or to snapshot ``snapshot``'s (taken on
        its node), in place: a fresh file system, the first process started
        again, the same id and resources."""
        self.info = await self._drive(_core.reset(self.id, snapshot))

    async def pause(self, *, release_memory: bool = False) -> None:
        """Freeze every process (memory kept, no CPU used) until :meth:`resume`;
        with ``release_memory``, end them and keep the files instead (resume
        starts the first process anew)."""
        self.info = await self._drive(_core.pause(self.id, release_memory))

    async def resume(self, *, timeout: float | None = None) -> None:
        """Thaw it; its timeout ``timeout`` seconds from now (default its own)."""
        self.info = await self._drive(_core.resume(self.id, timeout))

    async def kill(self) -> bool:
        """Destroy the environment (whether it still existed) and close the connection."""
        try:
            return await self._drive(_core.kill(self.id))
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        """Let go of the connection; the environment lives on until killed or timed out.  Idempotent."""
        if not self._closed:
            self._closed = True
            await self._conn.release()

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.kill()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(id={self.id!r}, template={self.info.template!r})"


def _templates(templates: str | list[str], count: int | None) -> list[str]:
    if isinstance(templates, str):
        return [templates] * (1 if count is None else count)
    if count is not None:
        raise _core.InvalidInputError("give count with one template, not with a list")
    return list(templates)


class AsyncNodeClient:
    """The node's API as records, one request a method, for the CLI and
    operators (:meth:`weenv.server.daemon.connect` makes one for a home,
    starting its daemon if asked): environments by id, commands run to their
    end with their output captured, the node's stats, its chunk cache, its
    shutdown.  It takes and returns the node's models (:mod:`weenv.api.models`).

    Where the daemon is: ``socket`` (a Unix socket, needing no key), else as a
    sandbox finds it.  ``request_timeout``: seconds a request may wait for its
    answer.  Errors as a sandbox's (:class:`DaemonError` when the daemon cannot
    be reached).
    """

    def __init__(
        self,
        *,
        socket: str | os.PathLike | None = None,
        api_url: str | None = None,
        api_key: str | None = None,
        request_timeout: float | None = None,
    ):
        self._conn = _Connection(ConnectionConfig.resolve(api_url, api_key, request_timeout, socket=socket))
        self._closed = False

    @property
    def where(self) -> str:
        return self._conn.config.where

    async def health(self) -> bool:
        return await self._conn.drive(_core.health())

    async def create(
        self,
        template: str,
        *,
        resources: Any = None,
        first_command: bool = True,
        timeout: float | None = None,
        priority: int = 0,
        metadata: dict[str, str] | None = None,
    ) -> EnvironmentInfo:
        return await self._conn.drive(
            _core.create(
                template,
                resources=resources,
                first_command=first_command,
                timeout=timeout,
                priority=priority,
                metadata=metadata,
            )
        )

    async def create_many(
        self,
        items: list[CreateRequest],
        *,
        concurrency: int | None = None,
        on_event: Callable[[BatchCreateEvent], Any] | None = None,
    ) -> list[BatchCreateEvent]:
        """One batch create; ``on_event(event)`` as each item is done (a failed
        item is an event); every event, in the order they came."""
        return await self._conn.drive(_core.batch_events(items, concurrency=concurrency, on_event=on_event))

    async def get(self, env_id: str) -> EnvironmentInfo:
        return await self._conn.drive(_core.get(env_id))

    async def list(self) -> list[EnvironmentInfo]:
        return await self._conn.drive(_core.list_environments())

    async def set_timeout(self, env_id: str, timeout: float) -> EnvironmentInfo:
        return await self._conn.drive(_core.set_timeout(env_id, timeout))

    async def set_priority(self, env_id: str, priority: int) -> EnvironmentInfo:
        """Higher grows first and is frozen last when memory runs short."""
        return await self._conn.drive(_core.set_priority(env_id, priority))

    async def set_resources(
        self,
        env_id: str,
        *,
        cpus: float | None = None,
        memory_bytes: int | None = None,
        pids: int | None = None,
        disk_bytes: int | None = None,
    ) -> EnvironmentInfo:
        """Resize environment ``env_id`` live (see :meth:`AsyncSandbox.set_resources`)."""
        return await self._conn.drive(
            _core.set_resources(env_id, cpus=cpus, memory_bytes=memory_bytes, pids=pids, disk_bytes=disk_bytes)
        )

    async def destroy(self, env_id: str) -> None:
        """Destroy environment ``env_id``; :class:`NotFoundError` if there is none."""
        await self._conn.drive(_core.kill(env_id, missing_ok=False))

    async def exec(
        self,
        env_id: str,
        command: list[str] | str,
        *,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        timeout: float | None = None,
        stdin: bytes | None = None,
    ) -> ExecResult:
        """Run ``command`` (argv, or a shell string) to its end; its exit code and captured output."""
        req = _core.exec_request(command, envs=env, cwd=cwd, timeout=timeout, stdin=stdin)
        return await self._conn.drive(_core.exec_captured(env_id, req))

    async def read_file(self, env_id: str, path: str) -> bytes:
        return await self._conn.drive(_core.read_file(env_id, path, format="bytes"))

    async def write_file(self, env_id: str, path: str, data: bytes) -> WriteInfo:
        return await self._conn.drive(_core.write_file(env_id, path, data))

    async def stats(self) -> NodeStats:
        return await self._conn.drive(_core.node_stats())

    async def provision_stats(self, env_id: str | None = None) -> ProvisionStats:
        return await self._conn.drive(_core.provision_stats(env_id))

    async def reset_profile(self, template: str) -> ProfileReset:
        """Forget what environments of ``template`` taught the node about their usage (its usage profile)."""
        return await self._conn.drive(_core.reset_profile(template))

    async def snapshot(self, env_id: str, name: str | None = None) -> SnapshotInfo:
        """Capture the environment's file system and publish it as a template."""
        return await self._conn.drive(_core.snapshot(env_id, name))

    async def fork(self, env_id: str, count: int, *, timeout: float | None = None) -> ForkResponse:
        """``count`` children of the environment (each one's info or error) and the fork's timings."""
        return await self._conn.drive(_core.fork_answer(env_id, count, timeout=timeout))

    async def reset(self, env_id: str, snapshot: str | None = None) -> EnvironmentInfo:
        return await self._conn.drive(_core.reset(env_id, snapshot))

    async def pause(self, env_id: str, *, release_memory: bool = False) -> EnvironmentInfo:
        return await self._conn.drive(_core.pause(env_id, release_memory))

    async def resume(self, env_id: str, *, timeout: float | None = None) -> EnvironmentInfo:
        return await self._conn.drive(_core.resume(env_id, timeout))

    async def tax(self) -> TaxReport:
        return await self._conn.drive(_core.tax_report())

    async def drop_cache(self) -> None:
        await self._conn.drive(_core.drop_cache())

    async def shutdown(self) -> None:
        await self._conn.drive(_core.shutdown())

    async def aclose(self) -> None:
        """Close the connection.  Idempotent."""
        if not self._closed:
            self._closed = True
            await self._conn.release()

    async def __aenter__(self) -> AsyncNodeClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()
