"""Commands whose output streams while they run (streamed and background runs).

A command is started by one of two *launchers*, each giving a :class:`Spawned`:
the exec agent inside the environment (:mod:`weenv.node.runtime.agent`, the fast path)
or ``runc exec`` through an exec helper (:meth:`weenv.node.runtime.runc.Runc.spawn`,
the fallback).  Either way its stdout and stderr are pipes the node reads.
A :class:`Process` owns one such command: a *pump* thread reads both pipes and
the launcher's status descriptor (:meth:`Spawned.fileno`) with poll(2) and
appends :class:`ProcessEvent` s to an :class:`OutputLog`, in the order the
bytes arrived:

    start (pid)  ->  stdout / stderr chunks  ->  end (exit code) | error

Readers follow the log with cursors.  The log keeps at most ``retain_bytes`` of
output: past that, chunks every attached reader has read (or, with no reader
attached, the oldest ones) are dropped and counted; when an attached reader
lags, the pump waits for it, so the command blocks on its full pipe
(back-pressure) and a slow client never makes the daemon hold a huge output.

Until the launcher reports that the command runs (:meth:`Spawned.started`),
output is held back: bytes on stderr may be runc's own error message, which
becomes a 127/126 exit (:meth:`Spawned.fate`).

When the command exits, the pump takes what it left in the pipes and hands
the pipes to a :class:`PipeSink`: descendants it left running in the background
(``server &``) keep writing into a sink that discards their output, as
:meth:`Runc.exec` lets them write into an unlinked file, instead of dying of
SIGPIPE.
"""

from __future__ import annotations

import abc
import collections
import contextlib
import errno
import logging
import os
import select
import signal as signals
import threading
import time
from collections.abc import Callable, Iterator
from typing import BinaryIO

from weenv.api.models import ErrorInfo, ExecResult, ProcessEvent, ProcessInfo
from weenv.errors import CommandTimeoutError, InvalidInputError, WeenvError

log = logging.getLogger(__name__)

EXIT_NOT_FOUND, EXIT_CANNOT_RUN, EXIT_KILLED = 127, 126, 128 + 9
"""Exit codes as shells report them: command not found, found but not
runnable, killed by SIGKILL (a timeout or a kill)."""

READ_SIZE = 64 << 10
DRAIN_CAP = 4 << 20
"""Bytes read from each pipe after the command exited (what it wrote before exiting
is in the pipe; descendants still writing are not waited for)."""
DEFAULT_RETAIN = 8 << 20


class Spawned(abc.ABC):
    """A command a launcher started, as :class:`Process` drives it.

    ``stdout``/``stderr``: the read ends of the command's pipes; ``stdin``: the
    write end of its stdin pipe, or None when stdin is not a pipe.
    ``poll_ms``: how often :meth:`started` must be polled until it answers
    (None: :meth:`fileno` becomes readable when it changes).
    """

    stdin: BinaryIO | None
    stdout: BinaryIO
    stderr: BinaryIO
    poll_ms: int | None = None
    tty: bool = False
    """Whether the command runs on a pseudo-terminal: ``stdout`` reads its master
    (end of file is EIO there), ``stdin`` writes it, ``stderr`` stays empty."""

    @abc.abstractmethod
    def fileno(self) -> int:
        """A descriptor that polls readable when :meth:`update` has news."""

    @abc.abstractmethod
    def update(self) -> bool:
        """Take the news without blocking; True once the command's fate is known
        (it ended, could not start, or its launcher died)."""

    @abc.abstractmethod
    def started(self) -> int | None:
        """The command's pid inside the environment once it runs (0 if it was
        gone too soon to see), else None."""

    @abc.abstractmethod
    def fate(self, stderr: bytes) -> tuple[int, bytes]:
        """``(exit code, message)`` once :meth:`update` returned True.  When the
        command never started, ``stderr`` is what it held back and the message
        says why (exit 127 or 126).  Raises :class:`WeenvError` when the
        launcher lost the command (the environment stopped, the agent died)."""

    @abc.abstractmethod
    def kill_tree(self) -> None:
        """SIGKILL the command and every descendant still in its tree."""

    def kill_leftovers(self) -> None:
        """Once the command ended: SIGKILL what it left running, where the
        launcher can tell (the exec agent's command cgroup); else nothing."""

    @abc.abstractmethod
    def signal(self, sig: int) -> None:
        """Send ``sig`` to the command alone (a command already gone is fine)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the launcher's resources (the pipes are the caller's)."""

    def resize(self, cols: int, rows: int) -> None:
        """Set the size of the command's terminal; raises :class:`InvalidInputError`
        without one."""
        raise InvalidInputError("the command does not run on a terminal")


