"""Fuzzed image documents: an OCI image layout's ``index.json``, manifest and
config, and a ``docker save`` archive's ``manifest.json``, are read or refused
with weenv's own errors on any bytes (no ``AttributeError`` from a list where
an object belongs, ``RecursionError``, ``KeyError``...).

Seeds are a real one-layer image written here in both forms; a mutated
manifest or config is stored under its own digest and the documents naming it
are pointed at it, so the mutation reaches the reader behind the digest check."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import tarfile
import tempfile
from pathlib import Path

import pytest
from fuzzing import expect_only, fuzz_settings, json_mutated
from hypothesis import given
from hypothesis import strategies as st

from weenv.errors import WeenvError
from weenv.packaging.importer.source import LayoutDir, TarArchive

pytestmark = pytest.mark.timeout(120)


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _layer() -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        info = tarfile.TarInfo("hello.txt")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"hi\n"))
    return out.getvalue()


LAYER = _layer()
CONFIG = json.dumps(
    {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Env": ["PATH=/bin"], "Cmd": ["sh"]},
        "rootfs": {"type": "layers", "diff_ids": [_digest(LAYER)]},
    }
).encode()


def _manifest(config: bytes) -> bytes:
    return json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": _digest(config),
                "size": len(config),
            },
            "layers": [
                {"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": _digest(LAYER), "size": len(LAYER)}
            ],
        }
    ).encode()


def _index(manifest: bytes) -> bytes:
    return json.dumps(
        {
            "schemaVersion": 2,
            "manifests": [
                {
                    "mediaType": "application/vnd.oci.image.manifest.v1+json",
                    "digest": _digest(manifest),
                    "size": len(manifest),
                    "annotations": {"org.opencontainers.image.ref.name": "latest"},
                    "platform": {"os": "linux", "architecture": "amd64"},
                }
            ],
        }
    ).encode()


MANIFEST = _manifest(CONFIG)
INDEX = _index(MANIFEST)
DOCKER = json.dumps(
    [{"Config": f"{_digest(CONFIG)[7:]}.json", "RepoTags": ["img:latest"], "Layers": ["layer.tar"]}]
).encode()


@pytest.fixture(scope="module")
def work():
    d = Path(tempfile.mkdtemp(prefix="weenv-fuzz-image-"))
    yield d
    shutil.rmtree(d)


def _layout(root: Path, index: bytes, manifest: bytes, config: bytes) -> Path:
    shutil.rmtree(root, ignore_errors=True)
    blobs = root / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    (root / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    (root / "index.json").write_bytes(index)
    for blob in (manifest, config, LAYER):
        (blobs / _digest(blob)[7:]).write_bytes(blob)
    return root


def _docker(path: Path, manifest: bytes, config: bytes) -> Path:
    with tarfile.open(path, "w") as tar:
        for name, data in (
            ("manifest.json", manifest),
            (f"{_digest(config)[7:]}.json", config),
            (f"{_digest(CONFIG)[7:]}.json", CONFIG),
            ("layer.tar", LAYER),
        ):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


DOCUMENTS = st.one_of(
    json_mutated([INDEX]).map(lambda i: (i, MANIFEST, CONFIG)),
    json_mutated([MANIFEST]).map(lambda m: (_index(m), m, CONFIG)),
    json_mutated([CONFIG]).map(lambda c: (_index(_manifest(c)), _manifest(c), c)),
)


@fuzz_settings(200)
@given(docs=DOCUMENTS, ref=st.sampled_from([None, "latest", "other"]))
def test_oci_layout_documents_are_read_or_refused_with_weenv_errors(work, docs, ref):
    source = LayoutDir(_layout(work / "layout", *docs))
    with expect_only(WeenvError):
        source.read_image(ref)


@fuzz_settings(150)
@given(
    docs=st.one_of(
        json_mutated([DOCKER]).map(lambda m: (m, CONFIG)),
        json_mutated([CONFIG]).map(
            lambda c: (DOCKER.replace(_digest(CONFIG)[7:].encode(), _digest(c)[7:].encode()), c)
        ),
    ),
    ref=st.sampled_from([None, "img:latest"]),
)
def test_docker_archive_manifest_and_config_are_read_or_refused_with_weenv_errors(work, docs, ref):
    with expect_only(WeenvError), TarArchive(_docker(work / "image.tar", *docs)) as source:
        source.read_image(ref)


def test_the_seed_images_read_whole(work):
    assert len(LayoutDir(_layout(work / "layout", INDEX, MANIFEST, CONFIG)).read_image().layers) == 1
    with TarArchive(_docker(work / "image.tar", DOCKER, CONFIG)) as source:
        assert len(source.read_image().layers) == 1
