"""The ``oci://`` store against Debian's docker-registry on loopback: layout in
the registry, round trip of a real group, resumed (Range) reads, retries, and
failures that must end in a weenv error within the configured timeout, in the
store and inside an environment on a node.  (The Store behaviour suite runs
against ``oci://`` too: tests/test_store.py.)"""

# ruff: noqa: F811  (pytest fixtures imported from registry_fixture, used as parameters)

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from registry_fixture import Registry, free_port, new_repository, oci_registry, registry  # noqa: F401 (fixtures)
from weenv.errors import InvalidInputError, NotFoundError, StoreUnavailableError
from weenv.formats.manifest import DEFAULT_CHUNK_SIZE, GROUP_MEDIA_TYPE, sha256_digest
from weenv.node.node import Node
from weenv.packaging.group import assemble_image, build_group, load_group
from weenv.packaging.template import create_template, load_template
from weenv.packaging.transfer import copy_template
from weenv.store import open_store
from weenv.store.file import FileStore
from weenv.store.oci import CHUNK_ARTIFACT_TYPE, CHUNK_MEDIA_TYPE, OciStore

FAST = {
    "connect_timeout": 1,
    "read_timeout": 1,
    "timeout": 3,
    "retries": 3,
    "backoff": 0.05,
    "probe_interval": 1,
    "probe_timeout": 0.5,
}


# --- a TCP fault injector between the store and the registry ------------------------------------


class FaultProxy:
    """Forwards 127.0.0.1:PORT to the registry.  ``fail_next`` connections get an
    HTTP 503 and are closed; with ``cut_after`` set, the next connection is cut
    once it has carried that many bytes to the client."""

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.fail_next = 0
        self.cut_after: int | None = None
        self.connections = 0
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def url(self, repository: str) -> str:
        return f"oci://127.0.0.1:{self.port}/{repository}"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            with self._lock:
                self.connections += 1
                self._sockets.append(client)
                fail = self.fail_next > 0
                self.fail_next -= fail
                cut, self.cut_after = self.cut_after, None
            if fail:
                client.recv(65536)
                client.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                client.close()
                continue
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            with self._lock:
                self._sockets.append(upstream)
            threading.Thread(target=self._pipe, args=(client, upstream, None), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, cut), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket, cut: int | None) -> None:
        sent = 0
        try:
            while data := src.recv(65536):
                if cut is not None and sent + len(data) >= cut:
                    dst.sendall(data[: cut - sent])
                    break
                dst.sendall(data)
                sent += len(data)
        except OSError:
            pass
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.listener.close()
        with self._lock:
            for s in self._sockets:
                with contextlib.suppress(OSError):
                    s.close()


@pytest.fixture
def proxy(oci_registry):
    p = FaultProxy(oci_registry.port)
    yield p
    p.close()


@pytest.fixture
def oci(oci_registry):
    s = OciStore(oci_registry.url(new_repository()), **FAST)
    yield s
    s.close()


def _small_tree(root):
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "hostname").write_text("weenv\n")
    (root / "bin").mkdir()
    (root / "bin" / "tool").write_bytes(os.urandom(3 * DEFAULT_CHUNK_SIZE + 12345))
    (root / "bin" / "tool").chmod(0o755)
    (root / "data").mkdir()
    (root / "data" / "zeros").write_bytes(bytes(2 * DEFAULT_CHUNK_SIZE))
    (root / "link").symlink_to("etc/hostname")
    return root


# --- opening -----------------------------------------------------------------------------------


def test_open_store_and_url_options(oci_registry):
    repo = new_repository()
    s = open_store(oci_registry.url(repo, read_timeout=2, retries=1))
    try:
        assert isinstance(s, OciStore)
        assert s.url == f"oci://{oci_registry.address}/{repo}" and s.repository == repo
        assert (s.options.read_timeout, s.options.retries, s.options.timeout) == (2.0, 1, 30.0)
        assert str(s._client.base_url).startswith("http://127.0.0.1")  # loopback: plain HTTP
    finally:
        s.close()
    s = OciStore(oci_registry.url(repo, retries=1), retries=5, timeout=4)  # keywords win
    assert (s.options.retries, s.options.timeout) == (5, 4.0)
    s.close()
    s.close()  # idempotent
    for bad in (
        f"oci://{oci_registry.address}/Upper",
        f"oci://{oci_registry.address}/",
        f"oci://{oci_registry.address}/a//b",
        "oci:///repo",
        f"oci://user:pw@{oci_registry.address}/repo",
        f"oci://{oci_registry.address}/repo?retries=-1",
        f"oci://{oci_registry.address}/repo?nosuch=1",
        f"oci://{oci_registry.address}/repo?timeout=soon",
    ):
        with pytest.raises(InvalidInputError):
            open_store(bad)


