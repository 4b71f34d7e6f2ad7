"""Starting, waiting for and stopping one service process (Linux only).

A service is started in its own session (``start_new_session``), so a signal
sent to the caller's terminal does not reach it, with stdout and stderr in a log
file.  It is stopped by its PID: SIGTERM, then SIGKILL after a grace period, and
reaped.  :func:`free_port` picks a loopback TCP port, :func:`umount_all_under`
removes every mount a service left below its directory.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from weenv.errors import MountError, RuntimeFailedError, ToolMissingError
from weenv.host import mounts

LOG_TAIL_LINES = 15


def require_program(path: str, package: str) -> str:
    """``path`` if it is an executable file; else :class:`ToolMissingError` naming
    the Debian ``package`` that ships it."""
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise ToolMissingError(f"{path} is not installed (apt-get install {package})")
    return path


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago (bound to port 0, then closed)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def log_tail(log: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of the file ``log`` ('' if absent)."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.strip().splitlines()[-lines:])


def spawn(argv: list[str], log: Path, *, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``argv`` in a new session with stdout+stderr appended to ``log``.
    Raises :class:`RuntimeFailedError` if it cannot be executed."""
    with open(log, "ab") as out:
        try:
            return subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                close_fds=True,
            )
        except OSError as exc:
            raise RuntimeFailedError(f"cannot start {argv[0]}: {exc}") from exc


def wait_ready(proc: subprocess.Popen, ready: Callable[[], bool], *, what: str, log: Path, timeout: float) -> None:
    """Poll ``ready()`` until it is true.  Raises :class:`RuntimeFailedError` (with
    the tail of ``log``) if the process exits first or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    delay = 0.02
    while True:
        if proc.poll() is not None:
            raise RuntimeFailedError(
                f"{what} exited with status {proc.returncode} before it was ready:\n{log_tail(log)}"
            )
        try:
            if ready():
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeFailedError(f"{what} was not ready after {timeout:.0f} s:\n{log_tail(log)}")
        time.sleep(delay)
        delay = min(delay * 1.5, 0.25)


def stop_process(proc: subprocess.Popen, *, grace: float = 10.0) -> int | None:
    """SIGTERM ``proc`` by its PID, SIGKILL it after ``grace`` seconds, reap it;
    return its exit status.  Idempotent."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode


def kill_pids(pids: list[int], *, grace: float = 5.0) -> None:
    """SIGTERM each PID in ``pids`` (processes this service started, found by the
    caller), SIGKILL those alive after ``grace`` seconds.  Not our children, so
    they are not reaped here; their parent (or init) does that."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    for pid in pids:
        if alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def pids_mentioning(text: str) -> list[int]:
    """PIDs of processes whose command line contains ``text`` (a path unique to
    one service instance, e.g. its private directory), excluding this process."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if text.encode() in cmdline:
            found.append(int(entry))
    return found


def umount_all_under(root: Path) -> None:
    """Unmount every mount at or below ``root``, deepest first (lazily if busy).
    Raises :class:`MountError` if one stays."""
    for _ in range(3):
        points = sorted({p for _t, p in mounts.mounts_under(root)}, key=len, reverse=True)
        if not points:
            return
        for point in points:
            try:
                mounts.umount(point)
            except MountError:
                try:
                    mounts.umount(point, detach=True)
                except MountError:
                    pass
    left = mounts.mounts_under(root)
    if left:
        raise MountError(f"mounts remain under {root}: {[p for _t, p in left]}")


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (from ``/proc/PID/stat``)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"
