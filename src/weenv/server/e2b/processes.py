"""envd's process service (``process.Process``) over weenv's streamed commands.

A command is the node's streamed process (:meth:`weenv.node.node.Node.spawn`,
a :class:`weenv.node.runtime.process.Process`), whose output log the RPC streams follow: ``Start`` sends the start event (the pid inside the
sandbox), each stdout/stderr chunk as it arrives, then the end event;
``Connect`` attaches to a running command and sends what comes next.  The
command's deadline is the call's ``Connect-Timeout-Ms`` (as envd: the command is
killed then, not when the client goes away); without it the command runs until
it ends or is killed.  Idle streams get a keepalive event every
``Keepalive-Ping-Interval`` seconds.

As in envd, a command runs as the user the call names (E2B's ``user``, sent as
HTTP basic auth; default the template's user) with that user's groups and
``HOME``/``USER``/``LOGNAME``; its variables are those, the template's, the
sandbox's (create ``envs``), then the call's; ``cwd`` defaults to the
template's working directory, else the user's home, and must exist.

A ``Start`` with ``pty`` runs the command on a pseudo-terminal the exec agent
allocates inside the sandbox (:meth:`weenv.node.node.Node.spawn`'s ``tty``):
its output comes as ``pty`` data, ``SendInput`` takes ``pty`` input (and only
that, as envd), ``Update`` resizes it; sizes are 1 to
:data:`~weenv.node.runtime.commands.MAX_TTY_SIDE` columns and rows.
"""

from __future__ import annotations

import signal as signals
import time
import weakref
from collections.abc import AsyncIterator

import anyio
import anyio.to_thread
from google.protobuf.message import Message

from weenv.errors import InvalidInputError, NotFoundError, WeenvError
from weenv.node.node import Node
from weenv.node.runtime.commands import check_tty_size
from weenv.node.runtime.process import Process
from weenv.node.runtime.users import Identity
from weenv.server.e2b.connect import CallContext, RpcError
from weenv.server.e2b.files import fs_of, resolve
from weenv.server.e2b.proto import process_pb
from weenv.server.e2b.sandboxes import Sandbox

READ_WAIT_S = 5.0
"""Longest a stream waits for output in one worker-thread call (then checks keepalive)."""
_LIMITER = anyio.CapacityLimiter(1024)
"""Worker threads for following command output (apart from the request handlers' pool)."""


def _selected(node: Node, sb: Sandbox, selector) -> Process:
    """The running command ``selector`` names (pid or tag); RpcError not_found otherwise."""
    kind = selector.WhichOneof("selector")
    if kind is None:
        raise RpcError("invalid_argument", "no process selected (pid or tag)")
    p = None
    if kind == "pid":
        try:
            p = node.process(sb.id, selector.pid)
        except NotFoundError:
            p = None
    else:
        pid = next((i.pid for i in node.processes(sb.id) if i.running and i.tag == selector.tag), None)
        p = node.process(sb.id, pid) if pid else None
    if p is None or not p.running:
        what = f"pid {selector.pid}" if kind == "pid" else f"tag {selector.tag!r}"
        raise RpcError("not_found", f"process with {what} not found")
    return p


def _start(node: Node, sb: Sandbox, req, timeout: float | None, who: Identity) -> Process:
    """Spawn the command of ``req`` (blocking: a worker thread); raises RpcError."""
    cfg = req.process
    if not cfg.cmd:
        raise RpcError("invalid_argument", "no command (process.cmd)")
    tty = _tty_size(req.pty) if req.HasField("pty") else None
    cwd = resolve(sb, cfg.cwd, who) if cfg.HasField("cwd") and cfg.cwd else sb.start_dir(who)
    if not fs_of(node, sb).exists(cwd):
        raise RpcError("invalid_argument", f"cwd '{cwd}' does not exist")
    stdin_open = req.stdin if req.HasField("stdin") else True  # envd: a pipe unless disabled
    try:
        return node.spawn(
            sb.id,
            [cfg.cmd, *cfg.args],
            env=dict(cfg.envs),
            cwd=cwd,
            timeout=timeout,
            stdin_open=stdin_open,
            tag=req.tag if req.HasField("tag") else None,
            primary_reader=True,
            user=who,
            tty=tty,
        )
    except InvalidInputError as exc:
        raise RpcError("invalid_argument", str(exc)) from exc


def _tty_size(pty) -> tuple[int, int]:
    """``(cols, rows)`` of a ``PTY`` message, checked (:func:`check_tty_size`); RpcError."""
    cols, rows = pty.size.cols, pty.size.rows
    try:
        check_tty_size(cols, rows)
    except InvalidInputError as exc:
        raise RpcError("invalid_argument", f"bad PTY size {cols}x{rows}: {exc}") from exc
    return cols, rows


