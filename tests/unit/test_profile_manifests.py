"""A prefetch profile carries its group manifests (issue 18, the manifests
phase of a cold start): a node holding the profile reads only the template's
manifest from the store; a carried manifest whose bytes do not match its
digest is never used (the store's is fetched); profiles written before the
field stay readable; the profile's own checks refuse manifests of groups it
does not name and more than its bound."""

from __future__ import annotations

import pytest

from weenv.formats.manifest import (
    ChunkRef,
    GroupManifest,
    RuntimeConfig,
    TemplateManifest,
    canonical_json,
    sha256_digest,
)
from weenv.node.manifests import KnownNames, NodeManifests
from weenv.node.resolver import Resolver
from weenv.packaging import profile as P
from weenv.packaging.profile import PrefetchProfile, carried_manifests
from weenv.store.file import FileStore


class CountingStore(FileStore):
    """A file store that logs the manifests it is asked for."""

    def __init__(self, root):
        super().__init__(root)
        self.reads: list[str] = []

    def get_manifest(self, digest: str) -> bytes:
        self.reads.append(digest)
        return super().get_manifest(digest)


def _group(i: int) -> GroupManifest:
    data = bytes([i]) * 4096
    chunk = ChunkRef(
        digest=sha256_digest(data), size=len(data), stored_size=len(data), stored_digest=sha256_digest(b"z" + data)
    )
    return GroupManifest(name=f"g{i}", version="1", image_size=4096, chunk_size=4096, chunks=[chunk], file_count=1)


def _template(store) -> tuple[str, list[tuple[str, GroupManifest]]]:
    groups = [(store.put_manifest(canonical_json(m)), m) for m in (_group(1), _group(2))]
    t = TemplateManifest(name="t", version="1", groups=[d for d, _m in groups], runtime=RuntimeConfig(command=["sh"]))
    return store.put_manifest(canonical_json(t)), groups


def _profile(digest: str, groups, manifests: dict[str, str]) -> PrefetchProfile:
    return PrefetchProfile(
        template=digest,
        groups=[d for d, _m in groups],
        chunks=[(0, 0)],
        refs=[groups[0][1].chunks[0]],
        window_s=0.1,
        manifests=manifests,
    )


def _resolver(tmp_path, store) -> Resolver:
    return Resolver(store, NodeManifests(tmp_path / "known", store), KnownNames(tmp_path / "known", store.url))


def test_a_cold_load_with_the_profile_reads_only_the_template_manifest(tmp_path):
    store = CountingStore(tmp_path / "store")
    digest, groups = _template(store)
    carried = carried_manifests(groups)
    assert list(carried) == [d for d, _m in groups]  # the groups built here serialize back to their digests
    profile = _profile(digest, groups, carried)
    again = PrefetchProfile.model_validate_json(canonical_json(profile))  # as a node reads it from the store
    offered = {d: text.encode() for d, text in again.manifests.items()}

    manifest, got = _resolver(tmp_path / "a", store).load(digest, again.groups, offered)
    assert store.reads == [digest]  # one store read, not three
    assert [g.name for g in got] == ["g1", "g2"] and got == [m for _d, m in groups]

    store.reads.clear()  # without the manifests (a profile of before): each group is read from the store
    _resolver(tmp_path / "b", store).load(digest, again.groups)
    assert sorted(store.reads) == sorted([digest, *again.groups])

    store.reads.clear()  # the template known, its groups not (evicted): they come from the profile too
    resolver = _resolver(tmp_path / "c", store)
    resolver.manifests.template(digest)
    store.reads.clear()
    assert resolver.load(digest, (), offered)[1] == got and store.reads == []


def test_a_forged_carried_manifest_is_never_used(tmp_path):
    store = CountingStore(tmp_path / "store")
    digest, groups = _template(store)
    forged = canonical_json(_group(7)).decode()  # a valid group manifest, under the digest of another
    profile = _profile(digest, groups, {groups[0][0]: forged, groups[1][0]: forged[:-5]})  # and a truncated one
    offered = {d: text.encode() for d, text in profile.manifests.items()}
    resolver = _resolver(tmp_path, store)
    _manifest, got = resolver.load(digest, profile.groups, offered)
    assert [g.name for g in got] == ["g1", "g2"]  # the store's, not the forged ones
    assert sorted(store.reads) == sorted([digest, *profile.groups])
    assert resolver.manifests.adopt(groups[0][0], forged.encode())  # known now (the store's): nothing taken
    assert resolver.manifests.group(groups[0][0]).name == "g1"
    other = tmp_path / "other"
    fresh = NodeManifests(other, store)
    assert not fresh.adopt(groups[0][0], forged.encode()) and not fresh.has(groups[0][0])  # refused, not kept
    assert not fresh.adopt(digest, store.get_manifest(digest))  # a template's bytes are not a group manifest
    assert not fresh.has(digest)


def test_profile_checks_and_older_profiles(tmp_path):
    store = CountingStore(tmp_path / "store")
    digest, groups = _template(store)
    old = _profile(digest, groups, {}).model_dump(mode="json")
    del old["manifests"]  # a profile written before the field
    assert PrefetchProfile.model_validate(old).manifests == {}
    stray = "sha256:" + "5" * 64
    with pytest.raises(ValueError, match="does not name"):
        _profile(digest, groups, {stray: "{}"})


def test_carried_manifests_stay_within_the_bound(monkeypatch, tmp_path):
    store = CountingStore(tmp_path / "store")
    digest, groups = _template(store)
    first = len(canonical_json(groups[0][1]))
    monkeypatch.setattr(P, "MAX_PROFILE_MANIFEST_BYTES", first)
    assert list(carried_manifests(groups)) == [groups[0][0]]  # the second did not fit
    with pytest.raises(ValueError, match="more than"):
        _profile(digest, groups, {d: canonical_json(m).decode() for d, m in groups})
    # a manifest that does not serialize back to its digest (an older writer's) is left out
    assert carried_manifests([("sha256:" + "6" * 64, groups[0][1])]) == {}


def test_a_profile_past_the_store_bound_with_its_manifests_is_published_without_them(monkeypatch, tmp_path):
    """The carried manifests are JSON inside JSON (escaped once more): a profile
    near the bound with them would be refused by the store; it goes without them."""
    store = CountingStore(tmp_path / "store")
    digest, groups = _template(store)
    profile = _profile(digest, groups, carried_manifests(groups))
    bare = len(canonical_json(profile.model_copy(update={"manifests": {}})))
    assert len(canonical_json(profile)) > bare
    monkeypatch.setattr(P, "MAX_MANIFEST_BYTES", bare)
    P.publish_profile(store, profile)
    assert P.load_profile(store, digest).manifests == {}
    monkeypatch.setattr(P, "MAX_MANIFEST_BYTES", 16 << 20)
    P.publish_profile(store, profile)
    assert P.load_profile(store, digest).manifests == profile.manifests
