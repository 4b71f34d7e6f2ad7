"""Debian's ``docker-registry`` (distribution 2.8) on loopback, for tests.

:class:`Registry` runs ``docker-registry serve CONFIG`` with its storage under
a given directory, on ``127.0.0.1:<free port>``, deletes enabled (unless
``delete=False``); it is stopped
by PID (SIGTERM, then SIGKILL).  Faults for tests: :meth:`Registry.kill`
(SIGKILL), :meth:`Registry.pause`/:meth:`Registry.resume` (SIGSTOP/SIGCONT: the
kernel still accepts connections, nothing answers), :meth:`Registry.start`
again on the same port and storage (a restart).

Fixtures (import them into a test module: ``from registry_fixture import oci_registry``):

- ``oci_registry`` (session): one registry shared by a test session; give each
  test its own repository (:func:`new_repository`).
- ``registry`` (function): a private registry, for tests that kill or pause it.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

CONFIG = """\
version: 0.1
log:
  level: error
  accesslog:
    disabled: true
storage:
  filesystem:
    rootdirectory: {data}
  delete:
    enabled: {delete}
  maintenance:
    uploadpurging:
      enabled: false
http:
  addr: 127.0.0.1:{port}
  secret: weenv-tests
"""

_repos = itertools.count()


def new_repository(prefix: str = "weenv/t") -> str:
    """A repository name not used before in this process."""
    return f"{prefix}{os.getpid()}-{next(_repos)}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Registry:
    """A ``docker-registry`` process with its config and storage under ``root``."""

    def __init__(self, root: Path, port: int | None = None, *, delete: bool = True):
        self.root = Path(root)
        self.data = self.root / "data"
        self.config = self.root / "config.yml"
        self.log = self.root / "registry.log"
        self.port = port or free_port()
        self.delete = delete
        self.process: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def url(self, repository: str, **options) -> str:
        """``oci://127.0.0.1:PORT/REPOSITORY[?options]``."""
        query = "&".join(f"{k}={v}" for k, v in options.items())
        return f"oci://{self.address}/{repository}" + (f"?{query}" if query else "")

    def start(self, timeout: float = 15.0) -> Registry:
        """Start (or restart) the registry; return when ``GET /v2/`` answers 200."""
        if shutil.which("docker-registry") is None:
            pytest.fail("docker-registry is not installed (apt-get install docker-registry)")
        assert self.process is None, "already running"
        self.data.mkdir(parents=True, exist_ok=True)
        self.config.write_text(CONFIG.format(data=self.data, port=self.port, delete=str(self.delete).lower()))
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                ["docker-registry", "serve", str(self.config)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                code, self.process = self.process.returncode, None
                raise RuntimeError(f"docker-registry exited with {code}: {self.log.read_text()[-2000:]}")
            try:
                if httpx.get(f"http://{self.address}/v2/", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"docker-registry did not answer on {self.address} within {timeout} s")

    def _signal(self, sig: int) -> None:
        assert self.process is not None, "not running"
        os.kill(self.process.pid, sig)

    def pause(self) -> None:
        """SIGSTOP: connections are still accepted by the kernel; nothing answers."""
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL, then reap.  Open connections are reset."""
        if self.process is None:
            return
        self._signal(signal.SIGKILL)
        self.process.wait()
        self.process = None

    def stop(self) -> None:
        """SIGTERM (SIGKILL after 5 s), then reap.  Idempotent."""
        if self.process is None:
            return
        try:
            os.kill(self.process.pid, signal.SIGCONT)  # a paused process cannot handle SIGTERM
            self.process.terminate()
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        except ProcessLookupError:
            self.process.wait()
        self.process = None

    def __enter__(self) -> Registry:  # noqa: PYI034
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- what the registry keeps on disk (distribution's filesystem layout) -------------------
    def blob_data(self, digest: str) -> Path:
        hexdigest = digest.split(":", 1)[1]
        return self.data / "docker/registry/v2/blobs/sha256" / hexdigest[:2] / hexdigest / "data"

    def tag_link(self, repository: str, tag: str) -> Path:
        return self.data / "docker/registry/v2/repositories" / repository / "_manifests/tags" / tag / "current/link"

    def uploads(self, repository: str) -> list[str]:
        """Upload sessions still open in ``repository``."""
        base = self.data / "docker/registry/v2/repositories" / repository / "_uploads"
        return sorted(str(p) for p in base.iterdir()) if base.is_dir() else []


@pytest.fixture(scope="session")
def oci_registry(tmp_path_factory):
    """A registry shared by the session (give each test its own repository)."""
    with Registry(tmp_path_factory.mktemp("oci-registry")) as r:
        yield r


@pytest.fixture
def registry(tmp_path):
    """A private registry for one test (free to kill, pause or restart)."""
    with Registry(tmp_path / "registry") as r:
        yield r
