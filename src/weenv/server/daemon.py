"""Running the node daemon: ``weenv serve`` in the foreground, or started on
demand in the background by a client.

One daemon per ``WEENV_HOME``: its :class:`~weenv.node.node.Node` holds an
flock(2) on ``run/weenv.lock`` for its whole life (so neither a second daemon
nor a program's own Node can take a home in use), writes its pid to ``run/weenv.pid`` and serves on
``run/weenv.sock`` (mode 0600: only its owner connects, and needs no key).
With a TCP port it also listens on ``HOST:PORT`` (port 0: one the kernel
picks), writes ``http://HOST:PORT`` to ``run/api-url`` and requires the API key
of ``run/api-key`` there (:mod:`weenv.server.auth`).  SIGTERM, SIGINT and
``POST /v1/shutdown`` stop it cleanly: every environment is destroyed and every
mount it made is unmounted.

At start it raises its soft descriptor limit to the hard one; it serves at
most :func:`~weenv.server.limits.tcp_connection_cap` TCP connections at once
(more are answered 503 and closed at accept; the Unix socket is never
refused), closes connections silent for 5 s, and bounds request bodies
(:mod:`weenv.server.limits`).

A daemon killed by SIGKILL (or crashed) leaves its environments running: the
next daemon on the home (started on demand by the next client, or by
``weenv serve``) takes over their FUSE connection from the home's FUSE holder
(``run/fuse-holder.pid``, :mod:`weenv.node.data.fuse.holder`) and adopts them
(:meth:`~weenv.node.node.Node.start`).  :func:`stop` with no daemon running
does that too, then destroys them: nothing stays, the holder included.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time

import uvicorn
from starlette.routing import Route

from weenv.config import Paths
from weenv.errors import BusyError, DaemonError, WeenvError
from weenv.sdk import NodeClient

log = logging.getLogger(__name__)


def serve(
    paths: Paths | None = None,
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    max_environments: int | None = None,
    reap_interval: float = 1.0,
) -> None:
    """Run the daemon in this process until stopped: on the Unix socket, and on
    TCP ``host:port`` if ``port`` is given.  ``max_environments``: creates past
    it answer 503 (kind ``capacity``).  Raises :class:`DaemonError` if another
    daemon already serves this home or the port cannot be bound."""
    from weenv.node.node import Node
    from weenv.server import limits
    from weenv.server.app import create_app
    from weenv.server.auth import ApiKey
    from weenv.server.e2b import create_e2b_app

    paths = paths or Paths.from_env()
    paths.run.mkdir(parents=True, exist_ok=True)
    nofile_before, nofile = limits.raise_nofile_limit()
    if nofile_before != nofile:
        log.info("raised the soft RLIMIT_NOFILE from %d to %d", nofile_before, nofile)
    # The node takes the home's lock (Node.start) before anything of a running
    # daemon (its socket, pid file, environments) is touched.
    node = Node(paths, max_environments=max_environments)
    try:
        node.start()
    except BusyError:
        raise DaemonError(f"a weenv daemon already serves {paths.home}") from None
    print(f"weenv: OCI runtime {node.runtime.name}", file=sys.stderr)
    sockets: list[socket.socket] = []
    e2b = None
    try:
        api_key = ApiKey.load_or_create(paths.api_key)
        paths.socket.unlink(missing_ok=True)
        paths.api_url.unlink(missing_ok=True)
        sockets.append(_unix_socket(paths.socket))
        if port is not None:
            try:
                tcp = socket.create_server((host, port), backlog=2048)
            except OSError as exc:
                raise DaemonError(f"cannot listen on {host}:{port}: {exc.strerror}") from exc
            sockets.append(tcp)
            bound_host, bound_port = tcp.getsockname()[:2]
            url = f"http://{_url_host(bound_host)}:{bound_port}"
            paths.api_url.write_text(url + "\n")
            print(f"weenv: serving {url} (API key in {paths.api_key}) and unix:{paths.socket}", file=sys.stderr)
        paths.pidfile.write_text(f"{os.getpid()}\n")
        server: uvicorn.Server | None = None

        def stop() -> None:
            if server is not None:
                server.should_exit = True

        app = create_app(
            node, on_shutdown=stop, api_key=api_key, trusted_socket=str(paths.socket), reap_interval=reap_interval
        )
        e2b = create_e2b_app(node, api_keys=[api_key.e2b])
        app.mount("/e2b", e2b)
        from weenv.server.prime import create_prime_app

        prime = create_prime_app(
            node, api_key=api_key, sandboxes=e2b.state.sandboxes, resolve=e2b.state.templates.resolve
        )
        app.mount("/prime", prime)
        # envd tokens and prime gateway tokens count as credentials (BodyLimit)
        app.state.envd_credentialed = lambda scope: (
            e2b.state.envd_credentialed(scope) or prime.state.credentialed(scope)
        )
        # the SDK's download_url/upload_url join "/files" to the sandbox URL with urljoin, which drops
        # E2B_SANDBOX_URL's /e2b/envd: envd's /files (signed URLs) answers at the root too
        app.router.routes.append(Route("/files", e2b.state.envd.files, methods=["GET", "POST"]))
        from weenv.server.e2b.ports import PortProxy, relay_settings
        from weenv.server.kit import wsrelay

        tcp_cap = limits.tcp_connection_cap(nofile)
        # outermost: E2B's PORT-ID. hosts to sandbox ports, at most a quarter of the TCP connections
        app.add_middleware(
            PortProxy, node=node, sandboxes=e2b.state.sandboxes, api_key=api_key, **relay_settings(tcp_cap)
        )
        http = limits.tcp_protocol(tcp_cap)
        config = uvicorn.Config(
            app,
            log_level="warning",
            lifespan="on",
            timeout_graceful_shutdown=5,
            http=http,
            # WebSocket upgrades (get_host's relay) on a protocol the connection cap still
            # counts; no per-message deflate (no decompression on the daemon)
            ws=http.ws_protocol,
            ws_per_message_deflate=False,
            ws_max_size=wsrelay.MAX_WS_MESSAGE,
            timeout_keep_alive=limits.IDLE_TIMEOUT_S,
        )
        server = uvicorn.Server(config)
        # uvicorn handles SIGTERM/SIGINT while it runs, shuts down cleanly, then
        # raises the signal again under the previous handler: make that an exit 0.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, _exit_cleanly)
        server.run(sockets=sockets)
    finally:
        for s in sockets:
            s.close()
        paths.socket.unlink(missing_ok=True)
        paths.api_url.unlink(missing_ok=True)
        paths.pidfile.unlink(missing_ok=True)
        if e2b is not None:
            e2b.state.templates.close()  # cancels and undoes the template builds still running
            e2b.state.watches.close()  # stops the directory watchers and their thread
        node.close()  # idempotent (the app's lifespan closed it); releases the home's lock


def _exit_cleanly(signum, frame) -> None:
    raise SystemExit(0)


def _unix_socket(path) -> socket.socket:
    """A listening Unix socket at ``path`` that only its owner may connect to (0600)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        s.bind(str(path))
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    s.listen(2048)
    return s


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def is_running(paths: Paths) -> bool:
    """Whether a daemon answers on this home's socket."""
    if not paths.socket.exists():
        return False
    try:
        with NodeClient(socket=paths.socket, request_timeout=2) as c:
            return c.health()
    except WeenvError:
        return False


