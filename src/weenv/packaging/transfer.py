"""Copy a template (its groups' chunks, its manifests and refs) from one store to another.

Chunks move as stored zstd frames (no recompression), each checked by the
source (plaintext digest) before it is written; chunks the destination already
has are skipped.  Order: chunks, then group manifests, then the template
manifest, then refs, so a reader of the destination never sees a ref to
missing content.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from weenv.errors import DigestMismatchError
from weenv.formats.limits import frame_bound
from weenv.formats.manifest import ChunkRef, sha256_digest
from weenv.packaging.group import load_group
from weenv.packaging.template import load_template
from weenv.store.base import Store, decode_frame
from weenv.store.lease import Lease


@dataclass(frozen=True)
class CopyResult:
    """What :func:`copy_template` wrote."""

    template: str
    """Digest of the template manifest."""
    chunks_copied: int
    chunks_skipped: int
    bytes_copied: int
    """Stored (zstd) bytes written to the destination."""


def _copy_chunk(src: Store, dst: Store, ref: ChunkRef) -> int:
    """Copy one chunk's frame unless ``dst`` has it; return bytes written (0 if skipped)."""
    if dst.has_chunk(ref.digest):
        return 0
    frame = src._get_frame(ref.digest, ref.stored_digest, frame_bound(ref.size))
    if sha256_digest(frame) != ref.stored_digest:  # the destination addresses it by that digest
        raise DigestMismatchError(f"chunk {ref.digest} in {src.url}: its frame is not {ref.stored_digest}")
    decode_frame(ref.digest, frame, size=ref.size, where=src.url)  # checked, within the chunk's size
    dst._put("chunks", ref.digest, frame)
    return len(frame)


def copy_template(
    src: Store, dst: Store, template: str, *, name: str | None = None, group_refs: bool = False, parallel: int = 8
) -> CopyResult:
    """Copy template ``template`` (a ref name or digest) from ``src`` to ``dst``.

    Sets ``templates/NAME`` in ``dst`` (``name`` defaults to the template's own
    name); with ``group_refs``, also ``groups/GROUP`` for each of its groups
    (the template refers to them by digest, so it needs none).  ``parallel``
    chunk copies run at once.  Raises what the stores raise (:class:`NotFoundError`,
    :class:`DigestMismatchError`, :class:`StoreUnavailableError`, ...).
    """
    digest, manifest = load_template(src, template)
    groups = [(g, load_group(src, g)) for g in manifest.groups]
    refs = list({c.digest: c for _, g in groups for c in g.chunks}.values())
    with Lease(dst, what=f"copy {manifest.name}") as lease:
        # named before any presence check, until the template is published (weenv.store.lease)
        lease.cover([*(c.digest for c in refs), *manifest.groups, digest])
        with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
            written = list(pool.map(lambda c: _copy_chunk(src, dst, c), refs))
        for group_digest, group in groups:
            dst.put_manifest(src.get_manifest(group_digest))
            if group_refs:
                dst.set_ref("groups", group.name, group_digest)
        dst.put_manifest(src.get_manifest(digest))
        lease.check()
        dst.set_ref("templates", name or manifest.name, digest)
    copied = sum(1 for n in written if n)
    return CopyResult(digest, copied, len(refs) - copied, sum(written))
