"""Running the node daemon: ``weenv serve`` in the foreground, or started on
demand in the background by a client.

One daemon per ``WEENV_HOME``: it holds an flock(2) on ``run/weenv.lock`` for
its whole life, writes its pid to ``run/weenv.pid`` and serves on
``run/weenv.sock``.  SIGTERM, SIGINT and ``POST /shutdown`` stop it cleanly:
every environment is destroyed and every mount it made is unmounted.
"""

from __future__ import annotations

import fcntl
import logging
import os
import subprocess
import sys
import time

import httpx
import uvicorn

from weenv.config import Paths
from weenv.errors import DaemonError

log = logging.getLogger(__name__)


def serve(paths: Paths | None = None) -> None:
    """Run the daemon in this process until stopped.  Raises :class:`DaemonError`
    if another daemon already serves this home."""
    from weenv.node.node import Node
    from weenv.server.app import create_app

    paths = paths or Paths.from_env()
    paths.run.mkdir(parents=True, exist_ok=True)
    lock = open(paths.run / "weenv.lock", "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise DaemonError(f"a weenv daemon already serves {paths.home}") from None
    try:
        paths.socket.unlink(missing_ok=True)
        paths.pidfile.write_text(f"{os.getpid()}\n")
        server: uvicorn.Server | None = None

        def stop() -> None:
            if server is not None:
                server.should_exit = True

        app = create_app(Node(paths), on_shutdown=stop)
        config = uvicorn.Config(app, uds=str(paths.socket), log_level="warning", lifespan="on")
        server = uvicorn.Server(config)
        server.run()
    finally:
        paths.socket.unlink(missing_ok=True)
        paths.pidfile.unlink(missing_ok=True)
        lock.close()


def is_running(paths: Paths) -> bool:
    """Whether a daemon answers on this home's socket."""
    if not paths.socket.exists():
        return False
    try:
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(paths.socket)), timeout=2) as c:
            return c.get("http://weenv/health").status_code == 200
    except httpx.HTTPError:
        return False


def start_background(paths: Paths, *, timeout: float = 60.0) -> int:
    """Start ``weenv serve`` detached (own session, output to ``run/daemon.log``)
    and wait until it answers; return its pid.  Raises :class:`DaemonError` with
    the log's tail if it exits or does not answer within ``timeout`` seconds."""
    paths.run.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, WEENV_HOME=str(paths.home), WEENV_CACHE=str(paths.cache),
               WEENV_STORE=paths.store_url)
    with open(paths.daemon_log, "ab") as logf:
        proc = subprocess.Popen(
            [sys.executable, "-m", "weenv", "serve"],
            stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, env=env,
            start_new_session=True, close_fds=True,
        )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if is_running(paths):
            return proc.pid
        if proc.poll() is not None:
            if is_running(paths):  # another client's daemon won the race
                return proc.pid
            raise DaemonError(f"weenv daemon exited ({proc.returncode}):\n{_log_tail(paths)}")
        time.sleep(0.05)
    raise DaemonError(f"weenv daemon did not answer within {timeout:.0f} s:\n{_log_tail(paths)}")


def stop(paths: Paths, *, timeout: float = 120.0) -> bool:
    """Ask the daemon to stop and wait until it has; return whether one was running."""
    if not is_running(paths):
        return False
    pid = _read_pid(paths)
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(paths.socket)), timeout=10) as c:
        c.post("http://weenv/shutdown")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pid is None or not _alive(pid):
            return True
        time.sleep(0.05)
    raise DaemonError(f"weenv daemon (pid {pid}) did not stop within {timeout:.0f} s")


def _read_pid(paths: Paths) -> int | None:
    try:
        return int(paths.pidfile.read_text())
    except (FileNotFoundError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _log_tail(paths: Paths, lines: int = 15) -> str:
    try:
        return "\n".join(paths.daemon_log.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"
