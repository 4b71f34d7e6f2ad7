"""Layer groups: build one from a directory, publish it, and assemble it back.

A group is one EROFS image (:mod:`weenv.packaging.erofs_writer`) cut into fixed-size
chunks; chunk ``i`` is image bytes ``[i * chunk_size, (i + 1) * chunk_size)``, the
last one shorter.  Each chunk goes to the store as a zstd frame addressed by the
sha256 of its plaintext (skipped if the store has it), then the group manifest,
then the ref ``groups/NAME``.  The image is streamed one chunk at a time, never
held whole in memory.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import uuid as uuid_mod
from dataclasses import dataclass
from pathlib import Path

from weenv.errors import InvalidInputError
from weenv.formats.limits import MAX_CHUNK_SIZE
from weenv.formats.manifest import (
    DEFAULT_CHUNK_SIZE,
    EROFS_BLOCK_SIZE,
    GroupManifest,
    Layout,
    canonical_json,
    check_digest,
    check_name,
    manifest_kind,
    parse_group_manifest,
    sha256_digest,
)
from weenv.host.punch import punch_hole
from weenv.packaging.chunksink import ChunkSink
from weenv.packaging.erofs import check_source_dir
from weenv.packaging.erofs_writer import WRITER, tree_from_dir, write_image
from weenv.store.base import Store

_UUID_NAMESPACE = uuid_mod.UUID("6d1b8a52-4f0e-4c55-8a0e-7765656e7600")


@dataclass(frozen=True)
class BuildResult:
    """What :func:`build_group` published."""

    digest: str
    """The group manifest's digest (``sha256:...``)."""
    manifest: GroupManifest
    chunks_written: int
    """Chunks the store did not have before (the others were skipped)."""
    bytes_written: int
    """Stored (zstd) bytes of those new chunks."""
    seconds: float
    """Wall time of the whole build."""
    new_chunks: tuple[str, ...] = ()
    """Digests of the chunks this build wrote (``chunks_written`` of them)."""
    new_manifest: bool = True
    """Whether the store did not hold the manifest before (a rollback deletes only a new one)."""


def group_uuid(name: str, version: str) -> str:
    """The EROFS UUID of group ``name``/``version``: fixed per group, so rebuilds
    repeat, and different per group, so overlayfs sees distinct lower layers."""
    return str(uuid_mod.uuid5(_UUID_NAMESPACE, f"group:{name}:{version}"))


def _check_chunk_size(chunk_size: int) -> None:
    if not isinstance(chunk_size, int) or not 0 < chunk_size <= MAX_CHUNK_SIZE or chunk_size % EROFS_BLOCK_SIZE:
        raise InvalidInputError(
            f"chunk size must be a positive multiple of {EROFS_BLOCK_SIZE} bytes of at most "
            f"{MAX_CHUNK_SIZE >> 20} MiB, not {chunk_size!r}"
        )


