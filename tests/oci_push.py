"""Push a directory tree to a registry as a one-layer image, without dockerd.

:func:`push_tree` writes an OCI layout (one uncompressed tar layer of the
tree, numeric owners and xattrs kept; an image config with ``Env``) and
copies it with ``skopeo copy`` to ``docker://ADDRESS/REPOSITORY:TAG`` (TLS off:
the tests' registries are on loopback).  The layer tar is made once per tree
and kept beside the layout.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pytest

from registry_fixture import new_repository


def _blob(layout: Path, data: bytes) -> dict:
    digest = hashlib.sha256(data).hexdigest()
    (layout / "blobs" / "sha256" / digest).write_bytes(data)
    return {"digest": f"sha256:{digest}", "size": len(data)}


def push_tree(
    tree: Path, work: Path, address: str, repository: str, tag: str = "1", env: list[str] | None = None
) -> str:
    """Push ``tree`` as ``ADDRESS/REPOSITORY:TAG``; returns that reference."""
    layout = work / "layout"
    (layout / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
    (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    tar = work / "layer.tar"
    if not tar.exists():
        subprocess.run(["tar", "-C", str(tree), "--xattrs", "--numeric-owner", "-cf", str(tar), "."], check=True)
    h = hashlib.sha256()
    with open(tar, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    layer_digest = h.hexdigest()
    target = layout / "blobs" / "sha256" / layer_digest
    if not target.exists():
        target.hardlink_to(tar)
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Env": env or ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]},
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{layer_digest}"]},
    }
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            **_blob(layout, json.dumps(config).encode()),
        },
        "layers": [
            {
                "mediaType": "application/vnd.oci.image.layer.v1.tar",
                "digest": f"sha256:{layer_digest}",
                "size": tar.stat().st_size,
            }
        ],
    }
    m = _blob(layout, json.dumps(manifest).encode())
    index = {
        "schemaVersion": 2,
        "manifests": [
            {
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                **m,
                "annotations": {"org.opencontainers.image.ref.name": tag},
            }
        ],
    }
    (layout / "index.json").write_text(json.dumps(index))
    reference = f"{address}/{repository}:{tag}"
    subprocess.run(
        ["skopeo", "copy", "--quiet", "--dest-tls-verify=false", f"oci:{layout}:{tag}", f"docker://{reference}"],
        check=True,
        capture_output=True,
    )
    return reference


@pytest.fixture(scope="session")
def e2b_base_image(oci_registry, debian_root, tmp_path_factory):
    """``127.0.0.1:PORT/REPO:1`` in the session's registry: the Debian tree
    (bookworm minbase + python3) as one layer (import it from registry_fixture
    and this module: ``oci_registry``, ``e2b_base_image``)."""
    return push_tree(debian_root, tmp_path_factory.mktemp("base-image"), oci_registry.address, new_repository())
