"""The Store behaviour suite, run against every backend in ``BACKENDS``.

A backend adds one harness class (how to open a store, find stray temporary
blobs, and tell whether a blob was rewritten) and one entry in ``BACKENDS``;
every test in :class:`TestStore` then runs against it.  Corruption is staged
with the backend's own raw write (``Store._put``), which skips every check.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from pathlib import Path

import pytest
import zstandard

from registry_fixture import Registry, new_repository, oci_registry  # noqa: F401 (a fixture)
from s3_fixture import Seaweed, new_prefix
from weenv.errors import BusyError, DigestMismatchError, InvalidInputError, NotFoundError
from weenv.formats.manifest import (
    GroupManifest,
    TemplateManifest,
    canonical_json,
    parse_group_manifest,
    sha256_digest,
)
from weenv.store import Store
from weenv.store import lease as lease_module
from weenv.store.check import check_store
from weenv.store.file import FileStore
from weenv.store.lease import Lease, LeasedStore, delete_unused, leased_digests
from weenv.store.oci import OciStore
from weenv.store.s3 import S3Store

MIB = 1 << 20


class FileBackend:
    """``file://`` stores in a temporary directory."""

    name = "file"

    def open(self, home: Path) -> Store:
        return FileStore(home / "store")

    def temp_files(self, store: FileStore) -> list[str]:
        return [str(p) for p in store.root.rglob("*") if p.name.startswith(".tmp-")]

    def blob_identity(self, store: FileStore, space: str, digest: str) -> tuple:
        st = store._path(space, digest).stat()
        return (st.st_ino, st.st_mtime_ns, st.st_ctime_ns)

    def corrupt_manifest(self, store: FileStore, digest: str, data: bytes) -> None:
        store._put("manifests", digest, data)


class OciBackend:
    """``oci://`` stores: a fresh repository of the session's docker-registry."""

    name = "oci"
    fixtures = (("registry", "oci_registry"),)  # (open() argument, the fixture it takes)

    def open(self, home: Path, registry: Registry) -> Store:
        self.registry = registry
        return OciStore(registry.url(new_repository()), timeout=10)

    def temp_files(self, store: OciStore) -> list[str]:
        return self.registry.uploads(store.repository)  # upload sessions left open

    def blob_identity(self, store: OciStore, space: str, digest: str) -> tuple:
        manifest = store._get_manifest_json(store._space_tag(space, digest))
        blob = manifest["layers"][0] if space == "chunks" else manifest["config"]
        blob_st = self.registry.blob_data(blob["digest"]).stat()
        tag_st = self.registry.tag_link(store.repository, store._space_tag(space, digest)).stat()
        return (blob_st.st_ino, blob_st.st_mtime_ns, tag_st.st_ino, tag_st.st_mtime_ns)

    def corrupt_manifest(self, store: OciStore, digest: str, data: bytes) -> None:
        """Other bytes in the blob under ``digest`` (what the store reads a manifest
        from; a registry never writes such a blob itself)."""
        self.registry.blob_data(digest).write_bytes(data)


class S3Backend:
    """``s3://`` stores: a fresh prefix of the session's SeaweedFS bucket."""

    name = "s3"
    fixtures = (("server", "s3_server"),)

    def open(self, home: Path, server: Seaweed) -> Store:
        self.server = server
        return S3Store(server.url(new_prefix()), timeout=10)

    def temp_files(self, store: S3Store) -> list[str]:
        """Multipart uploads left open under the store's prefix."""
        uploads = self.server.client().list_multipart_uploads(Bucket=store.bucket, Prefix=store.prefix + "/")
        return [u["Key"] for u in uploads.get("Uploads", [])]

    def blob_identity(self, store: S3Store, space: str, digest: str) -> tuple:
        head = self.server.client().head_object(Bucket=store.bucket, Key=store._blob_key(space, digest))
        return (head["ETag"], head["LastModified"], store.stats().bytes_sent)

    def corrupt_manifest(self, store: S3Store, digest: str, data: bytes) -> None:
        self.server.client().put_object(Bucket=store.bucket, Key=store._blob_key("manifests", digest), Body=data)


BACKENDS = [FileBackend(), OciBackend(), S3Backend()]