def _event(**kw) -> Message:
    return process_pb.ProcessEvent(**kw)


async def _follow(
    p: Process, reader: int, ctx: CallContext, wrap, *, sent_start: bool = False, pending: list | None = None
) -> AsyncIterator[Message]:
    """The envd events of ``p`` from ``reader``'s cursor (after ``pending``, events
    already read), each wrapped by ``wrap``.  A command lost or killed because
    its sandbox went away ends the stream ``unavailable`` (as envd's connection
    ending before the stream completed): the SDK then probes ``/health``, gets
    "not found" and raises ``SandboxNotRunningException``."""
    keepalive = keepalive_s(ctx)
    last = time.monotonic()
    try:
        while True:
            if pending:
                batch, pending = pending, None
            else:
                wait = (
                    READ_WAIT_S
                    if keepalive is None
                    else max(0.05, min(READ_WAIT_S, keepalive - (time.monotonic() - last)))
                )
                batch = await anyio.to_thread.run_sync(p.log.read, reader, wait, limiter=_LIMITER)
            if batch is None:
                return
            if not batch:
                if keepalive is not None and time.monotonic() - last >= keepalive:
                    yield wrap(_event(keepalive=process_pb.ProcessEvent.KeepAlive()))
                    last = time.monotonic()
                continue
            for e in batch:
                if e.type == "start":
                    if not sent_start:
                        sent_start = True
                        yield wrap(_event(start=process_pb.ProcessEvent.StartEvent(pid=e.pid or 0)))
                elif e.type in ("stdout", "stderr"):
                    data = process_pb.ProcessEvent.DataEvent(**{"pty" if p.tty else e.type: e.data or b""})
                    yield wrap(_event(data=data))
                elif e.type in ("end", "error") and await _sandbox_gone(ctx, e):
                    sid = ctx.state["sandbox"].id
                    raise RpcError("unavailable", f"the connection to sandbox {sid} ended before the command completed")
                elif e.type == "end":
                    if p.timed_out:
                        raise RpcError("deadline_exceeded", "the command ran past its timeout and was killed")
                    yield wrap(_event(end=_end_event(p, e.exit_code)))
                elif e.type == "error":
                    raise RpcError("internal", e.error.message if e.error else "the command failed")
            last = time.monotonic()
    finally:
        p.log.detach(reader)


async def _sandbox_gone(ctx: CallContext, e) -> bool:
    """Whether the command's sandbox is gone (killed, timed out) as the command
    ended with ``e``: lost, or killed by a signal (destroying a sandbox takes it
    out of the node's table before killing its processes)."""
    if e.type == "end" and (e.exit_code is None or e.exit_code < 128):
        return False
    node: Node = ctx.state["node"]
    try:
        await anyio.to_thread.run_sync(node.get, ctx.state["sandbox"].id)
    except NotFoundError:
        return True
    return False


_KILLED: weakref.WeakSet[Process] = weakref.WeakSet()
"""Commands stopped by SendSignal (their end reports the signal, as envd's does)."""


def _end_event(p: Process, code: int | None):
    code = -1 if code is None else code
    if p in _KILLED and code >= 128:
        status = f"signal: {signals.Signals(code - 128).name[3:].lower()}" if code - 128 in _SIGNALS else "signal"
        return process_pb.ProcessEvent.EndEvent(exit_code=-1, exited=False, status=status, error=status)
    end = process_pb.ProcessEvent.EndEvent(exit_code=code, exited=True, status=f"exit status {code}")
    if code != 0:
        end.error = f"exit status {code}"
    return end


_SIGNALS = {s.value for s in signals.Signals}


def keepalive_s(ctx: CallContext) -> float | None:
    """Seconds between keepalive events the call asks (``Keepalive-Ping-Interval``,
    at least 1), None without the header."""
    raw = ctx.header("keepalive-ping-interval")
    try:
        return max(1.0, float(raw)) if raw else None
    except ValueError:
        return None