def test_unreachable_registry_at_open_is_a_clear_error():
    port = free_port()  # nothing listens there
    started = time.monotonic()
    with pytest.raises(StoreUnavailableError, match=rf"127\.0\.0\.1:{port}/repo.*ConnectError") as info:
        OciStore(f"oci://127.0.0.1:{port}/repo", **FAST)
    assert time.monotonic() - started < FAST["timeout"] + 0.5
    assert isinstance(info.value, OSError) and info.value.kind == "store_unavailable"


def test_a_server_that_is_not_a_registry_is_refused(tmp_path):
    import http.server

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        with pytest.raises(StoreUnavailableError, match="not an OCI registry"):
            OciStore(f"oci://127.0.0.1:{server.server_address[1]}/repo", **FAST)
    finally:
        server.shutdown()
        server.server_close()


# --- layout and round trip -------------------------------------------------------------------------


def test_group_round_trip_and_layout(oci, oci_registry, tmp_path):
    tree = _small_tree(tmp_path / "tree")
    result = build_group(tree, oci, name="small", workdir=tmp_path)
    manifest = result.manifest
    assert oci.resolve("groups", "small") == result.digest
    assert load_group(oci, result.digest) == manifest
    digest, template = create_template(oci, "small-task", ["small"])
    assert load_template(oci, "small-task") == (digest, template)

    # the image assembled from the registry is the one built: each chunk's bytes
    # hash to the manifest's digest, and the same tree built into a file store
    # (mkfs.erofs with a fixed UUID) gives the same image
    image = tmp_path / "from-oci.img"
    assemble_image(oci, manifest, image)
    file_store = FileStore(tmp_path / "file-store")
    local = build_group(tree, file_store, name="small", workdir=tmp_path)
    assemble_image(file_store, local.manifest, tmp_path / "from-file.img")
    assert image.read_bytes() == (tmp_path / "from-file.img").read_bytes()
    assert image.stat().st_size == manifest.image_size
    assert [c.digest for c in local.manifest.chunks] == [c.digest for c in manifest.chunks]

    # in the registry: one chunk-HEX tag per distinct chunk, a manifest-HEX tag
    # per weenv manifest, and the refs as group-NAME / template-NAME
    tags = set(oci._tags())
    distinct = {c.digest for c in manifest.chunks}
    assert {t for t in tags if t.startswith("chunk-")} == {"chunk-" + d[7:] for d in distinct}
    assert {"manifest-" + result.digest[7:], "manifest-" + digest[7:], "group-small", "template-small-task"} <= tags
    chunk_manifest = oci._get_manifest_json("chunk-" + manifest.chunks[0].digest[7:])
    assert chunk_manifest["artifactType"] == CHUNK_ARTIFACT_TYPE
    assert chunk_manifest["layers"] == [
        {
            "mediaType": CHUNK_MEDIA_TYPE,
            "digest": manifest.chunks[0].stored_digest,
            "size": manifest.chunks[0].stored_size,
        }
    ]
    group_manifest = oci._get_manifest_json("manifest-" + result.digest[7:])
    assert group_manifest["artifactType"] == group_manifest["config"]["mediaType"] == GROUP_MEDIA_TYPE
    assert group_manifest["config"]["digest"] == result.digest  # the weenv JSON is the config blob
    assert {d["digest"] for d in group_manifest["layers"]} == {c.stored_digest for c in manifest.chunks}
    assert "subject" not in group_manifest
    # the zstd frames are the registry's blobs, addressed by their own sha256
    frame = oci_registry.blob_data(manifest.chunks[0].stored_digest).read_bytes()
    assert sha256_digest(frame) == manifest.chunks[0].stored_digest

    # a chunk fetch given the frame digest (as the node does) is one request;
    # without it, the chunk-HEX tag is read first
    before = oci.stats().requests
    oci.get_chunk(manifest.chunks[1].digest, stored_digest=manifest.chunks[1].stored_digest)
    assert oci.stats().requests - before == 1
    before = oci.stats().requests
    oci.get_chunk(manifest.chunks[1].digest)
    assert oci.stats().requests - before == 2

    # copied to a second repository, byte for byte
    other = OciStore(oci_registry.url(new_repository()), **FAST)
    copied = copy_template(oci, other, "small-task")
    assert copied.chunks_copied == len(distinct) and copied.chunks_skipped == 0
    assert copy_template(oci, other, "small-task").chunks_copied == 0
    assemble_image(other, load_group(other, result.digest), tmp_path / "copy.img")
    assert (tmp_path / "copy.img").read_bytes() == image.read_bytes()
    other.close()


