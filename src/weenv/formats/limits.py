"""Limits on what weenv reads from a store, in one place.

A build never makes content past these limits, and a node checks them again
when it reads, *before* it allocates: a store is shared and may hold anything
(a damaged or hostile blob under a valid digest).  Content past a limit is
refused with :class:`~weenv.errors.ContentLimitError` naming its digest (a
:class:`~weenv.errors.DigestMismatchError`: no weenv build wrote such bytes).

Where each is checked:

- the stored bytes of a blob (a chunk's frame, a manifest, a ref, a pack):
  :meth:`weenv.store.base.Store` passes a byte bound to its backend, which
  checks the file's size (``file://``) or the answer's ``Content-Length``
  (``oci://``, ``s3://``) first and stops reading past the bound either way;
- a chunk's plaintext: the zstd frame's declared content size and the decoder's
  output are held to the :class:`~weenv.formats.manifest.ChunkRef`'s ``size``
  (:func:`weenv.store.base.decode_frame`);
- a manifest's fields (chunk size and count, groups of a template, a profile's
  chunks and pack) by its model's validators.
"""

from __future__ import annotations

MAX_CHUNK_SIZE = 256 << 20
"""Largest chunk (plaintext bytes): a chunk is read, compressed and fetched whole, in memory."""

MAX_CHUNKS = 1 << 16
"""Most chunks of one group manifest: 64 GiB of image at the default 1 MiB chunk
size.  Such a manifest is ~13 MiB of JSON and ~50 MB of parsed objects."""

MAX_MANIFEST_BYTES = 16 << 20
"""Largest manifest (group, template or prefetch profile), in bytes of JSON:
room for :data:`MAX_CHUNKS` chunk refs (~210 bytes each)."""

MAX_TEMPLATE_GROUPS = 128
"""Most groups of one template (overlayfs stacks at most 500 lower layers; Docker images 127)."""

MAX_PROFILE_CHUNKS = MAX_CHUNKS
"""Most chunks a prefetch profile lists (a start reads tens to thousands; its pack
holds 64 MiB of them by default)."""

MAX_PACK_BYTES = 1 << 30
"""Largest prefetch pack, in stored bytes (a node packs 64 MiB of plaintext by default)."""

MAX_REF_BYTES = 4096
"""Largest ref a ``file://`` store reads (a ref is one digest line, 72 bytes)."""

MAX_REGISTRY_JSON_BYTES = MAX_MANIFEST_BYTES + (1 << 20)
"""Largest JSON answer of an OCI registry weenv reads (an OCI manifest, which
lists a group's chunk frames as layers; a page of tags; an error)."""

MAX_IMAGE_JSON_BYTES = 16 << 20
"""Largest image index, manifest or config an image import reads (bytes)."""


def frame_bound(size: int) -> int:
    """The most bytes a zstd frame of ``size`` plaintext bytes takes (above
    ``ZSTD_COMPRESSBOUND``: size + size/256 + 64, plus the frame header)."""
    return size + (size >> 8) + 128


MAX_TAR_HEADER_BYTES = 1 << 20
"""Largest extended header of a tar weenv unpacks (a PAX ``x`` / ``g`` header,
a GNU ``L`` long name or ``K`` long link target), bytes: Python's ``tarfile``
reads each whole, in one read, so a COPY upload's headers are checked against
this before ``tarfile`` sees them (:mod:`weenv.packaging.tarscan`).  A path is
at most 4 KiB on Linux; 1 MiB leaves room for any real header."""

MAX_LAYER_ENTRIES = 1 << 21
"""Most members of one image layer's tar that an import takes (each becomes an
in-memory inode of about 0.5 KiB until the import ends)."""

MAX_LAYER_FILE_BYTES = 64 << 30
"""Most bytes of regular files (as stored in the tar: a sparse member's data
only) in one image layer an import takes: the largest group image
(:data:`MAX_CHUNKS` chunks of the default 1 MiB)."""
