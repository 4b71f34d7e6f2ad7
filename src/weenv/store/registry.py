"""The registry primitives of :class:`~weenv.store.oci.OciStore`: the OCI
distribution API's blobs, manifests and tags as the store reads and writes
them (:class:`RegistryPrimitives`, a part of the store)."""

from __future__ import annotations

import json
import re
import time

import httpx

from weenv.errors import (
    DigestMismatchError,
    NotFoundError,
    StoreUnavailableError,
)
from weenv.formats.limits import MAX_REGISTRY_JSON_BYTES
from weenv.formats.manifest import (
    sha256_digest,
)
from weenv.store.base import too_large
from weenv.store.remote import Retry as _Retry

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
EMPTY_BLOB = b"{}"
_LINK_RE = re.compile(r'<([^>]+)>\s*;\s*rel="?next"?')


class RegistryPrimitives:
    """Blobs, manifests, tags and their listing; a part of :class:`~weenv.store.oci.OciStore`."""

    # --- registry primitives ---------------------------------------------------------------
    def _path(self, kind: str, ref: str) -> str:
        return f"/v2/{self.repository}/{kind}/{ref}"

    def _check_registry(self, deadline: float) -> None:
        """``GET /v2/``: returns if it answers 200; :class:`_Retry` as :meth:`_send`;
        :class:`StoreUnavailableError` for a refusal or a server that is not a registry."""
        r = self._send("GET", "/v2/", deadline)
        if r.status_code == 401:
            raise self._refused(r, "opening the store")
        if r.status_code != 200:
            raise StoreUnavailableError(f"{self.url} is not an OCI registry: GET /v2/ answered HTTP {r.status_code}")

    def _head_manifest(self, tag: str, deadline: float) -> str | None:
        """The digest of the manifest tagged ``tag``, or None if there is none."""
        r = self._send("HEAD", self._path("manifests", tag), deadline, headers={"Accept": OCI_MANIFEST})
        if r.status_code == 404:
            return None
        if r.status_code != 200:
            raise self._refused(r, f"HEAD manifest {tag}")
        digest = r.headers.get("Docker-Content-Digest")
        if digest is None:  # not required by the spec: ask for the bytes
            r = self._send("GET", self._path("manifests", tag), deadline, headers={"Accept": OCI_MANIFEST})
            if r.status_code == 404:
                return None
            digest = sha256_digest(r.content)
        return digest

    def _get_manifest_json(self, tag: str) -> dict | None:
        """The OCI manifest tagged ``tag`` (a dict), or None."""

        def attempt(deadline: float) -> dict | None:
            r = self._send("GET", self._path("manifests", tag), deadline, headers={"Accept": OCI_MANIFEST})
            if r.status_code == 404:
                return None
            if r.status_code != 200:
                raise self._refused(r, f"GET manifest {tag}")
            try:
                manifest = r.json()
                if not isinstance(manifest, dict):
                    raise ValueError("not an object")  # noqa: TRY004 (bad content, not a bad argument)
            except ValueError as exc:
                raise DigestMismatchError(f"manifest {tag} in {self.url} is not JSON: {exc}") from None
            return manifest

        return self._call(f"reading manifest {tag}", attempt)

    def _put_manifest_json(self, tag: str, manifest: dict) -> None:
        body = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()

        def attempt(deadline: float) -> None:
            for settle in (0.05, 0.2, None):
                r = self._send(
                    "PUT",
                    self._path("manifests", tag),
                    deadline,
                    content=body,
                    headers={"Content-Type": OCI_MANIFEST},
                )
                if r.status_code in (200, 201):
                    return
                if r.status_code != 400 or "MANIFEST_BLOB_UNKNOWN" not in r.text:
                    raise self._refused(r, f"PUT manifest {tag}")
                if settle is not None:  # another writer may be committing that blob right now
                    time.sleep(settle)
            raise NotFoundError(
                f"cannot tag {tag} in {self.url}: it references blobs the registry does not have "
                f"({_registry_error(r)}); put the chunks first"
            )

        self._call(f"writing manifest {tag}", attempt)

    def _ensure_blob(self, data: bytes, digest: str | None = None) -> str:
        """Upload ``data`` as a blob unless the repository has it; return its digest."""
        digest = digest or sha256_digest(data)

        def attempt(deadline: float) -> None:
            r = self._send("HEAD", self._path("blobs", digest), deadline)
            if r.status_code == 200:
                return
            if r.status_code != 404:
                raise self._refused(r, f"HEAD blob {digest}")
            r = self._send("POST", self._path("blobs", "uploads/"), deadline)
            location = r.headers.get("Location")
            if r.status_code != 202 or not location:
                raise self._refused(r, "starting a blob upload")
            target = httpx.URL(location)
            if not target.is_absolute_url:
                target = self._client.base_url.join(location)
            r = self._send(
                "PUT",
                target.copy_merge_params({"digest": digest}),
                deadline,
                content=data,
                headers={"Content-Type": "application/octet-stream"},
            )
            if r.status_code not in (201, 204):
                raise self._refused(r, f"uploading blob {digest}")
            self._count("bytes_sent", len(data))

        self._call(f"writing blob {digest}", attempt)
        return digest

    def _get_blob(self, digest: str, *, verify: bool = True, max_bytes: int) -> bytes:
        """Bytes of blob ``digest``, verified against it (unless ``verify`` is
        False: for a caller that checks what the bytes decode to).  A body cut
        short is resumed with a ``Range`` request; :class:`NotFoundError` if
        absent, :class:`ContentLimitError` if it has more than ``max_bytes``
        (told by its ``Content-Length`` before it is read, else once past it)."""
        received = bytearray()
        what = f"blob {digest} in {self.url}"
        url = self._path("blobs", digest)

        def attempt(deadline: float) -> None:
            headers = {"Accept-Encoding": "identity"}
            if received:
                headers["Range"] = f"bytes={len(received)}-"
            self._count("requests")
            try:
                with self._client.stream(
                    "GET", url, headers=headers, timeout=self._timeout(deadline), follow_redirects=True
                ) as r:
                    if r.status_code == 404:
                        raise NotFoundError(f"no blob {digest} in {self.url}")
                    if r.status_code == 429 or r.status_code >= 500:
                        raise _Retry(f"HTTP {r.status_code} from GET blob")
                    if r.status_code == 416:  # our offset is past the end: start over
                        received.clear()
                        raise _Retry("HTTP 416 for a resumed blob read")
                    if r.status_code == 206 and received:
                        if not r.headers.get("Content-Range", "").startswith(f"bytes {len(received)}-"):
                            raise DigestMismatchError(f"blob {digest}: unexpected Content-Range")
                        self._count("resumed")
                    elif r.status_code == 200:
                        received.clear()
                    else:
                        _read_capped(r, MAX_REGISTRY_JSON_BYTES, f"GET {r.url.path}")
                        raise self._refused(r, f"GET blob {digest}")
                    _check_length(r, max_bytes - len(received), what, offset=len(received))
                    for piece in r.iter_raw():
                        received.extend(piece)
                        self._count("bytes_received", len(piece))
                        if len(received) > max_bytes:
                            raise too_large(what, len(received), max_bytes)
                        if time.monotonic() > deadline:
                            raise _Retry("deadline passed during a blob read")
            except httpx.TransportError as exc:
                raise _Retry(_describe(exc)) from exc

        self._call(f"reading blob {digest}", attempt)
        data = bytes(received)
        if verify and sha256_digest(data) != digest:
            raise DigestMismatchError(f"blob {digest} from {self.url} has other content")
        return data

    def _tags(self) -> list[str]:
        """Every tag of the repository (following ``Link`` pages); [] if it has none."""

        def attempt(deadline: float) -> list[str]:
            tags: list[str] = []
            url: str | httpx.URL = self._path("tags", "list") + "?n=10000"
            for _page in range(100_000):
                r = self._send("GET", url, deadline)
                if r.status_code == 404:  # NAME_UNKNOWN: nothing pushed yet
                    return tags
                if r.status_code != 200:
                    raise self._refused(r, "listing tags")
                try:
                    page = r.json().get("tags") or []
                except (ValueError, AttributeError) as exc:
                    raise StoreUnavailableError(f"bad tags list from {self.url}: {exc}") from None
                tags.extend(t for t in page if isinstance(t, str))
                link = _LINK_RE.search(r.headers.get("Link", ""))
                if not link:
                    return tags
                url = self._client.base_url.join(link.group(1))
            return tags

        return self._call("listing tags", attempt)

    def _ensure_empty_blob(self) -> None:
        """Push the empty descriptor's blob once.  Serialized: docker-registry can
        fail a manifest that references a blob while another upload of that same
        blob is being committed (DIGEST_INVALID), so threads do not race here."""
        with self._empty_lock:
            if not self._empty_pushed:
                self._ensure_blob(EMPTY_BLOB)
                self._empty_pushed = True


