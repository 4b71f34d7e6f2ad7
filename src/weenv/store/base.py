"""The Store interface: content-addressed chunks and manifests, plus name refs.

A store keeps four things:

- **chunks**: zstd frames addressed by the sha256 of their *plaintext*
  (see :class:`weenv.formats.manifest.ChunkRef`);
- **manifests**: group and template manifests addressed by the sha256 of their
  canonical JSON bytes;
- **packs**: prefetch packs, several chunks' zstd frames in one blob, addressed
  by the sha256 of their bytes (:class:`weenv.packaging.profile.PrefetchPack`);
- **refs**: names (``templates/NAME``, ``groups/NAME``) pointing at a manifest digest;
  ``buildcache/KEY`` maps a recipe component's cache key (hex) to the group
  manifest built from it (:mod:`weenv.packaging.buildcache`);
  ``prefetch/<hex of a template digest>`` points at the template's prefetch
  profile (:mod:`weenv.node.data.prefetch`);
  ``leases/ID`` points at a lease record (:mod:`weenv.store.lease`).

Compression and digest checks live here, once; a backend only moves bytes
(``_put_blob`` / ``_get_blob`` ...).  Every read is verified: a chunk whose
plaintext does not hash to its digest raises :class:`DigestMismatchError`,
never returns wrong bytes.

Every read is bounded (:mod:`weenv.formats.limits`): a backend is given the
most bytes the blob may have (a chunk's frame: :func:`frame_bound` of its
plaintext size; a manifest: ``MAX_MANIFEST_BYTES``; a pack: its declared size)
and raises :class:`ContentLimitError` naming the digest before it reads more.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator

import zstandard

from weenv.errors import BusyError, ContentLimitError, DigestMismatchError, InvalidInputError, NotFoundError
from weenv.formats.limits import MAX_CHUNK_SIZE, MAX_MANIFEST_BYTES, MAX_PACK_BYTES, frame_bound
from weenv.formats.manifest import ChunkRef, check_digest, check_name, sha256_digest

REF_KINDS = ("templates", "groups", "buildcache", "prefetch", "usage", "leases")
SPACES = ("chunks", "manifests", "packs")
ZSTD_LEVEL = 3
SPACE_LIMITS = {"chunks": frame_bound(MAX_CHUNK_SIZE), "manifests": MAX_MANIFEST_BYTES, "packs": MAX_PACK_BYTES}
"""The most bytes a blob of each space may have, unless the reader knows a smaller bound."""


def read_limit(space: str, max_bytes: int | None) -> int:
    """``max_bytes``, or the space's own limit (:data:`SPACE_LIMITS`) when None."""
    return SPACE_LIMITS[space] if max_bytes is None else max_bytes


def too_large(what: str, size: int, limit: int) -> ContentLimitError:
    """The error for blob ``what`` (its kind, digest and store) of ``size`` bytes past ``limit``."""
    return ContentLimitError(f"{what} has {size} bytes, more than the {limit} weenv reads of it")


