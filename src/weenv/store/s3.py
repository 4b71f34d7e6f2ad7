"""The S3 store (``s3://BUCKET/PREFIX``): weenv content as objects of one bucket,
through boto3 (``pip install 'weenv[s3]'``).

Layout under ``PREFIX`` (the file store's, :mod:`weenv.store.file`)::

    PREFIX/chunks/sha256/ab/abcdef...   zstd frame of a chunk (address: plaintext sha256)
    PREFIX/manifests/sha256/abcdef...   canonical JSON of a manifest
    PREFIX/packs/sha256/abcdef...       a prefetch pack (address: sha256 of its bytes)
    PREFIX/refs/KIND/NAME               a digest, one line

Configuration.  The endpoint: the URL's ``endpoint`` option, else
``WEENV_S3_ENDPOINT``, else botocore's own (``AWS_ENDPOINT_URL_S3``,
``AWS_ENDPOINT_URL``, else AWS).  The region: ``region``, else ``AWS_REGION`` /
``AWS_DEFAULT_REGION``, else ``us-east-1``.  Credentials: boto3's chain
(``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``,
``~/.aws/credentials``, an instance role).  Timeouts and retries as
:class:`S3Options`, also as query parameters:
``s3://bucket/prefix?endpoint=http://127.0.0.1:8333&timeout=5``.

Failures.  Each store call runs under a deadline (``timeout``, seconds); each
request's connection waits at most ``connect_timeout`` and each read of its
answer at most ``read_timeout``.  Connection errors, timeouts, 429 and 5xx
are retried with exponential backoff (``backoff`` seconds, doubling, at most
``retries`` times, never past the deadline; botocore's own retries are off),
then :class:`~weenv.errors.StoreUnavailableError` is raised and the circuit
breaker opens (:mod:`weenv.store.breaker`: new calls fail at once until a probe,
``HeadBucket`` within ``probe_timeout``, is answered).  The bucket is checked
(``HeadBucket``) when the store opens, or, opened with ``check=False`` (a
node's store), by the first call: a bucket that does not exist, and a refusal
(403: a wrong key or secret, no permission), raise
:class:`~weenv.errors.StoreUnavailableError` naming the store; so does an
answer ``NoSuchBucket`` later.  A missing object is
:class:`~weenv.errors.NotFoundError`.  No boto exception leaves this module.

Limits (:mod:`weenv.formats.limits`).  A ``GetObject``'s ``Content-Length`` is
checked against what its reader allows (a chunk's frame, a manifest, a pack,
``MAX_REF_BYTES`` for a ref) before its body is read, and the body is counted
while it is read: past the bound, :class:`~weenv.errors.ContentLimitError`
naming the digest.  Listings (``ListObjectsV2``, at most 1,000 keys a page)
are parsed by botocore whole, one page at a time.

Refs.  :meth:`S3Store.set_ref` is one ``PutObject``: S3 replaces an object
atomically (a reader sees the old digest or the new one, never a mix), and of
two writers of one name the last one wins, as with ``file://`` (rename) and
``oci://`` (a tag ``PUT``).  :meth:`S3Store.swap_ref` (the compare-and-swap of
a read-modify-write, :meth:`Store.swap_ref`: ``weenv update``) moves a ref only
from the digest its caller read, in one conditional ``PutObject``
(``If-Match`` on the ref's ETag; ``If-None-Match: *`` for a ref that must not
exist yet), else raises :class:`~weenv.errors.BusyError`.  SeaweedFS and AWS
S3 honour both conditions (``412 PreconditionFailed``).
"""

from __future__ import annotations

import functools
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import parse_qsl, urlsplit

from pydantic import ValidationError

from weenv.config import settings
from weenv.errors import (
    BusyError,
    ContentLimitError,
    InvalidInputError,
    NotFoundError,
    StoreUnavailableError,
    ToolMissingError,
)
from weenv.formats.limits import MAX_REF_BYTES
from weenv.formats.manifest import check_digest
from weenv.store.base import SPACES, Store, read_limit, ref_moved, too_large
from weenv.store.breaker import CircuitBreaker
from weenv.store.remote import RemoteOptions, call_with_retries
from weenv.store.remote import Retry as _Retry

