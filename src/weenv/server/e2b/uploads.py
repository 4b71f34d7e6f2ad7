"""The uploads of E2B COPY steps on one node: their files, tokens, checks and lifetimes.

An upload is the gzip tar the ``e2b`` SDK PUTs to weenv's upload link for one
``filesHash``: ``$WEENV_HOME/e2b/files/HASH.tar``, written to a temporary
``.HASH.RANDOM.part`` as it arrives and renamed into place when whole.

- **Checked as it arrives** (:class:`~weenv.packaging.tarscan.TarScan`): a
  tar, extended headers of at most 1 MiB, at most
  :data:`~weenv.packaging.steps.MAX_COPY_ENTRIES` members and
  :data:`~weenv.packaging.steps.MAX_COPY_BYTES` bytes of files, all before
  the bytes past the offending header are read
  (:class:`~weenv.errors.InvalidInputError`, 400).  Its ``filesHash`` is
  checked where a build uses it (:mod:`weenv.packaging.fileshash`: the hash
  covers the COPY's ``src`` and ``dest``, which the link does not carry).
- **Tokens** (:meth:`Uploads.token`): the upload link's header
  ``X-Weenv-Upload-Token`` is ``TEMPLATE/HASH/EXPIRES/MAC`` (HMAC-SHA256 under
  the daemon's secret); it authorises one route, ``PUT
  /e2b/templates/TEMPLATE/files/HASH/upload``, until ``EXPIRES`` (unix seconds,
  ``ttl_s`` after the link was given), and nothing else: it is no credential
  for another route's body limit (:func:`upload_route`).
- **Lifetimes.**  An upload is kept while a build that is waiting or running
  names it in a COPY (:meth:`Uploads.hold`), or while a *claim* on it lives: a
  template asked for its link (``GET /templates/{id}/files/{hash}``, present
  or not) less than ``ttl_s`` ago and has not started a build since (a build
  start turns its template's claims into holds).  Any other upload is removed
  (:meth:`Uploads.sweep`): when a build ends (:meth:`Uploads.release`), when its
  template is deleted, on every link and upload, and every ``ttl_s / 4``
  seconds (at most 60).  At start, uploads on disk are claimed from their
  files' modification times, and ``.part`` files are removed.
- **Bounded in total**: the uploads on disk and those arriving hold at most
  ``max_total`` bytes (announced ``Content-Length`` reserved first, a chunked
  body counted as it comes); past that an upload is refused with
  :class:`~weenv.errors.CapacityError` (503) after a sweep.

Thread-safe.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import threading
import time
from pathlib import Path

from weenv.errors import AuthenticationError, CapacityError, InvalidInputError, RequestTooLargeError
from weenv.packaging.steps import MAX_COPY_BYTES, MAX_COPY_ENTRIES
from weenv.packaging.tarscan import TarScan

MAX_UPLOAD_BYTES = 4 << 30
"""Largest COPY upload (its gzip tar), bytes."""
UPLOADS_MAX_BYTES = 16 << 30
"""Bytes all uploads of a node hold at once (``WEENV_E2B_UPLOADS_MAX_BYTES``)."""
UPLOAD_TTL_S = 3600.0
"""Seconds an upload token lives, and an upload no build holds is kept (``WEENV_E2B_UPLOAD_TTL_S``)."""
HASH_RE = re.compile(r"^[0-9a-f]{64}$")
ROUTE_RE = re.compile(r"^/e2b/templates/([^/]+)/files/([0-9a-f]{64})/upload$")
"""The upload route, as the daemon's app sees it (the E2B face mounted at ``/e2b``)."""


def upload_route(method: str, path: str) -> tuple[str, str] | None:
    """``(template id, hash)`` of the upload route ``method path`` is, else None."""
    m = ROUTE_RE.match(path) if method == "PUT" else None
    return (m.group(1), m.group(2)) if m else None


