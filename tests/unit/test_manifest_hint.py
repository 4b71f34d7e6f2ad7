"""A cold create's manifests (issue 18, cold start under 100 ms): the group
digests the template's prefetch profile names are fetched beside the
template's manifest, not after it (weenv.node.resolver.Resolver.load's
``groups_hint``); a wrong hint changes nothing but its own fetches."""

from __future__ import annotations

import threading
import time

from weenv.formats.manifest import GroupManifest, RuntimeConfig, TemplateManifest, canonical_json
from weenv.node.manifests import KnownNames, NodeManifests
from weenv.node.resolver import Resolver
from weenv.store.file import FileStore

DELAY_S = 0.05
"""Each manifest read of the store below takes this long (a registry round trip, longer)."""


class SlowStore(FileStore):
    """A file store whose manifest reads take :data:`DELAY_S` and are logged: ``(digest, start, end)``."""

    def __init__(self, root):
        super().__init__(root)
        self.reads: list[tuple[str, float, float]] = []
        self._reads_lock = threading.Lock()

    def get_manifest(self, digest: str) -> bytes:
        start = time.monotonic()
        time.sleep(DELAY_S)
        data = super().get_manifest(digest)
        with self._reads_lock:
            self.reads.append((digest, start, time.monotonic()))
        return data


def _template(store: FileStore) -> tuple[str, list[str]]:
    groups = [
        store.put_manifest(
            canonical_json(
                GroupManifest.model_construct(name=f"g{i}", image_size=0, chunk_size=1 << 20, chunks=[], file_count=0)
            )
        )
        for i in range(2)
    ]
    template = TemplateManifest(name="t", version="1", groups=groups, runtime=RuntimeConfig(command=["sh"]))
    return store.put_manifest(canonical_json(template)), groups


def _resolver(tmp_path, store) -> Resolver:
    return Resolver(store, NodeManifests(tmp_path / "known", store), KnownNames(tmp_path / "known", store.url))


def _read(store: SlowStore, digest: str) -> tuple[float, float]:
    return next((start, end) for d, start, end in store.reads if d == digest)


def test_hinted_group_manifests_load_beside_the_template_manifest(tmp_path):
    store = SlowStore(tmp_path / "store")
    digest, groups = _template(store)
    manifest, group_manifests = _resolver(tmp_path / "a", store).load(digest, groups)
    assert list(manifest.groups) == groups and [g.name for g in group_manifests] == ["g0", "g1"]
    _start, template_end = _read(store, digest)
    for g in groups:  # each group's read began before the template's ended: one round trip, not two
        assert _read(store, g)[0] < template_end
    assert len(store.reads) == 3  # nothing fetched twice

    store.reads.clear()  # without a hint the groups wait for the template (what a create did before)
    _resolver(tmp_path / "b", store).load(digest)
    _start, template_end = _read(store, digest)
    assert all(_read(store, g)[0] >= template_end for g in groups)


def test_a_wrong_hint_is_ignored_and_a_known_template_asks_nothing(tmp_path):
    store = SlowStore(tmp_path / "store")
    digest, groups = _template(store)
    missing = "sha256:" + "0" * 64
    resolver = _resolver(tmp_path, store)
    manifest, group_manifests = resolver.load(digest, [missing, groups[1]])
    assert list(manifest.groups) == groups and [g.name for g in group_manifests] == ["g0", "g1"]
    store.reads.clear()
    assert resolver.load(digest, [missing])[0] == manifest  # the node has the template: the hint is not fetched
    assert store.reads == []


class CountingStore(SlowStore):
    """A :class:`SlowStore` that also counts existence checks of manifests."""

    def __init__(self, root):
        super().__init__(root)
        self.checks = 0

    def has_manifest(self, digest: str) -> bool:
        self.checks += 1
        return super().has_manifest(digest)


def test_a_cold_digest_is_checked_by_loading_its_manifest(tmp_path):
    """A template digest whose manifest the node lacks resolves without a
    store round trip of its own (the manifest's fetch, next, is the check: a
    cold create asked twice in a row before); an unknown one still fails, at
    the load, with NotFoundError; a digest the node holds is still asked about."""
    import pytest

    from weenv.errors import NotFoundError

    store = CountingStore(tmp_path / "store")
    digest, _groups = _template(store)
    resolver = _resolver(tmp_path, store)
    assert resolver.resolve(digest).digest == digest and store.checks == 0
    assert resolver.load(digest)[0].name == "t"
    assert resolver.resolve(digest).digest == digest and store.checks == 1  # known: the store confirms it
    missing = "sha256:" + "1" * 64
    assert resolver.resolve(missing).digest == missing
    with pytest.raises(NotFoundError):
        resolver.load(missing)