@pytest.fixture(params=BACKENDS, ids=lambda b: b.name)
def backend(request):
    return request.param


@pytest.fixture
def store(backend, paths, request):
    """This module's ``store``: one per backend (overrides conftest's file store)."""
    fixtures = getattr(backend, "fixtures", ())
    s = backend.open(paths.home, **{arg: request.getfixturevalue(f) for arg, f in fixtures})
    yield s
    s.close()


BAD_DIGESTS = [
    "",
    "sha256:",
    "sha256:" + "0" * 63,
    "sha256:" + "0" * 65,
    "sha256:" + "A" * 64,
    "sha512:" + "0" * 64,
    "0" * 64,
    "sha256:" + "0" * 62 + "/x",
    "../../../etc/passwd",
]


def _manifest(store: Store, name: str = "g") -> GroupManifest:
    ref, _ = store.put_chunk(b"image bytes of " + name.encode())
    return GroupManifest(
        name=name, image_size=ref.size, chunk_size=4096, chunks=[ref], file_count=1, source={"type": "test"}
    )


class TestStore:
    # --- chunks ----------------------------------------------------------------------

    @pytest.mark.parametrize(
        "plaintext",
        [b"", b"x", bytes(MIB), os.urandom(MIB), os.urandom(4097)],
        ids=["empty", "one-byte", "zeros", "random", "odd"],
    )
    def test_chunk_round_trip(self, store, plaintext):
        ref, written = store.put_chunk(plaintext)
        assert written
        assert ref.digest == "sha256:" + hashlib.sha256(plaintext).hexdigest()
        assert ref.size == len(plaintext)
        frame = store._get("chunks", ref.digest)
        assert ref.stored_size == len(frame) and ref.stored_digest == sha256_digest(frame)
        assert zstandard.ZstdDecompressor().decompress(frame) == plaintext
        assert store.has_chunk(ref.digest)
        assert store.get_chunk(ref.digest) == plaintext
        assert list(store.list_chunks()) == [ref.digest]

    def test_present_chunk_is_not_written_again(self, store, backend):
        data = os.urandom(100_000)
        ref1, written1 = store.put_chunk(data)
        before = backend.blob_identity(store, "chunks", ref1.digest)
        ref2, written2 = store.put_chunk(data)
        assert (written1, written2) == (True, False)
        assert ref2 == ref1
        assert backend.blob_identity(store, "chunks", ref1.digest) == before

    def test_identical_chunks_are_stored_once(self, store):
        a = os.urandom(5000)
        refs = [store.put_chunk(x)[0] for x in (a, b"other", bytes(a), a)]
        assert refs[0] == refs[2] == refs[3]
        assert sorted(store.list_chunks()) == sorted({refs[0].digest, refs[1].digest})

    def test_writes_leave_no_temporary_files(self, store, backend):
        for i in range(20):
            store.put_chunk(os.urandom(1000 + i))
        m = _manifest(store)
        digest = store.put_manifest(canonical_json(m))
        store.set_ref("groups", "g", digest)
        store.set_ref("groups", "g", digest)
        assert backend.temp_files(store) == []
        assert len(list(store.list_chunks())) == 21

    def test_corrupt_chunk_is_refused(self, store):
        ref, _ = store.put_chunk(b"the real content")
        other = zstandard.ZstdCompressor().compress(b"some other content")
        store._put("chunks", ref.digest, other)  # a valid zstd frame of other bytes
        with pytest.raises(DigestMismatchError, match="other content"):
            store.get_chunk(ref.digest)
        store._put("chunks", ref.digest, b"\x00garbage, not zstd")
        with pytest.raises(DigestMismatchError, match="not a zstd frame"):
            store.get_chunk(ref.digest)
        frame = zstandard.ZstdCompressor().compress(b"the real content")
        store._put("chunks", ref.digest, frame[:-3])  # truncated
        with pytest.raises(DigestMismatchError):
            store.get_chunk(ref.digest)
        store._put("chunks", ref.digest, frame)
        assert store.get_chunk(ref.digest) == b"the real content"

    def test_delete_chunk(self, store):
        ref, _ = store.put_chunk(b"short-lived")
        store.delete_chunk(ref.digest)
        store.delete_chunk(ref.digest)  # absent: no error
        assert not store.has_chunk(ref.digest)
        with pytest.raises(NotFoundError):
            store.get_chunk(ref.digest)
        assert store.put_chunk(b"short-lived")[1] is True

    # --- packs ---------------------------------------------------------------------------

    def test_pack_round_trip_streamed(self, store):
        data = os.urandom(3 * MIB + 17)
        digest = store.put_pack(data)
        assert digest == sha256_digest(data)
        assert store.put_pack(data) == digest  # idempotent
        assert store.has_pack(digest) and list(store.list_packs()) == [digest]
        pieces = list(store.stream_pack(digest))
        assert b"".join(pieces) == data
        assert len(pieces) > 1  # streamed, not read whole first
        assert not store.has_chunk(digest) and not store.has_manifest(digest)  # a space of its own

        store.delete_pack(digest)
        store.delete_pack(digest)  # absent: no error
        assert not store.has_pack(digest) and list(store.list_packs()) == []
        with pytest.raises(NotFoundError):
            next(store.stream_pack("sha256:" + "cd" * 32))
        for bad in BAD_DIGESTS:
            with pytest.raises(InvalidInputError):
                store.stream_pack(bad)

    # --- unknown and malformed digests ---------------------------------------------------

    def test_unknown_digests_are_not_found(self, store):
        unknown = "sha256:" + "ab" * 32
        assert not store.has_chunk(unknown) and not store.has_manifest(unknown)
        with pytest.raises(NotFoundError):
            store.get_chunk(unknown)
        with pytest.raises(NotFoundError):
            store.get_manifest(unknown)
        with pytest.raises(NotFoundError):
            store.resolve("groups", unknown)
        with pytest.raises(NotFoundError):
            store.get_ref("templates", "nobody")
        with pytest.raises(NotFoundError):
            store.resolve("templates", "nobody")

    @pytest.mark.parametrize("bad", BAD_DIGESTS)
    def test_bad_digests_are_invalid_input(self, store, bad):
        for call in (
            store.get_chunk,
            store.has_chunk,
            store.delete_chunk,
            store.get_manifest,
            store.has_manifest,
            store.delete_manifest,
        ):
            with pytest.raises(InvalidInputError):
                call(bad)
        with pytest.raises(InvalidInputError):
            store.set_ref("groups", "g", bad)
        if bad.startswith("sha256:"):
            with pytest.raises(InvalidInputError):
                store.resolve("groups", bad)

    # --- manifests -----------------------------------------------------------------------

    def test_manifest_round_trip_and_verification(self, store, backend):
        m = _manifest(store)
        data = canonical_json(m)
        digest = store.put_manifest(data)
        assert digest == m.digest() == sha256_digest(data)
        assert store.put_manifest(data) == digest  # idempotent
        assert store.has_manifest(digest)
        assert store.get_manifest(digest) == data
        assert parse_group_manifest(store.get_manifest(digest)) == m
        assert list(store.list_manifests()) == [digest]

        other = canonical_json(_manifest(store, "other"))
        backend.corrupt_manifest(store, digest, other)
        with pytest.raises(DigestMismatchError):
            store.get_manifest(digest)
        backend.corrupt_manifest(store, digest, data)
        assert store.get_manifest(digest) == data
        store.delete_manifest(digest)
        assert not store.has_manifest(digest)

    # --- refs ----------------------------------------------------------------------------

    def test_refs(self, store):
        a = store.put_manifest(canonical_json(_manifest(store, "a")))
        b = store.put_manifest(canonical_json(_manifest(store, "b")))
        assert store.list_refs("groups") == {} and store.list_refs("templates") == {}
        store.set_ref("groups", "a", a)
        store.set_ref("groups", "b", a)
        store.set_ref("groups", "b", b)  # replace
        store.set_ref("templates", "a", b)  # kinds are separate name spaces
        assert store.get_ref("groups", "a") == a
        assert store.get_ref("groups", "b") == b
        assert store.list_refs("groups") == {"a": a, "b": b}
        assert store.list_refs("templates") == {"a": b}
        assert store.resolve("groups", "a") == a
        assert store.resolve("groups", b) == b

    def test_swap_ref_moves_a_ref_only_from_what_its_caller_read(self, store):
        a, b, c = (store.put_manifest(canonical_json(_manifest(store, n))) for n in "abc")
        store.swap_ref("templates", "t", a, expected=None)
        with pytest.raises(BusyError, match=f"templates/t .*points at {a}, not nothing"):
            store.swap_ref("templates", "t", b, expected=None)
        store.swap_ref("templates", "t", b, expected=a)
        with pytest.raises(BusyError, match=f"points at {b}, not {a}"):
            store.swap_ref("templates", "t", c, expected=a)
        assert store.get_ref("templates", "t") == b and store.ref_or_none("templates", "none") is None
        with pytest.raises(InvalidInputError):
            store.swap_ref("templates", "t", "sha256:x", expected=b)

    @pytest.mark.parametrize(
        "kind,name", [("chunks", "a"), ("group", "a"), ("groups", "A"), ("groups", "../x"), ("groups", "")]
    )
    def test_bad_refs_are_invalid_input(self, store, kind, name):
        digest = "sha256:" + "0" * 64
        with pytest.raises(InvalidInputError):
            store.set_ref(kind, name, digest)
        with pytest.raises(InvalidInputError):
            store.get_ref(kind, name)


