"""Startup files together (issue 18): which files of a group a prefetch
profile read, in the order it read them, so a rebuild lays their data out
contiguously (:func:`weenv.packaging.erofs_writer.write_image`'s ``first``).

A profile records chunks, not files: ``(group, chunk index)`` in first-read
order (:mod:`weenv.packaging.profile`).  The group's image, read chunk by
chunk from the store (only the chunks its metadata and the profile's reads
need, each digest-checked by the store), gives every regular file's data
extents (:mod:`weenv.packaging.erofs_extents`); a file belongs to the
working set when its data overlaps a read range the profile recorded (the
reads that reached the lazy file system: page-cache misses, readahead-sized),
or, for an older profile without ranges, a chunk it read (this
over-approximates: a 1 MiB chunk holds other files' data too).
"""

from __future__ import annotations

from weenv.formats.manifest import GroupManifest
from weenv.packaging.erofs_extents import file_extents, files_in_chunks, files_in_ranges
from weenv.packaging.profile import PrefetchProfile
from weenv.store.base import Store


def image_reader(store: Store, manifest: GroupManifest, *, keep: bool = True):
    """``read_at(offset, n)`` over the group's image, fetching whole chunks
    from ``store`` (each checked by the store), and keeping them (``keep``)
    or only the last one read."""
    got: dict[int, bytes] = {}
    size = manifest.chunk_size

    def chunk(i: int) -> bytes:
        if i not in got:
            if not keep:
                got.clear()
            ref = manifest.chunks[i]
            got[i] = store.get_chunk(ref.digest, stored_digest=ref.stored_digest, size=ref.size)
        return got[i]

    def read_at(offset: int, n: int) -> bytes:
        end = min(offset + n, manifest.image_size)
        parts = []
        while offset < end:
            i, at = divmod(offset, size)
            piece = chunk(i)[at : at + end - offset]
            if not piece:
                break
            parts.append(piece)
            offset += len(piece)
        return b"".join(parts)

    return read_at


def startup_files(store: Store, group_digest: str, manifest: GroupManifest, profile: PrefetchProfile) -> list[str]:
    """Paths (``/a/b``) of the files of group ``group_digest`` whose data the
    profile's chunk reads touched, in access order ([] if the profile read
    none of the group's data).  Raises what the store raises for a missing or
    corrupt chunk, :class:`InvalidInputError` for an image it cannot read."""
    chunks = [ci for gi, ci in profile.chunks if profile.groups[gi] == group_digest]
    if not chunks:
        return []
    extents = file_extents(image_reader(store, manifest))
    ranges = [(off, n) for gi, off, n in profile.ranges if profile.groups[gi] == group_digest]
    if ranges:
        return files_in_ranges(extents, ranges)
    return files_in_chunks(extents, chunks, manifest.chunk_size)
