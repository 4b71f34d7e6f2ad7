"""The OCI registry store (``oci://HOST[:PORT]/REPO``): weenv content as blobs and
artifact manifests of one repository, through the OCI distribution API.

Sources: OCI distribution-spec (``/v2/`` check, blob HEAD/GET with ``Range``,
monolithic upload = ``POST /blobs/uploads/`` then ``PUT <location>?digest=``,
manifest HEAD/GET/PUT/DELETE, ``GET /tags/list``) and OCI image-spec manifest.md
(artifact manifests: ``artifactType``, the empty descriptor ``{}``).

Layout in repository ``REPO`` (``HEX`` = the 64 hex digits of a weenv digest)::

    tag chunk-HEX       artifact manifest, artifactType application/vnd.weenv.chunk.v1,
                        config = the empty descriptor, layers = [the zstd frame blob],
                        annotation vnd.weenv.digest = sha256:HEX (plaintext digest)
    tag manifest-HEX    artifact manifest whose config blob is the weenv manifest's
                        canonical JSON (mediaType = artifactType = the weenv media type);
                        layers = the group's chunk frames (so the registry's garbage
                        collector keeps them and OCI tools copy a group whole), or the
                        empty descriptor for a template
    tag pack-HEX        artifact manifest, artifactType application/vnd.weenv.pack.v1,
                        config = the empty descriptor, layers = [the pack blob]
                        (HEX = the pack's own digest, also its blob's)
    tag template-NAME   a copy of the manifest-HEX manifest plus annotation
    tag group-NAME        vnd.weenv.ref = KIND/NAME (distinct bytes: deleting a manifest
                        by digest, which drops every tag on those bytes, leaves refs alone)

Why tags for chunks.  A registry addresses a blob by the sha256 of its bytes,
the zstd frame (``ChunkRef.stored_digest``); weenv addresses a chunk by its
plaintext digest.  The ``chunk-HEX`` tag is the index from one to the other,
kept by the registry itself (no side file to go stale), and lets
``has``/``list``/``delete`` work by plaintext digest.  The node's hot path never
uses it: a group manifest carries each chunk's ``stored_digest``, and
:meth:`Store.get_chunk` passes it down, so a chunk fetch is one blob ``GET``.
A weenv manifest's bytes are its config blob, whose blob digest is the weenv
digest itself, so :meth:`Store.get_manifest` is one blob ``GET`` as well (the
``manifest-HEX`` tag is read only if that blob is not in the repository).  So a
deleted chunk or manifest stays readable by digest until the registry's garbage
collector frees its blob; ``has``/``list`` follow the tags at once.

Failures.  Each registry exchange (a blob read, a blob upload, a manifest read
or write, a tag listing) runs under a deadline (``timeout``, seconds); each of
its requests' connect/read/write timeouts is capped by what is left of it.  A
chunk fetch by ``stored_digest`` (the node's) is one exchange; a store call
makes at most three.  Connection errors, timeouts, 429 and 5xx answers are
retried with exponential backoff (``backoff`` seconds, doubling, at most
``retries`` times, never past the deadline); then :class:`StoreUnavailableError`
is raised, and a circuit breaker opens (:mod:`weenv.store.breaker`): every new
exchange fails at once until a probe (``GET /v2/`` within ``probe_timeout``,
every ``probe_interval`` seconds) is answered.  The kernel retries a failed
read of a lazy file two or three times, and an environment reads many files:
without it each read would wait a whole timeout for its EIO.  A blob ``GET``
cut short is resumed with ``Range: bytes=N-`` (206) instead of starting over.
The registry check (``GET /v2/`` answers 200) runs when the store opens, or,
opened with ``check=False`` (a node's store: a daemon starts while the
registry is down), as the first request of the first exchange.

Limits (:mod:`weenv.formats.limits`).  Every answer is read up to a bound,
checked against its ``Content-Length`` first and counted while it streams: a
blob up to what its reader allows (a chunk's frame, a manifest, a pack), any
JSON answer (an OCI manifest, a tags page, an error) up to
``MAX_REGISTRY_JSON_BYTES``; past it, :class:`ContentLimitError` naming the blob.
Bodies are asked for uncompressed (``Accept-Encoding: identity``).
A 404 is :class:`NotFoundError`; a refusal (401, 403, 405, other 4xx) is
:class:`StoreUnavailableError` with the registry's error code.

Deletes remove the tag's manifest (``DELETE /manifests/<digest>``; docker-registry
needs ``storage.delete.enabled: true``, else :class:`StoreUnavailableError`).
Blobs are left to the registry's garbage collector
(``docker-registry garbage-collect CONFIG``), which frees those no manifest
references.

Not supported yet: registry authentication (token or basic), cross-repository
blob mounts, chunked (resumable) uploads, the referrers API.

docker-registry 2.8 ignores the ``n``/``last`` pagination of ``tags/list`` and
returns every tag unordered; the client follows ``Link`` headers when a registry
sends them and filters by prefix itself, so listing refs reads every tag
(one per chunk): fine for thousands, slow for millions.
"""

