"""The node's side of the exec agent: its socket, and commands started through it.

:func:`listen` makes an environment's listening socket (the node hands it to
the environment's first process); :func:`spawn` connects to it, sends one
request and returns an :class:`AgentSpawned` that :class:`weenv.node.runtime.process.Process`
drives.  The wire protocol is described in ``agent.c``.
"""

from __future__ import annotations

import array
import contextlib
import errno
import fcntl
import logging
import os
import select
import socket
import struct
import termios
import time
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from weenv.errors import BrokenError, InvalidInputError, RuntimeFailedError, WeenvError
from weenv.node.cgroups.commands import CommandGroup, process_cgroup, same_environment
from weenv.node.runtime.process import EXIT_CANNOT_RUN, EXIT_NOT_FOUND, Spawned
from weenv.node.runtime.runc import kill_descendants

log = logging.getLogger(__name__)

START_TIMEOUT_S = 10.0
"""Seconds the agent has to accept a request and fork the command."""
MAX_REPLY = 4096
"""Bytes of replies the node keeps before a line ends (the agent's lines are short)."""

_STAGE_SETUP, _STAGE_CHDIR, _STAGE_EXEC, _STAGE_USER = 1, 2, 3, 4
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_CONTROL_SIZE = socket.CMSG_SPACE(_UCRED.size) + socket.CMSG_SPACE(4 * array.array("i").itemsize)
"""Ancillary bytes of one reply: the sender's credentials and a terminal's master
(room for a few descriptors: any beyond the first is closed)."""
_MAX_PATH = 100  # sun_path holds 108 bytes; longer paths go through /proc/self/fd


TIOCGPTN = 0x80045430
"""``_IOR('T', 0x30, unsigned int)`` (``asm-generic/ioctls.h``): a master's pty number."""


def is_terminal_master(fd: int) -> bool:
    """Whether ``fd`` is a pseudo-terminal master (``TIOCGPTN`` answers only on
    one, pty(7)).  The agent runs inside the environment, whose root could take
    it over (ptrace) and send any descriptor it holds (a FIFO that blocks the
    reader, a socket): the node uses a received descriptor only if it is one."""
    try:
        fcntl.ioctl(fd, TIOCGPTN, struct.pack("I", 0))
    except OSError:
        return False
    return True


class AgentUnavailable(Exception):
    """Nothing of the request ran: the agent is not listening (``gone``: it
    died or never started) or hung up before forking (e.g. it could not fork at
    the pids limit).  The node falls back to ``runc exec``."""

    def __init__(self, message: str, *, gone: bool):
        super().__init__(message)
        self.gone = gone


@contextlib.contextmanager
def _address(path: Path) -> Iterator[str]:
    """A sockaddr path for ``path``: itself, or ``/proc/self/fd/DIRFD/NAME`` when
    it is too long for ``sun_path``."""
    path = Path(path)
    if len(os.fsencode(path)) <= _MAX_PATH:
        yield str(path)
        return
    dirfd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{dirfd}/{path.name}"
    finally:
        os.close(dirfd)


def listen(path: Path, backlog: int = 128) -> socket.socket:
    """A listening Unix stream socket bound at ``path`` (mode 0600; a stale file
    there is replaced).  The caller passes it to the agent and closes its copy."""
    path = Path(path)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        with _address(path) as addr:
            sock.bind(addr)
        os.chmod(path, 0o600)
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


