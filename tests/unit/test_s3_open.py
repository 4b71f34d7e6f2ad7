"""Opening an ``s3://`` store without a server: its URL and options, the
environment it reads, a node's unchecked opening (sends nothing; the first
operation fails clearly), and boto3 missing (weenv[s3] not installed)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest
from test_product import HIDE, ROOT

from weenv.errors import InvalidInputError, StoreUnavailableError
from weenv.store import open_store
from weenv.store.s3 import S3Store

FAST = "connect_timeout=0.5&read_timeout=0.5&timeout=1&retries=1&backoff=0.01&probe_interval=0"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(autouse=True)
def _no_aws_environment(monkeypatch):
    for name in ("WEENV_S3_ENDPOINT", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")


def test_url_options_and_environment(monkeypatch):
    store = S3Store(f"s3://my-bucket/a/b?endpoint=http://127.0.0.1:1&{FAST}", check=False, timeout=3)
    try:
        assert (store.url, store.bucket, store.prefix) == ("s3://my-bucket/a/b", "my-bucket", "a/b")
        assert store.options.timeout == 3 and store.options.read_timeout == 0.5  # a keyword wins over the URL
        assert store.options.region == "us-east-1" and store.endpoint == "http://127.0.0.1:1"
        assert store._blob_key("chunks", "sha256:" + "ab" * 32) == "a/b/chunks/sha256/ab/" + "ab" * 32
        assert store._ref_key("templates", "t") == "a/b/refs/templates/t"
    finally:
        store.close()
    monkeypatch.setenv("WEENV_S3_ENDPOINT", "http://127.0.0.1:2")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "ap-south-1")
    store = open_store("s3://my-bucket", check=False)
    try:
        assert (store.url, store.prefix, store.endpoint) == ("s3://my-bucket", "", "http://127.0.0.1:2")
        assert store.options.region == "ap-south-1"
        assert store._ref_key("groups", "g") == "refs/groups/g"
    finally:
        store.close()


@pytest.mark.parametrize(
    "url",
    [
        "s3://",
        "s3://A-bucket/x",
        "s3://ab/x",
        "s3://bucket_1/x",
        "s3://b..c/x",
        "s3://bucket/a//b",
        "s3://bucket/a/../b",
        "s3://bucket/x?timeout=0",
        "s3://bucket/x?colour=red",
        "s3://bucket/x?endpoint=ftp://h",
        "s3://bucket/x?timeout",
    ],
)
def test_bad_urls_are_invalid_input(url):
    with pytest.raises(InvalidInputError):
        open_store(url, check=False)


def test_an_unchecked_store_opens_while_nothing_listens_and_its_first_operation_fails_clearly():
    url = f"s3://my-bucket/p?endpoint=http://127.0.0.1:{_closed_port()}&{FAST}"
    with pytest.raises(StoreUnavailableError, match="opening the store at s3://my-bucket/p .*EndpointConnection"):
        open_store(url)
    started = time.monotonic()
    store = open_store(url, check=False)
    try:
        assert time.monotonic() - started < 0.5 and store.stats().requests == 0
        with pytest.raises(StoreUnavailableError, match="reading ref templates/task in s3://my-bucket/p .*failed"):
            store.resolve("templates", "task")
    finally:
        store.close()


def test_without_boto3_an_s3_url_says_what_to_install():
    code = (
        f"HIDDEN = ('boto3', 'botocore')\n{HIDE}\nfrom weenv.store import open_store\n"
        "open_store('s3://my-bucket/p', check=False)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"},
    )
    assert r.returncode == 1
    assert "ToolMissingError: s3://my-bucket/p needs boto3: pip install 'weenv[s3]'" in r.stderr, r.stderr
