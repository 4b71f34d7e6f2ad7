"""A private Docker daemon: Debian's ``dockerd`` (package ``docker.io``) with all
its state under one temporary directory, for tests and benchmarks.

Debian's binaries are used by path (:data:`DOCKERD`, :data:`DOCKER`), never a
``docker`` found first on ``PATH`` (a machine may have a client-only build
there).  Layout under ``root`` (a fresh ``weenv-dockerd-*`` directory in the
system's temporary directory unless given; kept short, since containerd's
sockets live in it)::

    root/daemon.json      --config-file: data-root, exec-root, pidfile, host,
                          bridge "none", no iptables/ip6tables/ip-masq, no
                          userland proxy, insecure registries, trust key path
    root/data/            --data-root (images, layers, containers; overlay2)
    root/exec/            --exec-root (containerd's state and socket, netns files)
    root/docker.sock      the API (unix socket)
    root/docker.pid       pidfile
    root/dockerd.log      the daemon's (and its containerd's) output
    root/client/          DOCKER_CONFIG of the client

Checked on Debian 12 (docker.io 20.10.24, kernel 6.18, ext4): with
``bridge: none`` and ``iptables: false`` the daemon starts without touching
the host's network; ``docker build`` (classic builder), ``docker run`` (with
``--network none`` or the default network) and ``docker push`` to a loopback
registry work.  Containers go under the cgroup parent ``/dockerd-<token>``
(removed on stop) rather than the shared ``/docker``.

:meth:`Dockerd.stop` sends SIGTERM to the daemon by PID (it stops its
containers and its containerd), SIGKILLs it after a grace period, then ends any
process still naming ``root`` on its command line (containerd and its shims
after a crash), unmounts everything under ``root`` and removes it.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from weenv.errors import CommandTimeoutError, InvalidInputError, RuntimeFailedError
from weenv_bench.services import process

DOCKERD = "/usr/sbin/dockerd"
DOCKER = "/usr/bin/docker"
PACKAGE = "docker.io"
SOCKET_PATH_MAX = 100
"""sun_path holds 108 bytes; containerd appends to exec-root too, so keep margin."""
_CGROUP_ROOT = Path("/sys/fs/cgroup")
_RUN_DIRS = (Path("/run/docker/plugins"), Path("/run/docker"), Path("/run/containerd/s"), Path("/run/containerd"))
"""Directories dockerd and containerd's shims create outside their roots (plugin
discovery, shim sockets); removed on stop when they did not exist before and are empty."""


class Dockerd:
    """One private ``dockerd``.  Use as a context manager, or :meth:`start` then
    :meth:`stop`.

    ``root``: the directory for all its files (created; removed on stop); default
    a new ``weenv-dockerd-*`` directory in the system's temporary directory.
    ``insecure_registries``: ``HOST:PORT`` entries reached over plain HTTP
    (Docker already treats ``127.0.0.0/8`` so; listed for clarity).
    ``storage_driver``: default ``overlay2``.  ``start_timeout`` / ``stop_grace``:
    seconds.  Raises :class:`ToolMissingError` without Debian's docker.io,
    :class:`RuntimeFailedError` (with the log's tail) if it does not start.
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        *,
        insecure_registries: tuple[str, ...] | list[str] = (),
        storage_driver: str = "overlay2",
        start_timeout: float = 60.0,
        stop_grace: float = 20.0,
    ):
        self._given_root = Path(root).absolute() if root is not None else None
        self.root: Path | None = None
        self.insecure_registries = list(insecure_registries)
        self.storage_driver = storage_driver
        self.start_timeout = start_timeout
        self.stop_grace = stop_grace
        self.cgroup_parent = f"/dockerd-{secrets.token_hex(4)}"
        self._proc: subprocess.Popen | None = None
        self._run_dirs_existed: dict[Path, bool] = {}

    # --- paths ----------------------------------------------------------------------
    @property
    def socket(self) -> Path:
        return self._root() / "docker.sock"

    @property
    def host(self) -> str:
        """``DOCKER_HOST`` for clients: ``unix://ROOT/docker.sock``."""
        return f"unix://{self.socket}"

    @property
    def log(self) -> Path:
        return self._root() / "dockerd.log"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def env(self) -> dict[str, str]:
        """Environment for Debian's ``docker`` client talking to this daemon
        (classic builder: one layer per ``RUN``/``COPY``)."""
        return dict(
            os.environ,
            DOCKER_HOST=self.host,
            DOCKER_CONFIG=str(self._root() / "client"),
            DOCKER_BUILDKIT="0",
        )

    def _root(self) -> Path:
        if self.root is None:
            raise InvalidInputError("dockerd is not started")
        return self.root

    # --- lifetime -------------------------------------------------------------------
    def start(self) -> Dockerd:
        process.require_program(DOCKERD, PACKAGE)
        process.require_program(DOCKER, PACKAGE)
        if self._given_root is not None:
            self._given_root.mkdir(parents=True, exist_ok=True)
            self.root = self._given_root
        else:
            self.root = Path(tempfile.mkdtemp(prefix="weenv-dockerd-"))
        try:
            if len(str(self.socket)) > SOCKET_PATH_MAX or len(str(self.root / "exec")) > 60:
                raise InvalidInputError(
                    f"dockerd root {self.root} is too long for its unix sockets; use a shorter path"
                )
            for d in ("data", "exec", "client"):
                (self.root / d).mkdir(exist_ok=True)
            self._run_dirs_existed = {d: d.exists() for d in _RUN_DIRS}
            config = self.root / "daemon.json"
            config.write_text(json.dumps(self._config(), indent=2))
            self._proc = process.spawn([DOCKERD, "--config-file", str(config)], self.log)
            process.wait_ready(self._proc, self._ping, what="dockerd", log=self.log, timeout=self.start_timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _config(self) -> dict:
        root = self._root()
        return {
            "data-root": str(root / "data"),
            "exec-root": str(root / "exec"),
            "pidfile": str(root / "docker.pid"),
            "hosts": [self.host],
            "bridge": "none",
            "iptables": False,
            "ip6tables": False,
            "ip-masq": False,
            "userland-proxy": False,
            "storage-driver": self.storage_driver,
            "insecure-registries": self.insecure_registries,
            "cgroup-parent": self.cgroup_parent,
            "deprecated-key-path": str(root / "key.json"),
            "shutdown-timeout": 5,
            "log-level": "warn",
        }

    def _ping(self) -> bool:
        if not self.socket.exists():
            return False
        transport = httpx.HTTPTransport(uds=str(self.socket))
        with httpx.Client(transport=transport, timeout=2.0) as c:
            try:
                return c.get("http://docker/_ping").status_code == 200
            except httpx.HTTPError:
                return False

    def stop(self) -> None:
        """Stop the daemon by PID and remove every trace of it.  Idempotent.

        Raises :class:`MountError` if a mount under its root cannot be removed.
        """
        if self.root is None:
            return
        root = self.root
        if self._proc is not None:
            if self._proc.poll() is None:
                self._remove_containers()
            process.stop_process(self._proc, grace=self.stop_grace)
            self._proc = None
        # containerd and its shims outlive a killed dockerd; they name our root.
        process.kill_pids(process.pids_mentioning(str(root) + "/"))
        process.umount_all_under(root)
        self._remove_cgroup_parent()
        for d in _RUN_DIRS:
            if not self._run_dirs_existed.get(d, True):
                _rmdir_empty(d)
        shutil.rmtree(root, ignore_errors=True)
        self.root = None

    def _remove_containers(self) -> None:
        """``docker rm -f`` every container: quicker than the daemon's own shutdown,
        which gives each container ``shutdown-timeout`` seconds to stop."""
        try:
            ids = self.docker("ps", "-aq", timeout=30).stdout.decode().split()
            if ids:
                self.docker("rm", "-f", *ids, timeout=60, check=False)
        except (RuntimeFailedError, CommandTimeoutError):
            pass

    def _remove_cgroup_parent(self, timeout: float = 5.0) -> None:
        """rmdir the containers' parent cgroup in every hierarchy (v1 and v2), deepest
        first, retrying while a just-killed container's cgroup is still busy."""
        name = self.cgroup_parent.strip("/")
        if not _CGROUP_ROOT.is_dir():
            return
        deadline = time.monotonic() + timeout
        while True:
            left = [d for d in _CGROUP_ROOT.glob(f"*/{name}") if d.is_dir()]
            if (_CGROUP_ROOT / "cgroup.controllers").exists() and (_CGROUP_ROOT / name).is_dir():
                left.append(_CGROUP_ROOT / name)  # pure cgroup v2
            if not left or time.monotonic() > deadline:
                return
            for d in left:
                subdirs = [p for p in d.rglob("*") if p.is_dir() and not p.is_symlink()]
                for child in sorted(subdirs, key=lambda p: len(p.parts), reverse=True):
                    _rmdir_empty(child)
                _rmdir_empty(d)
            time.sleep(0.1)

    def __enter__(self) -> Dockerd:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- the client -----------------------------------------------------------------
    def docker(
        self,
        *args: str,
        input: bytes | None = None,
        timeout: float | None = 600,
        check: bool = True,
        cwd: str | os.PathLike[str] | None = None,
    ) -> subprocess.CompletedProcess[bytes]:
        """Run Debian's ``docker ARGS...`` against this daemon; return the completed
        process (stdout and stderr as bytes).

        Raises :class:`RuntimeFailedError` (with stderr's tail) if ``check`` and it
        exits non-zero, :class:`CommandTimeoutError` after ``timeout`` seconds.
        """
        argv = [DOCKER, *args]
        try:
            proc = subprocess.run(
                argv,
                input=input,
                capture_output=True,
                timeout=timeout,
                env=self.env(),
                cwd=cwd,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise CommandTimeoutError(f"docker {' '.join(args[:3])} ran past {timeout} s") from exc
        if check and proc.returncode != 0:
            tail = "\n".join((proc.stderr or proc.stdout).decode(errors="replace").strip().splitlines()[-12:])
            raise RuntimeFailedError(f"docker {' '.join(args[:4])} failed (exit {proc.returncode}):\n{tail}")
        return proc

    def import_tree(self, tree: Path, ref: str) -> None:
        """``docker import`` of directory ``tree`` (owners, modes and xattrs
        kept: ``tar --xattrs --numeric-owner``) as image ``ref``.  Raises
        :class:`RuntimeFailedError` with docker's message."""
        tar = subprocess.Popen(
            ["tar", "-C", str(tree), "--xattrs", "--numeric-owner", "-c", "."],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        try:
            imp = subprocess.run(
                [DOCKER, "import", "-", ref], stdin=tar.stdout, capture_output=True, env=self.env(), check=False
            )
        finally:
            tar.stdout.close()
            tar.wait()
        if imp.returncode != 0 or tar.returncode != 0:
            raise RuntimeFailedError(f"docker import failed: {imp.stderr.decode(errors='replace')[-600:]}")


def _rmdir_empty(path: Path) -> None:
    try:
        path.rmdir()
    except OSError:
        pass
