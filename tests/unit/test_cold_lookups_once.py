"""A batch's cold creates of one template on one node ask the store once, not
once each (``weenv bench cluster``: weenv's placement puts a template's creates
two by two on its nodes, and each create looked its name, its manifests and its
prefetch profile up for itself): the template name's lookup
(weenv.node.resolver.Resolver.resolve), each manifest's fetch
(weenv.node.manifests.NodeManifests) and the profile's lookup
(weenv.node.data.prefetch.Prefetcher.begin_early) are shared by the creates asking
at once; an error of the shared request reaches every one of them."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

from test_manifest_hint import _template as _two_group_template

from weenv.errors import StoreUnavailableError
from weenv.formats.manifest import sha256_digest
from weenv.node.data.cache import ChunkCache
from weenv.node.data.prefetch import Prefetcher
from weenv.node.manifests import KnownNames, NodeManifests
from weenv.node.resolver import Resolver
from weenv.packaging.profile import PrefetchProfile, publish_profile
from weenv.store.file import FileStore

DELAY_S = 0.1
"""Each store request below takes this long: long enough for the other creates to arrive meanwhile."""
CREATES = 4


class SlowStore(FileStore):
    """A file store whose reads take :data:`DELAY_S` and are counted by kind."""

    def __init__(self, root):
        super().__init__(root)
        self.counts: dict[str, int] = {}
        self.fail: type[Exception] | None = None
        self._count_lock = threading.Lock()

    def _slow(self, kind: str) -> None:
        with self._count_lock:
            self.counts[kind] = self.counts.get(kind, 0) + 1
        time.sleep(DELAY_S)
        if self.fail is not None:
            raise self.fail("the store is away")

    def get_manifest(self, digest: str) -> bytes:
        self._slow("manifest")
        return super().get_manifest(digest)

    def get_chunk(self, digest: str, **kw) -> bytes:
        self._slow("chunk")
        return super().get_chunk(digest, **kw)

    def get_ref(self, kind: str, name: str) -> str:  # a template name's resolve, a profile's lookup
        self._slow(kind)
        return super().get_ref(kind, name)


def _template(store: FileStore) -> tuple[str, list[str]]:
    """test_manifest_hint's template of two groups, named ``t`` in the store."""
    digest, groups = _two_group_template(store)
    store.set_ref("templates", "t", digest)
    return digest, groups


def _at_once(fn, n: int = CREATES) -> list:
    with ThreadPoolExecutor(n) as pool:
        return [f.result() for f in [pool.submit(fn) for _ in range(n)]]


def test_cold_creates_at_once_resolve_and_load_a_template_once(tmp_path):
    store = SlowStore(tmp_path / "store")
    digest, groups = _template(store)
    resolver = Resolver(store, NodeManifests(tmp_path / "known", store), KnownNames(tmp_path / "known", store.url))
    store.counts.clear()

    def create() -> list[str]:
        resolved = resolver.resolve("t")
        manifest, group_manifests = resolver.load(resolved.digest)
        return [resolved.digest, *manifest.groups, *(g.name for g in group_manifests)]

    assert _at_once(create) == [[digest, *groups, "g0", "g1"]] * CREATES
    # before: 4 resolves and 12 manifest reads (each create its own)
    assert store.counts == {"templates": 1, "manifest": 3}


def test_the_shared_lookup_s_error_reaches_every_create_and_the_next_asks_again(tmp_path):
    store = SlowStore(tmp_path / "store")
    digest, _groups = _template(store)
    resolver = Resolver(store, NodeManifests(tmp_path / "known", store), KnownNames(tmp_path / "known", store.url))
    store.fail = StoreUnavailableError
    store.counts.clear()

    def create() -> str:
        try:
            resolver.resolve("t")
        except StoreUnavailableError as exc:
            return str(exc)
        return "made"

    answers = _at_once(create)
    assert all("never started it" in a for a in answers), answers  # the node's own message, for each
    assert store.counts == {"templates": 1}

    def load() -> str:
        try:
            resolver.load(digest)
        except StoreUnavailableError:
            return "unavailable"
        return "loaded"

    assert _at_once(load) == ["unavailable"] * CREATES and store.counts == {"templates": 1, "manifest": 1}
    store.fail = None  # nothing of the failed requests stays: the next ones ask again
    assert resolver.resolve("t").digest == digest and resolver.load(digest)[0].name == "t"
    assert store.counts == {"templates": 2, "manifest": 4}


class _NoLazy:
    def read_seq(self):
        return 0

    def first_reads(self, *a):
        return []


def test_cold_creates_at_once_look_the_template_s_profile_up_once(tmp_path):
    store = SlowStore(tmp_path / "store")
    data = b"x" * 4096
    ref = store.put_chunk(data)[0]
    group = "sha256:" + "0" * 64
    digest = sha256_digest(b"a template")
    publish_profile(store, PrefetchProfile(template=digest, groups=[group], chunks=[(0, 0)], refs=[ref], window_s=0.1))
    cache = ChunkCache(tmp_path / "cache", store, max_bytes=1 << 30)
    pf = Prefetcher(cache, store, _NoLazy())
    try:
        store.counts.clear()
        envs = [f"e{i}" for i in range(CREATES)]
        assert all(pf.begin_early(e, digest) for e in envs)
        deadline = time.monotonic() + 10
        while len(pf._early) < CREATES and time.monotonic() < deadline:  # each create's early job starts
            time.sleep(0.01)
        assert sorted(pf._early) == envs
        while not cache.has(ref.digest) and time.monotonic() < deadline:
            time.sleep(0.01)
        # before: a ref and a profile read per create; the chunk once (the cache's own single flight)
        assert store.counts == {"prefetch": 1, "manifest": 1, "chunk": 1}
        assert pf.profile(digest).template == digest
        for e in envs:
            pf.cancel(e)
    finally:
        pf.close()