class ProcessService:
    """The handlers of ``process.Process`` for one app (see the module docstring)."""

    def __init__(self, node: Node):
        self.node = node

    async def start(self, req, ctx: CallContext) -> AsyncIterator[Message]:
        sb: Sandbox = ctx.state["sandbox"]
        p = await anyio.to_thread.run_sync(_start, self.node, sb, req, ctx.timeout, ctx.state["user"])
        assert p.primary is not None
        async for item in _follow(p, p.primary, ctx, lambda ev: process_pb.StartResponse(event=ev)):
            yield item

    async def connect(self, req, ctx: CallContext) -> AsyncIterator[Message]:
        sb: Sandbox = ctx.state["sandbox"]
        p = await anyio.to_thread.run_sync(_selected, self.node, sb, req.process)
        reader = p.log.attach()
        # A reader attached now starts at the oldest output kept; envd sends only
        # what comes next, so skip the output already there (not an end).
        seen = p.log.read(reader, 0) or []
        tail = [e for e in seen if e.type in ("end", "error")]
        yield process_pb.ConnectResponse(event=_event(start=process_pb.ProcessEvent.StartEvent(pid=p.pid or 0)))

        def wrap(ev):
            return process_pb.ConnectResponse(event=ev)

        async for item in _follow(p, reader, ctx, wrap, sent_start=True, pending=tail):
            yield item

    async def list(self, req, ctx: CallContext) -> Message:
        sb: Sandbox = ctx.state["sandbox"]
        procs = await anyio.to_thread.run_sync(self.node.processes, sb.id)
        out = process_pb.ListResponse()
        for p in procs:
            if not p.running or not p.pid:
                continue
            info = out.processes.add(pid=p.pid)
            argv = p.command if isinstance(p.command, list) else ["/bin/sh", "-c", p.command]
            info.config.cmd = argv[0]
            info.config.args.extend(argv[1:])
            if p.cwd:
                info.config.cwd = p.cwd
            if p.tag is not None:
                info.tag = p.tag
        return out

    async def send_signal(self, req, ctx: CallContext) -> Message:
        sb: Sandbox = ctx.state["sandbox"]
        p = await anyio.to_thread.run_sync(_selected, self.node, sb, req.process)
        await send_signal(p, req.signal)
        return process_pb.SendSignalResponse()

    async def send_input(self, req, ctx: CallContext) -> Message:
        sb: Sandbox = ctx.state["sandbox"]
        p = await anyio.to_thread.run_sync(_selected, self.node, sb, req.process)
        await _send_input(p, req.input)
        return process_pb.SendInputResponse()

    async def stream_input(self, requests: AsyncIterator[Message], ctx: CallContext) -> Message:
        """``StreamInput``: a start event naming the process, then its input
        events, written in order as they arrive; keepalives are ignored."""
        sb: Sandbox = ctx.state["sandbox"]
        p: Process | None = None
        async for req in requests:
            kind = req.WhichOneof("event")
            if kind == "start":
                p = await anyio.to_thread.run_sync(_selected, self.node, sb, req.start.process)
            elif kind == "data":
                if p is None:
                    raise RpcError("failed_precondition", "input before the start event naming the process")
                await _send_input(p, req.data.input)
        return process_pb.StreamInputResponse()

    async def close_stdin(self, req, ctx: CallContext) -> Message:
        sb: Sandbox = ctx.state["sandbox"]
        p = await anyio.to_thread.run_sync(_selected, self.node, sb, req.process)
        if p.stdin_open:
            await _write_stdin(p, b"", eof=True)
        return process_pb.CloseStdinResponse()

    async def update(self, req, ctx: CallContext) -> Message:
        """Resize the process's PTY (``UpdateRequest.pty``; nothing else to update)."""
        sb: Sandbox = ctx.state["sandbox"]
        p = await anyio.to_thread.run_sync(_selected, self.node, sb, req.process)
        if req.HasField("pty"):
            cols, rows = _tty_size(req.pty)
            try:
                await anyio.to_thread.run_sync(p.resize, cols, rows)
            except InvalidInputError as exc:
                raise RpcError("failed_precondition", str(exc)) from exc
        return process_pb.UpdateResponse()


async def send_signal(p: Process, signal: int) -> None:
    """SIGKILL (9) or SIGTERM (15) to ``p`` (its end event then names the
    signal); RpcError ``invalid_argument`` for another."""
    names = {9: "KILL", 15: "TERM"}
    if signal not in names:
        raise RpcError("invalid_argument", f"unsupported signal {signal} (SIGTERM or SIGKILL)")
    _KILLED.add(p)
    await anyio.to_thread.run_sync(p.kill, names[signal])


async def _send_input(p: Process, given) -> None:
    """Write the ``ProcessInput`` ``given`` to ``p``: ``pty`` input to its
    terminal, ``stdin`` to its stdin pipe (as envd, the other is refused)."""
    which = given.WhichOneof("input")
    if which is None:
        raise RpcError("invalid_argument", "no input (stdin or pty)")
    if (which == "pty") != p.tty:
        raise RpcError(
            "failed_precondition",
            "the process has a PTY: send pty input, not stdin"
            if p.tty
            else "the process has no PTY: send stdin input, not pty",
        )
    await _write_stdin(p, getattr(given, which), eof=False)


async def _write_stdin(p: Process, data: bytes, *, eof: bool) -> None:
    try:
        await anyio.to_thread.run_sync(lambda: p.write_stdin(data, eof=eof))
    except InvalidInputError as exc:
        raise RpcError("failed_precondition", str(exc)) from exc
    except WeenvError as exc:
        raise RpcError("deadline_exceeded" if exc.kind == "timeout" else "internal", str(exc)) from exc