def build_group(
    source_dir: str | os.PathLike[str],
    store: Store,
    *,
    name: str,
    version: str = "latest",
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    source: dict[str, str] | None = None,
    workdir: str | os.PathLike[str] | None = None,
    ref: bool = True,
    first: list[str] | None = None,
    layout: Layout | None = None,
) -> BuildResult:
    """Build group ``name`` from ``source_dir`` and publish it to ``store``.

    ``chunk_size`` (bytes) must be a positive multiple of the EROFS block size
    (4096).  ``source``: provenance entries added to the manifest's ``source``
    (they override the automatic ``type``, ``path`` and ``mkfs`` entries).
    ``workdir``: where the temporary image is written (default: the system's
    temporary directory); it must not be inside ``source_dir``.  The image is
    removed in every case.  ``ref``: point ``groups/NAME`` at the new manifest
    (without it the group is published by digest only).  ``first``: paths
    (``/a/b``) of the files whose data goes first, contiguous, in that order
    (an access profile's files: :mod:`weenv.packaging.layout`), with
    ``layout`` the manifest's record of where the order came from.

    The image is written by :mod:`weenv.packaging.erofs_writer` (names up to
    255 bytes, binary xattrs, sparse and > 4 GiB files).

    Raises :class:`InvalidInputError` (bad name, chunk size, source or workdir;
    an entry the image cannot hold, named by path) and whatever the store raises.
    """
    started = time.monotonic()
    check_name(name)
    _check_chunk_size(chunk_size)
    src = check_source_dir(source_dir)
    parent = Path(workdir if workdir is not None else tempfile.gettempdir()).resolve()
    if parent == src or src in parent.parents:
        raise InvalidInputError(f"work dir {parent} is inside the source {src}; pass another workdir")
    provenance = {"type": "directory", "path": str(src), "mkfs": WRITER}
    provenance.update(source or {})

    tmp = Path(tempfile.mkdtemp(dir=parent, prefix=".weenv-build-"))
    try:
        image = tmp / f"{name}.erofs"
        with open(image, "wb") as out:
            scan = write_image(tree_from_dir(src), out, uuid=group_uuid(name, version), first=first or ())
        return publish_image(
            image,
            store,
            name=name,
            version=version,
            chunk_size=chunk_size,
            file_count=scan.inodes,
            source=provenance,
            ref=ref,
            started=started,
            layout=layout,
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def publish_image(
    image: str | os.PathLike[str],
    store: Store,
    *,
    name: str,
    version: str = "latest",
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    file_count: int,
    source: dict[str, str],
    ref: bool = True,
    punch: bool = False,
    started: float | None = None,
    layout: Layout | None = None,
) -> BuildResult:
    """Publish the group image file ``image`` (written with
    :func:`group_uuid` of ``name``/``version``): its chunks, then the group
    manifest (``file_count`` inodes, provenance ``source``), then with ``ref``
    the ref ``groups/NAME``.  ``punch``: free each chunk's bytes of ``image``
    once read (``fallocate(PUNCH_HOLE)``; the file is spent afterwards), so
    the image and its stored chunks are not both on disk.  ``started``: the
    build's start (``time.monotonic()``) for :attr:`BuildResult.seconds`.
    ``layout``: how the image's file data is ordered (default: tree order).
    Raises :class:`InvalidInputError` for a bad name or chunk size and
    whatever the store raises."""
    check_name(name)
    _check_chunk_size(chunk_size)
    with open(image, "r+b" if punch else "rb") as f, ChunkSink(store, chunk_size) as sink:
        offset = 0
        while data := f.read(chunk_size):
            if punch:
                punch_hole(f.fileno(), offset, len(data))
            offset += len(data)
            sink.write(data)
        return publish_sink(
            sink,
            store,
            name=name,
            version=version,
            file_count=file_count,
            source=source,
            ref=ref,
            started=started,
            layout=layout,
        )


def publish_sink(
    sink: ChunkSink,
    store: Store,
    *,
    name: str,
    version: str = "latest",
    file_count: int,
    source: dict[str, str],
    ref: bool = True,
    started: float | None = None,
    layout: Layout | None = None,
) -> BuildResult:
    """Publish the group image written to ``sink`` (:class:`ChunkSink`, its
    chunks stored as they were written): the rest of its chunks, then the group
    manifest, then with ``ref`` the ref ``groups/NAME`` (arguments as
    :func:`publish_image`).  On a store error the sink is aborted (what it
    wrote stays, unreferenced: the caller rolls back or ``weenv gc`` removes
    it)."""
    started = time.monotonic() if started is None else started
    check_name(name)
    _check_chunk_size(sink.chunk_size)
    done = sink.finish()
    manifest = GroupManifest(
        name=name,
        version=version,
        image_size=done.size,
        chunk_size=sink.chunk_size,
        chunks=done.chunks,
        file_count=file_count,
        source=source,
        layout=layout,
    )
    data = canonical_json(manifest)
    new_manifest = not store.has_manifest(sha256_digest(data))
    digest = store.put_manifest(data)
    if ref:
        store.set_ref("groups", name, digest)
    return BuildResult(
        digest, manifest, len(done.new), done.stored, time.monotonic() - started, tuple(done.new), new_manifest
    )


def assemble_image(store: Store, manifest: GroupManifest, dest: str | os.PathLike[str]) -> None:
    """Write the group's whole image to the file ``dest`` (mode 0644), atomically:
    a temporary file beside it, fsync'd, renamed over ``dest``.

    Every chunk is verified by the store.  Raises :class:`NotFoundError` for a
    missing chunk, :class:`DigestMismatchError` for a corrupt one and
    :class:`InvalidInputError` if the manifest's chunks do not tile the image;
    ``dest`` is then untouched.
    """
    dest = Path(dest)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".tmp-{dest.name}-")
    try:
        with os.fdopen(fd, "wb") as f:
            for ref in manifest.chunks:
                data = store.get_chunk(ref.digest, stored_digest=ref.stored_digest, size=ref.size)
                if len(data) != ref.size:
                    raise InvalidInputError(f"chunk {ref.digest} has {len(data)} bytes, the manifest says {ref.size}")
                f.write(data)
            f.flush()
            os.fchmod(f.fileno(), 0o644)
            os.fsync(f.fileno())
        os.rename(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_group(store: Store, digest: str) -> GroupManifest:
    """The group manifest ``digest`` from ``store``, verified.

    Raises :class:`InvalidInputError` for a bad digest or a manifest that is not a
    group's, :class:`NotFoundError` if absent, :class:`DigestMismatchError` if corrupt.
    """
    data = store.get_manifest(check_digest(digest))
    if manifest_kind(data) != "group":
        raise InvalidInputError(f"{digest} is a {manifest_kind(data)} manifest, not a group")
    return parse_group_manifest(data, digest)
