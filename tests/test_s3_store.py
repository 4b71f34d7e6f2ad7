"""The ``s3://`` store against a real S3 server (SeaweedFS on loopback): what the
shared suite (test_store.py) does not cover: opening and its options, clear
errors (an endpoint that does not answer or hangs, a bucket that does not exist,
refused access), retries through a frozen server, the circuit breaker, the
conditional ref write, and a node creating an environment from an ``s3://``
store with lazy reads."""

from __future__ import annotations

import socket
import time

import pytest

from s3_fixture import BUCKET, new_prefix
from weenv.errors import BusyError, InvalidInputError, NotFoundError, StoreUnavailableError
from weenv.formats.manifest import TemplateManifest, canonical_json
from weenv.node.node import Node
from weenv.packaging.group import build_group
from weenv.packaging.template import create_template, load_template
from weenv.packaging.transfer import copy_template
from weenv.packaging.update import update_component
from weenv.store import open_store
from weenv.store.file import FileStore
from weenv.store.s3 import S3Store

FAST = {
    "connect_timeout": 0.5,
    "read_timeout": 0.5,
    "timeout": 2,
    "retries": 3,
    "backoff": 0.05,
    "probe_interval": 0.5,
    "probe_timeout": 0.3,
}
DIGEST = "sha256:" + "ab" * 32


def _assert_clear(exc: pytest.ExceptionInfo, url: str) -> None:
    """A weenv error naming the store, with no boto exception attached."""
    assert url in str(exc.value), exc.value
    assert exc.value.__cause__ is None and exc.value.__suppress_context__, "a boto exception is attached"
    assert "botocore" not in str(exc.value)


@pytest.fixture
def s3(s3_server):
    store = S3Store(s3_server.url(new_prefix()), timeout=10)
    yield store
    store.close()