def connect(paths: Paths | None = None, *, autostart: bool = True, timeout: float = 900.0) -> NodeClient:
    """The SDK's :class:`~weenv.sdk.NodeClient` on the socket of the daemon of
    ``paths.home`` (default: ``$WEENV_HOME``); with ``autostart``, a daemon is
    started (:func:`start_background`) if none answers.  ``timeout``: seconds a
    request may wait for its answer.  Raises :class:`DaemonError` when no daemon
    answers and ``autostart`` is off, or one cannot be started."""
    paths = paths or Paths.from_env()
    if not is_running(paths):
        if not autostart:
            raise DaemonError(f"no weenv daemon serves {paths.home} (start one: weenv serve)")
        start_background(paths)
    return NodeClient(socket=paths.socket, request_timeout=timeout)


def start_background(
    paths: Paths,
    *,
    timeout: float = 60.0,
    host: str | None = None,
    port: int | None = None,
    settings: dict[str, str] | None = None,
) -> int:
    """Start ``weenv serve`` detached (own session, output to ``run/daemon.log``)
    and wait until it answers; return its pid.  With ``port``, it serves TCP on
    ``host:port`` too (``weenv serve --host --port``; port 0: one the kernel
    picks, written to ``run/api-url``).  ``settings``: ``WEENV_*`` variables it
    runs with besides this process's.  Raises :class:`DaemonError` with the
    log's tail if it exits or does not answer within ``timeout`` seconds."""
    paths.run.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, WEENV_HOME=str(paths.home), WEENV_CACHE=str(paths.cache), WEENV_STORE=paths.store_url)
    env.update(settings or {})
    with open(paths.daemon_log, "ab") as logf:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "weenv",
                "serve",
                *(["--host", host or "127.0.0.1", "--port", str(port)] if port is not None else []),
            ],
            stdin=subprocess.DEVNULL,
            stdout=logf,
            stderr=logf,
            env=env,
            start_new_session=True,
            close_fds=True,
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
    """Stop the home's daemon and wait until it has, and until nothing of the
    home is left; return whether a daemon was running.

    A daemon that answers on its socket is asked (``POST /v1/shutdown``); one
    that does not (its socket deleted) but holds the home's lock and runs
    ``weenv serve`` gets SIGTERM (its pid from the lock, :func:`lock_holder`).
    Once no daemon is left, whatever remains (a daemon killed before or during
    its stop leaves containers, mounts, environment dirs, cgroups, its FUSE
    holder) is cleared here by starting and closing a node on the home.
    Raises :class:`DaemonError` if the daemon does not stop within ``timeout``
    seconds, if something of the home is still there after the clearing
    (naming what), or if the home is held by a process that is not a daemon
    (a program's own :class:`~weenv.node.node.Node`)."""
    was_running = False
    if is_running(paths):
        was_running = True
        pid = _read_pid(paths)
        try:
            with NodeClient(socket=paths.socket, request_timeout=10) as c:
                c.shutdown()
        except WeenvError as exc:  # it died meanwhile (or is dying): what it left is cleared below
            log.info("the daemon did not answer its shutdown: %s", exc)
        _wait_exit(pid, timeout)
    holder = lock_holder(paths)
    # A flock names the pid that took it; a daemon killed while it forked a
    # child (the child holds the descriptor until it execs, O_CLOEXEC) leaves
    # it held for a moment under a pid that is dead or a zombie: wait for that.
    deadline = time.monotonic() + LOCK_RELEASE_WAIT_S
    while holder is not None and not _alive(holder) and time.monotonic() < deadline:
        time.sleep(0.05)
        holder = lock_holder(paths)
    if holder is not None:
        if not _is_daemon(holder):
            raise DaemonError(
                f"WEENV_HOME={paths.home} is held by pid {holder} ({' '.join(_cmdline(holder))[:200]}), "
                "which is not a weenv daemon: stop that program"
            )
        was_running = True
        os.kill(holder, signal.SIGTERM)
        _wait_exit(holder, timeout)
    if _leftovers(paths):
        from weenv.node.node import Node

        log.info("clearing what a killed daemon left in %s", paths.home)
        try:
            Node(paths).start().close()  # start adopts (or clears) a killed node's state; close destroys it
        except BusyError:  # a daemon started on demand took the home meanwhile
            raise DaemonError(f"a weenv daemon started on {paths.home} while it was being stopped") from None
    left = _leftovers(paths)
    if left:
        raise DaemonError(f"weenv daemon stopped, but {paths.home} still has {'; '.join(left)}")
    return was_running