try:
    import boto3
    import botocore.config
    import botocore.exceptions
    import botocore.session
except ImportError:  # pragma: no cover (the extra is installed wherever tests run)
    boto3 = None

log = logging.getLogger(__name__)

DEFAULT_REGION = "us-east-1"
READ_PIECE = 1 << 20
"""Bytes per read of an answer's body (and per piece of a streamed pack)."""
MAX_KEY_BYTES = 1024
"""S3's limit on an object key (UTF-8 bytes)."""
ACCESS_CODES = frozenset(
    {
        "AccessDenied",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "InvalidToken",
        "ExpiredToken",
        "TokenRefreshRequired",
        "AllAccessDisabled",
        "403",
    }
)
MISSING_CODES = frozenset({"NoSuchKey", "404", "NotFound"})
RETRY_CODES = frozenset(
    {"SlowDown", "RequestTimeout", "InternalError", "ServiceUnavailable", "Throttling", "RequestTimeTooSkewed"}
)
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]\Z")
_HEX_RE = re.compile(r"^[0-9a-f]{64}\Z")

T = TypeVar("T")


class S3Options(RemoteOptions):
    """Endpoint, region, timeouts and retries of an :class:`S3Store` (also
    settable as URL query parameters: ``s3://bucket/prefix?read_timeout=2&timeout=5``);
    the probe is ``HeadBucket``."""

    endpoint: str | None = None
    """The S3 endpoint URL (``http://127.0.0.1:8333``); default ``WEENV_S3_ENDPOINT``,
    else botocore's (``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``, else AWS)."""
    region: str | None = None
    """Default ``AWS_REGION`` / ``AWS_DEFAULT_REGION``, else ``us-east-1``."""


@dataclass(frozen=True)
class S3Stats:
    """Counters of an :class:`S3Store` since it was opened."""

    requests: int
    """S3 requests sent (retries included)."""
    retries: int
    """Attempts repeated after a retryable failure."""
    bytes_received: int
    """Object bytes read (bodies of ``GetObject``\\s)."""
    bytes_sent: int
    """Object bytes written."""


class _Missing(Exception):
    """The object (not the bucket) does not exist (404)."""


class _Precondition(Exception):
    """A conditional write's condition did not hold (412)."""


def _parse_url(url: str, overrides: dict[str, Any]) -> tuple[str, str, S3Options]:
    """``(bucket, prefix, options)`` of an ``s3://`` URL; ``overrides`` (keyword
    arguments) win over its query parameters; the environment fills the rest."""
    parts = urlsplit(url)
    if parts.scheme != "s3":
        raise InvalidInputError(f"not an s3:// URL: {url!r}")
    bucket, prefix = parts.netloc, parts.path.strip("/")
    if not _BUCKET_RE.match(bucket) or ".." in bucket:
        raise InvalidInputError(
            f"bad bucket {bucket!r} in {url!r}: 3 to 63 characters of [a-z0-9.-], "
            "starting and ending with a letter or digit (S3 bucket naming rules)"
        )
    if "//" in prefix or any(part in (".", "..") for part in prefix.split("/")) or len(prefix.encode()) > 512:
        raise InvalidInputError(f"bad prefix {prefix!r} in {url!r}: '/'-separated names, at most 512 bytes")
    try:
        query: dict[str, Any] = dict(parse_qsl(parts.query, strict_parsing=True)) if parts.query else {}
        options = S3Options(**(query | overrides))
    except (ValueError, ValidationError) as exc:
        raise InvalidInputError(f"bad options for {url!r}: {exc}") from exc
    endpoint = options.endpoint or settings().store.s3_endpoint
    if endpoint is not None and urlsplit(endpoint).scheme not in ("http", "https"):
        raise InvalidInputError(f"bad S3 endpoint {endpoint!r} for {url!r}: an http:// or https:// URL")
    region = options.region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or DEFAULT_REGION
    return bucket, prefix, options.model_copy(update={"endpoint": endpoint, "region": region})


