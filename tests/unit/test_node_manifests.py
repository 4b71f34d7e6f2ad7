"""The node's manifests in memory (weenv.node.manifests.NodeManifests): bounded
by the bytes of their JSON, not by their count (issue 13, finding 13)."""

from __future__ import annotations

import functools
import hashlib
import time

from weenv.formats.limits import MAX_CHUNKS
from weenv.formats.manifest import ChunkRef, GroupManifest, canonical_json
from weenv.node.manifests import MEMORY_MANIFEST_BYTES, NodeManifests
from weenv.store.file import FileStore

CHUNK = 1 << 20


@functools.cache
def _refs(chunks: int) -> list[ChunkRef]:
    return [
        ChunkRef.model_construct(
            digest="sha256:" + hashlib.sha256(b"%d" % i).hexdigest(),
            size=CHUNK,
            stored_size=CHUNK // 2,
            stored_digest="sha256:" + hashlib.sha256(b"s%d" % i).hexdigest(),
        )
        for i in range(chunks)
    ]


def _group(store: FileStore, name: str, chunks: int) -> tuple[str, int]:
    """Store a group manifest ``name`` of ``chunks`` chunk refs; ``(digest, bytes of its JSON)``."""
    data = canonical_json(
        GroupManifest.model_construct(
            name=name, image_size=chunks * CHUNK, chunk_size=CHUNK, chunks=_refs(chunks), file_count=1
        )
    )
    return store.put_manifest(data), len(data)


def test_manifests_in_memory_are_bounded_by_bytes_least_recently_used_go(tmp_path):
    store = FileStore(tmp_path / "store")
    groups = [_group(store, f"g{i}", 100) for i in range(6)]  # ~21 KB of JSON each
    size = groups[0][1]
    nm = NodeManifests(tmp_path / "known", store, memory_bytes=3 * size + size // 2)
    for digest, _size in groups[:3]:
        nm.group(digest)
    assert nm.memory_used == (3, 3 * size)
    nm.group(groups[0][0])  # used again: the most recent
    nm.group(groups[3][0])  # a fourth does not fit: g1, the least recently used, goes
    assert nm.memory_used == (3, 3 * size)
    assert [d for d, _m in nm._cache.items()] == [groups[2][0], groups[0][0], groups[3][0]]
    # what left memory is read back from the node's disk, not the store
    (store.root / "manifests").rename(tmp_path / "store-manifests")
    assert nm.group(groups[1][0]).name == "g1"
    (tmp_path / "store-manifests").rename(store.root / "manifests")
    # a manifest larger than the whole bound is kept alone, until the next one
    nm = NodeManifests(tmp_path / "known", store, memory_bytes=size // 2)
    nm.group(groups[4][0])
    assert nm.memory_used == (1, size)
    nm.group(groups[5][0])
    assert nm.memory_used == (1, size)


def test_five_maximal_group_manifests_are_not_all_kept(tmp_path):
    """64 group manifests of MAX_CHUNKS chunks were kept (~3.3 GB of objects);
    five such (~14 MB of JSON, ~52 MB parsed, each) already pass the default bound."""
    store = FileStore(tmp_path / "store")
    groups = [_group(store, f"big{i}", MAX_CHUNKS) for i in range(5)]
    nm = NodeManifests(tmp_path / "known", store)
    started = time.monotonic()
    for digest, _size in groups:
        assert len(nm.group(digest).chunks) == MAX_CHUNKS
    count, used = nm.memory_used
    assert used <= MEMORY_MANIFEST_BYTES and count == MEMORY_MANIFEST_BYTES // groups[0][1] < 5
    assert time.monotonic() - started < 30