class UploadTokens:
    """The upload tokens of the daemon whose token secret is ``secret``
    (:func:`~weenv.server.e2b.sandboxes.token_secret` of its E2B key): made by
    its node, checked there and by a cluster's gateway, which knows the
    node's key (see the module docstring for their form)."""

    def __init__(self, secret: bytes):
        self._key = hmac.new(secret, b"weenv e2b uploads", hashlib.sha256).digest()

    def _mac(self, template_id: str, files_hash: str, expires: int) -> str:
        return hmac.new(self._key, f"{template_id}/{files_hash}/{expires}".encode(), hashlib.sha256).hexdigest()

    def token(self, template_id: str, files_hash: str, ttl_s: float) -> str:
        """A token for the upload of ``files_hash`` for ``template_id``, for ``ttl_s`` seconds."""
        expires = int(time.time() + ttl_s)
        return f"{template_id}/{files_hash}/{expires}/{self._mac(template_id, files_hash, expires)}"

    def check(self, token: str | None, template_id: str, files_hash: str) -> None:
        """Raise :class:`AuthenticationError` unless ``token`` authorises the
        upload of ``files_hash`` for ``template_id`` now."""
        parts = (token or "").split("/")
        if (
            len(parts) != 4
            or not parts[2].isdigit()
            or parts[:2] != [template_id, files_hash]
            or not hmac.compare_digest(
                parts[3].encode(errors="surrogateescape"), self._mac(*parts[:2], int(parts[2])).encode()
            )
        ):
            raise AuthenticationError(
                "missing or wrong upload token (ask GET /templates/{id}/files/{hash} for the link)"
            )
        if int(parts[2]) < time.time():
            raise AuthenticationError("the upload token expired (ask GET /templates/{id}/files/{hash} for a new link)")

    def authorises(self, token: str | None, method: str, path: str) -> bool:
        """Whether ``token`` is a live token for the upload route ``method path`` is."""
        route = upload_route(method, path)
        if route is None:
            return False
        try:
            self.check(token, *route)
        except AuthenticationError:
            return False
        return True


class Uploads:
    """The uploads under ``directory`` (see the module docstring)."""

    def __init__(
        self,
        directory: Path,
        *,
        secret: bytes,
        ttl_s: float = UPLOAD_TTL_S,
        max_total: int = UPLOADS_MAX_BYTES,
        max_upload: int = MAX_UPLOAD_BYTES,
    ):
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.ttl_s, self.max_total, self.max_upload = ttl_s, max_total, max_upload
        self.tokens = UploadTokens(secret)
        self._lock = threading.Lock()
        self._claims: dict[tuple[str, str], float] = {}  # (template id, hash) -> unix time of the claim
        self._holds: dict[str, set[str]] = {}  # hash -> ids of the builds holding it
        self._held_by: dict[str, set[str]] = {}  # build id -> hashes
        self._bytes = 0  # on disk and reserved by uploads arriving
        for p in self.dir.iterdir():
            if p.name.endswith(".part"):
                p.unlink(missing_ok=True)
            elif p.name.endswith(".tar") and HASH_RE.match(p.stem):
                st = p.stat()
                self._claims[("", p.stem)] = st.st_mtime
                self._bytes += st.st_size
        self._stop = threading.Event()
        self._sweeper = threading.Thread(target=self._sweep_every, name="e2b-upload-sweeper", daemon=True)
        self._sweeper.start()

    # --- tokens -----------------------------------------------------------------------------
    def token(self, template_id: str, files_hash: str) -> str:
        """A token for the upload of ``files_hash`` for ``template_id``, for ``ttl_s`` seconds."""
        return self.tokens.token(template_id, files_hash, self.ttl_s)

    def check_token(self, token: str | None, template_id: str, files_hash: str) -> None:
        """Raise :class:`AuthenticationError` unless ``token`` authorises the
        upload of ``files_hash`` for ``template_id`` now."""
        self.tokens.check(token, template_id, files_hash)

    def authorises(self, token: str | None, method: str, path: str) -> bool:
        """Whether ``token`` is a live token for the upload route ``method path`` is."""
        return self.tokens.authorises(token, method, path)

    # --- files ------------------------------------------------------------------------------
    def path(self, files_hash: str) -> Path | None:
        """The upload of ``files_hash``, None if it is not here."""
        if not HASH_RE.match(files_hash):
            return None
        path = self.dir / f"{files_hash}.tar"
        return path if path.is_file() else None

    def claim(self, template_id: str, files_hash: str) -> None:
        """``template_id`` asked for the link of ``files_hash``: keep its upload ``ttl_s`` seconds."""
        with self._lock:
            self._claims[(template_id, files_hash)] = time.time()
        self.sweep()

    def hold(self, build_id: str, template_id: str, hashes: set[str]) -> None:
        """Build ``build_id`` of ``template_id`` starts and uses ``hashes``: keep them until :meth:`release`."""
        with self._lock:
            self._held_by[build_id] = set(hashes)
            for h in hashes:
                self._holds.setdefault(h, set()).add(build_id)
                self._claims.pop((template_id, h), None)

    def release(self, build_id: str) -> None:
        """Build ``build_id`` ended: its uploads go unless something else keeps them."""
        with self._lock:
            for h in self._held_by.pop(build_id, ()):
                holders = self._holds.get(h, set())
                holders.discard(build_id)
                if not holders:
                    self._holds.pop(h, None)
        self.sweep()

    def forget(self, template_id: str) -> None:
        """``template_id`` was deleted: drop its claims (then sweep)."""
        with self._lock:
            for key in [k for k in self._claims if k[0] == template_id]:
                del self._claims[key]
        self.sweep()

    def sweep(self) -> list[str]:
        """Remove every upload nothing keeps; the hashes removed."""
        removed = []
        with self._lock:
            now = time.time()
            for key in [k for k, t in self._claims.items() if t < now - self.ttl_s]:
                del self._claims[key]
            kept = set(self._holds) | {h for _, h in self._claims}
            for p in self.dir.glob("*.tar"):
                if p.stem not in kept and HASH_RE.match(p.stem):
                    try:
                        size = p.stat().st_size
                        p.unlink()
                    except FileNotFoundError:
                        continue
                    self._bytes -= size
                    removed.append(p.stem)
        return removed

    def _sweep_every(self) -> None:
        while not self._stop.wait(min(60.0, max(0.5, self.ttl_s / 4))):
            self.sweep()

    def close(self) -> None:
        self._stop.set()
        self._sweeper.join()

    def held_bytes(self) -> int:
        """Bytes the uploads hold (on disk and arriving)."""
        with self._lock:
            return self._bytes

    def _reserve(self, n: int) -> None:
        for attempt in (0, 1):
            with self._lock:
                if self._bytes + n <= self.max_total:
                    self._bytes += n
                    return
            if attempt == 0:
                self.sweep()
        raise CapacityError(
            f"this node holds {self.max_total} bytes of uploads no build has used yet; try again once builds have run"
        )

    def _unreserve(self, n: int) -> None:
        with self._lock:
            self._bytes -= n

    def writer(self, template_id: str, files_hash: str, length: int | None) -> UploadWriter:
        """A writer of the upload of ``files_hash`` (``length``: its announced
        size, refused before anything is written if past ``max_upload``, or
        past what ``max_total`` leaves)."""
        if not HASH_RE.match(files_hash):
            raise InvalidInputError(f"files hash {files_hash!r} is not 64 lowercase hex digits")
        if length is not None and length > self.max_upload:
            raise RequestTooLargeError(f"the upload has {length} bytes; at most {self.max_upload} are taken")
        self.sweep()
        return UploadWriter(self, template_id, files_hash, length or 0)