class OutputLog:
    """The ordered events of one command, read through cursors (see the module doc).

    ``retain_bytes``: output bytes kept before dropping or waiting.  Thread-safe.
    """

    def __init__(self, retain_bytes: int = DEFAULT_RETAIN):
        self.retain_bytes = retain_bytes
        self.dropped = 0
        """Output bytes dropped from the front."""
        self._cond = threading.Condition()
        self._events: collections.deque[ProcessEvent] = collections.deque()
        self._first = 0
        self._next = 0
        self._size = 0
        self._closed = False
        self._abandoned = False
        self._readers: dict[int, int] = {}
        self._reader_ids = 0

    def append(self, event: ProcessEvent) -> None:
        """Add ``event``; may wait while an attached reader lags (back-pressure)."""
        with self._cond:
            self._events.append(event)
            self._next += 1
            self._size += len(event.data or b"")
            self._cond.notify_all()
            while self._size > self.retain_bytes and self._events:
                floor = min(self._readers.values(), default=self._next)
                if self._first < floor:
                    old = self._events.popleft()
                    self._first += 1
                    self._size -= len(old.data or b"")
                    self.dropped += len(old.data or b"")
                elif self._abandoned:
                    break
                else:
                    self._cond.wait(0.5)

    def close(self) -> None:
        """No more events will come; readers get None once they have read all."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def abandon(self) -> None:
        """Stop waiting for lagging readers (the command is being killed)."""
        with self._cond:
            self._abandoned = True
            self._cond.notify_all()

    def attach(self) -> int:
        """A new reader, starting at the oldest event kept; returns its id."""
        with self._cond:
            self._reader_ids += 1
            self._readers[self._reader_ids] = self._first
            return self._reader_ids

    def detach(self, reader: int) -> None:
        with self._cond:
            self._readers.pop(reader, None)
            self._cond.notify_all()

    def read(self, reader: int, timeout: float | None = None) -> list[ProcessEvent] | None:
        """The events ``reader`` has not read yet, waiting up to ``timeout`` seconds
        for some (``[]`` if none came); None when the log is closed and read."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                pos = max(self._readers[reader], self._first)
                if pos < self._next:
                    out = [self._events[i - self._first] for i in range(pos, self._next)]
                    self._readers[reader] = self._next
                    self._cond.notify_all()
                    return out
                if self._closed:
                    return None
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return []
                self._cond.wait(left)

    def follow(self, reader: int | None = None) -> Iterator[ProcessEvent]:
        """Every event from ``reader``'s cursor (a new reader if None) to the end,
        blocking; detaches the reader at the end or when the iterator is closed."""
        reader = self.attach() if reader is None else reader
        try:
            while (batch := self.read(reader)) is not None:
                yield from batch
        finally:
            self.detach(reader)