def _publish(store: Store, name: str) -> tuple[str, GroupManifest]:
    """A group ``name`` of one chunk, its manifest stored and ``groups/NAME`` set."""
    m = _manifest(store, name)
    digest = store.put_manifest(canonical_json(m))
    store.set_ref("groups", name, digest)
    return digest, m


class TestLeases:
    """The lease protocol (:mod:`weenv.store.lease`), the same on every backend."""

    def test_a_lease_names_what_its_writer_stores_or_finds_stored(self, store):
        present, _ = store.put_chunk(b"stored by someone before")
        with Lease(store, what="test") as lease:
            leased = LeasedStore(store, lease)
            ref_old, written_old = leased.put_chunk(b"stored by someone before")
            ref_new, written_new = leased.put_chunk(b"new bytes")
            m = leased.put_manifest(b'{"media_type": "application/vnd.weenv.test"}')
            assert (written_old, written_new) == (False, True)
            assert leased_digests(store, "write") == {present.digest, ref_new.digest, m}
            assert leased_digests(store, "write", exclude=lease.id) == set()
            assert leased_digests(store, "delete") == set()
        assert leased_digests(store, "write") == set()
        assert store.list_refs("leases") == {}
        assert sorted(store.list_manifests()) == [m]  # the lease's own records are gone

    def test_a_held_lease_is_renewed_past_its_duration(self, store):
        with Lease(store, duration=1.5, digests=["sha256:" + "a" * 64]) as lease:
            time.sleep(2.5)
            assert leased_digests(store, "write") == {"sha256:" + "a" * 64}
            lease.check()
        assert leased_digests(store, "write") == set()

    def test_delete_unused_keeps_what_a_lease_names_or_a_ref_reaches(self, store, monkeypatch):
        monkeypatch.setattr(lease_module, "DELETE_BATCH", 2)  # several delete leases, one after another
        g_digest, g = _publish(store, "kept")
        leased_chunk, _ = store.put_chunk(b"a writer relies on this")
        loose_chunk, _ = store.put_chunk(b"no one needs this")
        loose_manifest = store.put_manifest(b'{"media_type": "application/vnd.weenv.test"}')
        reached = {g_digest, *(c.digest for c in g.chunks)}
        with Lease(store, digests=[leased_chunk.digest]) as writer:
            done = delete_unused(
                store,
                {
                    "manifests": [g_digest, loose_manifest],
                    "chunks": [leased_chunk.digest, loose_chunk.digest, g.chunks[0].digest],
                },
                reached=lambda: reached,
                what="test",
            )
            assert sorted(done.removed) == sorted([loose_manifest, loose_chunk.digest])
            assert store.has_chunk(leased_chunk.digest) and store.has_manifest(g_digest)
            # the holder's own lease does not protect from its own rollback
            done = delete_unused(store, {"chunks": [leased_chunk.digest]}, reached=set, what="test", exclude=writer.id)
            assert done.removed == [leased_chunk.digest]
        assert not store.has_chunk(loose_chunk.digest) and not store.has_manifest(loose_manifest)
        assert store.list_refs("leases") == {}
        assert check_store(store).ok

    def test_a_writer_waits_while_a_delete_lease_names_its_chunk(self, store):
        plaintext = b"garbage about to be deleted"
        ref, _ = store.put_chunk(plaintext)
        results = []
        with Lease(store, purpose="delete", digests=[ref.digest]) as deleter:
            with Lease(store, what="writer") as lease:
                writer = threading.Thread(target=lambda: results.append(LeasedStore(store, lease).put_chunk(plaintext)))
                writer.start()
                time.sleep(1.0)
                assert writer.is_alive() and results == []  # it may not trust the chunk it sees
                store.delete_chunk(ref.digest)  # the deleter goes on
                time.sleep(0.3)
                deleter.drop()
                writer.join(30)
                assert results == [(ref, True)]  # written again, once the delete was over
        assert store.get_chunk(ref.digest) == plaintext

    def test_an_expired_lease_protects_nothing(self, store):
        lease = Lease(store, duration=1.0, digests=["sha256:" + "b" * 64]).take()
        lease._stop.set()  # its holder stops renewing it (as if killed)
        lease._renewer.join()
        assert leased_digests(store, "write") == {"sha256:" + "b" * 64}
        time.sleep(1.2)
        assert leased_digests(store, "write") == set()
        with pytest.raises(BusyError, match="lost"):
            lease.check()
        lease.drop()

    def test_a_lease_whose_renewal_lands_after_it_expired_stays_lost(self, store, monkeypatch):
        """A holder paused (or a store slow) between its expiry check and the
        write of its renewed record: the record it writes then names a fresh
        expiry, but a deleter may have gone by in the gap, so the lease stays
        lost (before, the late write revived it and the writer published)."""
        lease = Lease(store, duration=1.0, digests=["sha256:" + "c" * 64]).take()
        lease._stop.set()  # renewals by hand below
        lease._renewer.join()
        set_ref = type(store).set_ref

        def late(self, kind, name, digest):  # the write lands after the old record expired
            time.sleep(1.5)
            return set_ref(self, kind, name, digest)

        monkeypatch.setattr(type(store), "set_ref", late)
        with pytest.raises(BusyError, match="after it expired"):
            lease.cover(["sha256:" + "d" * 64])
        monkeypatch.setattr(type(store), "set_ref", set_ref)
        with pytest.raises(BusyError, match="lost"):
            lease.check()
        lease.drop()
        assert store.list_refs("leases") == {}

    def test_a_writers_lease_write_reads_no_other_write_lease(self, store):
        """A writer's lease write reads the delete leases only: the requests it
        takes do not grow with the writers sharing the store (before, each one
        read every lease's ref, a write lease's too, and asked whether its own
        new record was stored)."""
        if not isinstance(store, S3Store):
            pytest.skip("counts an s3:// store's requests")
        others = [Lease(store, what=f"other {i}", digests=[f"sha256:{i:064x}"]).take() for i in range(12)]
        try:
            with Lease(store, what="counted") as lease:
                before = store.stats().requests
                lease.cover(["sha256:" + "e" * 64])
                assert store.stats().requests - before <= 4  # record, ref, old record, one listing
        finally:
            for other in others:
                other.drop()

    def test_store_check_reports_missing_and_corrupt_blobs(self, store):
        g_digest, g = _publish(store, "g")
        template = store.put_manifest(canonical_json(TemplateManifest(name="t", groups=[g_digest])))
        store.set_ref("templates", "t", template)
        extra, _ = store.put_chunk(b"an unreferenced chunk")
        assert check_store(store).ok
        store._put("chunks", extra.digest, zstandard.ZstdCompressor().compress(b"other bytes"))
        store.delete_chunk(g.chunks[0].digest)
        problems = check_store(store).problems
        assert len(problems) == 2, problems
        assert any(p.startswith(f"missing chunk {g.chunks[0].digest}") for p in problems)
        assert any(p.startswith(f"corrupt chunk {extra.digest}") for p in problems)
        store.delete_manifest(g_digest)
        problems = check_store(store).problems
        assert any(f"missing manifest {g_digest} (ref groups/g)" in p for p in problems)
        assert any(f"missing manifest {g_digest} (group of template t" in p for p in problems)