from __future__ import annotations

import functools
import ipaddress
import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import parse_qsl, urlsplit

import httpx
from pydantic import ValidationError

from weenv.errors import (
    DigestMismatchError,
    InvalidInputError,
    NotFoundError,
    StoreUnavailableError,
)
from weenv.formats.limits import MAX_REGISTRY_JSON_BYTES
from weenv.formats.manifest import (
    GROUP_MEDIA_TYPES,
    check_digest,
    parse_group_manifest,
    sha256_digest,
)
from weenv.store.base import Store, read_limit, too_large
from weenv.store.breaker import CircuitBreaker
from weenv.store.registry import (
    EMPTY_BLOB,
    OCI_MANIFEST,
    RegistryPrimitives,
    _check_length,
    _describe,
    _read_capped,
    _registry_error,
)
from weenv.store.remote import RemoteOptions, call_with_retries
from weenv.store.remote import Retry as _Retry

EMPTY_MEDIA_TYPE = "application/vnd.oci.empty.v1+json"
EMPTY_DESCRIPTOR = {
    "mediaType": EMPTY_MEDIA_TYPE,
    "digest": sha256_digest(EMPTY_BLOB),
    "size": len(EMPTY_BLOB),
    "data": "e30=",
}
CHUNK_ARTIFACT_TYPE = "application/vnd.weenv.chunk.v1"
CHUNK_MEDIA_TYPE = "application/vnd.weenv.chunk.v1+zstd"
PACK_ARTIFACT_TYPE = "application/vnd.weenv.pack.v1"
PACK_MEDIA_TYPE = "application/vnd.weenv.pack.v1+zstd"
UNKNOWN_MANIFEST_TYPE = "application/vnd.weenv.unknown.v1+json"
ANNOTATION_DIGEST = "vnd.weenv.digest"
ANNOTATION_REF = "vnd.weenv.ref"

SPACE_TAG_PREFIX = {"chunks": "chunk-", "manifests": "manifest-", "packs": "pack-"}
REF_TAG_PREFIX = {"templates": "template-", "groups": "group-"}  # other kinds: "KIND-"
MAX_TAG = 128

# distribution-spec: repository name components, and tags.
_REPO_RE = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*\Z")
_TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}\Z")
_HEX_RE = re.compile(r"^[0-9a-f]{64}\Z")

T = TypeVar("T")


class OciOptions(RemoteOptions):
    """Timeouts and retries of an :class:`OciStore` (also settable as URL query
    parameters: ``oci://host:5000/repo?read_timeout=2&timeout=5``); the probe
    is ``GET /v2/``."""

    tls: bool | None = None
    """HTTPS (True) or HTTP (False); default: HTTP for loopback hosts, HTTPS otherwise."""


@dataclass(frozen=True)
class OciStats:
    """Counters of an :class:`OciStore` since it was opened."""

    requests: int
    """HTTP requests sent (retries included)."""
    retries: int
    """Attempts repeated after a retryable failure."""
    resumed: int
    """Blob reads continued with a ``Range`` request after a cut."""
    bytes_received: int
    """Blob bytes received (bodies of blob ``GET``\\s)."""
    bytes_sent: int
    """Blob bytes uploaded."""