class UploadWriter:
    """An upload written to a temporary file, checked and counted as it comes,
    renamed into place by :meth:`finish`; :meth:`abort` removes it."""

    def __init__(self, uploads: Uploads, template_id: str, files_hash: str, announced: int):
        self.uploads, self.template_id, self.files_hash = uploads, template_id, files_hash
        uploads._reserve(announced)
        self.reserved = announced
        self.size = 0
        self.final = uploads.dir / f"{files_hash}.tar"
        self.tmp = uploads.dir / f".{files_hash}.{secrets.token_hex(4)}.part"
        self.scan = TarScan(max_entries=MAX_COPY_ENTRIES, max_bytes=MAX_COPY_BYTES)
        try:
            self.f = open(self.tmp, "wb")
        except BaseException:  # no writer to abort: its reservation is given back here
            uploads._unreserve(announced)
            raise
        self._done = False

    def write(self, data: bytes) -> None:
        """Check and write the next bytes; raises :class:`InvalidInputError`,
        :class:`RequestTooLargeError`, :class:`CapacityError`."""
        self.size += len(data)
        if self.size > self.uploads.max_upload:
            raise RequestTooLargeError(f"the upload is larger than {self.uploads.max_upload} bytes")
        if self.size > self.reserved:
            self.uploads._reserve(self.size - self.reserved)
            self.reserved = self.size
        self.scan.feed(data)
        self.f.write(data)

    def finish(self) -> None:
        """The body is whole: check it is a whole tar, put it in place."""
        self.scan.finish()
        self.f.close()
        u = self.uploads
        with u._lock:
            try:
                old = self.final.stat().st_size
            except FileNotFoundError:
                old = 0
            os.replace(self.tmp, self.final)
            u._bytes -= old + (self.reserved - self.size)
            u._claims[(self.template_id, self.files_hash)] = time.time()
            self._done = True

    def abort(self) -> None:
        """Drop what was written (idempotent; nothing once :meth:`finish` succeeded)."""
        if self._done:
            return
        self._done = True
        self.f.close()
        self.tmp.unlink(missing_ok=True)
        self.uploads._unreserve(self.reserved)
