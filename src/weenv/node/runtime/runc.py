"""runc, the OCI runtime, driven through its command line (Linux only).

Every call runs ``runc --root ROOT ...`` (runc 1.1, ``man runc``) and blocks
until runc answers: the node daemon calls these methods from worker threads.
:class:`Runc` keeps no state of its own, so one instance serves many threads.

Errors: a container that does not exist -> :class:`NotFoundError`; any other
failure of runc -> :class:`RuntimeFailedError` with runc's message; a missing
runc binary -> :class:`ToolMissingError`; a bad container id, user or variable
name -> :class:`InvalidInputError`.

How a command runs (:meth:`Runc.exec`): plain ``runc exec`` copies the
command's output through pipes and returns only when every holder of them has
closed them, so ``server &`` would keep it waiting for the server.  Instead a
small helper process (:data:`_EXEC_HELPER`, ``python -I -S``) marks itself a
child subreaper (prctl(2) ``PR_SET_CHILD_SUBREAPER``), runs ``runc exec
--detach --pid-file``, adopts the command when runc exits, and waits for exactly
that process.  The command's stdio are the helper's: an unlinked temporary file
each for stdout and stderr (a big output never blocks; a background process
keeps writing into the unlinked file, on the host's disk, until it exits: so the
node does not use it, it runs commands through its exec agent or
:meth:`Runc.spawn`, with bounded pipes) and a file or /dev/null as stdin.
Cost: ~15 ms of interpreter start per command on top of runc's ~20 ms.

Which runc runs: a sealed in-memory copy of the binary (:class:`SealedBinary`),
made once per :class:`Runc`.  Every ``runc init`` (the process that becomes a
container's first process, for each ``run``, ``create`` and ``exec``) checks
that it runs from a sealed memfd (runc 1.1 ``libcontainer/nsenter/cloned_binary.c``,
the CVE-2019-5736 fix) and otherwise copies its own ~9 MB binary into a new
one and executes itself again first: a copy and an execve per container
start, which a binary sealed ahead already satisfies.

:meth:`Runc.spawn` is the Popen-based variant for streamed and background
commands: the same helper, with pipes for stdout and stderr (and optionally
stdin), returning at once (a :class:`RuncSpawned`); the helper also writes
``STATUS.started`` (the command's host pid and its pid inside the container)
once the command runs.  :mod:`weenv.node.runtime.process` reads the pipes.  The node
uses it only when an environment's exec agent (:mod:`weenv.node.runtime.agent`, no
runtime process per command) is not there.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import select
import shutil
import signal as signals
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, BinaryIO

from weenv.api.models import ExecResult
from weenv.errors import (
    FULL_ERRNOS,
    InvalidInputError,
    NotFoundError,
    RuntimeFailedError,
    ToolMissingError,
)
from weenv.node.runtime.process import EXIT_CANNOT_RUN, EXIT_KILLED, EXIT_NOT_FOUND, Spawned

EXEC_FIFO = "exec.fifo"
"""In a created container's state directory (``ROOT/ID/``): the FIFO its first process waits on (:meth:`Runc.start`)."""
FIFO_VERSION = (1, 1)
"""The runc release (major, minor) whose exec FIFO :meth:`Runc.start` opens itself."""
INIT_PID_FILE = "init.pid"
"""In a bundle: the host pid of the container's first process (``runc --pid-file``)."""
_ID_RE = re.compile(r"^[\w+.-]{1,1024}\Z")
_USER_RE = re.compile(r"^\d+(:\d+)?\Z")
_MSG_RE = re.compile(r'msg="((?:[^"\\]|\\.)*)"')

# The parent of every command (run as ``python -I -S -c``; argv: STATUS_FILE
# PID_FILE RUNC_ARGV...).  It makes itself a child subreaper (prctl
# PR_SET_CHILD_SUBREAPER), runs ``runc exec --detach`` with its own stdio, and
# when runc has exited adopts the command (runc was its parent), writes
# ``HOST_PID CONTAINER_PID`` to STATUS_FILE.started (the command runs: what a
# streaming reader waits for), waits for it and writes its fate to STATUS_FILE:
# ``exit N`` (128 + signal for a signal), ``runc-failed N`` (runc's exit status;
# its message is on stderr), ``no-runc`` or ``lost``.
_EXEC_HELPER = """
import os, sys
def done(status):
    with open(sys.argv[1], "w") as f:
        f.write(status)
    os._exit(0)
try:  # prctl(PR_SET_CHILD_SUBREAPER, 1); _ctypes loads ~5 ms faster than ctypes
    import _ctypes
    _ctypes.call_function(_ctypes.dlsym(_ctypes.dlopen(None, 2), "prctl"), (36, 1, 0, 0, 0))
except (ImportError, AttributeError):
    import ctypes
    ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)
pid_file, argv = sys.argv[2], sys.argv[3:]
try:
    runc = os.posix_spawnp(argv[0], argv, os.environ)
except OSError:
    done("no-runc")
status = os.waitstatus_to_exitcode(os.waitpid(runc, 0)[1])
if status != 0:
    done("runc-failed %d" % status)
try:
    with open(pid_file) as f:
        pid = int(f.read())
except (OSError, ValueError):
    done("lost")
try:  # tell a streaming reader the command runs: "HOST_PID PID_IN_CONTAINER" (NSpid)
    with open("/proc/%d/status" % pid) as f:
        ns = [line.split()[-1] for line in f if line.startswith("NSpid:")][0]
except (OSError, IndexError):
    ns = "0"
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write("%d %s" % (pid, ns))
os.rename(sys.argv[1] + ".tmp", sys.argv[1] + ".started")
try:
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
except OSError:
    done("lost")
done("exit %d" % (code if code >= 0 else 128 - code))
"""


