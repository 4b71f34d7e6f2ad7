"""Where an image comes from: an OCI image layout directory, a tar archive
(``docker save``, or an OCI layout in a tar), or a registry through skopeo.

Formats:

- OCI image layout (image-spec v1.0 ``image-layout.md``): ``oci-layout``,
  ``index.json``, ``blobs/sha256/<hex>``.  The index may point at a manifest or
  at a nested index (``manifest-list``); a nested one is resolved to the
  ``linux`` manifest of this machine's architecture.  Docker's media types
  (``application/vnd.docker.distribution.manifest.v2+json``, ``...list.v2+json``,
  ``...rootfs.diff.tar.gzip``) are read like their OCI twins.
- ``docker save`` archive (Docker's "legacy" image archive, ``manifest.json``:
  ``[{"Config": PATH, "RepoTags": [...], "Layers": [PATH, ...]}]``).  An
  archive that holds ``oci-layout`` (Docker >= 25, ``skopeo copy ...
  oci-archive:``) is read as an OCI layout.  The archive itself may be gzip-,
  bzip2- or xz-compressed.
- ``docker://HOST[:PORT]/REPO[:TAG|@DIGEST]``: copied with Debian's ``skopeo
  copy`` into an OCI layout in a temporary directory first.  Loopback hosts
  (``localhost``, ``127.0.0.0/8``, ``[::1]``) are reached without TLS
  verification, as Docker does; others only with ``insecure=True``.

Verification: every blob read (index, manifest, config, layer) is checked
against its descriptor's size and sha256 (:class:`DigestMismatchError`); each
layer's uncompressed stream is also checked against the config's
``rootfs.diff_ids`` (the only check a ``docker save`` layer has).  A missing or
unreadable blob, a truncated archive, a bad JSON document or an unsupported
media type or digest algorithm is an :class:`InvalidInputError`.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import ipaddress
import json
import os
import platform
import posixpath
import re
import shutil
import subprocess
import tarfile
import tempfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import IO, Any

import httpx

from weenv.config import settings
from weenv.errors import (
    DigestMismatchError,
    InvalidInputError,
    NotFoundError,
    RuntimeFailedError,
    ToolMissingError,
)
from weenv.formats.limits import MAX_IMAGE_JSON_BYTES

SKOPEO = "skopeo"
MAX_JSON_BYTES = MAX_IMAGE_JSON_BYTES
"""A manifest, index or config larger than this (bytes) is refused (:mod:`weenv.formats.limits`)."""

INDEX_TYPES = {
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
}
MANIFEST_TYPES = {
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
}
LAYER_TYPES = {
    "application/vnd.oci.image.layer.v1.tar",
    "application/vnd.oci.image.layer.v1.tar+gzip",
    "application/vnd.oci.image.layer.v1.tar+zstd",
    "application/vnd.oci.image.layer.nondistributable.v1.tar",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd",
    "application/vnd.docker.image.rootfs.diff.tar",
    "application/vnd.docker.image.rootfs.diff.tar.gzip",
    "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip",
}
REF_NAME_ANNOTATION = "org.opencontainers.image.ref.name"
_DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}\Z")
_ARCH = {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm", "ppc64le": "ppc64le", "s390x": "s390x"}


@dataclass(frozen=True)
class Layer:
    """One layer of an image, bottom to top."""

    index: int
    diff_id: str
    """sha256 of the uncompressed tar (from the config's ``rootfs.diff_ids``)."""
    digest: str | None
    """sha256 of the blob as stored (compressed); ``None`` for a ``docker save`` layer."""
    size: int | None
    """Bytes of the blob as stored, if the manifest says."""
    media_type: str
    location: str
    """Where the blob is: a path in the layout or archive."""


@dataclass
class Image:
    """An image's config and layers, read and verified from an :class:`ImageSource`."""

    reference: str
    """What was imported (path, ``docker://`` reference), for provenance."""
    config: dict[str, Any]
    config_digest: str
    manifest_digest: str | None
    layers: list[Layer] = field(default_factory=list)


def check_blob_digest(digest: str, what: str) -> str:
    if not isinstance(digest, str) or not _DIGEST_RE.match(digest):
        raise InvalidInputError(f"{what}: unsupported or malformed digest {digest!r} (want sha256:<64 hex>)")
    return digest


class ImageSource(contextlib.AbstractContextManager):
    """Blobs of one image source.  Subclasses implement :meth:`_open` and :meth:`read_image`."""

    reference: str

    def read_image(self, ref: str | None = None) -> Image:  # pragma: no cover - abstract
        raise NotImplementedError

    def _open(self, location: str) -> IO[bytes]:  # pragma: no cover - abstract
        raise NotImplementedError

    def blob_size(self, location: str) -> int:
        """Bytes of the blob at ``location``; :class:`InvalidInputError` if missing."""
        try:
            return self._size(location)
        except (FileNotFoundError, KeyError) as exc:
            raise InvalidInputError(f"{self.reference}: blob {location} is missing") from exc

    def _size(self, location: str) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    def close(self) -> None:
        pass

    def release(self, location: str) -> None:
        """The blob at ``location`` will not be read again: a source holding a
        copy of its own may free it (a registry image's), others keep theirs."""

    def __exit__(self, *exc) -> None:
        self.close()

    @contextlib.contextmanager
    def open_blob(self, location: str, what: str) -> Iterator[IO[bytes]]:
        """The blob at ``location`` as a binary stream; :class:`InvalidInputError`
        if it is missing or unreadable."""
        try:
            f = self._open(location)
        except (FileNotFoundError, KeyError) as exc:
            raise InvalidInputError(f"{self.reference}: {what} is missing ({location})") from exc
        except (OSError, tarfile.TarError, EOFError) as exc:
            raise InvalidInputError(f"{self.reference}: cannot read {what} ({location}): {exc}") from exc
        with f:
            yield f

    def read_json(
        self, location: str, what: str, *, digest: str | None = None, size: int | None = None
    ) -> tuple[dict[str, Any], str]:
        """Parse the JSON blob at ``location``; verify ``size`` and ``digest`` if
        given.  Returns ``(document, sha256 digest of its bytes)``."""
        with self.open_blob(location, what) as f:
            try:
                data = f.read(MAX_JSON_BYTES + 1)
            except (OSError, tarfile.TarError, EOFError) as exc:
                raise InvalidInputError(f"{self.reference}: cannot read {what}: {exc}") from exc
        if len(data) > MAX_JSON_BYTES:
            raise InvalidInputError(f"{self.reference}: {what} is larger than {MAX_JSON_BYTES} bytes")
        actual = "sha256:" + hashlib.sha256(data).hexdigest()
        if size is not None and len(data) != size:
            raise DigestMismatchError(f"{self.reference}: {what} has {len(data)} bytes, its descriptor says {size}")
        if digest is not None and actual != digest:
            raise DigestMismatchError(f"{self.reference}: {what} has digest {actual}, expected {digest}")
        try:
            doc = json.loads(data)
        except (ValueError, RecursionError) as exc:  # RecursionError: arrays nested too deep
            raise InvalidInputError(f"{self.reference}: {what} is not JSON: {exc}") from exc
        if not isinstance(doc, dict):
            raise InvalidInputError(f"{self.reference}: {what} is not a JSON object")
        return doc, actual


# --- OCI image layout -----------------------------------------------------------------
class _LayoutMixin:
    """Reading an OCI image layout whose files are opened through ``self.read_json``."""

    reference: str

    def _read_layout(self, ref: str | None) -> Image:
        index, _ = self.read_json("index.json", "index.json")  # type: ignore[attr-defined]
        desc = _select_manifest(index, ref, self.reference)
        for _depth in range(4):
            media_type = _text(desc.get("mediaType", ""), f"{self.reference}: a descriptor's mediaType")
            digest = check_blob_digest(desc.get("digest"), f"{self.reference}: descriptor")
            doc, _ = self.read_json(  # type: ignore[attr-defined]
                _blob_path(digest),
                f"{media_type or 'manifest'} {digest}",
                digest=digest,
                size=desc.get("size"),
            )
            media_type = media_type or _text(doc.get("mediaType", ""), f"{self.reference}: {digest}'s mediaType")
            if media_type in INDEX_TYPES or (not media_type and "manifests" in doc):
                desc = _select_platform(doc, self.reference)
                continue
            if media_type not in MANIFEST_TYPES and not (not media_type and "layers" in doc):
                raise InvalidInputError(f"{self.reference}: unsupported manifest media type {media_type!r}")
            return self._image_from_manifest(doc, digest)
        raise InvalidInputError(f"{self.reference}: indexes nested too deeply")

    def _image_from_manifest(self, manifest: dict, manifest_digest: str) -> Image:
        cdesc = _object(manifest.get("config") or {}, f"{self.reference}: manifest {manifest_digest}'s config")
        cdigest = check_blob_digest(cdesc.get("digest"), f"{self.reference}: config descriptor")
        config, _ = self.read_json(  # type: ignore[attr-defined]
            _blob_path(cdigest), f"config {cdigest}", digest=cdigest, size=cdesc.get("size")
        )
        layer_descs = manifest.get("layers")
        if not isinstance(layer_descs, list):
            raise InvalidInputError(f"{self.reference}: manifest {manifest_digest} has no layer list")
        diff_ids = _diff_ids(config, len(layer_descs), self.reference)
        layers = []
        for i, (d, diff_id) in enumerate(zip(layer_descs, diff_ids)):
            d = _object(d, f"{self.reference}: layer {i}'s descriptor")
            digest = check_blob_digest(d.get("digest"), f"{self.reference}: layer {i}")
            media_type = _text(
                d.get("mediaType", "application/vnd.oci.image.layer.v1.tar"), f"{self.reference}: layer {i}'s mediaType"
            )
            if media_type not in LAYER_TYPES:
                raise InvalidInputError(f"{self.reference}: layer {i} has unsupported media type {media_type!r}")
            layers.append(Layer(i, diff_id, digest, d.get("size"), media_type, _blob_path(digest)))
        return Image(self.reference, config, cdigest, manifest_digest, layers)


def _blob_path(digest: str) -> str:
    algorithm, hexdigest = digest.split(":", 1)
    return f"blobs/{algorithm}/{hexdigest}"


def _object(value: Any, what: str) -> dict:
    """``value`` if it is a JSON object, else :class:`InvalidInputError` naming ``what``."""
    if not isinstance(value, dict):
        raise InvalidInputError(f"{what} is not a JSON object")
    return value


def _text(value: Any, what: str) -> str:
    """``value`` if it is a JSON string, else :class:`InvalidInputError` naming ``what``."""
    if not isinstance(value, str):
        raise InvalidInputError(f"{what} is not a string")
    return value


def _objects(value: Any, what: str) -> list[dict]:
    """``value`` if it is a JSON array of objects, else :class:`InvalidInputError` naming ``what``."""
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise InvalidInputError(f"{what} is not an array of objects")
    return value


def _ref_name(descriptor: dict) -> str:
    """A descriptor's ``org.opencontainers.image.ref.name`` annotation ("?" if none)."""
    annotations = descriptor.get("annotations")
    name = annotations.get(REF_NAME_ANNOTATION, "?") if isinstance(annotations, dict) else "?"
    return name if isinstance(name, str) else "?"


def _repo_tags(entry: dict) -> list[str]:
    """A ``docker save`` manifest entry's ``RepoTags`` (those that are strings)."""
    tags = entry.get("RepoTags")
    return [t for t in tags if isinstance(t, str)] if isinstance(tags, list) else []


def _select_manifest(index: dict, ref: str | None, where: str) -> dict:
    manifests = index.get("manifests")
    if not isinstance(manifests, list) or not manifests:
        raise InvalidInputError(f"{where}: index.json lists no manifests")
    manifests = _objects(manifests, f"{where}: index.json's manifests")
    if ref is not None:
        found = [m for m in manifests if _ref_name(m) == ref]
        if not found:
            names = sorted({_ref_name(m) for m in manifests})
            raise NotFoundError(f"{where}: no image named {ref!r} (the layout has: {', '.join(names)})")
        return found[0]
    if len(manifests) > 1:
        names = sorted({_ref_name(m) for m in manifests})
        raise InvalidInputError(f"{where} holds {len(manifests)} images; choose one with --ref ({', '.join(names)})")
    return manifests[0]


def _select_platform(index: dict, where: str) -> dict:
    arch = _ARCH.get(platform.machine(), platform.machine())
    manifests = _objects(index.get("manifests") or [], f"{where}: the image index's manifests")
    for m in manifests:
        p = m.get("platform")
        p = p if isinstance(p, dict) else {}
        if p.get("os", "linux") == "linux" and p.get("architecture") == arch:
            return m
    if len(manifests) == 1:
        return manifests[0]
    raise NotFoundError(f"{where}: the image index has no linux/{arch} manifest")


def _diff_ids(config: dict, count: int, where: str) -> list[str]:
    rootfs = _object(config.get("rootfs") or {}, f"{where}: the config's rootfs")
    diff_ids = rootfs.get("diff_ids")
    if not isinstance(diff_ids, list) or len(diff_ids) != count:
        raise InvalidInputError(
            f"{where}: the config lists {len(diff_ids) if isinstance(diff_ids, list) else 'no'} "
            f"diff_ids for {count} layers"
        )
    return [check_blob_digest(d, f"{where}: diff_id") for d in diff_ids]


class LayoutDir(_LayoutMixin, ImageSource):
    """An OCI image layout directory."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self.reference = str(self.path)
        if not (self.path / "oci-layout").is_file():
            raise InvalidInputError(f"{self.path} is not an OCI image layout (no oci-layout file)")

    def _open(self, location: str) -> IO[bytes]:
        target = (self.path / location).resolve()
        if self.path.resolve() not in target.parents:
            raise InvalidInputError(f"{self.reference}: blob path {location!r} leaves the layout")
        return open(target, "rb")

    def _size(self, location: str) -> int:
        return (self.path / location).stat().st_size

    def read_image(self, ref: str | None = None) -> Image:
        return self._read_layout(ref)


# --- tar archives -----------------------------------------------------------------------
class TarArchive(_LayoutMixin, ImageSource):
    """A ``docker save`` archive, or an OCI layout in a tar (possibly compressed)."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self.reference = str(self.path)
        try:
            self._tar = tarfile.open(self.path, "r:*")
        except (tarfile.TarError, EOFError, OSError) as exc:
            raise InvalidInputError(f"{self.path} is not a readable tar archive: {exc}") from exc
        try:
            self._members = {}
            for m in self._tar:
                self._members[_clean_member_name(m.name)] = m
        except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:
            self._tar.close()
            raise InvalidInputError(f"{self.path}: truncated or corrupt archive: {exc}") from exc

    def close(self) -> None:
        self._tar.close()

    def _member(self, location: str) -> tarfile.TarInfo:
        member = self._members[_clean_member_name(location)]
        if member.issym() or member.islnk():
            # docker save links identical layers; follow within the archive only.
            if member.issym():
                target = posixpath.normpath(posixpath.join(posixpath.dirname(member.name), member.linkname))
            else:
                target = member.linkname
            member = self._members[_clean_member_name(target)]
        return member

    def _size(self, location: str) -> int:
        return self._member(location).size

    def _open(self, location: str) -> IO[bytes]:
        member = self._member(location)
        if not member.isfile():
            raise InvalidInputError(f"{self.reference}: {location} is not a file in the archive")
        f = self._tar.extractfile(member)
        if f is None:  # pragma: no cover - isfile() above
            raise InvalidInputError(f"{self.reference}: cannot read {location}")
        return f

    def read_image(self, ref: str | None = None) -> Image:
        if "oci-layout" in self._members and "index.json" in self._members:
            return self._read_layout(ref)
        if "manifest.json" in self._members:
            return self._read_docker(ref)
        raise InvalidInputError(
            f"{self.reference} is neither a docker save archive (manifest.json) nor an OCI layout (oci-layout)"
        )

    def _read_docker(self, ref: str | None) -> Image:
        with self.open_blob("manifest.json", "manifest.json") as f:
            try:
                data = f.read(MAX_JSON_BYTES + 1)
                if len(data) > MAX_JSON_BYTES:
                    raise InvalidInputError(f"{self.reference}: manifest.json is larger than {MAX_JSON_BYTES} bytes")
                entries = json.loads(data)
            except (ValueError, RecursionError, OSError, tarfile.TarError, EOFError) as exc:
                raise InvalidInputError(f"{self.reference}: bad manifest.json: {exc}") from exc
        if not isinstance(entries, list) or not entries:
            raise InvalidInputError(f"{self.reference}: manifest.json lists no image")
        entries = _objects(entries, f"{self.reference}: manifest.json")
        if ref is not None:
            chosen = [e for e in entries if ref in _repo_tags(e)]
            if not chosen:
                tags = sorted(t for e in entries for t in _repo_tags(e))
                raise NotFoundError(f"{self.reference}: no image tagged {ref!r} (the archive has: {', '.join(tags)})")
            entry = chosen[0]
        elif len(entries) > 1:
            tags = sorted(t for e in entries for t in _repo_tags(e))
            raise InvalidInputError(
                f"{self.reference} holds {len(entries)} images; choose one with --ref ({', '.join(tags)})"
            )
        else:
            entry = entries[0]
        config_path = entry.get("Config")
        layer_paths = entry.get("Layers")
        if not isinstance(config_path, str) or not isinstance(layer_paths, list):
            raise InvalidInputError(f"{self.reference}: manifest.json entry lacks Config or Layers")
        # The config's file name is its sha256 (``<hex>.json``, or blobs/sha256/<hex>).
        stem = PurePosixPath(config_path).name.removesuffix(".json")
        expected = f"sha256:{stem}" if re.fullmatch(r"[0-9a-f]{64}", stem) else None
        config, cdigest = self.read_json(config_path, "config", digest=expected)
        diff_ids = _diff_ids(config, len(layer_paths), self.reference)
        layers = [
            Layer(i, diff_id, None, None, "application/vnd.docker.image.rootfs.diff.tar", str(path))
            for i, (path, diff_id) in enumerate(zip(layer_paths, diff_ids))
        ]
        return Image(self.reference, config, cdigest, None, layers)


def _clean_member_name(name: str) -> str:
    while name.startswith("./"):
        name = name[2:]
    return name.strip("/")


# --- registries (skopeo) -------------------------------------------------------------
def _is_loopback(host: str) -> bool:
    host = host.rsplit(":", 1)[0] if not host.startswith("[") else host[1 : host.index("]")]
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class RegistryImage(_LayoutMixin, ImageSource):
    """``docker://HOST/REPO:TAG`` copied by ``skopeo copy`` into a temporary OCI
    layout (removed on close)."""

    def __init__(self, reference: str, *, insecure: bool = False, timeout: float = 1800):
        if not reference.startswith("docker://") or "/" not in reference[len("docker://") :]:
            raise InvalidInputError(f"not a registry reference: {reference!r} (want docker://HOST/REPO:TAG)")
        self.reference = reference
        program = shutil.which(SKOPEO)
        if program is None:
            raise ToolMissingError("skopeo is not installed (apt-get install skopeo)")
        host = reference[len("docker://") :].split("/", 1)[0]
        self._tmp = Path(tempfile.mkdtemp(prefix="weenv-import-"))
        argv = [program, "copy", "--quiet"]
        if insecure or _is_loopback(host):
            argv.append("--src-tls-verify=false")
        argv += [reference, f"oci:{self._tmp / 'layout'}:image"]
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, errors="replace", timeout=timeout, check=False)
        except subprocess.TimeoutExpired as exc:
            self.close()
            raise RuntimeFailedError(f"skopeo copy {reference} ran past {timeout} s") from exc
        except BaseException:
            self.close()
            raise
        if proc.returncode != 0:
            self.close()
            tail = "\n".join(proc.stderr.strip().splitlines()[-6:])
            if "manifest unknown" in tail or "name unknown" in tail or "not found" in tail:
                raise NotFoundError(f"{reference}: no such image in the registry:\n{tail}")
            raise RuntimeFailedError(f"skopeo copy {reference} failed (exit {proc.returncode}):\n{tail}")
        self._layout = LayoutDir(self._tmp / "layout")
        self._layout.reference = reference

    def _open(self, location: str) -> IO[bytes]:
        return self._layout._open(location)

    def read_image(self, ref: str | None = None) -> Image:
        return self._read_layout("image")

    def release(self, location: str) -> None:
        """Remove the copied blob (the import streams each layer once)."""
        with contextlib.suppress(OSError):
            (self._tmp / "layout" / location).unlink()

    def close(self) -> None:
        shutil.rmtree(self._tmp, ignore_errors=True)