def spawn(
    path: Path,
    argv: list[str],
    *,
    env: dict[str, str],
    cwd: str,
    stdin: bytes | None = None,
    stdin_pipe: bool = False,
    start_timeout: float = START_TIMEOUT_S,
    cgroup: str | None = None,
    ident: str = "",
    tty: tuple[int, int] | None = None,
) -> AgentSpawned:
    """Start ``argv`` (already checked, e.g. by :func:`weenv.node.runtime.runc.exec_args`)
    through the agent listening at ``path``, in working dir ``cwd`` (absolute,
    inside the environment) with ``env`` over the environment's own variables.

    stdin: a pipe with ``stdin_pipe``, else a memfd holding ``stdin``, else
    ``/dev/null``.  ``cgroup``: the environment's cgroup (``"/weenv-<id>"``):
    the command runs in a :class:`~weenv.node.cgroups.commands.CommandGroup`
    of its own below it, which :meth:`AgentSpawned.kill_tree` kills whole
    (None, or a group that cannot be made: its process tree is killed instead);
    below the handler's own cgroup when that is another container of the same
    environment (a reset replaced the container since ``cgroup`` was read).
    ``ident``: who the command runs as, ``"UID:GID[:G1,G2...]"`` (supplementary
    groups; ``""``: as the agent itself runs); an agent started without ``-c``
    refuses it (the command could not start, ``EPERM``).
    ``tty``: ``(cols, rows)``: run it on a new pseudo-terminal of that size,
    allocated by the agent inside the environment (its stdin, stdout and
    stderr; ``stdin``/``stdin_pipe`` are ignored): the spawned's ``stdout``
    reads the terminal's output, its ``stdin`` writes its input, ``stderr`` is
    empty and :meth:`AgentSpawned.resize` sets its size.
    Returns once the agent forked the command (or refused it).
    Raises :class:`AgentUnavailable` when nothing ran (fall back), and
    :class:`RuntimeFailedError` when the agent does not answer within
    ``start_timeout`` seconds.
    """
    argc = str(len(argv)) if tty is None else f"{len(argv)} {tty[0]} {tty[1]}"
    payload = b"".join(os.fsencode(s) + b"\0" for s in (ident, cwd, argc, *argv, *(f"{k}={v}" for k, v in env.items())))
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    theirs: list[int] = []  # the command's ends: closed here once sent (or on failure)
    ours: list[BinaryIO] = []  # the node's ends: the caller's on success
    spawned: AgentSpawned | None = None
    try:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)  # the handler's host pid
        conn.settimeout(start_timeout)
        try:
            with _address(path) as addr:
                conn.connect(addr)
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise AgentUnavailable(f"no exec agent listens at {path}: {exc.strerror}", gone=True) from None
        stdout = _pipe(theirs, ours, read=True)
        stderr = _pipe(theirs, ours, read=True)
        stdin_w: BinaryIO | None = None
        if tty is not None:  # the agent closes these unused: the pipes read end of file
            theirs.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
        elif stdin_pipe:
            stdin_w = _pipe(theirs, ours, read=False)
        elif stdin:
            theirs.append(os.memfd_create("weenv-stdin", os.MFD_CLOEXEC))
            _write_all(theirs[-1], stdin)
            os.lseek(theirs[-1], 0, os.SEEK_SET)
        else:
            theirs.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
        spawned = AgentSpawned(conn, argv, cwd, stdin_w, stdout, stderr, cgroup=cgroup)
        message = struct.pack("<I", len(payload)) + payload
        try:
            out_w, err_w, in_r = theirs
            fds = array.array("i", [in_r, out_w, err_w])
            sent = conn.sendmsg([message], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
            conn.sendall(message[sent:])
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise AgentUnavailable(f"the exec agent at {path} hung up: {exc.strerror}", gone=False) from None
        except TimeoutError:
            raise RuntimeFailedError(f"the exec agent at {path} does not read its requests") from None
        conn.setblocking(False)
        spawned._wait_forked(start_timeout)
        if tty is not None and spawned._master is not None:
            spawned.use_terminal()
        return spawned
    except BaseException:
        conn.close()
        for f in ours:
            f.close()
        if spawned is not None and spawned._master is not None:
            os.close(spawned._master)
            spawned._master = None
        raise
    finally:
        for fd in theirs:
            os.close(fd)


def _pipe(theirs: list[int], ours: list[BinaryIO], *, read: bool) -> BinaryIO:
    """A pipe: the command's end appended to ``theirs``, the node's end (read end
    if ``read``) appended to ``ours`` and returned, unbuffered."""
    r, w = os.pipe2(os.O_CLOEXEC)
    theirs.append(w if read else r)
    ours.append(open(r if read else w, "rb" if read else "wb", buffering=0))
    return ours[-1]


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class AgentSpawned(Spawned):
    """A command started through the exec agent: the connection to its handler
    (the command's parent inside the environment) and the command's pipes.

    News comes on the connection (readable when a reply arrives): ``T`` (with
    the terminal's master, for a command on a terminal), ``A`` (forked;
    the kernel's SCM_CREDENTIALS give the handler's host pid), ``P`` (runs),
    ``F`` (could not start), ``X`` (ended), or end of file (the handler died).
    """

    def __init__(
        self,
        conn: socket.socket,
        argv: list[str],
        cwd: str,
        stdin: BinaryIO | None,
        stdout: BinaryIO,
        stderr: BinaryIO,
        *,
        cgroup: str | None = None,
    ):
        self.conn = conn
        self._cgroup = cgroup
        self.group: CommandGroup | None = None
        """The command's own cgroup, once the handler is in it (see :func:`spawn`)."""
        self.argv, self.cwd = argv, cwd
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self.handler_pid: int | None = None
        """The handler's host pid (from the kernel, not from the agent's words)."""
        self._handler_fd = -1  # a pidfd: kill the tree only while the handler lives
        self._forked_pid: int | None = None  # the command's pid inside the environment
        self._running = False
        self._failure: tuple[int, int] | None = None  # (stage, errno)
        self._status: int | None = None
        self._eof = False
        self._buf = b""
        self._master: int | None = None  # the terminal's master, received with T, until use_terminal

    # --- replies ---------------------------------------------------------------------
    def _receive(self) -> None:
        """Read every reply available now (non-blocking) and parse whole lines."""
        while not self._eof:
            try:
                data, ancdata, _flags, _addr = self.conn.recvmsg(MAX_REPLY, _CONTROL_SIZE, socket.MSG_CMSG_CLOEXEC)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data, ancdata = b"", []
            for level, kind, cdata in ancdata:
                if (level, kind) == (socket.SOL_SOCKET, socket.SCM_CREDENTIALS) and self.handler_pid is None:
                    pid = _UCRED.unpack(cdata[: _UCRED.size])[0]
                    if pid > 0:
                        self._adopt_handler(pid)
                elif (level, kind) == (socket.SOL_SOCKET, socket.SCM_RIGHTS):
                    fds = array.array("i")
                    fds.frombytes(cdata[: len(cdata) - len(cdata) % fds.itemsize])
                    for fd in fds:  # one terminal master at most; anything else is closed
                        if self._master is None and is_terminal_master(fd):
                            self._master = fd
                        else:
                            os.close(fd)
            if not data:
                self._eof = True
                return
            self._buf += data
            *lines, self._buf = self._buf.split(b"\n")
            if len(self._buf) > MAX_REPLY:
                raise RuntimeFailedError("the exec agent sent a garbled reply")
            for line in lines:
                self._parse(line)

    def _adopt_handler(self, pid: int) -> None:
        self.handler_pid = pid
        with contextlib.suppress(OSError):
            self._handler_fd = os.pidfd_open(pid)

    def _parse(self, line: bytes) -> None:
        kind, _, rest = line.partition(b" ")
        try:
            fields = [int(x) for x in rest.split()]
            if kind == b"H" and not fields:
                self._go()
            elif kind == b"T" and not fields and self._master is not None:
                pass  # the master came with it (see _receive)
            elif kind == b"A" and len(fields) == 1:
                self._forked_pid = fields[0]
            elif kind == b"P" and not fields:
                self._running = True
            elif kind == b"F" and len(fields) == 2:
                self._failure = (fields[0], fields[1])
            elif kind == b"X" and len(fields) == 1:
                self._status = fields[0]
            else:
                raise ValueError
        except ValueError:
            raise RuntimeFailedError(f"the exec agent sent a garbled reply: {line[:80]!r}") from None

    def _wait_forked(self, timeout: float) -> None:
        """Block until the handler forked the command or refused it."""
        deadline = time.monotonic() + timeout
        poller = select.poll()
        poller.register(self.conn.fileno(), select.POLLIN)
        while True:
            self._receive()
            if self._forked_pid is not None or self._failure is not None:
                return
            if self._eof:
                raise AgentUnavailable("the exec agent hung up before starting the command", gone=False)
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeFailedError(f"the exec agent did not start the command within {timeout} s")
            poller.poll(int(left * 1000) + 1)

    # --- Spawned ---------------------------------------------------------------------
    def fileno(self) -> int:
        return self.conn.fileno()

    def update(self) -> bool:
        self._receive()
        return self._eof or self._status is not None or self._failure is not None

    def started(self) -> int | None:
        return self._forked_pid if self._running else None

    def fate(self, stderr: bytes) -> tuple[int, bytes]:
        """The exit code (128 + N for signal N) once ended; for a command that
        could not start, 127 (not found) or 126 and a message like runc's."""
        if self._status is not None:
            code = os.waitstatus_to_exitcode(self._status)
            return (code if code >= 0 else 128 - code), b""
        if self._failure is not None:
            return self._failure_result(*self._failure)
        raise BrokenError(
            "lost the command: its exec agent handler went away (the environment stopped, "
            "or a process inside killed the agent)"
        )

    def _failure_result(self, stage: int, err: int) -> tuple[int, bytes]:
        reason = os.strerror(err).lower()
        if stage == _STAGE_EXEC:
            name = self.argv[0]
            if err == errno.ENOENT:
                if "/" not in name:
                    return EXIT_NOT_FOUND, f'exec: "{name}": executable file not found in $PATH\n'.encode()
                return EXIT_NOT_FOUND, f'exec: "{name}": {reason}\n'.encode()
            return EXIT_CANNOT_RUN, f'exec: "{name}": {reason}\n'.encode()
        if stage == _STAGE_CHDIR:
            return EXIT_CANNOT_RUN, f'chdir to cwd ("{self.cwd}") failed: {reason}\n'.encode()
        if stage == _STAGE_USER:
            return EXIT_CANNOT_RUN, f"cannot become the command's user: {reason}\n".encode()
        if err == errno.EPROTO:
            raise RuntimeFailedError("the exec agent refused the request (protocol error)")
        return EXIT_CANNOT_RUN, f"cannot start the command: {reason}\n".encode()

    def _go(self) -> None:
        """The handler read the request (``H``): move it into the command's own
        cgroup, then let it fork (the command and all it starts are born there)."""
        if self._cgroup is not None and self.handler_pid is not None and self.group is None:
            group = CommandGroup(self._parent_cgroup())
            try:
                group.create()
                try:
                    group.add(self.handler_pid)
                except BaseException:
                    group.remove()
                    raise
                self.group = group
            except (WeenvError, OSError) as exc:  # the command runs anyway; a kill walks its tree
                log.warning("no cgroup of its own for command %s: %s", self.argv[:1], exc)
        self._request(0)

    def _parent_cgroup(self) -> str:
        """Where the command's group goes: the cgroup the handler is in (the
        agent's container's), when it is one of the environment's containers
        (``cgroup`` named the one of the moment the caller looked, and a reset
        may have started a container made ahead since: the handler answering is
        the new agent's); else ``cgroup`` as given."""
        actual = process_cgroup(self.handler_pid) if self.handler_pid is not None else None
        if actual is not None and actual != self._cgroup and same_environment(actual, self._cgroup):
            return actual
        return self._cgroup

    # --- a terminal ------------------------------------------------------------------
    def use_terminal(self) -> None:
        """Read the command's output from the terminal's master received with
        ``T`` and write its input there (``stdout``/``stdin``; its ``stderr``
        pipe reads end of file: a terminal has one output)."""
        master, self._master = self._master, None
        assert master is not None
        self.stdout.close()
        self.stdout = open(master, "rb", buffering=0)
        self.stdin = open(os.dup(master), "wb", buffering=0)
        self.tty = True

    def resize(self, cols: int, rows: int) -> None:
        """Set the terminal's size (``TIOCSWINSZ`` on its master: the kernel
        sends SIGWINCH to its foreground process group)."""
        if not self.tty:
            super().resize(cols, rows)
        if self.stdin is None or self.stdin.closed:
            raise InvalidInputError("the command's terminal is closed (the command ended)")
        fcntl.ioctl(self.stdin.fileno(), termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))

    def _handler_alive(self) -> bool:
        if self._handler_fd < 0:
            return False
        alive = select.poll()
        alive.register(self._handler_fd, select.POLLIN)  # a pidfd polls readable once the process exited
        return not alive.poll(0)

    def kill_tree(self) -> None:
        """SIGKILL the command and everything it started: its cgroup (see
        :func:`spawn`) but the handler, which reports the command's exit; or,
        without one, its tree from the host (the handler is a child subreaper:
        orphans of the command are in its tree too).  Then ask the handler to
        kill the command's process group (for when neither is known)."""
        group = self.group
        if group is not None:
            group.kill(exclude=frozenset({self.handler_pid}) if self._handler_alive() else frozenset())
        elif self._handler_alive() and self.handler_pid is not None:
            kill_descendants(self.handler_pid)
        self._request(-9)

    def kill_leftovers(self) -> None:
        """SIGKILL what the ended command left running (``cmd &``, a fork bomb
        whose first process returned, a ``setsid``'d daemon): its whole cgroup,
        which is removed then."""
        group, self.group = self.group, None
        if group is not None:
            group.kill()
            group.remove()

    def signal(self, sig: int) -> None:
        self._request(sig)

    def _request(self, value: int) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(struct.pack("<i", value))

    def close(self) -> None:
        """Hang up (a command still running is killed by its handler) and
        remove the command's cgroup once the handler left it (it exits right
        after its ``X``); a group still holding processes the command left
        running stays for :meth:`kill_leftovers` (or the environment's end)."""
        self.conn.close()
        if self._master is not None:  # received, never used (the command could not start)
            os.close(self._master)
            self._master = None
        group = self.group
        if group is not None:
            if self._handler_fd >= 0:
                _pidfd_wait(self._handler_fd, 1.0)
            if group.remove():
                self.group = None
        if self._handler_fd >= 0:
            os.close(self._handler_fd)
            self._handler_fd = -1


def _pidfd_wait(pidfd: int, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for the process of ``pidfd`` to exit; whether it has."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(int(timeout * 1000)))