class Store(abc.ABC):
    """A content-addressed store.  Implementations: :class:`weenv.store.file.FileStore`,
    :class:`weenv.store.oci.OciStore`, :class:`weenv.store.s3.S3Store`."""

    url: str

    # --- what a backend implements -------------------------------------------------
    @abc.abstractmethod
    def _has(self, space: str, digest: str) -> bool:
        """Whether blob ``digest`` exists in ``space`` (one of :data:`SPACES`)."""

    @abc.abstractmethod
    def _put(self, space: str, digest: str, data: bytes) -> None:
        """Write ``data`` atomically as blob ``digest`` of ``space``."""

    @abc.abstractmethod
    def _get(self, space: str, digest: str, max_bytes: int | None = None) -> bytes:
        """Bytes of blob ``digest``; raise :class:`NotFoundError` if absent,
        :class:`ContentLimitError` (before reading it whole) if it has more than
        ``max_bytes`` (None: :func:`read_limit` of ``space``)."""

    def _stream(self, space: str, digest: str, max_bytes: int | None = None) -> Iterator[bytes]:
        """Bytes of blob ``digest`` in pieces as they arrive (default: one
        piece, :meth:`_get`); :class:`NotFoundError` if absent,
        :class:`ContentLimitError` past ``max_bytes`` as :meth:`_get`."""
        yield self._get(space, digest, max_bytes)

    @abc.abstractmethod
    def _list(self, space: str) -> Iterator[str]:
        """Digests of every blob in ``space``."""

    @abc.abstractmethod
    def _delete(self, space: str, digest: str) -> None:
        """Remove blob ``digest`` (no error if absent)."""

    def _modified(self, space: str, digest: str) -> float | None:
        """When blob ``digest`` was stored (``time.time()`` scale), or None if
        the backend cannot tell or it is absent (``weenv gc``'s grace period)."""
        return None

    def _claim(self, space: str, digest: str) -> None:
        """Called before a put asks whether blob ``digest`` is stored: a
        :class:`weenv.store.lease.LeasedStore` names it in its lease here."""

    @abc.abstractmethod
    def set_ref(self, kind: str, name: str, digest: str) -> None:
        """Point ref ``kind/name`` at ``digest`` (atomic replace)."""

    @abc.abstractmethod
    def get_ref(self, kind: str, name: str) -> str:
        """The digest ref ``kind/name`` points at; raise :class:`NotFoundError`."""

    @abc.abstractmethod
    def list_refs(self, kind: str) -> dict[str, str]:
        """Every ref of ``kind`` as ``{name: digest}``."""

    def swap_ref(self, kind: str, name: str, digest: str, *, expected: str | None) -> None:
        """Point ref ``kind/name`` at ``digest`` only if it points at ``expected``
        now (None: only if it does not exist), for a read-modify-write that must
        not lose a concurrent writer's ref (an update of a template); else
        :class:`BusyError` naming the ref, which is left as the other writer set it.

        ``s3://`` (a conditional write) and ``file://`` (under a lock file) do
        it atomically; this default (``oci://``: a registry has no conditional
        tag write) checks, then writes: a writer between the check and the
        write is overwritten (the last one wins).
        """
        check_digest(digest)
        current = self.ref_or_none(kind, name)
        if current != expected:
            raise ref_moved(self.url, kind, name, current, expected)
        self.set_ref(kind, name, digest)

    def ref_names(self, kind: str) -> list[str]:
        """The names of the refs of ``kind``, without reading them (backends
        that can list names alone override this default, :meth:`list_refs`):
        a reader that wants a few of many refs reads only those."""
        return sorted(self.list_refs(kind))

    def ref_or_none(self, kind: str, name: str) -> str | None:
        """The digest ref ``kind/name`` points at, or None if it does not exist."""
        try:
            return self.get_ref(kind, name)
        except NotFoundError:
            return None

    def delete_ref(self, kind: str, name: str, *, expected: str | None = None) -> None:
        """Remove ref ``kind/name`` (no error if absent); with ``expected``, only
        if it points at that digest now (``weenv gc``: a ref a writer re-pointed
        since gc read it stays).  ``file://`` checks and deletes atomically;
        ``oci://`` and ``s3://`` check, then delete.

        Backends that can delete refs override this; the default raises
        :class:`InvalidInputError` (``weenv gc`` then keeps dangling refs).
        """
        self._check_ref(kind, name)
        raise InvalidInputError(f"{self.url} cannot delete refs")

    # --- chunks ------------------------------------------------------------------------
    def put_chunk(self, plaintext: bytes, *, level: int = ZSTD_LEVEL) -> tuple[ChunkRef, bool]:
        """Store one chunk; return its ref and whether bytes were written.

        A chunk already present is not written again (``False``).
        """
        digest = sha256_digest(plaintext)
        frame = zstandard.ZstdCompressor(level=level, write_content_size=True).compress(plaintext)
        ref = ChunkRef(
            digest=digest,
            size=len(plaintext),
            stored_size=len(frame),
            stored_digest=sha256_digest(frame),
        )
        self._claim("chunks", digest)
        if self._has("chunks", digest):
            return ref, False
        self._put("chunks", digest, frame)
        return ref, True

    def _get_frame(self, digest: str, stored_digest: str, max_bytes: int | None = None) -> bytes:
        """The zstd frame of chunk ``digest`` whose own sha256 is ``stored_digest``
        (at most ``max_bytes``, as :meth:`_get`).

        A backend that addresses blobs by their stored bytes (OCI registries)
        overrides this to fetch the frame directly, skipping its plaintext-digest
        index; the default reads ``_get("chunks", digest)``.
        """
        return self._get("chunks", digest, max_bytes)

    def get_chunk(self, digest: str, *, stored_digest: str | None = None, size: int | None = None) -> bytes:
        """Plaintext of chunk ``digest``, verified.

        ``stored_digest`` (``ChunkRef.stored_digest``, the sha256 of the zstd
        frame), when the caller knows it, is a hint: stores that address blobs by
        their stored bytes fetch the frame in one request.  The result is checked
        against ``digest`` either way.  ``size`` (``ChunkRef.size``): the
        plaintext's bytes, checked before the frame is decoded (:func:`decode_frame`);
        the frame is read only up to :func:`frame_bound` of it (of
        ``MAX_CHUNK_SIZE`` without it).

        Raises :class:`NotFoundError` if absent, :class:`DigestMismatchError` if
        the stored frame does not decompress to bytes with that digest,
        :class:`ContentLimitError` for a frame past its bound.
        """
        check_digest(digest)
        limit = frame_bound(MAX_CHUNK_SIZE if size is None else min(size, MAX_CHUNK_SIZE))
        if stored_digest is None:
            frame = self._get("chunks", digest, limit)
        else:
            frame = self._get_frame(digest, check_digest(stored_digest), limit)
        return decode_frame(digest, frame, size=size, where=self.url)

    def has_chunk(self, digest: str) -> bool:
        return self._has("chunks", check_digest(digest))

    def list_chunks(self) -> Iterator[str]:
        return self._list("chunks")

    def delete_chunk(self, digest: str) -> None:
        self._delete("chunks", check_digest(digest))

    # --- packs ---------------------------------------------------------------------------
    def put_pack(self, data: bytes) -> str:
        """Store a prefetch pack; return the sha256 digest of its bytes."""
        digest = sha256_digest(data)
        self._claim("packs", digest)
        if not self._has("packs", digest):
            self._put("packs", digest, data)
        return digest

    def stream_pack(self, digest: str, size: int | None = None) -> Iterator[bytes]:
        """The bytes of pack ``digest`` in pieces as they arrive, for a reader
        that decodes frames while the rest is on its way.  Not verified as a
        whole: the reader checks each frame against its chunk's digest
        (:func:`decode_frame`), so a damaged pack fails at its first bad frame.
        ``size``: the pack's bytes (``PrefetchPack.size``); a longer blob raises
        :class:`ContentLimitError` before its first piece when the store knows
        its length, else once past it (at most ``MAX_PACK_BYTES`` either way).
        Raises :class:`NotFoundError` (at the first piece) if absent, and the
        backend's errors (:class:`~weenv.errors.StoreUnavailableError`) when a
        read fails midway."""
        return self._stream("packs", check_digest(digest), min(size or MAX_PACK_BYTES, MAX_PACK_BYTES))

    def has_pack(self, digest: str) -> bool:
        return self._has("packs", check_digest(digest))

    def list_packs(self) -> Iterator[str]:
        return self._list("packs")

    def delete_pack(self, digest: str) -> None:
        self._delete("packs", check_digest(digest))

    # --- manifests ---------------------------------------------------------------------
    def put_manifest(self, data: bytes) -> str:
        """Store manifest bytes (canonical JSON); return their digest."""
        digest = sha256_digest(data)
        self._claim("manifests", digest)
        if not self._has("manifests", digest):
            self._put("manifests", digest, data)
        return digest

    def get_manifest(self, digest: str) -> bytes:
        """Manifest bytes, verified; :class:`NotFoundError`, :class:`DigestMismatchError`,
        :class:`ContentLimitError` past ``MAX_MANIFEST_BYTES`` (before it is read whole).
        A deleted manifest is gone from ``has``/``list`` at once; an ``oci://``
        store may still read it by digest until the registry's garbage collector
        frees its blob (content-addressed: the bytes are still the right ones)."""
        check_digest(digest)
        data = self._get("manifests", digest, MAX_MANIFEST_BYTES)
        if sha256_digest(data) != digest:
            raise DigestMismatchError(f"manifest {digest} in {self.url} has other content")
        return data

    def has_manifest(self, digest: str) -> bool:
        return self._has("manifests", check_digest(digest))

    def list_manifests(self) -> Iterator[str]:
        return self._list("manifests")

    def delete_manifest(self, digest: str) -> None:
        self._delete("manifests", check_digest(digest))

    # --- names -------------------------------------------------------------------------
    def resolve(self, kind: str, name_or_digest: str) -> str:
        """A digest from a ref name or a digest (which must exist)."""
        if name_or_digest.startswith("sha256:"):
            check_digest(name_or_digest)
            if not self.has_manifest(name_or_digest):
                raise NotFoundError(f"no manifest {name_or_digest} in {self.url}")
            return name_or_digest
        return self.get_ref(kind, name_or_digest)

    @staticmethod
    def _check_ref(kind: str, name: str) -> None:
        if kind not in REF_KINDS:
            raise InvalidInputError(f"ref kind must be one of {REF_KINDS}, not {kind!r}")
        check_name(name)

    def close(self) -> None:
        """Release connections (nothing for local stores)."""