def _check_length(response: httpx.Response, limit: int, what: str, offset: int = 0) -> None:
    """Raise :class:`ContentLimitError` if ``response``'s ``Content-Length`` passes ``limit``
    (``offset``: bytes of the blob before this answer's, for the message)."""
    length = response.headers.get("Content-Length", "")
    if length.isdigit() and int(length) > limit:
        raise too_large(what, offset + int(length), offset + limit)


def _read_capped(response: httpx.Response, limit: int, what: str) -> bytes:
    """The body of streamed ``response``, at most ``limit`` bytes (else
    :class:`ContentLimitError`); also kept as its content, for ``.json()``."""
    _check_length(response, limit, what)
    body = bytearray()
    for piece in response.iter_bytes():
        body += piece
        if len(body) > limit:
            raise too_large(what, len(body), limit)
    response._content = bytes(body)  # noqa: SLF001 (httpx has no public way to set a streamed body)
    return bytes(body)


def _registry_error(response: httpx.Response) -> str:
    """``CODE: message`` of a registry error body (distribution-spec), else the status text."""
    try:
        errors = response.json().get("errors") or []
        return "; ".join(f"{e.get('code')}: {e.get('message')}" for e in errors) or response.reason_phrase
    except (ValueError, AttributeError, httpx.ResponseNotRead):
        return response.reason_phrase


def _describe(exc: httpx.TransportError) -> str:
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"
