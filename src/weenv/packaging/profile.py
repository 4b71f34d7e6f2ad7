"""The prefetch profile format: which chunks a template's start reads, in order, and their pack.

A node records a profile on a template's first start and publishes it beside the
template (:mod:`weenv.node.data.prefetch` records and replays it):

- the profile: canonical JSON as a manifest (:class:`PrefetchProfile`, media
  type ``application/vnd.weenv.prefetch.v1+json``);
- the ref ``prefetch/<hex of the template digest>`` pointing at it (templates are
  content-addressed, so the profile cannot be a field of the template itself;
  ``TemplateManifest.prefetch`` stays for profiles baked in at build time);
- its **pack** (optional): the profile's chunks as one blob, their zstd frames
  concatenated in profile order (:class:`PrefetchPack`, stored with
  :meth:`Store.put_pack <weenv.store.base.Store.put_pack>`).  A cold start then
  fetches its working set in one streamed request instead of one request per
  chunk: from a registry a request costs ~3 ms of its time and ~3 ms of the
  node's, more than moving and decoding a 1 MiB chunk's frame (the idea of
  eStargz's prioritized files at a blob's head, and of Nydus's prefetch list).
  Each frame is still checked against its chunk's sha256, so a pack can only
  make a start faster, never wrong.

The profile also carries the **group manifests** it names (their canonical
JSON, at most :data:`MAX_PROFILE_MANIFEST_BYTES` in all): a node holding the
profile loads them without asking the store (the template's own manifest is
still fetched: that fetch is the check that the template exists).  Measured
with ``weenv bench start --quick``: the store's answers to three manifest
reads at once took ~10 ms on 2 cores against ~2.7 ms for one.  Each is checked
against its digest before it is used, so a forged one is only a fetch more.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Literal

import zstandard
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, model_validator

from weenv.errors import NotFoundError, StoreUnavailableError, WeenvError
from weenv.formats.limits import (
    MAX_MANIFEST_BYTES,
    MAX_PACK_BYTES,
    MAX_PROFILE_CHUNKS,
    MAX_TEMPLATE_GROUPS,
    frame_bound,
)
from weenv.formats.manifest import ChunkRef, Digest, GroupManifest, canonical_json, sha256_digest, utc_now
from weenv.store.base import Store

log = logging.getLogger(__name__)

REF_KIND = "prefetch"
PROFILE_MEDIA_TYPE = "application/vnd.weenv.prefetch.v1+json"
PACK_ZSTD_LEVEL = 3
MAX_PROFILE_MANIFEST_BYTES = 4 << 20
"""Bytes of group manifest JSON a profile carries at most (groups past it are fetched from the store)."""


class PrefetchPack(BaseModel):
    """A profile's first chunks as one stored blob: one zstd frame per entry of
    the profile's ``refs``, from the first on, concatenated in that order (a
    chunk read twice in a profile, by two groups, appears twice).  It may hold
    only a prefix of ``refs`` (a node packs at most ``pack_bytes`` of
    plaintext); the rest is fetched chunk by chunk."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    digest: Digest
    """sha256 of the pack's bytes (how the store addresses it)."""
    frames: list[PositiveInt] = Field(min_length=1, max_length=MAX_PROFILE_CHUNKS)
    """Bytes of each frame, in order (frame i decompresses to ``refs[i]``'s
    plaintext; never more than zstd's bound for that size, :func:`frame_bound`);
    at most :data:`~weenv.formats.limits.MAX_PACK_BYTES` in all."""

    @model_validator(mode="after")
    def _bounded(self) -> PrefetchPack:
        if self.size > MAX_PACK_BYTES:
            raise ValueError(f"a pack of {self.size} bytes, more than {MAX_PACK_BYTES}")
        return self

    @property
    def size(self) -> int:
        """Bytes of the whole pack."""
        return sum(self.frames)


