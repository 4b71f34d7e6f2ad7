"""A private container registry on loopback: Debian's ``docker-registry``
(package ``docker-registry``, distribution 2.8) for tests and benchmarks.

``docker-registry serve CONFIG`` with a generated config (JSON, which its YAML
parser reads): filesystem storage under ``root/data``, deletes enabled, no
auth, plain HTTP on ``127.0.0.1:PORT`` (a free port unless given).  Clients
reach it without TLS: Docker treats ``127.0.0.0/8`` as insecure, skopeo needs
``--tls-verify=false`` (``--src-``/``--dest-``).

Layout under ``root`` (a fresh ``weenv-registry-*`` directory unless given)::

    root/config.yml     the config
    root/data/          storage (docker/registry/v2/blobs, repositories)
    root/registry.log   its output
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import httpx

from weenv.errors import InvalidInputError
from weenv_bench.services import process

REGISTRY = "/usr/bin/docker-registry"
PACKAGE = "docker-registry"


class Registry:
    """One private registry.  Use as a context manager, or :meth:`start` then
    :meth:`stop`.

    ``root``: directory for its files (created; removed on stop).  ``port``: TCP
    port on 127.0.0.1 (default: a free one).  Raises :class:`ToolMissingError`
    without Debian's docker-registry, :class:`RuntimeFailedError` (with the log's
    tail) if it does not answer ``GET /v2/`` within ``start_timeout`` seconds.
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        *,
        port: int | None = None,
        start_timeout: float = 30.0,
    ):
        self._given_root = Path(root).absolute() if root is not None else None
        self.root: Path | None = None
        self.port = port
        self.start_timeout = start_timeout
        self._proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        """``127.0.0.1:PORT``: the registry part of an image reference."""
        if self.port is None:
            raise InvalidInputError("registry is not started")
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def log(self) -> Path:
        if self.root is None:
            raise InvalidInputError("registry is not started")
        return self.root / "registry.log"

    def reference(self, repository: str, tag: str = "latest") -> str:
        """``127.0.0.1:PORT/REPOSITORY:TAG``."""
        return f"{self.address}/{repository}:{tag}"

    def start(self) -> Registry:
        process.require_program(REGISTRY, PACKAGE)
        if self._given_root is not None:
            self._given_root.mkdir(parents=True, exist_ok=True)
            self.root = self._given_root
        else:
            self.root = Path(tempfile.mkdtemp(prefix="weenv-registry-"))
        try:
            if self.port is None:
                self.port = process.free_port()
            (self.root / "data").mkdir(exist_ok=True)
            config = self.root / "config.yml"
            config.write_text(json.dumps(self._config(), indent=2))
            self._proc = process.spawn([REGISTRY, "serve", str(config)], self.log)
            process.wait_ready(
                self._proc,
                self._ready,
                what="docker-registry",
                log=self.log,
                timeout=self.start_timeout,
            )
        except BaseException:
            self.stop()
            raise
        return self

    def _config(self) -> dict:
        return {
            "version": 0.1,
            "log": {"level": "warn", "accesslog": {"disabled": True}},
            "storage": {
                "filesystem": {"rootdirectory": str(self.root / "data")},
                "delete": {"enabled": True},
                "cache": {"blobdescriptor": "inmemory"},
            },
            "http": {"addr": self.address, "headers": {"X-Content-Type-Options": ["nosniff"]}},
        }

    def _ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/v2/", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def blob_bytes(self) -> int:
        """Bytes of every blob stored (layers, configs, manifests): compare before
        and after a push to get the bytes it added."""
        blobs = self._data() / "docker" / "registry" / "v2" / "blobs"
        total = 0
        for dirpath, _dirs, files in os.walk(blobs):
            for f in files:
                total += os.lstat(os.path.join(dirpath, f)).st_size
        return total

    def _data(self) -> Path:
        if self.root is None:
            raise InvalidInputError("registry is not started")
        return self.root / "data"

    def stop(self) -> None:
        """Stop the registry by PID and remove its directory.  Idempotent."""
        if self._proc is not None:
            process.stop_process(self._proc, grace=10.0)
            self._proc = None
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None

    def __enter__(self) -> Registry:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