def test_ref_names_must_fit_in_a_tag(oci):
    digest = oci.put_manifest(b'{"media_type":"application/vnd.weenv.template.v1+json"}')
    oci.set_ref("templates", "t" * 119, digest)  # "template-" + 119 = 128 characters
    assert oci.get_ref("templates", "t" * 119) == digest
    with pytest.raises(InvalidInputError, match="at most 119"):
        oci.set_ref("templates", "t" * 120, digest)
    with pytest.raises(NotFoundError):  # a ref to a manifest the store lacks
        oci.set_ref("groups", "g", "sha256:" + "1" * 64)
    oci.delete_ref("templates", "t" * 119)
    oci.delete_ref("templates", "t" * 119)
    assert oci.list_refs("templates") == {}
    assert oci.has_manifest(digest)  # a ref's tag has bytes of its own


def test_delete_disabled_is_a_clear_error(tmp_path):
    with Registry(tmp_path / "r", delete=False) as r:
        s = OciStore(r.url("weenv/nodelete"), **FAST)
        ref, _ = s.put_chunk(b"kept")
        with pytest.raises(StoreUnavailableError, match="storage.delete.enabled"):
            s.delete_chunk(ref.digest)
        assert s.get_chunk(ref.digest) == b"kept"
        s.close()


# --- range reads, retries ------------------------------------------------------------------------


def test_a_cut_blob_read_resumes_with_a_range_request(oci_registry, proxy):
    repo = new_repository()
    writer = OciStore(oci_registry.url(repo), **FAST)
    plaintext = os.urandom(DEFAULT_CHUNK_SIZE)
    ref, _ = writer.put_chunk(plaintext)
    writer.close()

    proxy.cut_after = 300_000  # the first connection dies 300 kB into the answers
    s = OciStore(proxy.url(repo), **FAST)
    assert s.get_chunk(ref.digest, stored_digest=ref.stored_digest) == plaintext
    st = s.stats()
    assert st.resumed == 1 and st.retries == 1
    # what arrived before the cut was kept: about one frame crossed the wire, not two
    assert ref.stored_size <= st.bytes_received < ref.stored_size + 300_000
    s.close()


def test_5xx_answers_are_retried_with_backoff(oci_registry, proxy):
    proxy.fail_next = 2
    s = OciStore(proxy.url(new_repository()), **FAST)  # GET /v2/: 503, 503, 200
    assert s.stats().retries == 2
    ref, _ = s.put_chunk(b"after the storm")
    assert s.get_chunk(ref.digest) == b"after the storm"
    s.close()
    proxy.fail_next = 100
    started = time.monotonic()
    with pytest.raises(StoreUnavailableError, match="HTTP 503"):
        OciStore(proxy.url(new_repository()), **FAST)
    assert time.monotonic() - started < FAST["timeout"] + 0.5


def test_retries_outlast_a_registry_restart(registry):
    s = OciStore(registry.url("weenv/restart"), connect_timeout=1, read_timeout=2, timeout=20, retries=10, backoff=0.1)
    ref, _ = s.put_chunk(b"survives a restart")
    registry.stop()
    restarter = threading.Timer(1.0, registry.start)
    restarter.start()
    try:
        assert s.get_chunk(ref.digest, stored_digest=ref.stored_digest) == b"survives a restart"
        assert s.stats().retries >= 1
    finally:
        restarter.join()
        s.close()


# --- a registry that dies or hangs: an error within the timeout, never a hang ---------------------


def test_registry_killed_mid_read_is_an_error_within_the_timeout(registry):
    s = OciStore(registry.url("weenv/dies"), **(FAST | {"probe_interval": 0}))  # every call really tries
    ref, _ = s.put_chunk(os.urandom(DEFAULT_CHUNK_SIZE))
    registry.pause()  # the request below is sent and waits for an answer...
    outcome: dict = {}

    def read():
        started = time.monotonic()
        try:
            s.get_chunk(ref.digest, stored_digest=ref.stored_digest)
        except Exception as exc:  # noqa: BLE001 (checked below, in the test's thread)
            outcome["error"] = exc
        outcome["elapsed"] = time.monotonic() - started

    reader = threading.Thread(target=read)
    reader.start()
    time.sleep(0.3)
    registry.kill()  # ...when the registry dies
    reader.join(timeout=FAST["timeout"] + 5)
    assert not reader.is_alive(), "the read hung"
    assert isinstance(outcome["error"], StoreUnavailableError)
    assert outcome["elapsed"] < FAST["timeout"] + 0.5
    # and every other operation fails the same way, quickly
    for call in (
        lambda: s.has_chunk(ref.digest),
        lambda: s.put_chunk(b"x"),
        lambda: list(s.list_chunks()),
        lambda: s.get_ref("templates", "t"),
    ):
        started = time.monotonic()
        with pytest.raises(StoreUnavailableError):
            call()
        assert time.monotonic() - started < FAST["timeout"] + 0.5
    s.close()