def runc_message(stderr: str) -> str:
    """runc's error message(s) from its logrus output (``level=error msg="..."``)."""
    msgs = [m.encode().decode("unicode_escape") for m in _MSG_RE.findall(stderr)]
    return "; ".join(msgs) if msgs else stderr.strip()


MEMFD_SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
"""The seals runc 1.1 takes as "already cloned" (``RUNC_MEMFD_SEALS``: all four, exactly)."""


class SealedBinary:
    """A read-only in-memory copy of an executable, run by its path ``/proc/PID/fd/N``.

    ``path()``: that path, the copy made on first use (a memfd, ``MFD_CLOEXEC``:
    no child inherits the descriptor; the kernel resolves the path through
    this process's table), again after a fork (the path names the process
    that made it), and again when ``binary`` is set to another name or the
    file it names changes on disk (another inode, size or mtime: a runc
    upgraded in place is run from the next call on); ``binary`` itself (found
    through ``PATH``) when no copy can be made (no such binary: running it
    then fails as it would have).  The copy is sealed against every change
    (:data:`MEMFD_SEALS`).  A copy replaced stays open until :meth:`close`: a
    call that was handed its path may not have executed it yet."""

    def __init__(self, binary: str, *, sealed: bool = True):
        self.binary = binary
        self.sealed = sealed
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._pid = 0
        self._source: tuple | None = None  # (binary, path found, st_dev, st_ino, st_size, st_mtime_ns)
        self._replaced: list[int] = []

    def path(self) -> str:
        with self._lock:
            found = shutil.which(self.binary)
            if found is None or not self.sealed:
                return self.binary if found is None else found
            try:
                st = os.stat(found)
            except OSError:
                return found
            source = (self.binary, found, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
            if self._fd is None or self._pid != os.getpid() or source != self._source:
                try:
                    fd = _sealed_copy(Path(found))
                except OSError:  # no memfd here: run the file (runc copies itself then)
                    return found
                if self._fd is not None and self._pid == os.getpid():
                    self._replaced.append(self._fd)
                self._fd, self._pid, self._source = fd, os.getpid(), source
            return f"/proc/{self._pid}/fd/{self._fd}"

    def close(self) -> None:
        with self._lock:
            if self._pid == os.getpid():
                for fd in [*self._replaced, *([self._fd] if self._fd is not None else [])]:
                    os.close(fd)
            self._fd, self._source, self._replaced = None, None, []


def _sealed_copy(path: Path) -> int:
    """A sealed memfd holding the file ``path`` (its descriptor).  Raises :class:`OSError`."""
    fd = os.memfd_create(path.name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        with open(path, "rb") as src:
            size = os.fstat(src.fileno()).st_size
            done = 0
            while done < size:
                n = os.sendfile(fd, src.fileno(), done, size - done)
                if n == 0:
                    raise OSError(f"{path} shrank while it was copied")
                done += n
        os.fchmod(fd, 0o555)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, MEMFD_SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


class Runc:
    """runc with its state in ``root`` (``runc --root``).

    ``binary``: the runc executable (run as a sealed copy, see the module doc);
    ``command_timeout``: seconds after which a control command (create,
    start, state, list, kill, delete) counts as hung.
    """

    name = "runc"
    """The runtime's name: in messages, settings and what each bundle records (:data:`RUNTIME_FILE`)."""
    fifo_version: tuple[int, ...] | None = FIFO_VERSION
    """The release (major, minor) whose exec FIFO :meth:`start` opens itself; None: never."""
    sealed = True
    """Run the binary from a sealed in-memory copy (:class:`SealedBinary`)."""

    def __init__(self, root: Path, binary: str | None = None, *, command_timeout: float = 60.0):
        self.root = Path(root)
        binary = binary or self.name
        self.command_timeout = command_timeout
        self.executable = SealedBinary(binary, sealed=self.sealed)
        self.fifo_starts = 0
        """Starts done through the exec FIFO in this process (:meth:`start`), not by ``runc start``."""
        self._versions: dict[str, tuple[int, ...] | None] = {}
        self._versions_lock = threading.Lock()

    def version(self) -> tuple[int, ...] | None:
        """The runc binary's version (``runc --version``'s first line, e.g.
        ``(1, 1, 5)``), asked once per binary (again when it changes on disk);
        None when it cannot be told."""
        path = self.executable.path()
        with self._versions_lock:
            if path in self._versions:
                return self._versions[path]
        try:
            out = subprocess.run(
                [path, "--version"], stdin=subprocess.DEVNULL, capture_output=True, timeout=self.command_timeout
            ).stdout.decode(errors="replace")
        except (OSError, subprocess.SubprocessError):
            out = ""
        m = re.match(rf"{self.name} version (\d+)\.(\d+)(?:\.(\d+))?", out)
        found = tuple(int(g) for g in m.groups() if g is not None) if m else None
        with self._versions_lock:
            self._versions[path] = found
        return found

    @property
    def binary(self) -> str:
        """The runc executable's name or path; setting it makes the next call run a copy of the new one."""
        return self.executable.binary

    @binary.setter
    def binary(self, binary: str) -> None:
        self.executable.binary = binary

    def close(self) -> None:
        """Free the sealed copies of the binary (a later call makes one again)."""
        self.executable.close()

    # --- container lifecycle ---------------------------------------------------------
    def create(self, container_id: str, bundle: Path, *, stdin: int | None = None) -> None:
        """``runc create``: set up the container from ``bundle/config.json``, its
        first process waiting to be started; that process's host pid goes to
        ``bundle/``:data:`INIT_PID_FILE`.

        The first process gets ``bundle/init.log`` as stdout and stderr (runc
        create would otherwise wait on pipes it passes on) and ``stdin`` (a file
        descriptor, e.g. the exec agent's listening socket) or ``/dev/null`` as
        stdin.  Raises :class:`NotFoundError` without ``bundle/config.json``.
        """
        self._launch(("create",), container_id, bundle, stdin)

    def _launch(self, verb: tuple[str, ...], container_id: str, bundle: Path, stdin: int | None) -> None:
        """``runc VERB... --bundle BUNDLE ID`` with the first process's stdio as :meth:`create` sets it."""
        _check_id(container_id)
        bundle = Path(bundle).absolute()
        if not (bundle / "config.json").is_file():
            raise NotFoundError(f"no OCI bundle at {bundle} (config.json missing)")
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        log_path = bundle / "init.log"
        with open(log_path, "ab") as log:
            offset = log.tell()
            try:
                proc = subprocess.Popen(
                    self._argv(*verb, "--bundle", str(bundle), "--pid-file", str(bundle / INIT_PID_FILE), container_id),
                    stdin=subprocess.DEVNULL if stdin is None else stdin,
                    stdout=log,
                    stderr=log,
                )
            except FileNotFoundError as exc:
                raise ToolMissingError(f"{self.name} not found: {self.binary!r}") from exc
            try:
                returncode = _wait(proc, self.command_timeout)  # not Popen.wait: it sleeps up to 50 ms
            except BaseException as exc:  # a timeout, or an interrupt: runc goes too
                proc.kill()
                proc.wait()
                if isinstance(exc, subprocess.TimeoutExpired):
                    raise RuntimeFailedError(f"{self.name} {verb[0]} {container_id}: hung") from exc
                raise
        if returncode != 0:
            with open(log_path, "rb") as f:
                f.seek(offset)
                out = f.read(64 << 10).decode(errors="replace")
            what = f"{self.name} {' '.join(verb)} {container_id}"
            raise RuntimeFailedError(
                f"{what}: {runc_message(out)}"
                if runc_message(out)
                else silent_failure(what, returncode, bundle, self.root)
            )

    def start(self, container_id: str, *, timeout: float | None = None) -> None:
        """``runc start``: run the first process of a created container.
        ``timeout``: seconds (default :attr:`command_timeout`) after which
        runc is killed and :class:`RuntimeFailedError` raised.

        Done in this process when the binary is runc 1.1.x (:meth:`version`:
        the FIFO protocol below is that version's) and the container's exec
        FIFO is there (:meth:`_start_through_fifo`: what ``runc start`` does,
        without its ~6 ms of Go runtime start and state load; counted in
        :attr:`fifo_starts`); else, and when its first process is gone, by
        ``runc start`` (its errors: already running, stopped)."""
        _check_id(container_id)
        timeout = self.command_timeout if timeout is None else timeout
        version = self.version()
        if (
            version is not None
            and self.fifo_version is not None
            and version[:2] == self.fifo_version
            and self._start_through_fifo(container_id, timeout)
        ):
            self.fifo_starts += 1
            return
        self._run("start", container_id, timeout=timeout)

    def _start_through_fifo(self, container_id: str, timeout: float) -> bool:
        """runc 1.1's start of a created container: its first process (``runc
        init``, done setting up) waits opening ``ROOT/ID/exec.fifo`` for writing;
        ``runc start`` opens it for reading, reads the byte ``runc init``
        writes, reads on until end of file (the writer's descriptor is
        close-on-exec: the container's process has been executed) and removes
        the FIFO (runc's state then says ``running``: libcontainer
        ``container_linux.go`` ``exec``, ``standard_init_linux.go``).  Done here:
        True if so; False when there is no FIFO or no process writing it (then
        ``runc start`` answers).  Raises :class:`RuntimeFailedError` when no byte
        comes in ``timeout`` seconds."""
        path = self.root / container_id / EXEC_FIFO
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return False
        try:
            if not stat.S_ISFIFO(os.fstat(fd).st_mode):
                return False
            deadline = time.monotonic() + timeout
            poller = select.poll()
            poller.register(fd, select.POLLIN)  # POLLHUP too once the writer it had at open closed
            got = b""
            while True:
                try:
                    data = os.read(fd, 16)
                except BlockingIOError:  # its writer is there, done writing or not
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise RuntimeFailedError(
                            f"runc start {container_id}: its first process did not start in {timeout} s"
                        ) from None
                    poller.poll(min(100, int(left * 1000) + 1))
                    continue
                if not data:  # end of file: executed (its byte read), or no runc init at all (none)
                    break
                got += data
            if not got:
                return False
        finally:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return True

    def run_detached(self, container_id: str, bundle: Path, *, stdin: int | None = None) -> None:
        """``runc run --detach``: :meth:`create` and :meth:`start` in one runc
        process (one Go runtime start and state load fewer: ~5-10 ms here), the
        first process's stdio as :meth:`create` sets it; on failure nothing is
        left behind."""
        try:
            self._launch(("run", "--detach"), container_id, bundle, stdin)
        except BaseException:
            self.delete(container_id, force=True)
            raise

    def state(self, container_id: str) -> dict[str, Any] | None:
        """``runc state``: ``{"id", "pid", "status", "bundle", ...}``, or None if
        there is no such container.  ``status``: created, running, paused, stopped."""
        _check_id(container_id)
        try:
            out = self._run("state", container_id)
        except NotFoundError:
            return None
        return json.loads(out)

    def list(self) -> list[dict[str, Any]]:
        """``runc list``: the state of every container under ``root``."""
        return json.loads(self._run("list", "--format", "json") or "null") or []

    def kill(self, container_id: str, signal: str = "KILL", all: bool = True) -> None:
        """``runc kill``: send ``signal`` (a name like ``"KILL"`` or a number) to the
        first process, or with ``all`` to every process of the container.
        Raises :class:`NotFoundError` if there is no such container."""
        _check_id(container_id)
        self._run("kill", *(["--all"] if all else []), container_id, str(signal), cid=container_id)

    def delete(self, container_id: str, force: bool = True, *, bundle: Path | None = None) -> None:
        """``runc delete``: remove the container, its cgroup and its state.  With
        ``force``, kill it first if it runs.  A missing container is fine.

        ``bundle``: the container's bundle (its :data:`INIT_PID_FILE` is read):
        with ``force``, its first process is killed here first, see
        :meth:`stop` (``runc delete --force`` of a running container sleeps in
        steps of 100 ms until it has died)."""
        _check_id(container_id)
        if force and bundle is not None:
            self.stop(container_id, bundle)
        try:
            self._run("delete", *(["--force"] if force else []), container_id)
        except NotFoundError:
            pass

    def stop(self, container_id: str, bundle: Path, *, timeout: float = 1.0) -> bool:
        """SIGKILL the container's first process and wait (woken by a pidfd, at
        most ``timeout`` seconds) until it has exited; True if it has.  A
        container frozen by its freezer cgroup does not die until thawed: after
        ``timeout`` it is left to ``runc delete --force``, which thaws it.

        The first process is the init of the container's pid namespace: when it
        dies the kernel kills every other process of the namespace
        (pid_namespaces(7)).  Its pid comes from ``bundle/``:data:`INIT_PID_FILE`
        (written by :meth:`create` and :meth:`run_detached`), and it is signalled
        only if that pid is still in the container's cgroup (the pid may have
        been reused).  False when there is no such process (then ``runc delete
        --force`` does the work)."""
        _check_id(container_id)
        try:
            pid = int((Path(bundle) / INIT_PID_FILE).read_text().strip())
            pidfd = os.pidfd_open(pid)
        except (OSError, ValueError):
            return False
        try:
            if not _in_cgroup(pid, container_id):  # checked after pidfd_open: the pidfd is that very process
                return False
            try:
                signals.pidfd_send_signal(pidfd, signals.SIGKILL)
            except ProcessLookupError:
                return True
            return _pidfd_exited(pidfd, timeout)
        finally:
            os.close(pidfd)

    # --- commands ----------------------------------------------------------------------
    def exec(
        self,
        container_id: str,
        argv: list[str] | str,
        *,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        timeout: float | None = None,
        stdin: bytes | None = None,
    ) -> ExecResult:
        """Run a command in a running container and wait for it (``runc exec``).

        ``argv``: a list, or a string run by ``/bin/sh -c``.  ``env`` overrides
        the container's variables by name; ``cwd`` (absolute) and ``user``
        (``"UID:GID"``) default to the container's.  ``stdin``: bytes to read
        (default: none, ``/dev/null``).  After ``timeout`` seconds the command and
        all its descendants are SIGKILLed and the result has ``timed_out=True``
        and exit code 137 (nothing is raised).  Descendants that already left the
        command's process tree (daemonized, reparented to the container's first
        process) are not killed.
        """
        exec_args(argv, env, cwd, user)  # bad arguments: before anything is made
        _check_id(container_id)
        with (
            tempfile.TemporaryDirectory(prefix="weenv-exec-") as tmp,
            tempfile.TemporaryFile() as out,
            tempfile.TemporaryFile() as err,
            _stdin_file(stdin) as inp,
        ):
            pid_file, status_file = Path(tmp) / "pid", Path(tmp) / "status"
            runc = self._exec_argv(container_id, argv, env, cwd, user, None, Path(tmp))
            t0 = time.monotonic()
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _EXEC_HELPER, str(status_file), str(pid_file), *runc],
                stdin=inp,
                stdout=out,
                stderr=err,
            )
            timed_out = False
            try:
                rc = _wait(proc, timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                kill_descendants(proc.pid)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                rc = EXIT_KILLED
            except BaseException:  # interrupted: leave nothing running
                kill_descendants(proc.pid)
                proc.kill()
                proc.wait()
                raise
            duration = time.monotonic() - t0
            out.seek(0)
            err.seek(0)
            stdout, stderr = out.read(), err.read()
            if not timed_out:
                rc, stderr = self._fate(container_id, status_file, rc, stderr)
        return ExecResult(exit_code=rc, stdout=stdout, stderr=stderr, duration_s=duration, timed_out=timed_out)

    def spawn(
        self,
        container_id: str,
        argv: list[str] | str,
        *,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        stdin: bytes | None = None,
        stdin_pipe: bool = False,
        process: dict | None = None,
    ) -> RuncSpawned:
        """Start a command like :meth:`exec` and return at once (the Popen-based variant).

        The same exec helper runs it, but its stdout and stderr are pipes the
        caller reads (:class:`weenv.node.runtime.process.Process` does), and with
        ``stdin_pipe`` so is its stdin (else ``stdin`` bytes or ``/dev/null``).
        Until :meth:`Spawned.started` answers, bytes on stderr may be runc's own
        error message; :meth:`Spawned.fate` sorts that out after the helper exits.
        ``process``: an OCI process object (``runc exec --process``) that
        replaces the container's own, the command's argv, ``env``, ``cwd``
        and ``user`` filled into it (its capabilities and additional groups
        are its own, not the first process's).
        Raises :class:`InvalidInputError` for bad arguments.
        """
        exec_args(argv, env, cwd, user)  # bad arguments: before anything is made
        _check_id(container_id)
        tmp = Path(tempfile.mkdtemp(prefix="weenv-exec-"))
        try:
            runc = self._exec_argv(container_id, argv, env, cwd, user, process, tmp)
            with _stdin_file(None if stdin_pipe else stdin) as inp:
                proc = subprocess.Popen(
                    [sys.executable, "-I", "-S", "-c", _EXEC_HELPER, str(tmp / "status"), str(tmp / "pid"), *runc],
                    stdin=subprocess.PIPE if stdin_pipe else inp,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    bufsize=0,
                )
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return RuncSpawned(self, container_id, proc, tmp)

    # --- helpers -----------------------------------------------------------------------
    def _fate(self, container_id: str, status_file: Path, rc: int, stderr: bytes) -> tuple[int, bytes]:
        """The command's exit code (and stderr) from the exec helper's status file."""
        try:
            status = status_file.read_text()
        except FileNotFoundError:
            full = full_dirs(status_file.parent)  # it could not write its status file there
            raise RuntimeFailedError(
                f"exec in {container_id}: the exec helper died (exit status {rc})"
                + (f"; {_no_space(full, self.name)}" if full else "")
            ) from None
        if status.startswith("exit "):
            return int(status[5:]), stderr
        if status.startswith("runc-failed"):  # the command never started
            code = status[len("runc-failed") :].strip()
            return _start_failure(
                container_id,
                stderr,
                int(code) if code.isdigit() else None,
                (status_file.parent, self.root),
                runtime=self.name,
            )
        if status == "no-runc":
            raise ToolMissingError(f"{self.name} not found: {self.binary!r}")
        raise RuntimeFailedError(f"exec in {container_id}: lost track of the command")

    def _exec_argv(
        self,
        container_id: str,
        argv,
        env: dict[str, str] | None,
        cwd: str | None,
        user: str | None,
        process: dict | None,
        tmp: Path,
    ) -> list[str]:
        """The runtime's ``exec --detach --pid-file TMP/pid`` command line of
        :meth:`exec` and :meth:`spawn`; with ``process`` (an OCI process
        object), ``--process TMP/process.json`` holding it with the command's
        argv, ``env`` (replacing its variables), ``cwd`` and ``user`` filled in."""
        flags, command = exec_args(argv, env, cwd, user)
        if process is not None:
            spec = {**process, "args": command, "terminal": False}
            if env is not None:
                spec["env"] = [f"{k}={v}" for k, v in env.items()]
            if cwd is not None:
                spec["cwd"] = cwd
            if user is not None:
                uid, _, gid = user.partition(":")
                spec["user"] = {**spec.get("user", {}), "uid": int(uid), "gid": int(gid or uid)}
            (tmp / "process.json").write_text(json.dumps(spec))
            flags, command = ["--process", str(tmp / "process.json")], []
        return self._argv("exec", "--detach", "--pid-file", str(tmp / "pid"), *flags, container_id, *command)

    @staticmethod
    def is_missing(msg: str) -> bool:
        """Whether the runtime's message ``msg`` says there is no such container."""
        return "does not exist" in msg

    def _argv(self, *args: str) -> list[str]:
        return [self.executable.path(), "--root", str(self.root), *args]

    def _run(self, *args: str, cid: str | None = None, timeout: float | None = None) -> str:
        timeout = self.command_timeout if timeout is None else timeout
        try:
            proc = subprocess.run(
                self._argv(*args),
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=timeout,
            )
        except FileNotFoundError as exc:
            raise ToolMissingError(f"{self.name} not found: {self.binary!r}") from exc
        except subprocess.TimeoutExpired as exc:
            raise RuntimeFailedError(f"{self.name} {' '.join(args)}: no answer in {timeout} s") from exc
        if proc.returncode != 0:
            msg = runc_message(proc.stderr.decode(errors="replace"))
            if self.is_missing(msg):
                raise NotFoundError(f"no container {cid or args[-1]!r} ({self.name} {args[0]}): {msg}")
            what = f"{self.name} {' '.join(args)}"
            raise RuntimeFailedError(f"{what}: {msg}" if msg else silent_failure(what, proc.returncode, self.root))
        return proc.stdout.decode()


class RuncSpawned(Spawned):
    """A command started by :meth:`Runc.spawn`: the exec helper's ``proc`` (whose
    ``stdout``/``stderr``, and ``stdin`` if piped, are the command's) and the
    helper's files in ``dir``.  News comes from a pidfd of the helper, and the
    start from its ``status.started`` file (polled every :attr:`poll_ms`)."""

    poll_ms = 5

    def __init__(self, runc: Runc, container_id: str, proc: subprocess.Popen, dir: Path):
        self.runc = runc
        self.container_id = container_id
        self.proc = proc
        self.dir = dir
        self.stdin, self.stdout, self.stderr = proc.stdin, proc.stdout, proc.stderr
        self.host_pid: int | None = None
        """The command's pid on the host, once it runs."""
        self._pidfd = os.pidfd_open(proc.pid)

    def fileno(self) -> int:
        return self._pidfd

    def update(self) -> bool:
        return self.proc.poll() is not None

    def started(self) -> int | None:
        try:
            host, ns = (self.dir / "status.started").read_text().split()
        except (FileNotFoundError, ValueError):
            return None
        self.host_pid = int(host)
        return int(ns)

    def fate(self, stderr: bytes) -> tuple[int, bytes]:
        """When runc could not start the command, ``stderr`` (what the helper's
        stderr carried, runc's message) becomes the message and the code 127 or
        126.  Raises as :meth:`Runc.exec` does when the container is gone."""
        return self.runc._fate(self.container_id, self.dir / "status", self.proc.wait(), stderr)

    def kill_tree(self) -> None:
        kill_descendants(self.proc.pid)

    def signal(self, sig: int) -> None:
        if self.host_pid is not None:
            _send(self.host_pid, sig)

    def close(self) -> None:
        """Kill the helper if it still runs, wait for it, remove its files."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1
        shutil.rmtree(self.dir, ignore_errors=True)


def _wait(proc: subprocess.Popen, timeout: float | None) -> int:
    """``proc.wait(timeout)``, woken by a pidfd the moment ``proc`` exits
    (``Popen.wait`` with a timeout polls with sleeps of up to 50 ms)."""
    if timeout is None:
        return proc.wait()
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # Linux < 5.3
        return proc.wait(timeout)
    try:
        if not _pidfd_exited(pidfd, timeout):
            raise subprocess.TimeoutExpired(proc.args, timeout)
    finally:
        os.close(pidfd)
    return proc.wait()


def _pidfd_exited(pidfd: int, timeout: float) -> bool:
    """Wait until the process of ``pidfd`` exits (the pidfd turns readable), at
    most ``timeout`` seconds; whether it did."""
    deadline = time.monotonic() + timeout
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    while True:
        left = deadline - time.monotonic()
        # poll(2) takes an int of ms: wait in slices of at most a day
        if poller.poll(max(0, min(int(left * 1000 + 0.999), 86_400_000))):
            return True
        if left <= 0 or time.monotonic() >= deadline:
            return False


def _in_cgroup(pid: int, container_id: str) -> bool:
    """Whether ``pid`` is in a cgroup whose last path component is
    ``container_id`` (``/proc/PID/cgroup``, cgroup v1 or v2)."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            return any(line.rstrip("\n").split(":", 2)[-1].endswith("/" + container_id) for line in f)
    except OSError:
        return False


def _check_id(container_id: str) -> None:
    if not isinstance(container_id, str) or not _ID_RE.match(container_id):
        raise InvalidInputError(f"bad container id {container_id!r}")


MAX_ARG_STRLEN = 32 * os.sysconf("SC_PAGE_SIZE")
"""Longest single argument or ``KEY=VALUE`` execve(2) takes (Linux: 32 pages)."""
MAX_EXEC_BYTES = os.sysconf("SC_ARG_MAX") - (64 << 10)
"""Most bytes of argv + variables a command may have (ARG_MAX, less room for
the exec helper's and runc's own arguments)."""


def exec_args(argv, env, cwd, user) -> tuple[list[str], list[str]]:
    """(runc exec flags, the command's argv; a string becomes ``/bin/sh -c
    STRING``).  Raises :class:`InvalidInputError`
    for what execve(2) could not take: a NUL byte in an argument, variable or
    the working dir, an argument longer than :data:`MAX_ARG_STRLEN`, or more
    than :data:`MAX_EXEC_BYTES` in all."""
    if isinstance(argv, str):
        argv = ["/bin/sh", "-c", argv]
    if not argv or not all(isinstance(a, str) for a in argv):
        raise InvalidInputError("the command must be a non-empty list of strings or a string")
    if any("\0" in a for a in argv):
        raise InvalidInputError("the command holds a NUL byte (execve(2) cannot pass it)")
    flags: list[str] = []
    for key, value in (env or {}).items():
        if not key or "=" in key or "\0" in key or "\0" in value:
            raise InvalidInputError(f"bad environment variable {key[:100]!r}")
        flags += ["--env", f"{key}={value}"]
    if cwd is not None:
        if not cwd.startswith("/") or "\0" in cwd:
            raise InvalidInputError(f"working dir {cwd[:200]!r} is not an absolute path")
        flags += ["--cwd", cwd]
    if user is not None:
        if not _USER_RE.match(user):
            raise InvalidInputError(f"bad user {user!r}: want numeric 'UID:GID'")
        flags += ["--user", user]
    sizes = [len(os.fsencode(a)) + 1 for a in (*argv, *flags)]
    if max(sizes) > MAX_ARG_STRLEN or sum(sizes) > MAX_EXEC_BYTES:
        raise InvalidInputError(
            f"the command is too long for execve(2): {sum(sizes)} bytes of arguments and variables "
            f"(at most {MAX_EXEC_BYTES} in all, {MAX_ARG_STRLEN} in one); pass big data as stdin or a file"
        )
    return flags, list(argv)


def _start_failure(
    container_id: str, stderr: bytes, status: int | None = None, dirs: tuple[Path, ...] = (), *, runtime: str = "runc"
) -> tuple[int, bytes]:
    """Map runc's failure to start a command to 127/126, or raise if runc failed
    for another reason (no such container, container stopped; or it said
    nothing: then its exit ``status`` and which of ``dirs``, where it writes,
    is full, :func:`silent_failure`)."""
    msg = runc_message(stderr.decode(errors="replace"))
    if not msg:
        raise RuntimeFailedError(silent_failure(f"{runtime} exec in {container_id}", status, *dirs))
    if "container does not exist" in msg or (f"/{container_id}/status`: No such file" in msg):
        raise NotFoundError(f"no container {container_id!r}: {msg}")
    # crun: "executable file `ARGV0` not found in $PATH: ...", "open executable: ...", "chdir to `DIR`: ..."
    crun_exec = msg.startswith(("exec", "open executable", "chdir"))
    if "unable to start container process" not in msg and not crun_exec:
        raise RuntimeFailedError(f"{runtime} exec in {container_id}: {msg}")
    not_found = (
        "executable file not found" in msg
        or ('exec: "' in msg and "no such file or directory" in msg.lower())
        or (msg.startswith(("executable file", "exec")) and ("not found" in msg or "No such file" in msg))
    )
    return (EXIT_NOT_FOUND if not_found else EXIT_CANNOT_RUN), (msg + "\n").encode()


def silent_failure(what: str, status: int | None, *dirs: Path) -> str:
    """The message of ``what`` (a runc command) that failed without a word on
    its stderr: its exit status, and, when one of ``dirs`` (where it writes its
    state, pid file and message) is on a full file system, that (the likely
    cause: runc could not even write its message)."""
    if status is not None and status < 0:  # subprocess's way of saying a signal ended it
        msg = f"{what} was killed by {_signal_name(-status)} before it answered"
    else:
        msg = f"{what} failed (exit status {'unknown' if status is None else status}) without a message"
    full = full_dirs(*dirs)
    return f"{msg}; {_no_space(full, what.partition(' ')[0])}" if full else msg


def _signal_name(number: int) -> str:
    try:
        return signals.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _no_space(full: list[Path], runtime: str = "runc") -> str:
    return (
        f"no space left on the file system of {', '.join(map(str, full))} (the likely cause: "
        f"what {runtime} writes there, its state, pid file and messages, found no room)"
    )


def full_dirs(*dirs: Path) -> list[Path]:
    """Those of ``dirs`` on a file system that refuses a new 4 KiB file
    (``ENOSPC`` or ``EDQUOT``); the file is removed."""
    full = []
    for d in dirs:
        try:
            fd, name = tempfile.mkstemp(dir=d, prefix=".weenv-room-")
        except OSError as exc:
            if exc.errno in FULL_ERRNOS:
                full.append(d)
            continue
        try:
            os.write(fd, bytes(4096))
        except OSError as exc:
            if exc.errno in FULL_ERRNOS:
                full.append(d)
        finally:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(name)
    return full


class _stdin_file:
    """A context manager giving the file a command reads as stdin."""

    def __init__(self, data: bytes | None):
        self.data = data
        self.f: BinaryIO | None = None

    def __enter__(self):
        if self.data is None:
            return subprocess.DEVNULL
        self.f = tempfile.TemporaryFile()
        self.f.write(self.data)
        self.f.seek(0)
        return self.f

    def __exit__(self, *exc):
        if self.f is not None:
            self.f.close()


# --- process trees on the host (/proc) -------------------------------------------------
def children(pid: int) -> set[int]:
    """Host pids of ``pid``'s children, from ``/proc/PID/task/*/children``
    (Linux >= 3.5 with CONFIG_PROC_CHILDREN; every thread has its own list)."""
    kids: set[int] = set()
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return kids
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids.update(int(x) for x in f.read().split())
        except OSError:
            continue
    return kids


def _state(pid: int) -> str:
    """The one-letter state of ``pid`` (``R``, ``S``, ``T``, ``Z``...), ``""`` if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return ""


def _send(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def kill_descendants(root_pid: int, *, settle_s: float = 2.0) -> set[int]:
    """SIGKILL every descendant of ``root_pid`` (not ``root_pid`` itself).

    The tree is first frozen with SIGSTOP, level by level, waiting until each
    process shows as stopped, so none can fork a child we would miss or die and
    hand its children to the container's init before they are listed; then all
    get SIGKILL.  ``settle_s`` bounds the waiting (a process in uninterruptible
    sleep may not stop).  Returns the pids signalled.
    """
    seen: set[int] = set()
    deadline = time.monotonic() + settle_s
    while True:
        found = children(root_pid)
        for pid in seen:
            found |= children(pid)
        new = found - seen
        if not new:
            break
        for pid in new:
            _send(pid, signals.SIGSTOP)
        seen |= new
        pending = set(new)
        while pending and time.monotonic() < deadline:
            pending = {p for p in pending if _state(p) not in ("", "T", "t", "Z", "X")}
            if pending:
                time.sleep(0.001)
        if time.monotonic() >= deadline:
            break
    for pid in seen:
        _send(pid, signals.SIGKILL)
    return seen