def ref_moved(url: str, kind: str, name: str, current: str | None, expected: str | None) -> BusyError:
    """The error of a :meth:`Store.swap_ref` that found ref ``kind/name`` at ``current``."""
    return BusyError(
        f"ref {kind}/{name} in {url} points at {current or 'nothing'}, not {expected or 'nothing'} "
        "(another writer moved it)"
    )


def decode_frame(digest: str, frame: bytes, *, size: int | None = None, where: str = "the store") -> bytes:
    """The plaintext of chunk ``digest`` from its zstd ``frame``, checked against
    ``digest``.  ``size``: the plaintext's bytes when the caller knows them (a
    :class:`ChunkRef`'s); at most :data:`MAX_CHUNK_SIZE` either way, checked
    against the frame's header before anything is decoded, so a small frame
    declaring gigabytes costs nothing.  Raises :class:`DigestMismatchError`
    (naming ``where``) if the frame is not zstd, declares another size, or
    decodes to other bytes."""
    limit = MAX_CHUNK_SIZE if size is None else min(size, MAX_CHUNK_SIZE)
    try:
        declared = zstandard.frame_content_size(frame)
        if declared > limit or (size is not None and declared not in (size, -1)):
            raise DigestMismatchError(
                f"chunk {digest} in {where}: its frame declares {declared} bytes, "
                f"not {size if size is not None else f'at most {limit}'}"
            )
        plaintext = zstandard.ZstdDecompressor().decompress(frame, max_output_size=limit)
    except zstandard.ZstdError as exc:
        raise DigestMismatchError(f"chunk {digest} in {where} is not a zstd frame: {exc}") from exc
    if sha256_digest(plaintext) != digest:
        raise DigestMismatchError(f"chunk {digest} in {where} has other content")
    return plaintext