def running_templates(paths: Paths) -> list[str]:
    """Template digests of the environments the daemon of ``paths.home`` runs
    (empty if no daemon runs): what ``weenv gc`` keeps (the ``in_use`` of
    :func:`weenv.packaging.gc.collect`).  Raises :class:`DaemonError` if one runs
    (its pidfile names a live process) and does not answer."""
    if not is_running(paths):
        pid = _read_pid(paths)
        if pid is not None and _alive(pid):
            raise DaemonError(
                f"the weenv daemon of {paths.home} (pid {pid}) runs but does not answer on "
                f"{paths.socket}; gc cannot tell which environments run and refuses"
            )
        return []
    try:
        with connect(paths, autostart=False, timeout=30.0) as client:
            return sorted({e.template_digest for e in client.list()})
    except WeenvError as exc:
        raise DaemonError(
            f"a weenv daemon runs for {paths.home} but cannot say which environments run "
            f"({exc}); gc refuses to guess — stop it (weenv stop) or retry"
        ) from exc


def _wait_exit(pid: int | None, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while pid is not None and _alive(pid):
        if time.monotonic() >= deadline:
            raise DaemonError(f"weenv daemon (pid {pid}) did not stop within {timeout:.0f} s")
        time.sleep(0.05)


LOCK_RELEASE_WAIT_S = 5.0
"""Seconds :func:`stop` waits for a home lock named by a dead pid to be released."""


def lock_holder(paths: Paths) -> int | None:
    """The pid holding the home's lock (``run/weenv.lock``, see
    :meth:`~weenv.node.node.Node.start`), from /proc/locks; None if none does."""
    try:
        st = os.stat(paths.run / "weenv.lock")
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return None
    # "1: FLOCK  ADVISORY  WRITE 1234 00:2d:5678 0 EOF" (fs/locks.c, lock_get_status)
    want = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
    for line in lines:
        fields = line.split()
        if "->" in fields or len(fields) < 6 or fields[1] != "FLOCK":
            continue
        try:
            major, minor, ino = fields[5].split(":")
            if (int(major, 16), int(minor, 16), int(ino)) == want:
                return int(fields[4])
        except ValueError:
            continue
    return None


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


def _is_daemon(pid: int) -> bool:
    """Whether ``pid`` runs ``weenv serve`` (``python -m weenv serve`` or the ``weenv`` script)."""
    argv = _cmdline(pid)
    return "serve" in argv and any(a == "weenv" or a.endswith("/weenv") for a in argv)


def _leftovers(paths: Paths) -> list[str]:
    """What of the home outlives its daemon, in words (``[]``: nothing): mounts
    below it, its FUSE holder, environment dirs, runc containers and the
    cgroups of the environments those name."""
    from weenv.host import mounts
    from weenv.node.data.fuse import holder

    left = []
    points = mounts.mounts_under(paths.home)
    if points:
        left.append(f"{len(points)} mounts")
    pid = holder.pid_of(paths.run)
    if pid is not None:
        left.append(f"its FUSE holder (pid {pid})")
    ids = set()
    if paths.environments.is_dir():
        ids |= {d.name for d in paths.environments.iterdir()}
        if ids:
            left.append(f"{len(ids)} environment dirs")
    containers = [d.name for root in paths.runtime_roots.values() if root.is_dir() for d in root.iterdir()]
    if containers:
        left.append(f"{len(containers)} containers")
    ids |= {c.removeprefix("weenv-") for c in containers}
    cgroups = sorted({c for i in ids for c in _cgroups_of(i)})
    if cgroups:
        left.append(f"{len(cgroups)} cgroups")
    return left


def _cgroups_of(env_id: str) -> list[str]:
    """The cgroup directories of environment ``env_id`` (``weenv-<id>``, and
    ``weenv-<id>.N`` of containers a reset made ahead, in any hierarchy)."""
    from weenv.node.cgroups import environment_dirs

    return [str(d) for d in environment_dirs(env_id)]


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