@pytest.fixture
def hung_endpoint():
    """``http://127.0.0.1:PORT`` of a socket that accepts connections (the kernel
    does) and never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    listener.close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- opening ---------------------------------------------------------------------------------------


def test_open_store_url_options_and_environment(s3_server, monkeypatch):
    store = open_store(s3_server.url("p/q", read_timeout=2))
    try:
        assert isinstance(store, S3Store)
        assert (store.url, store.bucket, store.prefix) == (f"s3://{BUCKET}/p/q", BUCKET, "p/q")
        assert store.options.read_timeout == 2 and store.options.region == "us-east-1"
        ref, _ = store.put_chunk(b"under a prefix")
        key = f"p/q/chunks/sha256/{ref.digest[7:9]}/{ref.digest[7:]}"
        assert s3_server.client().get_object(Bucket=BUCKET, Key=key)["ContentLength"] == ref.stored_size
    finally:
        store.close()
    monkeypatch.setenv("WEENV_S3_ENDPOINT", s3_server.endpoint)
    monkeypatch.setenv("AWS_REGION", "eu-west-3")
    with_env = open_store(f"s3://{BUCKET}/p/q")  # the endpoint from WEENV_S3_ENDPOINT
    try:
        assert with_env.endpoint == s3_server.endpoint and with_env.options.region == "eu-west-3"
        assert with_env.has_chunk(ref.digest)
    finally:
        with_env.close()
    for bad in (
        "s3://",
        "s3://UPPER/x",
        "s3://ab/x",
        f"s3://{BUCKET}/a/../b",
        f"s3://{BUCKET}/x?timeout=-1",
        f"s3://{BUCKET}/x?colour=red",
        f"s3://{BUCKET}/x?endpoint=ftp://h",
    ):
        with pytest.raises(InvalidInputError):
            open_store(bad)


def test_an_unreachable_endpoint_is_a_clear_error_within_the_timeout():
    url = f"s3://{BUCKET}/x"
    started = time.monotonic()
    with pytest.raises(StoreUnavailableError, match="failed.*EndpointConnectionError") as exc:
        S3Store(url, endpoint=f"http://127.0.0.1:{_closed_port()}", **FAST)
    assert time.monotonic() - started < FAST["timeout"] + 0.5
    _assert_clear(exc, url)
    assert "4 attempts" in str(exc.value)  # 3 retries


def test_a_hung_endpoint_times_out_then_fails_fast_until_a_probe_is_answered(hung_endpoint):
    url = f"s3://{BUCKET}/x"
    store = S3Store(url, endpoint=hung_endpoint, check=False, **FAST)  # sends nothing
    try:
        started = time.monotonic()
        with pytest.raises(StoreUnavailableError, match="ReadTimeoutError") as exc:
            store.has_chunk(DIGEST)
        assert FAST["read_timeout"] <= time.monotonic() - started < FAST["timeout"] + 0.5
        _assert_clear(exc, url)
        assert store.breaker.is_open
        started = time.monotonic()
        with pytest.raises(StoreUnavailableError, match="not tried: the store has not answered"):
            store.get_chunk(DIGEST)
        assert time.monotonic() - started < 0.05  # at once
        time.sleep(FAST["probe_interval"] + FAST["probe_timeout"] + 0.3)
        assert store.breaker.probes >= 1 and store.breaker.is_open  # the probes time out too
    finally:
        store.close()


def test_a_bucket_that_does_not_exist_is_a_clear_error(s3_server):
    url = s3_server.url("x", bucket="no-such-bucket")
    with pytest.raises(StoreUnavailableError, match="bucket 'no-such-bucket' does not exist") as exc:
        S3Store(url, **FAST)
    _assert_clear(exc, "s3://no-such-bucket/x")
    lazy = S3Store(url, check=False, **FAST)  # a node's: the first operation finds out, not "no such chunk"
    try:
        with pytest.raises(StoreUnavailableError, match="does not exist"):
            lazy.has_chunk(DIGEST)
        with pytest.raises(StoreUnavailableError, match="does not exist"):
            lazy.get_ref("templates", "task")
    finally:
        lazy.close()
    assert "no-such-bucket" not in [b["Name"] for b in s3_server.client().list_buckets()["Buckets"]]


@pytest.mark.parametrize("wrong", ["secret", "key"])
def test_refused_access_is_a_clear_error(s3_server, monkeypatch, wrong):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY" if wrong == "secret" else "AWS_ACCESS_KEY_ID", "wrong")
    url = s3_server.url("x")
    with pytest.raises(StoreUnavailableError, match="access refused") as exc:
        S3Store(url, **FAST)
    _assert_clear(exc, f"s3://{BUCKET}/x")
    assert "AWS_SECRET_ACCESS_KEY" in str(exc.value)
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(StoreUnavailableError, match="no S3 credentials"):
        S3Store(url, **FAST)


# --- retries ---------------------------------------------------------------------------------------


def test_retries_outlast_a_frozen_server(s3_server, s3):
    """SIGSTOP for 0.6 s: the first attempts time out, a retry after SIGCONT succeeds."""
    ref, _ = s3.put_chunk(b"read through a freeze")
    store = S3Store(s3_server.url(s3.prefix), **(FAST | {"timeout": 8, "retries": 8}))
    try:
        thaw = s3_server.freeze_for(0.6)
        try:
            assert store.get_chunk(ref.digest) == b"read through a freeze"
        finally:
            thaw.join()
        assert store.stats().retries >= 1
        assert not store.breaker.is_open
    finally:
        store.close()


# --- refs ----------------------------------------------------------------------------------------


def test_swap_ref_is_refused_when_the_ref_moves_between_its_read_and_its_write(s3):
    """The conditional write itself: another writer moves the ref after this
    caller read it; the server refuses the write (412), the other writer's ref stays."""
    a, b, c = (s3.put_manifest(b'{"n":%d}' % n) for n in range(3))
    s3.swap_ref("templates", "t", a, expected=None)  # If-None-Match: *
    s3.swap_ref("templates", "t", b, expected=a)  # If-Match: the ETag read
    real_read = s3._read_ref

    def read_then_another_writer_moves_it(kind, name):
        found = real_read(kind, name)
        s3.set_ref(kind, name, c)
        return found

    s3._read_ref = read_then_another_writer_moves_it
    with pytest.raises(BusyError, match="moved by another writer meanwhile"):
        s3.swap_ref("templates", "t", a, expected=b)
    s3._read_ref = real_read
    assert s3.get_ref("templates", "t") == c  # the other writer's, not lost
    s3.delete_ref("templates", "t")
    s3._read_ref = read_then_another_writer_moves_it  # absent when read, made meanwhile: If-None-Match fails
    with pytest.raises(BusyError, match="moved by another writer meanwhile"):
        s3.swap_ref("templates", "t", a, expected=None)
    s3._read_ref = real_read
    assert s3.get_ref("templates", "t") == c