def test_a_hung_registry_times_out_then_fails_fast_until_a_probe_is_answered(registry):
    s = OciStore(registry.url("weenv/hangs"), **FAST)
    refs = [s.put_chunk(os.urandom(1000))[0] for _ in range(5)]
    registry.pause()
    try:
        started = time.monotonic()
        with pytest.raises(StoreUnavailableError, match="Timeout"):
            s.get_chunk(refs[0].digest, stored_digest=refs[0].stored_digest)
        elapsed = time.monotonic() - started
        assert FAST["read_timeout"] <= elapsed < FAST["timeout"] + 0.5
        # the breaker is open: every read fails at once, however long the outage lasts
        started = time.monotonic()
        failures = 0
        while time.monotonic() - started < 3 * FAST["probe_interval"]:
            for ref in refs:
                with pytest.raises(StoreUnavailableError, match="not tried"):
                    s.get_chunk(ref.digest, stored_digest=ref.stored_digest)
                failures += 1
            time.sleep(0.05)
        assert failures > 50
        assert s.breaker.probes >= 2  # one probe every interval, each within its own timeout
    finally:
        registry.resume()
    # back: the next probe closes the breaker
    deadline = time.monotonic() + FAST["probe_interval"] + FAST["probe_timeout"] + 1
    while s.breaker.is_open and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not s.breaker.is_open
    assert s.get_chunk(refs[0].digest, stored_digest=refs[0].stored_digest) == s.get_chunk(refs[0].digest)
    s.close()


# --- through a node -----------------------------------------------------------------------------


def test_registry_death_gives_eio_in_the_environment_and_the_node_serves_on(paths, shared_store, registry, leak_check):
    oci = OciStore(registry.url("weenv/node"), **FAST)
    copy_template(shared_store, oci, "task")
    task_group = load_template(oci, "task")[1].groups[-1]  # holds /workspace
    with Node(paths, store=oci) as node:
        a = node.create("task")
        b = node.create("task")
        assert node.exec(a.id, ["python3", "hello.py"]).stdout == b"hello from the task\n"

        # python3 is in the page cache now; /workspace/big.bin was never read
        read_big = ["python3", "-c", "open('/workspace/big.bin', 'rb').read()"]

        registry.pause()  # hangs: connections accepted, nothing answered
        started = time.monotonic()
        r = node.exec(a.id, read_big, timeout=120)
        elapsed = time.monotonic() - started
        assert r.exit_code == 1 and b"OSError: [Errno 5] Input/output error" in r.stderr, r
        # one store timeout (the kernel's retries of the read fail at once: the breaker is open)
        assert elapsed < FAST["timeout"] + 1.5, elapsed
        registry.resume()
        time.sleep(FAST["probe_interval"] + FAST["probe_timeout"] + 0.5)  # a probe closes the breaker

        registry.kill()  # dies: connections refused
        started = time.monotonic()
        r = node.exec(a.id, read_big, timeout=120)
        elapsed = time.monotonic() - started
        assert r.exit_code == 1 and b"OSError: [Errno 5] Input/output error" in r.stderr, r
        assert elapsed < FAST["timeout"], elapsed
        assert "StoreUnavailableError" in node.lazyfs.last_error(task_group)

        # the node keeps serving: both environments, from what is cached
        assert node.exec(b.id, ["python3", "hello.py"]).stdout == b"hello from the task\n"
        assert node.exec(a.id, ["python3", "-c", "print('still here')"]).stdout == b"still here\n"
        assert {e.id for e in node.list()} == {a.id, b.id}
        node.destroy(a.id)
        node.destroy(b.id)
    oci.close()
    # this test's own cgroups are gone (leak_check also sees other engineers' tests' ones)
    assert not [p for e in (a, b) for p in Path("/sys/fs/cgroup").glob(f"*/weenv-{e.id}")]


def test_deleted_chunks_are_freed_by_the_registry_garbage_collector(registry):
    s = OciStore(registry.url("weenv/gc"), **FAST)
    kept, _ = s.put_chunk(os.urandom(5000))
    plaintext = os.urandom(5000)
    gone, _ = s.put_chunk(plaintext)
    s.delete_chunk(gone.digest)
    assert list(s.list_chunks()) == [kept.digest]
    registry.stop()
    subprocess.run(["docker-registry", "garbage-collect", str(registry.config)], check=True, capture_output=True)
    assert not registry.blob_data(gone.stored_digest).exists()
    assert registry.blob_data(kept.stored_digest).exists()
    registry.start()
    assert s.get_chunk(kept.digest) == s.get_chunk(kept.digest, stored_digest=kept.stored_digest)
    assert s.put_chunk(plaintext) == (gone, True)  # the blob is uploaded again
    assert s.get_chunk(gone.digest, stored_digest=gone.stored_digest) == plaintext
    s.close()
