"""Store content past the read limits (weenv.formats.limits): refused when a node
reads it, before it is read whole, with an error naming the digest.

Each oversized kind is crafted in a file store (written beside the store's own
files) and in an OCI registry (pushed as raw blobs and manifests): a chunk whose
frame is larger than its chunk could be, or declares more plaintext than the
manifest says; a group manifest of too many bytes or chunks; a template of too
many bytes; a profile and a pack past theirs; a ref file of a gigabyte.  Each
check bounds the time and the memory (tracemalloc) the refusal costs.
"""

# ruff: noqa: F811  (pytest fixtures imported from registry_fixture, used as parameters)

from __future__ import annotations

import hashlib
import http.server
import json
import os
import threading
import time
import tracemalloc

import pytest
import zstandard

from registry_fixture import new_repository, oci_registry  # noqa: F401 (fixtures)
from s3_fixture import new_prefix
from weenv.errors import ContentLimitError, DigestMismatchError, InvalidInputError
from weenv.formats.limits import MAX_CHUNKS, MAX_MANIFEST_BYTES, MAX_PACK_BYTES, frame_bound
from weenv.formats.manifest import TemplateManifest, canonical_json, sha256_digest
from weenv.node.node import Node
from weenv.packaging.group import load_group
from weenv.packaging.profile import PrefetchPack, PrefetchProfile, load_profile, ref_name
from weenv.packaging.template import load_template
from weenv.store.file import FileStore
from weenv.store.oci import OciStore
from weenv.store.s3 import S3Store

MiB = 1 << 20
MEMORY_BOUND = 100 * MiB
"""What refusing one bad blob may cost in Python allocations (the bad content is 200 MB to 1 GiB)."""
TIME_BOUND = 5.0


@pytest.fixture(params=["file", "oci", "s3"])
def store(request, tmp_path):
    if request.param == "file":
        yield FileStore(tmp_path / "store")
        return
    if request.param == "s3":
        s = S3Store(request.getfixturevalue("s3_server").url(new_prefix()), timeout=30)
    else:
        s = OciStore(request.getfixturevalue("oci_registry").url(new_repository()), timeout=30)
    yield s
    s.close()


def _blob(store, space: str, data: bytes, *, digest: str | None = None, sparse: int = 0, tagged: bool = False) -> str:
    """Put ``data`` as a raw blob of ``space``, not checked: under ``digest`` (default
    its sha256) in a file store (``sparse``: that many bytes of holes instead, cheap)
    or an S3 store (as an object of that key), as a registry blob (addressed by its sha256) in an OCI store (``tagged``: with
    its ``manifest-HEX`` tag, which a ref needs).  Returns the digest to read it by."""
    digest = digest or sha256_digest(data)
    if isinstance(store, FileStore):
        path = store._path(space, digest)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
            if sparse:
                f.truncate(sparse)
        return digest
    if isinstance(store, S3Store):
        store._put(space, digest, data)
        return digest
    if tagged:
        return store.put_manifest(data)
    return store._ensure_blob(data)


class Bounded:
    """Time and Python memory of the block: ``seconds``, ``peak`` (bytes)."""

    def __enter__(self):
        tracemalloc.start()
        self.started = time.monotonic()
        return self

    def __exit__(self, *exc):
        self.seconds = time.monotonic() - self.started
        self.peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert self.seconds < TIME_BOUND, f"refusing took {self.seconds:.1f} s"
        assert self.peak < MEMORY_BOUND, f"refusing took {self.peak / MiB:.0f} MiB"


def _received(store) -> int:
    return store.stats().bytes_received if isinstance(store, (OciStore, S3Store)) else 0


def _group_json(n: int, chunk_size: int = 4096) -> bytes:
    """A group manifest's JSON of ``n`` chunks (made as text: fast, and as a hostile store would)."""
    digest = "sha256:" + "ab" * 32
    ref = f'{{"digest":"{digest}","size":{chunk_size},"stored_digest":"{digest}","stored_size":100}}'
    return (
        f'{{"block_size":4096,"chunk_size":{chunk_size},"chunks":[{",".join([ref] * n)}],'
        '"created":"2024-01-01T00:00:00Z","file_count":1,'
        f'"image_size":{n * chunk_size},"media_type":"application/vnd.weenv.group.v1+json","name":"big",'
        '"schema_version":1,"source":{},"version":"latest"}'
    ).encode()