@pytest.mark.parametrize("kind", ["file", "s3"])
def test_an_update_does_not_lose_a_template_moved_meanwhile(kind, s3, paths, tmp_path):
    """``weenv update`` of template t while another writer publishes a new t:
    the update fails with BusyError and the other writer's t stays (before,
    the update overwrote it)."""
    store = s3 if kind == "s3" else FileStore(tmp_path / "store")
    for name in ("app", "v2", "v3"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "file").write_text(name)
    build_group(tmp_path / "app", store, name="app")
    first, _ = create_template(store, "t", ["app"])
    other = build_group(tmp_path / "v3", store, name="app")  # another writer's version of "app"
    elsewhere = store.put_manifest(canonical_json(TemplateManifest(name="t", version="x", groups=[other.digest])))
    real_put = store._put  # what put_manifest stores through (the update's leased view of the store too)

    def put_then_another_writer_publishes_t(space: str, digest: str, data: bytes) -> None:
        real_put(space, digest, data)
        if space == "manifests" and b'"application/vnd.weenv.template' in data and digest != elsewhere:
            store.set_ref("templates", "t", elsewhere)  # the other writer, between the update's read and write

    store._put = put_then_another_writer_publishes_t
    with pytest.raises(BusyError, match=f"templates/t in {store.url} points at {elsewhere}, not {first}"):
        update_component(store, "t", "app", tmp_path / "v2", paths=paths)
    assert store.get_ref("templates", "t") == elsewhere
    store._put = real_put
    updated = update_component(store, "t", "app", tmp_path / "v2", paths=paths)  # from what t is now
    assert updated.previous_digest == elsewhere and store.get_ref("templates", "t") == updated.template_digest


def test_damaged_and_oversized_refs(s3_server, s3):
    client = s3_server.client()
    client.put_object(Bucket=BUCKET, Key=f"{s3.prefix}/refs/templates/junk", Body=b"not a digest")
    client.put_object(Bucket=BUCKET, Key=f"{s3.prefix}/refs/templates/huge", Body=DIGEST.encode() + bytes(1 << 20))
    s3.set_ref("templates", "good", DIGEST)
    with pytest.raises(InvalidInputError, match="ref templates/junk .* damaged"):
        s3.get_ref("templates", "junk")
    with pytest.raises(Exception, match="ref templates/huge .* more than the 4096"):
        s3.get_ref("templates", "huge")
    received = s3.stats().bytes_received
    with pytest.raises(NotFoundError):
        s3.get_ref("templates", "none")
    assert s3.stats().bytes_received == received
    assert s3.list_refs("templates") == {"good": DIGEST}
    s3.delete_ref("templates", "good")
    s3.delete_ref("templates", "good")  # absent: no error
    assert s3.list_refs("templates") == {}


def test_listing_follows_pages(s3):
    s3.list_page = 7  # S3's is 1,000
    digests = {s3.put_manifest(b'{"i":%d}' % i) for i in range(30)}
    before = s3.stats().requests
    assert set(s3.list_manifests()) == digests
    assert s3.stats().requests - before == 5  # ceil(30 / 7) pages


# --- through a node --------------------------------------------------------------------------------


def test_a_node_creates_from_an_s3_store_with_lazy_reads(paths, shared_store, s3_server, leak_check):
    """Publish template "task" to an s3:// store; a node whose store is that
    s3:// URL creates an environment from it, its group images read lazily
    through FUSE: the big file nobody reads is not fetched."""
    url = s3_server.url(new_prefix())
    publisher = S3Store(url)
    copy_template(shared_store, publisher, "task")
    published = publisher.stats().bytes_sent
    publisher.close()
    node_store = open_store(url, check=False)  # as a node opens WEENV_STORE
    with Node(paths, store=node_store, pool_size=0) as node:
        e = node.create("task")
        assert node.exec(e.id, ["python3", "hello.py"]).stdout == b"hello from the task\n"
        read = node_store.stats().bytes_received
        assert 0 < read < published - (4 << 20), (read, published)  # big.bin (4 MiB, random) not fetched
        r = node.exec(e.id, ["python3", "-c", "print(len(open('/workspace/big.bin', 'rb').read()))"])
        assert r.stdout == b"4194304\n"
        assert node_store.stats().bytes_received >= read + (2 << 20)  # fetched on demand now (most of it)
        assert load_template(node_store, "task")[1].name == "task"
        node.destroy(e.id)
    node_store.close()