class PipeSink:
    """One thread reading and discarding what is written to adopted pipes until
    their writers close them.  :meth:`close` stops it and closes every pipe."""

    def __init__(self) -> None:
        self._files: dict[int, BinaryIO] = {}
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._thread: threading.Thread | None = None
        self._stop = False

    def adopt(self, f: BinaryIO) -> None:
        with self._lock:
            if self._stop:
                f.close()
                return
            os.set_blocking(f.fileno(), False)
            self._files[f.fileno()] = f
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="weenv-pipe-sink", daemon=True)
                self._thread.start()
        os.write(self._wake_w, b"x")

    def __len__(self) -> int:
        with self._lock:
            return len(self._files)

    def _run(self) -> None:
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        registered: set[int] = set()
        while True:
            with self._lock:
                if self._stop:
                    return
                for fd in set(self._files) - registered:
                    poller.register(fd, select.POLLIN)
                    registered.add(fd)
            for fd, _ev in poller.poll():
                if fd == self._wake_r:
                    with contextlib.suppress(BlockingIOError):
                        os.read(self._wake_r, 4096)
                    continue
                try:
                    data = os.read(fd, READ_SIZE)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data:
                    poller.unregister(fd)
                    registered.discard(fd)
                    with self._lock:
                        f = self._files.pop(fd, None)
                    if f is not None:
                        f.close()

    def close(self) -> None:
        with self._lock:
            self._stop = True
            files, self._files = list(self._files.values()), {}
        os.write(self._wake_w, b"x")
        if self._thread is not None:
            self._thread.join(timeout=5)
        for f in files:
            f.close()
        os.close(self._wake_r)
        os.close(self._wake_w)