def _parse_url(url: str, overrides: dict[str, Any]) -> tuple[str, str, str, OciOptions]:
    """``(base_url, host, repository, options)`` of an ``oci://`` URL; ``overrides``
    (keyword arguments) win over the URL's query parameters."""
    parts = urlsplit(url)
    if parts.scheme not in ("oci", "oci+http", "oci+https"):
        raise InvalidInputError(f"not an oci:// URL: {url!r}")
    host = parts.netloc
    repo = parts.path.strip("/")
    if not host or "@" in host:
        raise InvalidInputError(f"oci:// URL {url!r} needs a HOST[:PORT] (credentials are not supported)")
    if not _REPO_RE.match(repo) or len(repo) >= 256:
        raise InvalidInputError(
            f"bad repository {repo!r} in {url!r}: lowercase [a-z0-9] components separated "
            "by '.', '_', '__' or '-', joined by '/' (OCI distribution-spec)"
        )
    try:
        query: dict[str, Any] = dict(parse_qsl(parts.query, strict_parsing=True)) if parts.query else {}
        if parts.scheme != "oci":
            query["tls"] = parts.scheme == "oci+https"
        options = OciOptions(**(query | overrides))
    except (ValueError, ValidationError) as exc:
        raise InvalidInputError(f"bad options for {url!r}: {exc}") from exc
    tls = options.tls if options.tls is not None else not _is_loopback(parts.hostname or "")
    return f"{'https' if tls else 'http'}://{host}", host, repo, options


def _is_loopback(hostname: str) -> bool:
    if hostname == "localhost":
        return True
    try:
        return ipaddress.ip_address(hostname).is_loopback
    except ValueError:
        return False