# --- chunks --------------------------------------------------------------------------------------


def test_a_small_frame_declaring_a_gigabyte_is_refused_from_its_header(store):
    bomb = zstandard.ZstdCompressor(level=19, write_content_size=True).compress(bytes(1 << 30))
    assert len(bomb) < 64 << 10
    plaintext_digest = sha256_digest(b"whatever the manifest says")
    stored = _blob(store, "chunks", bomb, digest=plaintext_digest)
    with Bounded(), pytest.raises(DigestMismatchError, match=f"chunk {plaintext_digest}.*declares {1 << 30} bytes"):
        store.get_chunk(plaintext_digest, stored_digest=stored, size=MiB)


def test_a_frame_larger_than_its_chunk_could_be_is_not_read(store):
    plaintext_digest = sha256_digest(b"a 1 MiB chunk")
    if isinstance(store, FileStore):  # a gigabyte of holes: only its size is looked at
        stored = _blob(store, "chunks", b"", digest=plaintext_digest, sparse=1 << 30)
    else:  # 3 MiB for a 1 MiB chunk: the answer's Content-Length says so before any byte is read
        stored = _blob(store, "chunks", os.urandom(3 * MiB), digest=plaintext_digest)
    with Bounded(), pytest.raises(ContentLimitError, match=f"(chunk {plaintext_digest}|blob {stored})"):
        store.get_chunk(plaintext_digest, stored_digest=stored, size=MiB)
    assert _received(store) == 0


# --- manifests -----------------------------------------------------------------------------------


def test_a_group_manifest_of_a_million_chunks_is_refused_before_it_is_read(store):
    data = _group_json(10**6)  # 194 MB of JSON: it cost 1.4 GB and 42 s
    assert len(data) > 190 * MiB
    digest = _blob(store, "manifests", data)
    del data
    with Bounded(), pytest.raises(ContentLimitError, match=f"{digest}.* more than the {MAX_MANIFEST_BYTES}"):
        load_group(store, digest)
    assert _received(store) == 0


def test_a_group_manifest_of_too_many_chunks_is_refused(store):
    data = _group_json(MAX_CHUNKS + 1)  # within the byte limit
    assert len(data) < MAX_MANIFEST_BYTES
    digest = _blob(store, "manifests", data)
    with pytest.raises(InvalidInputError, match="at most 65536 items") as e:
        load_group(store, digest)
    message = str(e.value)
    assert digest in message and "\n" not in message and len(message) < 300, message  # one line naming it


def test_a_group_manifest_with_giant_chunks_is_refused():
    data = _group_json(1, chunk_size=1 << 40)
    with pytest.raises(InvalidInputError, match="chunk_size"):
        from weenv.formats.manifest import parse_group_manifest

        parse_group_manifest(data)


def test_a_template_manifest_past_the_limit_is_refused(store):
    manifest = TemplateManifest(name="big", groups=["sha256:" + "cd" * 32])
    doc = json.loads(canonical_json(manifest))
    doc["runtime"]["env"] = {"PAD": "x" * (MAX_MANIFEST_BYTES + 10)}
    data = json.dumps(doc).encode()
    digest = _blob(store, "manifests", data)
    with Bounded(), pytest.raises(ContentLimitError, match=digest):
        load_template(store, digest)
    many = json.loads(canonical_json(manifest))
    many["groups"] = ["sha256:" + hashlib.sha256(str(i).encode()).hexdigest() for i in range(129)]
    with pytest.raises(InvalidInputError, match="groups"):
        load_template(store, _blob(store, "manifests", json.dumps(many).encode()))


# --- profiles and packs ----------------------------------------------------------------------------


