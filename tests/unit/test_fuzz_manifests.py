"""Fuzzed store content: group and template manifests, prefetch profiles and
their packs, and chunk frames are refused with weenv's own errors on any bytes
(no ``KeyError``, ``UnicodeDecodeError``, ``RecursionError``, zstd errors,
``MemoryError``, no hang).

Seeds are real: a small group built here (its manifest, its chunks' zstd
frames), a template over it, and a prefetch profile with a pack of those
frames (:mod:`weenv.packaging.profile`); then mutated (:mod:`fuzzing`)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
from fuzzing import corpus, expect_only, fuzz_settings, json_mutated, mutated
from hypothesis import given
from hypothesis import strategies as st

from weenv.errors import WeenvError
from weenv.formats.manifest import (
    canonical_json,
    manifest_kind,
    parse_group_manifest,
    parse_template_manifest,
)
from weenv.node.data.cache import ChunkCache
from weenv.packaging.group import build_group
from weenv.packaging.profile import (
    REF_KIND,
    PrefetchPack,
    PrefetchProfile,
    build_pack,
    load_profile,
    ref_name,
)
from weenv.packaging.template import create_template
from weenv.store.base import decode_frame
from weenv.store.file import FileStore

pytestmark = pytest.mark.timeout(120)


class Seeds:
    """A store holding one small group, a template over it and that template's
    prefetch profile with a pack: the bytes the fuzzing starts from."""

    def __init__(self, root: Path):
        src = root / "src"
        (src / "app").mkdir(parents=True)
        (src / "app" / "main.py").write_text("print('hello')\n" * 400)
        (src / "app" / "data.bin").write_bytes(bytes(range(256)) * 64)
        self.store = FileStore(root / "store")
        built = build_group(src, self.store, name="g", chunk_size=4096)
        self.group = canonical_json(built.manifest)
        self.template_digest, template = create_template(self.store, "t", ["g"])
        self.template = canonical_json(template)
        refs = built.manifest.chunks
        self.plaintexts = [self.store.get_chunk(r.digest) for r in refs]
        self.frames = [self.store._get("chunks", r.digest) for r in refs]
        pack, sizes = build_pack(self.plaintexts)
        self.pack = pack
        profile = PrefetchProfile(
            template=self.template_digest,
            groups=[built.digest],
            chunks=[(0, i) for i in range(len(refs))],
            refs=refs,
            pack=PrefetchPack(digest=self.store.put_pack(pack), frames=sizes),
            manifests={built.digest: self.group.decode()},
            window_s=1.5,
        )
        self.profile = canonical_json(profile)
        self.refs = refs


@pytest.fixture(scope="module")
def seeds():
    root = Path(tempfile.mkdtemp(prefix="weenv-fuzz-manifests-"))
    yield Seeds(root)
    shutil.rmtree(root)


def _seed_bytes() -> Seeds:
    """The seeds, built once at import for the strategies (hypothesis draws from them)."""
    root = Path(tempfile.mkdtemp(prefix="weenv-fuzz-seeds-"))
    try:
        return Seeds(root)
    finally:
        shutil.rmtree(root)


SEEDS = _seed_bytes()
DOCUMENTS = [SEEDS.group, SEEDS.template, SEEDS.profile, *corpus("manifest")]


@fuzz_settings(300)
@given(data=json_mutated(DOCUMENTS))
def test_manifest_parsers_raise_only_weenv_errors(data):
    for parse in (parse_group_manifest, parse_template_manifest, manifest_kind):
        with expect_only(WeenvError):
            parse(data)


@fuzz_settings(150)
@given(profile=json_mutated([SEEDS.profile]), pack=mutated([SEEDS.pack], max_ops=3) | st.just(SEEDS.pack))
def test_prefetch_profile_and_pack_are_read_or_refused_with_weenv_errors(seeds, profile, pack):
    """A profile as a node loads it (:func:`load_profile`: a profile or None),
    then its pack cut into frames and each cached as a prefetch worker does
    (:meth:`ChunkCache.put_frame`): a bad frame is a DigestMismatchError."""
    store = seeds.store
    store.set_ref(REF_KIND, ref_name(seeds.template_digest), store.put_manifest(profile))
    loaded = load_profile(store, seeds.template_digest)
    if loaded is None or loaded.pack is None or not loaded.refs:
        return
    cache_root = Path(tempfile.mkdtemp(prefix="cache-", dir=store.root))
    try:
        cache = ChunkCache(cache_root, store, max_bytes=64 << 20)
        at = 0
        for ref, size in zip(loaded.refs, loaded.pack.frames):
            frame, at = pack[at : at + size], at + size
            with expect_only(WeenvError):
                cache.put_frame(ref, frame)
    finally:
        shutil.rmtree(cache_root)


@fuzz_settings(300)
@given(
    frame=mutated(SEEDS.frames + [SEEDS.pack], max_ops=4),
    which=st.integers(0, len(SEEDS.refs) - 1),
    sized=st.booleans(),
)
def test_chunk_decoder_raises_only_weenv_errors(frame, which, sized):
    ref = SEEDS.refs[which]
    with expect_only(WeenvError):
        decode_frame(ref.digest, frame, size=ref.size if sized else None)