class S3Store(Store):
    """A store under ``PREFIX`` of S3 bucket ``BUCKET``.

    ``url`` is ``s3://BUCKET[/PREFIX]``, optionally with :class:`S3Options` fields
    as query parameters; ``options`` (the same fields as keyword arguments)
    override them.  With ``check`` (the default) the bucket is checked when the
    store opens, else by the first operation (a node starts while its store is
    down).  Raises :class:`InvalidInputError` for a malformed URL,
    :class:`ToolMissingError` without boto3, and :class:`StoreUnavailableError`
    for an endpoint that does not answer (within ``options.timeout``), a
    bucket that does not exist, or refused access.  Thread-safe (one boto3
    client).  Call :meth:`close` when done.
    """

    def __init__(self, url: str, *, check: bool = True, **options: Any):
        self.bucket, self.prefix, self.options = _parse_url(url, options)
        self.url = f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
        if boto3 is None:
            raise ToolMissingError(f"{self.url} needs boto3: pip install 'weenv[s3]'")
        o = self.options
        self.endpoint = o.endpoint or "AWS"
        """The endpoint the store's requests go to (for messages)."""

        session = _session()

        def client(connect: float, read: float):
            config = botocore.config.Config(
                connect_timeout=connect,
                read_timeout=read,
                retries={"total_max_attempts": 1},
                max_pool_connections=64,
                tcp_keepalive=True,
                s3={"addressing_style": "path" if o.endpoint else "auto"},
            )
            with _SESSION_LOCK:  # the shared loader is not thread-safe
                return session.client("s3", endpoint_url=o.endpoint, region_name=o.region, config=config)

        self._client = client(o.connect_timeout, o.read_timeout)
        self._probe_client = client(min(o.connect_timeout, o.probe_timeout), o.probe_timeout)
        if o.endpoint is None:
            self.endpoint = self._client.meta.endpoint_url
        self._lock = threading.Lock()  # guards the counters
        self._counts = {"requests": 0, "retries": 0, "bytes_received": 0, "bytes_sent": 0}
        self.breaker = CircuitBreaker(self.url, self._probe, o.probe_interval)
        """Open while the store is known to be down (:mod:`weenv.store.breaker`)."""
        self._checked = False  # the bucket answered the check once
        if check:
            try:
                self._call("opening the store", lambda deadline: None)
            except BaseException:
                self.close()
                raise

    # --- requests with deadlines and retries ---------------------------------------------
    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def stats(self) -> S3Stats:
        with self._lock:
            return S3Stats(**self._counts)

    def _call(self, what: str, attempt: Callable[[float], T]) -> T:
        """``attempt(deadline)``, repeated on :class:`_Retry` with backoff until
        ``options.retries`` or the deadline runs out; then StoreUnavailableError,
        and the breaker opens (while it is open: at once)."""
        if not self._checked:  # the first operation checks the bucket first, within its deadline
            attempt = functools.partial(self._check_then, attempt)
        where = f"{self.url} (endpoint {self.endpoint})"
        return call_with_retries(what, where, attempt, self.options, self.breaker, lambda: self._count("retries"))

    def _check_then(self, attempt: Callable[[float], T], deadline: float) -> T:
        self._check_bucket(self._client)
        self._checked = True
        return attempt(deadline)

    def _check_bucket(self, client) -> None:
        """``HeadBucket``: returns if the bucket answers; :class:`_Retry`, or
        :class:`StoreUnavailableError` for a missing bucket or refused access."""
        try:
            self._request("head_bucket", client=client)
        except _Missing:
            raise StoreUnavailableError(
                f"store {self.url}: bucket {self.bucket!r} does not exist at {self.endpoint}"
            ) from None

    def _probe(self) -> None:
        """One ``HeadBucket`` within ``probe_timeout``, no retry: returns if the
        endpoint answers (a refusal is an answer too), raises otherwise."""
        try:
            self._check_bucket(self._probe_client)
        except StoreUnavailableError:
            pass

    def _request(self, operation: str, *, client=None, **params: Any) -> dict:
        """One S3 request (``operation`` is the boto3 method, on this store's
        bucket), its errors mapped: :class:`_Retry` (connection, timeout, 429,
        5xx), :class:`_Missing` (404 of an object), :class:`_Precondition` (412),
        :class:`StoreUnavailableError` (no bucket, access refused, no
        credentials, another refusal)."""
        self._count("requests")
        try:
            return getattr(client or self._client, operation)(Bucket=self.bucket, **params)
        except botocore.exceptions.ClientError as exc:
            raise self._client_error(exc, operation) from None
        except (botocore.exceptions.NoCredentialsError, botocore.exceptions.PartialCredentialsError) as exc:
            raise StoreUnavailableError(
                f"store {self.url}: no S3 credentials ({exc}): set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
            ) from None
        except botocore.exceptions.BotoCoreError as exc:
            raise _Retry(_describe(exc)) from None

    def _client_error(self, exc: Exception, operation: str) -> Exception:
        response = getattr(exc, "response", {}) or {}
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        error = response.get("Error", {})
        code, message = str(error.get("Code", "")), error.get("Message", "")
        if code == "NoSuchBucket":
            return StoreUnavailableError(f"store {self.url}: bucket {self.bucket!r} does not exist at {self.endpoint}")
        if status == 429 or status >= 500 or code in RETRY_CODES:
            return _Retry(f"HTTP {status} {code} from {operation}")
        if code in MISSING_CODES or status == 404:
            return _Missing()
        if status == 412 or code == "PreconditionFailed":
            return _Precondition()
        if status == 403 or code in ACCESS_CODES:
            return StoreUnavailableError(
                f"store {self.url}: access refused by {self.endpoint}: {code or status} {message} "
                "(check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY and the key's permissions on the bucket)"
            )
        return StoreUnavailableError(f"{operation} at {self.url}: refused: HTTP {status} {code} {message}".rstrip())

    def _read_body(self, response: dict, limit: int, what: str, deadline: float | None) -> Iterator[bytes]:
        """The body of a ``GetObject`` answer in pieces, at most ``limit`` bytes
        (its ``ContentLength`` checked before any is read, then counted), closed
        at the end; a failed read is :class:`_Retry`, one past ``deadline`` too."""
        body = response["Body"]
        got = 0
        try:
            length = response.get("ContentLength")
            if isinstance(length, int) and length > limit:
                raise too_large(what, length, limit)
            while True:
                try:
                    piece = body.read(READ_PIECE)
                except (botocore.exceptions.BotoCoreError, OSError, ValueError) as exc:
                    raise _Retry(f"reading {what}: {_describe(exc)}") from None
                if not piece:
                    return
                got += len(piece)
                self._count("bytes_received", len(piece))
                if got > limit:
                    raise too_large(what, got, limit)
                if deadline is not None and time.monotonic() > deadline:
                    raise _Retry(f"deadline passed while reading {what}")
                yield piece
        finally:
            body.close()

    def _get_object(self, key: str, limit: int, what: str) -> bytes | None:
        """The bytes of object ``key`` (at most ``limit``), or None if absent."""

        def attempt(deadline: float) -> bytes | None:
            try:
                response = self._request("get_object", Key=key)
            except _Missing:
                return None
            return b"".join(self._read_body(response, limit, what, deadline))

        return self._call(f"reading {what}", attempt)

    # --- keys ----------------------------------------------------------------------------
    def _key(self, *parts: str) -> str:
        return "/".join((self.prefix, *parts)) if self.prefix else "/".join(parts)

    def _blob_key(self, space: str, digest: str) -> str:
        hexdigest = check_digest(digest).split(":", 1)[1]
        if space == "chunks":
            return self._key("chunks", "sha256", hexdigest[:2], hexdigest)
        if space in SPACES:
            return self._key(space, "sha256", hexdigest)
        raise InvalidInputError(f"unknown store space {space!r}")

    def _ref_key(self, kind: str, name: str) -> str:
        self._check_ref(kind, name)
        key = self._key("refs", kind, name)
        if len(key.encode()) > MAX_KEY_BYTES:
            raise InvalidInputError(f"name {name!r} is too long for {self.url}: its key passes S3's 1024 bytes")
        return key

    list_page = 1000
    """Keys per ``ListObjectsV2`` page (S3's most)."""

    def _keys(self, prefix: str) -> Iterator[str]:
        """Every key under ``prefix`` (one ``ListObjectsV2`` exchange a page)."""
        token: str | None = None
        while True:
            params: dict[str, Any] = {"Prefix": prefix, "MaxKeys": self.list_page}
            if token:
                params["ContinuationToken"] = token
            page = self._call(f"listing {prefix}", lambda deadline, p=params: self._request("list_objects_v2", **p))
            for item in page.get("Contents", []):
                yield item["Key"]
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return

    # --- the Store backend ---------------------------------------------------------------
    def _has(self, space: str, digest: str) -> bool:
        key = self._blob_key(space, digest)

        def attempt(deadline: float) -> bool:
            try:
                self._request("head_object", Key=key)
            except _Missing:
                return False
            return True

        return self._call(f"checking {space[:-1]} {digest}", attempt)

    def _modified(self, space: str, digest: str) -> float | None:
        key = self._blob_key(space, digest)

        def attempt(deadline: float) -> float | None:
            try:
                return self._request("head_object", Key=key)["LastModified"].timestamp()
            except _Missing:
                return None

        return self._call(f"checking {space[:-1]} {digest}", attempt)

    def _put(self, space: str, digest: str, data: bytes) -> None:
        self._put_object(self._blob_key(space, digest), data, f"writing {space[:-1]} {digest}")

    def _put_object(self, key: str, data: bytes, what: str, **conditions: str) -> None:
        """``PutObject`` of ``data`` (S3 writes an object whole or not at all);
        ``conditions``: ``IfMatch`` / ``IfNoneMatch`` (:class:`_Precondition` if one fails)."""

        def attempt(deadline: float) -> None:
            self._request("put_object", Key=key, Body=data, **conditions)
            self._count("bytes_sent", len(data))

        self._call(what, attempt)

    def _get(self, space: str, digest: str, max_bytes: int | None = None) -> bytes:
        what = f"{space[:-1]} {digest} in {self.url}"
        data = self._get_object(self._blob_key(space, digest), read_limit(space, max_bytes), what)
        if data is None:
            raise NotFoundError(f"no {space[:-1]} {digest} in {self.url}")
        return data

    def _stream(self, space: str, digest: str, max_bytes: int | None = None) -> Iterator[bytes]:
        """The object in pieces as they arrive, from one ``GetObject`` (opening it
        is retried like any exchange; a read failing midway raises
        :class:`StoreUnavailableError`; each read waits at most ``read_timeout``,
        no overall deadline, so a large pack on a slow link is not cut off)."""
        limit = read_limit(space, max_bytes)
        what = f"{space[:-1]} {digest} in {self.url}"
        key = self._blob_key(space, digest)

        def attempt(deadline: float) -> dict:
            try:
                return self._request("get_object", Key=key)
            except _Missing:
                raise NotFoundError(f"no {space[:-1]} {digest} in {self.url}") from None

        response = self._call(f"reading {what}", attempt)
        try:
            yield from self._read_body(response, limit, what, None)
        except _Retry as exc:
            raise StoreUnavailableError(f"{exc} (endpoint {self.endpoint})") from None

    def _list(self, space: str) -> Iterator[str]:
        for key in self._keys(self._key(space, "sha256") + "/"):
            hexdigest = key.rsplit("/", 1)[-1]
            if _HEX_RE.match(hexdigest):
                yield f"sha256:{hexdigest}"

    def _delete(self, space: str, digest: str) -> None:
        key = self._blob_key(space, digest)
        self._call(f"deleting {space[:-1]} {digest}", lambda deadline: self._request("delete_object", Key=key))

    # --- refs ----------------------------------------------------------------------------
    def set_ref(self, kind: str, name: str, digest: str) -> None:
        """Point ref ``kind/name`` at ``digest``: one ``PutObject`` (atomic
        replace; of two writers, the last one wins)."""
        key = self._ref_key(kind, name)
        check_digest(digest)
        self._put_object(key, (digest + "\n").encode(), f"writing ref {kind}/{name}")

    def _read_ref(self, kind: str, name: str) -> tuple[str, str] | None:
        """``(digest, ETag)`` of ref ``kind/name``, or None if it does not exist."""
        key = self._ref_key(kind, name)
        what = f"ref {kind}/{name} in {self.url}"

        def attempt(deadline: float) -> tuple[bytes, str] | None:
            try:
                response = self._request("get_object", Key=key)
            except _Missing:
                return None
            return b"".join(self._read_body(response, MAX_REF_BYTES, what, deadline)), response.get("ETag", "")

        found = self._call(f"reading {what}", attempt)
        if found is None:
            return None
        data, etag = found
        try:
            return check_digest(data.decode().strip()), etag
        except (UnicodeDecodeError, InvalidInputError):
            raise InvalidInputError(f"{what} is damaged: it holds {data[:80]!r}, not a digest") from None

    def get_ref(self, kind: str, name: str) -> str:
        found = self._read_ref(kind, name)
        if found is None:
            raise NotFoundError(f"no {kind[:-1]} named {name!r} in {self.url}")
        return found[0]

    def swap_ref(self, kind: str, name: str, digest: str, *, expected: str | None) -> None:
        """:meth:`Store.swap_ref`, atomically: a conditional ``PutObject``
        (``If-Match`` on the ETag of the ref read, or ``If-None-Match: *``);
        :class:`BusyError` also when the ref was moved between that read and
        the write (the server answers 412)."""
        key = self._ref_key(kind, name)
        check_digest(digest)
        found = self._read_ref(kind, name)
        current = None if found is None else found[0]
        if current != expected:
            raise ref_moved(self.url, kind, name, current, expected)
        condition = {"IfNoneMatch": "*"} if found is None else {"IfMatch": found[1]}
        try:
            self._put_object(key, (digest + "\n").encode(), f"writing ref {kind}/{name}", **condition)
        except _Precondition:
            raise BusyError(f"ref {kind}/{name} in {self.url} was moved by another writer meanwhile") from None

    def ref_names(self, kind: str) -> list[str]:
        """One listing, no ref read."""
        self._check_ref(kind, "x")
        base = self._key("refs", kind) + "/"
        return sorted(key[len(base) :] for key in self._keys(base))

    def list_refs(self, kind: str) -> dict[str, str]:
        """Every ref of ``kind``; a damaged one (not a digest, or past
        ``MAX_REF_BYTES``) is left out with a warning."""
        self._check_ref(kind, "x")
        base = self._key("refs", kind) + "/"
        refs = {}
        for key in sorted(self._keys(base)):
            name = key[len(base) :]
            try:
                found = self._read_ref(kind, name)
            except (InvalidInputError, ContentLimitError) as exc:  # damaged, or a key weenv did not write
                log.warning("%s", exc)
                continue
            if found is not None:  # else deleted meanwhile
                refs[name] = found[0]
        return refs

    def delete_ref(self, kind: str, name: str, *, expected: str | None = None) -> None:
        """:meth:`Store.delete_ref`; ``expected`` is checked, then the key deleted."""
        key = self._ref_key(kind, name)
        if expected is not None and self.ref_or_none(kind, name) != expected:
            return
        self._call(f"deleting ref {kind}/{name}", lambda deadline: self._request("delete_object", Key=key))

    def close(self) -> None:
        """Stop the breaker's probes, close the connection pools.  Idempotent."""
        self.breaker.close()
        for client in (self._client, self._probe_client):
            client.close()


_SESSION_LOCK = threading.Lock()
"""Held while a client is made."""


@functools.cache
def _loader():
    """botocore's data loader (service models, endpoints), shared by the stores'
    sessions: each session would load and parse that JSON anew (~0.3 s)."""
    return botocore.session.get_session().get_component("data_loader")


def _session():
    """A boto3 session of its own (credentials are resolved per session, so a
    store opened after the environment changed sees the new ones), with the
    shared loader."""
    core = botocore.session.get_session()
    core.register_component("data_loader", _loader())
    return boto3.session.Session(botocore_session=core)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
