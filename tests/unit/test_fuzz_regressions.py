"""Inputs the fuzz tests (``test_fuzz_*.py``) found raising something other
than weenv's own errors, each kept as a plain example: it must be refused with
a :class:`~weenv.errors.WeenvError` saying what is wrong."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import re
import tarfile

import pytest

from weenv.errors import InvalidInputError, NotFoundError
from weenv.formats.manifest import parse_group_manifest
from weenv.packaging.importer.source import LayoutDir, TarArchive
from weenv.server.e2b.multipart import write_parts


@pytest.mark.parametrize("version", [[1], {"v": 2}, [None, None]])
def test_a_group_manifest_whose_schema_version_is_a_list_or_object_is_invalid_input(version):
    doc = {"schema_version": version, "name": "g", "image_size": 0, "chunk_size": 4096, "chunks": [], "file_count": 1}
    with pytest.raises(InvalidInputError, match="has schema version"):
        parse_group_manifest(json.dumps(doc).encode())


def test_a_multipart_upload_with_a_boundary_past_256_bytes_is_invalid_input():
    boundary = "b" * 257
    body = f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="f"\r\n\r\nx\r\n--{boundary}--\r\n'

    async def chunks():
        yield body.encode()

    opened = []
    with pytest.raises(InvalidInputError, match="boundary of 257 bytes"):
        asyncio.run(
            write_parts(
                f"multipart/form-data; boundary={boundary}",
                chunks(),
                lambda p: opened.append(p) or (io.BytesIO(), {"path": p}),
                None,
            )
        )
    assert opened == []


def _layout(root, index: dict, manifest: dict | None = None, config: bytes | None = None):
    """An OCI image layout at ``root``: ``index`` (its first manifest's digest
    set to ``manifest``'s), ``manifest`` (its config's to ``config``)."""
    blobs = root / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    (root / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    if config is not None:
        (blobs / hashlib.sha256(config).hexdigest()).write_bytes(config)
        manifest["config"] = {"digest": "sha256:" + hashlib.sha256(config).hexdigest(), "size": len(config)}
    if manifest is not None:
        data = json.dumps(manifest).encode()
        (blobs / hashlib.sha256(data).hexdigest()).write_bytes(data)
        index["manifests"][0].update(digest="sha256:" + hashlib.sha256(data).hexdigest(), size=len(data))
    (root / "index.json").write_text(json.dumps(index))
    return LayoutDir(root)


OCI_MANIFEST = {"mediaType": "application/vnd.oci.image.manifest.v1+json", "layers": []}


@pytest.mark.parametrize(
    "index, manifest, config, words",
    [
        ({"manifests": [1]}, None, None, "manifests is not an array of objects"),
        ({"manifests": [{"annotations": ["x"]}, {}]}, None, None, "holds 2 images"),
        ({"manifests": [{"mediaType": ["x"]}]}, None, None, "mediaType is not a string"),
        (
            {"manifests": [{}]},
            {**OCI_MANIFEST, "layers": [7]},
            b'{"rootfs": {"diff_ids": ["sha256:' + b"0" * 64 + b'"]}}',
            "layer 0's descriptor is not a JSON object",
        ),
        ({"manifests": [{}]}, dict(OCI_MANIFEST), b'{"rootfs": [1]}', "rootfs is not a JSON object"),
        ({"manifests": [{}]}, dict(OCI_MANIFEST), b"[" * 100_000 + b"]" * 100_000, "is not JSON"),
    ],
)
def test_oci_layout_documents_of_the_wrong_shape_are_invalid_input(tmp_path, index, manifest, config, words):
    with pytest.raises(InvalidInputError, match=re.escape(words)):
        _layout(tmp_path / "layout", index, manifest, config).read_image()


@pytest.mark.parametrize(
    "entries, words",
    [
        ([3], "manifest.json is not an array of objects"),
        ([[{}]], "manifest.json is not an array of objects"),
        (None, "bad manifest.json"),
    ],
)
def test_a_docker_archive_manifest_of_the_wrong_shape_is_invalid_input(tmp_path, entries, words):
    data = b"[" * 100_000 + b"]" * 100_000 if entries is None else json.dumps(entries).encode()
    with tarfile.open(tmp_path / "image.tar", "w") as tar:
        info = tarfile.TarInfo("manifest.json")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    with pytest.raises(InvalidInputError, match=re.escape(words)), TarArchive(tmp_path / "image.tar") as source:
        source.read_image()


def test_docker_archive_tags_that_are_not_strings_are_left_out_of_the_error(tmp_path):
    """``RepoTags`` holding a null made the 'no image tagged' message a TypeError."""
    data = json.dumps([{"Config": "c.json", "RepoTags": [None, "img:1"], "Layers": []}]).encode()
    with tarfile.open(tmp_path / "image.tar", "w") as tar:
        info = tarfile.TarInfo("manifest.json")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    with (
        pytest.raises(NotFoundError, match=re.escape("(the archive has: img:1)")),
        TarArchive(tmp_path / "image.tar") as source,
    ):
        source.read_image("img:2")