class Process:
    """One command a launcher started (see the module doc).

    ``command``/``tag``/``cwd``: what it was asked (for :meth:`info`).
    ``timeout``: seconds after which the command tree is SIGKILLed (exit 137,
    ``timed_out``).  ``stdin``: bytes written to a piped stdin by a helper
    thread.  ``primary_reader``: attach a reader before anything is read (a
    foreground stream: it sees every event and exerts back-pressure); its id is
    :attr:`primary`.  ``on_exit`` is called from the pump once the log is closed.
    """

    def __init__(
        self,
        spawned: Spawned,
        *,
        command: list[str] | str,
        tag: str | None = None,
        cwd: str | None = None,
        timeout: float | None = None,
        stdin: bytes | None = None,
        retain_bytes: int = DEFAULT_RETAIN,
        sink: PipeSink | None = None,
        primary_reader: bool = False,
        on_exit: Callable[[Process], None] | None = None,
    ):
        self.spawned = spawned
        self.command, self.tag, self.cwd = command, tag, cwd
        self.timeout = timeout
        self.log = OutputLog(retain_bytes)
        self.primary = self.log.attach() if primary_reader else None
        self.started_at = time.time()
        self._t0 = time.monotonic()
        self.pid: int | None = None
        """Pid inside the environment (0: never started, or gone before it was seen)."""
        self.exit_code: int | None = None
        self.timed_out = False
        self.duration_s: float | None = None
        self.error: WeenvError | None = None
        self._sink = sink
        self._on_exit = on_exit
        self._started = threading.Event()
        self._done = threading.Event()
        self._stdin_lock = threading.Lock()
        self._kill_lock = threading.Lock()
        self._timer: threading.Timer | None = None
        if timeout is not None:  # made before the pump runs: a pump that ends at once must find it to cancel it
            self._timer = threading.Timer(timeout, self._on_timeout)
            self._timer.daemon = True
        self._pump = threading.Thread(target=self._run, name="weenv-pump", daemon=True)
        self._pump.start()
        if self._timer is not None:
            self._timer.start()  # one cancelled meanwhile ends at once
        if stdin:
            threading.Thread(target=self._feed_stdin, args=(stdin,), daemon=True).start()

    # --- state -----------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return not self._done.is_set()

    def wait_started(self, timeout: float | None = None) -> int | None:
        """Block until the command runs or ended; its pid in the environment."""
        self._started.wait(timeout)
        return self.pid

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the command ended and its output is all in the log; whether it has."""
        return self._done.wait(timeout)

    def info(self) -> ProcessInfo:
        return ProcessInfo(
            pid=self.pid or 0,
            command=self.command,
            tag=self.tag,
            cwd=self.cwd,
            started_at=self.started_at,
            running=self.running,
            exit_code=self.exit_code,
            timed_out=self.timed_out,
            duration_s=self.duration_s,
            output_dropped=self.log.dropped,
        )

    def result(self) -> ExecResult:
        """The ended command as an :class:`ExecResult` with the output the log still holds."""
        self.wait()
        out, err = bytearray(), bytearray()
        reader = self.log.attach()
        for e in self.log.follow(reader):
            if e.type == "stdout":
                out += e.data or b""
            elif e.type == "stderr":
                err += e.data or b""
        if self.error is not None:
            raise self.error
        return ExecResult(
            exit_code=self.exit_code if self.exit_code is not None else -1,
            stdout=bytes(out),
            stderr=bytes(err),
            duration_s=self.duration_s or 0.0,
            timed_out=self.timed_out,
        )

    # --- control ---------------------------------------------------------------------
    def kill(self, signal: str | int = "KILL") -> None:
        """Send ``signal`` to the command; ``KILL`` (the default) kills its whole
        tree as a timeout does, with what escaped it (``setsid``, double forks:
        every process the command started, through the launcher's command
        cgroup).  Raises :class:`InvalidInputError` for an unknown signal.  A
        command that already ended gets no signal; ``KILL`` still kills what it
        left running (e.g. a fork bomb whose first process returned)."""
        sig = _signal_number(signal)
        if not self.running:
            if sig == signals.SIGKILL:
                with self._kill_lock:
                    self.spawned.kill_leftovers()
            return
        with self._kill_lock:
            if sig == signals.SIGKILL:
                self.log.abandon()
                self.spawned.kill_tree()
            elif self.pid:
                self.spawned.signal(sig)

    def write_stdin(self, data: bytes, *, eof: bool = False, timeout: float = 30.0) -> None:
        """Write ``data`` to the command's stdin pipe (and close it with ``eof``).

        Raises :class:`InvalidInputError` if stdin is not a pipe (not started with
        ``stdin_open``) or is closed, :class:`CommandTimeoutError` if the command
        does not read it within ``timeout`` seconds."""
        with self._stdin_lock:
            f = self.spawned.stdin
            if f is None or f.closed:
                raise InvalidInputError("the command's stdin is not open (start it with stdin_open, once)")
            fd = f.fileno()
            os.set_blocking(fd, False)
            view = memoryview(data)
            deadline = time.monotonic() + timeout
            try:
                while view:
                    try:
                        view = view[os.write(fd, view) :]
                    except BlockingIOError:
                        left = deadline - time.monotonic()
                        poller = select.poll()
                        poller.register(fd, select.POLLOUT)
                        if left <= 0 or not poller.poll(int(left * 1000) + 1):
                            raise CommandTimeoutError(
                                f"the command did not read its stdin within {timeout} s"
                            ) from None
            except BrokenPipeError:
                f.close()
                raise InvalidInputError("the command closed its stdin or ended") from None
            except OSError as exc:  # a terminal whose other side is gone answers EIO, not EPIPE
                if exc.errno != errno.EIO or not self.spawned.tty:
                    raise
                raise InvalidInputError("the command's terminal closed: the command ended") from None
            if eof:
                f.close()

    @property
    def tty(self) -> bool:
        """Whether the command runs on a pseudo-terminal (its output is all ``stdout``)."""
        return self.spawned.tty

    def resize(self, cols: int, rows: int) -> None:
        """Set the size of the command's terminal (columns, rows; the node
        checked them); raises :class:`InvalidInputError` without a terminal or
        once it ended."""
        with self._stdin_lock:  # the pump closes the terminal under this lock
            self.spawned.resize(cols, rows)

    @property
    def stdin_open(self) -> bool:
        """Whether the command's stdin is a pipe still open for :meth:`write_stdin`."""
        f = self.spawned.stdin
        return f is not None and not f.closed

    def _feed_stdin(self, data: bytes) -> None:
        with contextlib.suppress(WeenvError, OSError):
            self.write_stdin(data, timeout=3600)

    def _on_timeout(self) -> None:
        if self.running:
            self.timed_out = True
            self.kill("KILL")

    # --- the pump --------------------------------------------------------------------
    def _run(self) -> None:
        proc = self.spawned
        streams = {proc.stdout.fileno(): "stdout", proc.stderr.fileno(): "stderr"}
        files = {proc.stdout.fileno(): proc.stdout, proc.stderr.fileno(): proc.stderr}
        held: list[ProcessEvent] = []
        open_fds = set(streams)
        try:
            for fd in streams:
                os.set_blocking(fd, False)
            poller = select.poll()
            status_fd = proc.fileno()
            for fd in (*streams, status_fd):
                poller.register(fd, select.POLLIN)
            exited = False
            while not exited:
                if self.pid is None:  # (the launcher may know already, before any news)
                    self._check_started(held)
                for fd, _ev in poller.poll(proc.poll_ms if self.pid is None else None):
                    if fd == status_fd:
                        exited = proc.update()
                        continue
                    data = _read(fd)
                    if data == b"":
                        poller.unregister(fd)
                        open_fds.discard(fd)
                    elif data:
                        self._emit(streams[fd], data, held)
            for fd in list(open_fds):  # what the command wrote before it exited
                total = 0
                while total < DRAIN_CAP:
                    data = _read(fd)
                    if not data:
                        if data == b"":
                            open_fds.discard(fd)
                        break
                    total += len(data)
                    self._emit(streams[fd], data, held)
            if self.pid is None:
                self._check_started(held)
            self.duration_s = time.monotonic() - self._t0
            if self.timed_out:
                self.exit_code = EXIT_KILLED
                for e in held:
                    self.log.append(e)
            elif self.pid is None:  # it could not start: the held stderr may be runc's message
                code, message = proc.fate(b"".join(e.data or b"" for e in held if e.type == "stderr"))
                self.pid = 0
                self.log.append(ProcessEvent(type="start", pid=0))
                if message:
                    self.log.append(ProcessEvent(type="stderr", data=message))
                self.exit_code = code
            else:
                self.exit_code, _ = proc.fate(b"")
            self.log.append(
                ProcessEvent(
                    type="end",
                    pid=self.pid,
                    exit_code=self.exit_code,
                    timed_out=self.timed_out,
                    duration_s=self.duration_s,
                )
            )
        except WeenvError as exc:
            self.error = exc
            self.log.append(ProcessEvent(type="error", pid=self.pid, error=ErrorInfo(kind=exc.kind, message=str(exc))))
        except Exception as exc:  # never leave readers waiting
            log.exception("process pump")
            self.error = WeenvError(f"process pump failed: {exc}")
            self.log.append(ProcessEvent(type="error", pid=self.pid, error=ErrorInfo(kind="weenv", message=str(exc))))
        finally:
            if self._timer is not None:
                self._timer.cancel()
            for fd, f in files.items():
                if fd in open_fds and self._sink is not None:
                    self._sink.adopt(f)
                else:
                    f.close()
            with self._stdin_lock:
                if proc.stdin is not None and not proc.stdin.closed:
                    with contextlib.suppress(OSError):
                        proc.stdin.close()
            proc.close()
            if self.pid is None:
                self.pid = 0
            self._started.set()
            self.log.close()
            self._done.set()
            if self._on_exit is not None:
                self._on_exit(self)

    def _emit(self, stream: str, data: bytes, held: list[ProcessEvent]) -> None:
        event = ProcessEvent(type=stream, data=data)  # type: ignore[arg-type]
        if self.pid is None:
            held.append(event)
        else:
            self.log.append(event)

    def _check_started(self, held: list[ProcessEvent]) -> None:
        started = self.spawned.started()
        if started is None:
            return
        self.pid = started
        self.log.append(ProcessEvent(type="start", pid=self.pid))
        self._started.set()
        for e in held:
            self.log.append(e)
        held.clear()


def _read(fd: int) -> bytes | None:
    """Up to READ_SIZE bytes; ``b""`` at end of file (for a terminal's master:
    EIO, once no process holds its slave); None if nothing is there now."""
    try:
        return os.read(fd, READ_SIZE)
    except BlockingIOError:
        return None
    except OSError as exc:
        if exc.errno == errno.EIO:
            return b""
        raise


def _signal_number(signal: str | int) -> int:
    if isinstance(signal, int) or (isinstance(signal, str) and signal.isdigit()):
        n = int(signal)
        if n in {s.value for s in signals.Signals}:
            return n
    elif isinstance(signal, str):
        name = signal.upper()
        name = name if name.startswith("SIG") else "SIG" + name
        if name in signals.Signals.__members__:
            return int(signals.Signals[name])
    raise InvalidInputError(f"unknown signal {signal!r}")