def _profile_doc(template: str, **fields) -> dict:
    profile = PrefetchProfile(template=template, groups=["sha256:" + "ef" * 32], chunks=[], window_s=1.0)
    return json.loads(canonical_json(profile)) | fields


def test_a_profile_past_the_limits_is_ignored(store):
    template = "sha256:" + "12" * 32
    for doc in (
        _profile_doc(template, chunks=[[0, 0]] * (MAX_MANIFEST_BYTES // 6 + 1)),  # too many bytes
        _profile_doc(template, chunks=[[0, i] for i in range(MAX_CHUNKS + 1)]),  # too many chunks
    ):
        digest = _blob(store, "manifests", json.dumps(doc, separators=(",", ":")).encode(), tagged=True)
        store.set_ref("prefetch", ref_name(template), digest)
        with Bounded():
            assert load_profile(store, template) is None


def test_a_pack_past_its_declared_size_is_not_streamed(store):
    data = os.urandom(2 * MiB)
    digest = _blob(store, "packs", data)
    with Bounded(), pytest.raises(ContentLimitError, match=f"pack {digest}"):
        for _piece in store.stream_pack(digest, size=MiB):
            pass
    assert _received(store) == 0
    with pytest.raises(ValueError, match="more than"):
        PrefetchPack(digest=digest, frames=[frame_bound(256 * MiB)] * (MAX_PACK_BYTES // (256 * MiB) + 1))


# --- refs ----------------------------------------------------------------------------------------


def test_a_ref_file_of_a_gigabyte_is_a_damaged_ref(tmp_path):
    store = FileStore(tmp_path / "store")
    path = store.root / "refs" / "templates" / "huge"
    path.parent.mkdir(parents=True)
    with open(path, "wb") as f:
        f.write(b"sha256:" + b"0" * 64 + b"\n")
        f.truncate(1 << 30)
    with Bounded(), pytest.raises(InvalidInputError, match="ref templates/huge .* damaged"):
        store.get_ref("templates", "huge")
    with Bounded():
        assert store.list_refs("templates") == {}


class _HugeAnswers(http.server.BaseHTTPRequestHandler):
    """A registry whose manifests are endless: ``GET /v2/`` answers; a manifest
    ``GET`` declares a gigabyte (``.../length``) or streams chunked without end."""

    def do_GET(self):  # noqa: N802 (http.server's name)
        if self.path == "/v2/":
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/vnd.oci.image.manifest.v1+json")
        if self.path.endswith("template-length"):
            self.send_header("Content-Length", str(1 << 30))
            self.end_headers()
            self.wfile.write(b"{" + b" " * 65536)
            return
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        piece = b" " * (1 << 20)
        try:
            for _ in range(1024):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
        except OSError:
            pass

    def log_message(self, *args):
        pass


def test_an_oci_manifest_past_the_limit_is_refused():
    """docker-registry refuses such manifests itself; another registry may not."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _HugeAnswers)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    store = OciStore(f"oci://127.0.0.1:{server.server_address[1]}/weenv/huge", timeout=30)
    try:
        for name in ("length", "chunked"):
            with Bounded(), pytest.raises(ContentLimitError, match=f"template-{name}"):
                store.get_ref("templates", name)
    finally:
        store.close()
        server.shutdown()
        server.server_close()


# --- through a node --------------------------------------------------------------------------------


def test_a_create_over_an_oversized_group_manifest_fails_fast_and_small(paths, leak_check):
    """The daemon's path: a template whose group manifest is 194 MB (it cost the
    node 1.4 GB, 1.16 GB of it kept, and 42 s) fails its create at once."""
    store = FileStore(paths.home / "store")
    data = _group_json(10**6)
    group = _blob(store, "manifests", data)
    del data
    template = TemplateManifest(name="huge", groups=[group])
    store.set_ref("templates", "huge", store.put_manifest(canonical_json(template)))
    with Node(paths, store=store) as node:
        with Bounded(), pytest.raises(ContentLimitError, match=group):
            node.create("huge")
        assert node.list() == []