class _NoDirectPull(Exception):
    """The registry wants what :class:`RegistryStream` does not do (authentication)."""


class _HttpBlob(io.RawIOBase):
    """A registry answer's body as a readable binary stream (``read(n)``)."""

    def __init__(self, response: httpx.Response):
        self._response = response
        self._pieces = response.iter_raw(1 << 20)
        self._buf, self._pos = b"", 0

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            out = self._buf[self._pos :] + b"".join(self._pieces)
            self._buf, self._pos = b"", 0
            return out
        if self._pos >= len(self._buf):
            self._buf, self._pos = next(self._pieces, b""), 0
        if len(self._buf) - self._pos >= n:
            out = self._buf[self._pos : self._pos + n]
            self._pos += n
            return out
        out = bytearray(self._buf[self._pos :])
        while len(out) < n:
            piece = next(self._pieces, b"")
            if not piece:
                break
            out += piece
        self._buf, self._pos = bytes(out[n:]), 0
        return bytes(out[:n])

    def close(self) -> None:
        self._response.close()
        super().close()


class RegistryStream(_LayoutMixin, ImageSource):
    """``docker://HOST/REPO:TAG`` on a loopback registry read over plain HTTP
    (registry API v2, ``distribution-spec``), each blob streamed once and never
    written to disk.  The manifest named by the tag appears as a one-entry
    ``index.json``; other locations (``blobs/sha256/HEX``) are fetched from
    ``/v2/REPO/blobs/`` (or ``/manifests/`` for a manifest of an index).  A
    registry asking for authentication is left to :class:`RegistryImage`
    (skopeo) by :func:`open_source`."""

    def __init__(self, reference: str, *, timeout: float = 60.0):
        self.reference = reference
        rest = reference[len("docker://") :]
        self._host, path = rest.split("/", 1)
        if "@" in path:
            self._repo, self._tag = path.split("@", 1)
        else:
            self._repo, _, self._tag = path.rpartition(":") if ":" in path.rsplit("/", 1)[-1] else (path, "", "latest")
        self._client = httpx.Client(base_url=f"http://{self._host}", timeout=timeout)
        self._manifests: dict[str, bytes] = {}

    def _get(self, kind: str, name: str, accept: bool) -> httpx.Response:
        headers = {"Accept": ", ".join(sorted(INDEX_TYPES | MANIFEST_TYPES))} if accept else {}
        try:
            r = self._client.send(
                self._client.build_request("GET", f"/v2/{self._repo}/{kind}/{name}", headers=headers), stream=True
            )
        except httpx.HTTPError as exc:
            raise _NoDirectPull(str(exc)) from exc
        if r.status_code == 401:
            r.close()
            raise _NoDirectPull("the registry asks for authentication")
        return r

    def _manifest(self, name: str) -> bytes:
        r = self._get("manifests", name, True)
        try:
            if r.status_code == 404:
                raise NotFoundError(f"{self.reference}: no such image in the registry ({name})")
            if r.status_code != 200:
                raise RuntimeFailedError(f"{self.reference}: the registry answered {r.status_code} for {name}")
            data = _HttpBlob(r).read(MAX_JSON_BYTES + 1)
        finally:
            r.close()
        if len(data) > MAX_JSON_BYTES:
            raise InvalidInputError(f"{self.reference}: manifest {name} is larger than {MAX_JSON_BYTES} bytes")
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        self._manifests[digest] = data
        self._manifest_type = r.headers.get("content-type", "").split(";")[0]
        return data

    def read_image(self, ref: str | None = None) -> Image:
        data = self._manifest(self._tag)
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        if self._tag.startswith("sha256:") and digest != self._tag:
            raise DigestMismatchError(f"{self.reference}: the registry's manifest has digest {digest}")
        desc = {"digest": digest, "size": len(data)}
        if self._manifest_type in INDEX_TYPES | MANIFEST_TYPES:
            desc["mediaType"] = self._manifest_type
        self._index = json.dumps({"schemaVersion": 2, "manifests": [desc]}).encode()
        return self._read_layout(None)

    def _open(self, location: str) -> IO[bytes]:
        if location == "index.json":
            return io.BytesIO(self._index)
        digest = location.replace("blobs/", "", 1).replace("/", ":", 1)
        if digest in self._manifests:
            return io.BytesIO(self._manifests[digest])
        r = self._get("blobs", digest, False)
        if r.status_code == 404:
            r.close()
            with contextlib.suppress(NotFoundError):
                return io.BytesIO(self._manifest(digest))  # a manifest of an index
            raise FileNotFoundError(location)
        if r.status_code != 200:
            r.close()
            raise OSError(f"the registry answered {r.status_code}")
        return _HttpBlob(r)

    def _size(self, location: str) -> int:
        raise FileNotFoundError(location)  # layers always carry their size in the manifest

    def close(self) -> None:
        self._client.close()


def open_source(source: str, *, insecure: bool = False) -> ImageSource:
    """The :class:`ImageSource` for ``source``: ``docker://...``, a directory (OCI
    layout) or a file (tar archive).  Raises :class:`NotFoundError` if the path
    does not exist, :class:`InvalidInputError` if it is neither."""
    if source.startswith("docker://"):
        rest = source[len("docker://") :]
        if "/" in rest and _is_loopback(rest.split("/", 1)[0]) and not settings().build.import_skopeo:
            stream = RegistryStream(source)
            try:
                stream.read_image()
                return stream
            except _NoDirectPull:
                stream.close()
            except BaseException:
                stream.close()
                raise
        return RegistryImage(source, insecure=insecure)
    if "://" in source:
        raise InvalidInputError(f"unsupported image source {source!r} (a path or docker://HOST/REPO:TAG)")
    path = Path(source)
    if path.is_dir():
        return LayoutDir(path)
    if path.is_file():
        return TarArchive(path)
    if not path.exists():
        raise NotFoundError(f"no such image source: {source}")
    raise InvalidInputError(f"{source} is neither a directory nor a file")
