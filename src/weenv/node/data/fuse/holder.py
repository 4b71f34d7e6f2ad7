"""The FUSE holder: a small process that keeps a FUSE connection open while
the daemon serving it dies and a new one starts.

A FUSE connection lives as long as some process holds a descriptor of its
``/dev/fuse`` file: when the last one closes, the kernel aborts it and every
read of the file system (and of the EROFS group mounts on it) fails with
ENOTCONN from then on.  So the node daemon, right after mounting its lazy
file system, starts one holder per home (:func:`spawn`): the holder gets a
copy of the descriptor at exec (``pass_fds``) and the small
:class:`~weenv.node.data.fuse.session.InitState` the connection was initialized
with, and does nothing else.  A daemon killed by SIGKILL leaves the holder
running, the connection alive and the requests it was serving waiting; the
next daemon on the home asks the holder for the descriptor (:func:`take`:
SCM_RIGHTS over the holder's Unix socket) and serves it again
(:class:`~weenv.node.data.fuse.session.FuseSession` with ``resume``).

Files, in the node's run directory ``RUN``: ``RUN/fuse-holder.sock`` (mode
0600; the holder also checks that the peer's uid is its own) and
``RUN/fuse-holder.pid``.  Requests are one datagram each (SOCK_SEQPACKET):
``GET`` (answered with the state as JSON and the descriptor) and ``EXIT``
(answered ``OK``; the holder closes its descriptor, removes its files and
exits; :func:`release`).  SIGTERM and SIGINT end it too.  The holder also ends
by itself when the connection is gone (it checks every second for POLLERR,
which /dev/fuse reports once the connection is aborted, e.g. after an
unmount), so it never outlives its file system.

This module imports only the standard library: the holder runs it as a
script (``python -I -S holder.py``), a few MB of memory, no weenv imports.
"""

from __future__ import annotations

import array
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time

SOCKET_NAME = "fuse-holder.sock"
PIDFILE_NAME = "fuse-holder.pid"
CHECK_INTERVAL_S = 1.0


# --- the daemon's side ---------------------------------------------------------------------
def spawn(run_dir: str | os.PathLike[str], fd: int, state: dict, *, timeout: float = 10.0) -> subprocess.Popen:
    """Start a holder of descriptor ``fd`` (with ``state``, a JSON-able dict) for
    run directory ``run_dir`` and wait until it answers; return its process.

    It runs in its own session, its output discarded.  Raises ``OSError`` if it
    exits or does not answer within ``timeout`` seconds (it is killed then)."""
    run_dir = os.path.abspath(run_dir)  # pid_of knows its holder by it
    proc = subprocess.Popen(
        [sys.executable, "-I", "-S", os.path.abspath(__file__), run_dir, str(fd), json.dumps(state)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        pass_fds=(fd,),
        start_new_session=True,
        cwd="/",
    )
    try:
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        line = proc.stdout.readline() if ready else b""
        if line.strip() != b"ready":
            raise OSError(f"the FUSE holder did not start (exit status {proc.poll()})")
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    finally:
        proc.stdout.close()
    return proc


def pid_of(run_dir: str | os.PathLike[str]) -> int | None:
    """The pid in ``run_dir``'s holder pid file if that process runs the holder
    of ``run_dir`` (not another home's: the file may be stale or damaged), else None."""
    try:
        pid = int(open(os.path.join(run_dir, PIDFILE_NAME)).read())
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except (OSError, ValueError):
        return None
    mine = os.fsencode(os.path.abspath(run_dir))
    return pid if any(a.endswith(b"/holder.py") and b == mine for a, b in zip(argv, argv[1:])) else None


def _request(run_dir: str | os.PathLike[str], message: bytes, timeout: float) -> tuple[bytes, list[int]]:
    path = os.path.join(run_dir, SOCKET_NAME)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as s:
        s.settimeout(timeout)
        s.connect(path)
        s.send(message)
        fds = array.array("i")
        data, ancdata, _flags, _addr = s.recvmsg(65536, socket.CMSG_SPACE(fds.itemsize))
        for level, kind, cdata in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(cdata[: len(cdata) - len(cdata) % fds.itemsize])
        for fd in fds:
            os.set_inheritable(fd, False)
        return data, list(fds)


def take(run_dir: str | os.PathLike[str], *, timeout: float = 5.0) -> tuple[int, dict] | None:
    """A copy of the descriptor ``run_dir``'s holder keeps, and its state; None if
    no holder answers.  The holder keeps its own copy."""
    if pid_of(run_dir) is None:
        return None
    try:
        data, fds = _request(run_dir, b"GET", timeout)
    except OSError:
        return None
    if len(fds) != 1:
        for fd in fds:
            os.close(fd)
        return None
    return fds[0], json.loads(data)


def release(run_dir: str | os.PathLike[str], *, timeout: float = 5.0) -> bool:
    """Make ``run_dir``'s holder close its descriptor and exit, and wait for it;
    whether one was running.  A holder that does not answer gets SIGKILL."""
    pid = pid_of(run_dir)
    if pid is None:
        return False
    try:
        _request(run_dir, b"EXIT", timeout)
    except OSError:
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)
    return True


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


# --- the holder ----------------------------------------------------------------------------
def _connection_gone(fd: int) -> bool:
    p = select.poll()
    p.register(fd, 0)  # POLLERR and POLLHUP are always reported
    return any(ev & (select.POLLERR | select.POLLHUP | select.POLLNVAL) for _fd, ev in p.poll(0))


def main(argv: list[str]) -> int:
    run_dir, fd, state = argv[0], int(argv[1]), argv[2].encode()
    sock_path = os.path.join(run_dir, SOCKET_NAME)
    pid_path = os.path.join(run_dir, PIDFILE_NAME)
    me = os.getpid()

    def cleanup(*_args) -> None:
        try:
            if int(open(pid_path).read()) == me:
                os.unlink(pid_path)
                os.unlink(sock_path)
        except (OSError, ValueError):
            pass
        os._exit(0)

    signal.signal(signal.SIGTERM, cleanup)
    signal.signal(signal.SIGINT, cleanup)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        os.unlink(sock_path)
    except FileNotFoundError:
        pass
    old = os.umask(0o177)
    try:
        server.bind(sock_path)
    finally:
        os.umask(old)
    server.listen(16)
    tmp = f"{pid_path}.{me}"
    with open(tmp, "w") as f:
        f.write(f"{me}\n")
    os.rename(tmp, pid_path)
    os.write(1, b"ready\n")
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)

    while True:
        ready, _, _ = select.select([server], [], [], CHECK_INTERVAL_S)
        if not ready:
            if _connection_gone(fd):
                cleanup()
            continue
        try:
            conn, _ = server.accept()
        except OSError:
            continue
        with conn:
            try:
                conn.settimeout(5)
                pid, uid, gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
                if uid != os.getuid():
                    continue
                message = conn.recv(64)
                if message == b"GET":
                    conn.sendmsg([state], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
                elif message == b"EXIT":
                    os.close(fd)
                    conn.send(b"OK")
                    cleanup()
            except OSError:
                continue


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