class OciStore(RegistryPrimitives, Store):
    """A store in repository ``REPO`` of the OCI registry at ``HOST:PORT``.

    ``url`` is ``oci://HOST[:PORT]/REPO`` (``oci+http://`` / ``oci+https://`` force
    the scheme), optionally with :class:`OciOptions` fields as query parameters;
    ``options`` (the same fields as keyword arguments) override them.  The
    registry check (``GET /v2/``) raises :class:`StoreUnavailableError` if the
    registry cannot be reached (within ``options.timeout``), asks for
    authentication, or is not a registry; with ``check`` (the default) it runs
    when the store opens, else (``check=False``: a node, which must start while
    the registry is down) within the deadline of the first operation, which
    then raises it, and the opening itself sends nothing.
    :class:`InvalidInputError` for a malformed URL.  Thread-safe (one pooled
    httpx client).  Call :meth:`close` when done.
    """

    def __init__(self, url: str, *, check: bool = True, **options: Any):
        base_url, self.host, self.repository, self.options = _parse_url(url, options)
        self.url = f"oci://{self.host}/{self.repository}"
        self._client = httpx.Client(
            base_url=base_url,
            timeout=httpx.Timeout(self.options.read_timeout, connect=self.options.connect_timeout),
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=32),
            headers={"User-Agent": "weenv", "Accept-Encoding": "identity"},
        )
        self._lock = threading.Lock()  # guards the counters
        self._counts = {"requests": 0, "retries": 0, "resumed": 0, "bytes_received": 0, "bytes_sent": 0}
        self._empty_lock = threading.Lock()  # guards _empty_pushed
        self._empty_pushed = False
        self.breaker = CircuitBreaker(self.url, self._probe, self.options.probe_interval)
        """Open while the registry is known to be down (:mod:`weenv.store.breaker`)."""
        self._checked = False  # the registry answered the check once
        if check:
            try:
                self._call("opening the store", lambda deadline: None)
            except BaseException:
                self._client.close()
                raise

    # --- HTTP with deadlines and retries ---------------------------------------------------
    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def stats(self) -> OciStats:
        with self._lock:
            return OciStats(**self._counts)

    def _timeout(self, deadline: float) -> httpx.Timeout:
        left = max(0.01, deadline - time.monotonic())
        o = self.options
        return httpx.Timeout(
            connect=min(o.connect_timeout, left),
            read=min(o.read_timeout, left),
            write=min(o.read_timeout, left),
            pool=left,
        )

    def _call(self, what: str, attempt: Callable[[float], T]) -> T:
        """``attempt(deadline)``, repeated on :class:`_Retry` with backoff until
        ``options.retries`` or the deadline runs out; then StoreUnavailableError,
        and the breaker opens (while it is open: at once, see :mod:`weenv.store.breaker`)."""
        if not self._checked:  # the first operation checks the registry first, within its deadline
            attempt = functools.partial(self._check_then, attempt)
        return call_with_retries(what, self.url, attempt, self.options, self.breaker, lambda: self._count("retries"))

    def _check_then(self, attempt: Callable[[float], T], deadline: float) -> T:
        self._check_registry(deadline)
        self._checked = True
        return attempt(deadline)

    def _probe(self) -> None:
        """One ``GET /v2/`` within ``probe_timeout``, no retry: returns if the
        registry answers (any status below 500), raises otherwise."""
        r = self._send("GET", "/v2/", time.monotonic() + self.options.probe_timeout)
        if r.status_code >= 500:
            raise _Retry(f"HTTP {r.status_code} from GET /v2/")

    def _send(self, method: str, url: str | httpx.URL, deadline: float, **kwargs: Any) -> httpx.Response:
        """One request, its body read (at most ``MAX_REGISTRY_JSON_BYTES``, else
        :class:`ContentLimitError`); transport errors, 429 and 5xx raise :class:`_Retry`."""
        self._count("requests")
        try:
            with self._client.stream(method, url, timeout=self._timeout(deadline), **kwargs) as r:
                if r.status_code == 429 or r.status_code >= 500:
                    raise _Retry(f"HTTP {r.status_code} from {method} {r.url.path}")
                if method == "HEAD":
                    r.read()  # no body; its Content-Length is the blob's
                else:
                    _read_capped(r, MAX_REGISTRY_JSON_BYTES, f"{method} {r.url.path}")
        except httpx.TransportError as exc:
            raise _Retry(_describe(exc)) from exc
        return r

    def _refused(self, response: httpx.Response, what: str) -> StoreUnavailableError:
        """The error for an answer the registry should not have given."""
        detail = _registry_error(response)
        if response.status_code == 405 and response.request.method == "DELETE":
            detail += " (deletes are disabled; docker-registry: storage.delete.enabled: true)"
        elif response.status_code == 401:
            detail += " (registry authentication is not supported yet)"
        return StoreUnavailableError(f"{what} at {self.url}: registry refused: HTTP {response.status_code} {detail}")

    # --- the Store backend ---------------------------------------------------------------
    @staticmethod
    def _space_tag(space: str, digest: str) -> str:
        if space not in SPACE_TAG_PREFIX:
            raise InvalidInputError(f"unknown store space {space!r}")
        return SPACE_TAG_PREFIX[space] + check_digest(digest).split(":", 1)[1]

    def _has(self, space: str, digest: str) -> bool:
        tag = self._space_tag(space, digest)
        return self._call(f"checking {tag}", lambda deadline: self._head_manifest(tag, deadline)) is not None

    def _put(self, space: str, digest: str, data: bytes) -> None:
        tag = self._space_tag(space, digest)
        blob = self._ensure_blob(data)
        descriptor = {"digest": blob, "size": len(data)}
        if space in ("chunks", "packs"):
            artifact_type, media_type = (
                (CHUNK_ARTIFACT_TYPE, CHUNK_MEDIA_TYPE) if space == "chunks" else (PACK_ARTIFACT_TYPE, PACK_MEDIA_TYPE)
            )
            self._ensure_empty_blob()
            manifest = _artifact(
                artifact_type, EMPTY_DESCRIPTOR, [{"mediaType": media_type, **descriptor}], {ANNOTATION_DIGEST: digest}
            )
        else:
            media_type, layers = self._manifest_layers(data)
            manifest = _artifact(
                media_type, {"mediaType": media_type, **descriptor}, layers, {ANNOTATION_DIGEST: digest}
            )
        self._put_manifest_json(tag, manifest)

    def _manifest_layers(self, data: bytes) -> tuple[str, list[dict]]:
        """The media type of weenv manifest ``data`` and the layers of its OCI
        manifest: a group's distinct chunk frames, else the empty descriptor."""
        try:
            media_type = json.loads(data).get("media_type")
        except (ValueError, AttributeError):
            media_type = None
        if not isinstance(media_type, str) or not media_type.startswith("application/vnd.weenv."):
            media_type = UNKNOWN_MANIFEST_TYPE
        if media_type in GROUP_MEDIA_TYPES.values():
            try:
                group = parse_group_manifest(data)
            except InvalidInputError:
                pass
            else:
                seen: dict[str, int] = {}
                for c in group.chunks:
                    seen.setdefault(c.stored_digest, c.stored_size)
                if seen:
                    return media_type, [
                        {"mediaType": CHUNK_MEDIA_TYPE, "digest": d, "size": n} for d, n in seen.items()
                    ]
        self._ensure_empty_blob()
        return media_type, [EMPTY_DESCRIPTOR]

    def _get(self, space: str, digest: str, max_bytes: int | None = None) -> bytes:
        limit = read_limit(space, max_bytes)
        if space == "manifests":  # its bytes are a blob under its own digest: one request, not two
            try:
                return self._get_blob(digest, verify=False, max_bytes=limit)  # get_manifest checks them
            except NotFoundError:
                pass  # not under that digest here: the tag knows where
        tag = self._space_tag(space, digest)
        manifest = self._get_manifest_json(tag)
        if manifest is None:
            raise NotFoundError(f"no {space[:-1]} {digest} in {self.url}")
        try:
            blob = manifest["layers"][0] if space in ("chunks", "packs") else manifest["config"]
            blob_digest = check_digest(blob["digest"])
        except (KeyError, IndexError, TypeError, InvalidInputError) as exc:
            raise DigestMismatchError(f"manifest {tag} in {self.url} is not a weenv artifact: {exc!r}") from None
        return self._get_blob(blob_digest, max_bytes=limit)

    def _stream(self, space: str, digest: str, max_bytes: int | None = None) -> Iterator[bytes]:
        """A pack streamed in one ``GET`` of its blob (its digest is the blob's);
        other spaces: :meth:`_get`.  Opening the response is retried like any
        exchange; a read failing midway raises :class:`StoreUnavailableError`
        (each read waits at most ``read_timeout``; no overall deadline, so a
        large pack on a slow link is not cut off).  Past ``max_bytes``:
        :class:`ContentLimitError` (before the first piece when the answer's
        ``Content-Length`` tells)."""
        if space != "packs":
            yield self._get(space, digest, max_bytes)
            return
        limit = read_limit(space, max_bytes)
        what = f"pack {digest} in {self.url}"
        url = self._path("blobs", digest)

        def attempt(deadline: float) -> httpx.Response:
            self._count("requests")
            request = self._client.build_request(
                "GET", url, headers={"Accept-Encoding": "identity"}, timeout=self._timeout(deadline)
            )
            try:
                r = self._client.send(request, stream=True, follow_redirects=True)
            except httpx.TransportError as exc:
                raise _Retry(_describe(exc)) from exc
            if r.status_code == 200:
                try:
                    _check_length(r, limit, what)
                except BaseException:
                    r.close()
                    raise
                return r
            try:
                _read_capped(r, MAX_REGISTRY_JSON_BYTES, f"GET {r.url.path}")  # an error's body, for _refused
            except httpx.HTTPError:
                pass
            finally:
                r.close()
            if r.status_code == 404:
                raise NotFoundError(f"no pack {digest} in {self.url}")
            if r.status_code == 429 or r.status_code >= 500:
                raise _Retry(f"HTTP {r.status_code} from GET blob")
            raise self._refused(r, f"GET pack {digest}")

        response = self._call(f"reading pack {digest}", attempt)
        got = 0
        try:
            for piece in response.iter_raw():
                self._count("bytes_received", len(piece))
                got += len(piece)
                if got > limit:
                    raise too_large(what, got, limit)
                yield piece
        except httpx.TransportError as exc:
            raise StoreUnavailableError(f"reading pack {digest} at {self.url} failed: {_describe(exc)}") from exc
        finally:
            response.close()

    def _get_frame(self, digest: str, stored_digest: str, max_bytes: int | None = None) -> bytes:
        try:  # no hash of the frame: get_chunk checks the plaintext's
            return self._get_blob(stored_digest, verify=False, max_bytes=read_limit("chunks", max_bytes))
        except NotFoundError:  # not under that digest here: ask the index
            return self._get("chunks", digest, max_bytes)

    def _list(self, space: str) -> Iterator[str]:
        prefix = SPACE_TAG_PREFIX[space]
        for tag in sorted(self._tags()):
            hexdigest = tag[len(prefix) :]
            if tag.startswith(prefix) and _HEX_RE.match(hexdigest):
                yield f"sha256:{hexdigest}"

    def _delete(self, space: str, digest: str) -> None:
        self._delete_tag(self._space_tag(space, digest))

    def _delete_tag(self, tag: str) -> None:
        """Delete the manifest tagged ``tag`` (and so the tag); nothing if absent.
        Every manifest weenv writes has bytes of its own, so no other tag goes with it."""

        def attempt(deadline: float) -> None:
            manifest_digest = self._head_manifest(tag, deadline)
            if manifest_digest is None:
                return
            r = self._send("DELETE", self._path("manifests", manifest_digest), deadline)
            if r.status_code not in (200, 202, 404):
                raise self._refused(r, f"DELETE manifest {tag}")

        self._call(f"deleting {tag}", attempt)

    # --- refs ------------------------------------------------------------------------------
    @staticmethod
    def _ref_prefix(kind: str) -> str:
        return REF_TAG_PREFIX.get(kind, f"{kind}-")

    def _ref_tag(self, kind: str, name: str) -> str:
        self._check_ref(kind, name)
        prefix = self._ref_prefix(kind)
        tag = prefix + name
        if len(tag) > MAX_TAG or not _TAG_RE.match(tag):
            raise InvalidInputError(
                f"name {name!r} is too long for an oci:// store: a {kind} name may have "
                f"at most {MAX_TAG - len(prefix)} characters (OCI tags: {MAX_TAG})"
            )
        return tag

    def set_ref(self, kind: str, name: str, digest: str) -> None:
        """Point tag ``template-NAME``/``group-NAME`` at manifest ``digest``, which
        must be in the store (:class:`NotFoundError` otherwise)."""
        tag = self._ref_tag(kind, name)
        check_digest(digest)
        manifest = self._get_manifest_json(self._space_tag("manifests", digest))
        if manifest is None:
            raise NotFoundError(f"no manifest {digest} in {self.url} for {kind}/{name}")
        manifest["annotations"] = {**manifest.get("annotations", {}), ANNOTATION_REF: f"{kind}/{name}"}
        self._put_manifest_json(tag, manifest)

    def get_ref(self, kind: str, name: str) -> str:
        tag = self._ref_tag(kind, name)
        manifest = self._get_manifest_json(tag)
        if manifest is None:
            raise NotFoundError(f"no {kind[:-1]} named {name!r} in {self.url}")
        try:
            return check_digest(manifest["annotations"][ANNOTATION_DIGEST])
        except (KeyError, TypeError, InvalidInputError) as exc:
            raise DigestMismatchError(f"tag {tag} in {self.url} is not a weenv ref: {exc!r}") from None

    def ref_names(self, kind: str) -> list[str]:
        """One tag listing, no ref read."""
        self._check_ref(kind, "x")
        prefix = self._ref_prefix(kind)
        return sorted(tag[len(prefix) :] for tag in self._tags() if tag.startswith(prefix))

    def list_refs(self, kind: str) -> dict[str, str]:
        self._check_ref(kind, "x")
        prefix = self._ref_prefix(kind)
        refs = {}
        for tag in sorted(self._tags()):
            if tag.startswith(prefix):
                try:
                    refs[tag[len(prefix) :]] = self.get_ref(kind, tag[len(prefix) :])
                except (NotFoundError, InvalidInputError):
                    continue  # deleted meanwhile, or a tag weenv did not write
        return refs

    def delete_ref(self, kind: str, name: str, *, expected: str | None = None) -> None:
        """Remove the ref's tag (its manifest, whose bytes no other tag shares);
        with ``expected``, only if it points there (checked, then deleted)."""
        tag = self._ref_tag(kind, name)
        if expected is not None and self.ref_or_none(kind, name) != expected:
            return
        self._delete_tag(tag)

    def close(self) -> None:
        """Stop the breaker's probes, close the connection pool.  Idempotent."""
        self.breaker.close()
        self._client.close()


# --- helpers -------------------------------------------------------------------------------


def _artifact(artifact_type: str, config: dict, layers: list[dict], annotations: dict) -> dict:
    """An OCI image manifest used as an artifact (image-spec manifest.md)."""
    return {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "artifactType": artifact_type,
        "config": config,
        "layers": layers,
        "annotations": annotations,
    }