class PrefetchProfile(BaseModel):
    """The chunks a template's first start read, in the order it read them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: Literal[1] = 1
    media_type: Literal["application/vnd.weenv.prefetch.v1+json"] = PROFILE_MEDIA_TYPE
    template: Digest
    groups: list[Digest] = Field(min_length=1, max_length=MAX_TEMPLATE_GROUPS)
    """The template's group digests, bottom to top (what ``chunks`` indexes)."""
    chunks: list[tuple[int, int]] = Field(max_length=MAX_PROFILE_CHUNKS)
    """``(index into groups, chunk index in that group)`` in first-read order."""
    refs: list[ChunkRef] = Field(default_factory=list, max_length=MAX_PROFILE_CHUNKS)
    """The same chunks, in the same order, as chunk refs: a replay can start
    fetching before the group manifests are loaded (empty in profiles recorded
    before weenv kept them)."""
    ranges: list[tuple[int, int, int]] = Field(default_factory=list, max_length=MAX_PROFILE_CHUNKS)
    """``(index into groups, image offset, bytes)`` of the reads that reached
    the node's lazy file system in the window, in order (page-cache misses:
    finer than chunks); what a rebuild maps to files to lay them out together
    (:mod:`weenv.packaging.layout`).  Empty in older profiles."""
    pack: PrefetchPack | None = None
    """The frames of the first ``len(pack.frames)`` refs as one blob (None: fetch them one by one)."""
    manifests: dict[Digest, str] = Field(default_factory=dict, max_length=MAX_TEMPLATE_GROUPS)
    """Group digest (one of ``groups``) -> that group manifest's canonical JSON,
    at most :data:`MAX_PROFILE_MANIFEST_BYTES` in all; a node checks each
    against its digest before using it
    (:meth:`weenv.node.manifests.NodeManifests.adopt`).  Empty in
    older profiles, and for groups that did not fit."""
    window_s: float
    """How long the recording ran (seconds)."""
    created: str = Field(default_factory=utc_now)

    @model_validator(mode="after")
    def _pack_matches_refs(self) -> PrefetchProfile:
        if self.refs and len(self.refs) != len(self.chunks):
            raise ValueError(f"{len(self.refs)} refs for {len(self.chunks)} chunks")
        if self.pack is not None:
            if len(self.pack.frames) > len(self.refs):
                raise ValueError(f"a pack of {len(self.pack.frames)} frames for {len(self.refs)} refs")
            for i, (n, ref) in enumerate(zip(self.pack.frames, self.refs)):
                if n > frame_bound(ref.size):
                    raise ValueError(f"pack frame {i} has {n} bytes, more than a frame of {ref.size} can")
        stray = set(self.manifests) - set(self.groups)
        if stray:
            raise ValueError(f"manifests of groups the profile does not name: {sorted(stray)[0]}")
        carried = sum(len(m) for m in self.manifests.values())
        if carried > MAX_PROFILE_MANIFEST_BYTES:
            raise ValueError(f"{carried} bytes of group manifests, more than {MAX_PROFILE_MANIFEST_BYTES}")
        return self


def carried_manifests(groups: Iterable[tuple[str, GroupManifest]]) -> dict[str, str]:
    """What a profile carries of ``groups`` (digest, manifest): the canonical
    JSON of each whose bytes have that digest (a manifest that does not
    serialize back to it, e.g. one written by an older weenv, is left out), in
    order, while the total stays within :data:`MAX_PROFILE_MANIFEST_BYTES`."""
    out, total = {}, 0
    for digest, manifest in groups:
        data = canonical_json(manifest)
        if sha256_digest(data) != digest or digest in out:
            continue
        if total + len(data) > MAX_PROFILE_MANIFEST_BYTES:
            break
        out[digest] = data.decode()
        total += len(data)
    return out


def ref_name(template_digest: str) -> str:
    return template_digest.split(":", 1)[1]


def build_pack(plaintexts: Iterable[bytes], *, level: int = PACK_ZSTD_LEVEL) -> tuple[bytes, list[int]]:
    """The bytes of a pack of ``plaintexts`` (one zstd frame each, in order) and
    each frame's size in bytes."""
    compressor = zstandard.ZstdCompressor(level=level, write_content_size=True)
    frames = [compressor.compress(p) for p in plaintexts]
    return b"".join(frames), [len(f) for f in frames]


def load_profile(store: Store, template_digest: str) -> PrefetchProfile | None:
    """The published profile of ``template_digest``, or None (none, or
    unreadable, or past the limits of :mod:`weenv.formats.limits`: logged).
    Raises :class:`StoreUnavailableError` when the store does not answer."""
    try:
        digest = store.get_ref(REF_KIND, ref_name(template_digest))
        profile = PrefetchProfile.model_validate_json(store.get_manifest(digest))
    except NotFoundError:
        return None
    except StoreUnavailableError:  # not known either way: the caller may ask again later
        raise
    except (ValueError, WeenvError) as exc:
        log.warning("prefetch profile of %s unreadable: %s", template_digest, exc)
        return None
    return profile if profile.template == template_digest else None


def publish_profile(store: Store, profile: PrefetchProfile) -> str:
    """Store ``profile`` and point ``prefetch/<hex>`` at it; return its digest.
    Its pack, if any, must be stored first (:meth:`Store.put_pack`).  A profile
    whose carried group manifests (escaped once more inside its JSON) would take
    it past the store's :data:`MAX_MANIFEST_BYTES` is published without them
    (a node reading it fetches them from the store, as for an older profile)."""
    data = canonical_json(profile)
    if len(data) > MAX_MANIFEST_BYTES and profile.manifests:
        log.info(
            "prefetch profile of %s: %d bytes with its group manifests, published without them",
            profile.template,
            len(data),
        )
        data = canonical_json(profile.model_copy(update={"manifests": {}}))
    digest = store.put_manifest(data)
    store.set_ref(REF_KIND, ref_name(profile.template), digest)
    return digest
