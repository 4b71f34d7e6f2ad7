"""Leases: how writers, rollbacks and gc sharing one store agree on what is in use.

A **lease** is a record kept in the store itself, so it works the same for
every backend (``file://``, ``oci://``, ``s3://``) and among every process and
node that opens the store: a small JSON blob in the manifests space
(``media_type`` :data:`LEASE_MEDIA_TYPE`) that the ref ``leases/ID`` points
at.  It names the digests (chunks, manifests, packs) its holder relies on and
the wall-clock time it expires.  Its holder rewrites it (a new blob, the ref
moved, the old blob deleted) when it names more digests and every third of
its duration (:func:`lease_seconds`, ``WEENV_STORE_LEASE_S``) to renew it;
a holder killed with SIGKILL stops renewing, so its lease expires and protects
nothing after that time.  An expired lease is ignored by everyone and
removed by ``weenv gc``.

Two purposes:

- a **write lease** (an import, a build, a snapshot being published) names
  every digest it writes *or relies on*, a chunk it found already stored and
  did not write included, until its template or ref is published or it is
  rolled back;
- a **delete lease** (a rollback, a gc) names the digests it is about to
  delete, while it deletes them.

The protocol (:class:`LeasedStore` for writers, :func:`delete_unused` for
deleters), with ``D`` one digest:

- writer: (W1) its write lease names ``D`` (written to the store); then (W2) it
  reads the live delete leases, and while one names ``D`` it waits for that
  one to end; then (W3) it checks whether ``D`` is stored and writes it if
  not.  It publishes its ref, and only then drops its lease.
- deleter: (D1) its delete lease names ``D``; then (D2) it reads the live write
  leases, and keeps ``D`` if one (not its own) names it; then (D3) it reads
  the refs and what they reach, and keeps ``D`` if reached; then (D4) it
  deletes ``D`` (only while its own lease is still unexpired) and drops its
  lease.

Why no published or relied-on digest is lost.  The store is linearizable for
these reads and writes (a local file system; S3's strong read-after-write and
list-after-write consistency; a registry's manifest API).  Take a writer and
a deleter of the same ``D``.  W1 precedes W2 and D1 precedes D2 (each holder's
own program order).  If D2 precedes W1, then D1 < D2 < W1 < W2: the writer
reads the deleter's lease at W2 and waits until it is gone, which is after D4,
so at W3 it sees ``D`` missing and writes it again.  Otherwise W1 precedes D2:
the deleter reads the writer's lease and keeps ``D``, as long as that lease
lives.  The writer drops its lease only after its ref is published, and the
deleter reads the leases (D2) before the refs (D3): if D2 precedes the drop it
sees the lease, else D3 follows the ref's publication and reaches ``D``
through it.  Either way ``D`` stays.  Both sides' waits are bounded by lease
expiry, and a holder whose lease expired before it could renew it must not go
on (:meth:`Lease.check`: a writer refuses to publish, a deleter stops); a
renewal whose write ended after the old record expired does not revive the
lease (a deleter may have read the leases in the gap).  A writer waits for a
delete lease at most :data:`MAX_WAIT_LEASES` times its own duration, then
fails naming it (a record expiring far ahead was not written by a deleter at
work).  A record that cannot be read protects nothing and is skipped.  Clocks
of the nodes sharing a store are assumed to agree to well within a lease's
duration.

gc adds a grace period (:func:`gc_grace_seconds`, ``WEENV_GC_GRACE_S``): it
spares what was stored more recently than that (on backends that tell a
blob's time: ``file://``, ``s3://``), for writers that take no lease.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from weenv.config import settings
from weenv.errors import BusyError, DigestMismatchError, InvalidInputError, NotFoundError, StoreUnavailableError
from weenv.formats.manifest import sha256_digest
from weenv.store.base import Store

log = logging.getLogger(__name__)

LEASE_MEDIA_TYPE = "application/vnd.weenv.lease.v1+json"
REF_KIND = "leases"
DEFAULT_LEASE_S = 300.0
"""How long a lease protects its digests without being renewed."""
DEFAULT_GC_GRACE_S = 0.0
"""What gc spares by age alone (leases are what protects writers in progress)."""
WAIT_POLL_S = 0.2
"""How often a writer blocked by a delete lease looks again."""
MAX_WAIT_LEASES = 2
"""A writer waits for a delete lease at most this many times its own lease's duration."""
DELETE_BATCH = 20_000
"""Digests one delete lease names at most (its record: about 1.4 MB)."""


def lease_seconds() -> float:
    """``WEENV_STORE_LEASE_S``: how long a lease lives unrenewed (default :data:`DEFAULT_LEASE_S`)."""
    return settings().store.lease_s


def gc_grace_seconds() -> float:
    """``WEENV_GC_GRACE_S``: gc spares blobs stored more recently (default :data:`DEFAULT_GC_GRACE_S`)."""
    return settings().store.gc_grace_s


@dataclass(frozen=True)
class LeaseRecord:
    """One lease as read from the store."""

    id: str
    purpose: str
    """``"write"`` or ``"delete"``."""
    holder: str
    """``host:pid`` of the process that holds it."""
    what: str
    expires: float
    """Wall-clock time (``time.time()``) after which it protects nothing."""
    digests: frozenset[str]

    def live(self, now: float | None = None) -> bool:
        return (time.time() if now is None else now) < self.expires


def is_lease(data: bytes) -> bool:
    """Whether manifest-space blob ``data`` is a lease record."""
    try:
        return json.loads(data).get("media_type") == LEASE_MEDIA_TYPE
    except (ValueError, AttributeError, RecursionError):
        return False


def parse_lease(data: bytes) -> LeaseRecord:
    try:
        doc = json.loads(data)
        if doc.get("media_type") != LEASE_MEDIA_TYPE:
            raise ValueError("not a lease")
        return LeaseRecord(
            str(doc["id"]),
            str(doc["purpose"]),
            str(doc["holder"]),
            str(doc.get("what", "")),
            float(doc["expires"]),
            frozenset(doc["digests"]),
        )
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:  # RecursionError: nested too deep
        raise InvalidInputError(f"damaged lease record: {exc}") from None


_warned: set[tuple[str, str]] = set()  # damaged records logged already: (store url, digest)


def read_leases(store: Store, purpose: str | None = None) -> Iterator[LeaseRecord]:
    """Every lease in ``store`` (of ``purpose``: its id starts with it), live or
    expired (one that is dropped while it is read is left out)."""
    for lease_id in store.ref_names(REF_KIND):  # names first: a writer reads only the (few) delete leases
        if purpose is not None and not lease_id.startswith(f"{purpose}-"):
            continue
        try:
            digest = store.ref_or_none(REF_KIND, lease_id)
        except (InvalidInputError, DigestMismatchError) as exc:  # a damaged ref
            log.warning("lease %s in %s is skipped: %s", lease_id, store.url, exc)
            continue
        for _ in range(5):  # its holder may move the ref and delete the blob under us: read the ref again
            if digest is None:  # dropped meanwhile
                break
            try:
                yield parse_lease(store.get_manifest(digest))
                break
            except NotFoundError:
                digest = store.ref_or_none(REF_KIND, lease_id)
            except (InvalidInputError, DigestMismatchError) as exc:  # damaged, or past the manifest limit
                if (store.url, digest) not in _warned:  # once per record, not at every lease write
                    _warned.add((store.url, digest))
                    log.warning("lease %s in %s is skipped: %s", lease_id, store.url, exc)
                break


def leased_digests(store: Store, purpose: str, *, exclude: str | None = None) -> set[str]:
    """The digests named by the live leases of ``purpose`` (but lease ``exclude``)."""
    now = time.time()
    found: set[str] = set()
    for record in read_leases(store, purpose):
        if record.purpose == purpose and record.id != exclude and record.live(now):
            found |= record.digests
    return found


class Lease:
    """A lease held by this process (module docstring).  As a context manager:
    taken on entry, renewed in a thread while held, dropped on exit.

    ``purpose``: ``"write"`` or ``"delete"``; ``what``: a line for people
    (``import NAME``); ``duration``: seconds (default :func:`lease_seconds`).
    """

    def __init__(
        self,
        store: Store,
        *,
        purpose: str = "write",
        what: str = "",
        duration: float | None = None,
        digests: Iterable[str] = (),
    ):
        if purpose not in ("write", "delete"):
            raise InvalidInputError(f"lease purpose must be 'write' or 'delete', not {purpose!r}")
        self.store = store
        self.purpose = purpose
        self.what = what
        self.duration = lease_seconds() if duration is None else duration
        self.id = f"{purpose}-{secrets.token_hex(8)}"
        self.holder = f"{socket.gethostname()}:{os.getpid()}"
        self._lock = threading.Lock()  # the digests and generations below
        self._flush_lock = threading.Lock()  # one record write at a time
        self._digests: dict[str, int] = dict.fromkeys(digests, 0)  # digest -> generation that added it
        self._wanted = 0  # generation of the digest set
        self._flushed = -1  # generation last written
        self._blob: str | None = None
        self._expires = 0.0  # of the record last written
        self._lost: str | None = None
        self._deleting: set[str] = set()  # named by delete leases, read after the last write
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    # --- holding it ----------------------------------------------------------------------
    def take(self) -> Lease:
        """Write the record and start renewing it."""
        self._flush(self._wanted)
        self._renewer = threading.Thread(target=self._renew, name=f"lease-{self.id}", daemon=True)
        self._renewer.start()
        return self

    def drop(self) -> None:
        """Stop renewing and remove the record (idempotent; errors are logged:
        a record left behind expires)."""
        self._stop.set()
        if self._renewer is not None and self._renewer is not threading.current_thread():
            self._renewer.join()
        with self._flush_lock:
            blob, self._blob = self._blob, None
            if blob is None:
                return
            try:
                self.store.delete_ref(REF_KIND, self.id)
                self.store.delete_manifest(blob)
            except Exception as exc:  # noqa: BLE001 - it expires on its own
                log.warning("could not drop lease %s from %s: %s", self.id, self.store.url, exc)

    def __enter__(self) -> Lease:
        return self.take()

    def __exit__(self, *exc) -> None:
        self.drop()

    def check(self, margin: float = 0.0) -> None:
        """Raise :class:`BusyError` if the lease expired (a renewal came too
        late) or expires within ``margin`` seconds: what it protected may be gone."""
        if self._lost is None and time.time() + margin >= self._expires:
            self._lost = f"it expired at {self._expires:.0f}"
        if self._lost is not None:
            raise BusyError(f"lease {self.id} ({self.what}) on {self.store.url} was lost: {self._lost}")

    # --- naming digests ------------------------------------------------------------------
    def expect(self, digests: Iterable[str]) -> int:
        """Add ``digests`` to the record's next write, without writing it: a
        writer that knows what it will store names it early, so that one write
        serves many :meth:`cover` calls.  Returns the generation that names them."""
        with self._lock:
            fresh = [d for d in digests if d not in self._digests]
            if fresh:
                self._wanted += 1
                self._digests.update(dict.fromkeys(fresh, self._wanted))
            return max((self._digests[d] for d in digests), default=0) if not fresh else self._wanted

    def cover(self, digests: Iterable[str]) -> None:
        """Name ``digests`` in the record (written before this returns); for a
        write lease, then wait while a live delete lease names any of them.
        After it returns, a presence check of these digests is safe."""
        digests = set(digests)
        self._flush(self.expect(digests))
        if self.purpose == "write":
            self._wait_for_deleters(digests)

    def _flush(self, gen: int) -> None:
        """Write the record if generation ``gen`` is not written yet (group commit:
        one write serves every caller waiting meanwhile)."""
        with self._flush_lock:
            if self._flushed >= gen:
                return
            if self._blob is not None:  # a renewal or more digests: not after it expired
                self.check()
            with self._lock:
                gen, digests = self._wanted, sorted(self._digests)
            expires = time.time() + self.duration
            data = json.dumps(
                {
                    "media_type": LEASE_MEDIA_TYPE,
                    "id": self.id,
                    "purpose": self.purpose,
                    "holder": self.holder,
                    "what": self.what,
                    "expires": expires,
                    "digests": digests,
                },
                sort_keys=True,
            ).encode()
            blob = sha256_digest(data)  # new bytes each time (its expiry): written without asking first
            self.store._put("manifests", blob, data)
            self.store.set_ref(REF_KIND, self.id, blob)
            landed, before = time.time(), self._expires
            old, self._blob, self._expires, self._flushed = self._blob, blob, expires, gen
            if old is not None and old != blob:
                try:
                    self.store.delete_manifest(old)
                except (StoreUnavailableError, NotFoundError) as exc:
                    log.warning("lease %s: old record %s stays until gc: %s", self.id, old, exc)
            if old is not None and landed >= before:  # the write took (or was paused) past the old record's
                # expiry: a deleter may have gone by meanwhile, so the new record must not revive the lease
                self._lost = f"a write of its record ended at {landed:.0f}, after it expired at {before:.0f}"
                self.check()
            if self.purpose == "write":  # read after this write: what the waits go by
                self._deleting = leased_digests(self.store, "delete")

    def _wait_for_deleters(self, digests: set[str]) -> None:
        """Wait while a live delete lease names one of ``digests``, at most
        :data:`MAX_WAIT_LEASES` times this lease's duration: a deleter renews its
        lease only while it deletes, so a delete lease that lives longer is
        not a delete in progress (a record whose ``expires`` lies far ahead:
        a clock far off, or a record written by hand) and a clear error beats
        waiting for ever."""
        blocked = digests & self._deleting
        give_up = time.monotonic() + MAX_WAIT_LEASES * self.duration
        while blocked:
            log.info("lease %s waits for a delete of %d digests to end", self.id, len(blocked))
            if time.monotonic() > give_up:
                holders = [
                    f"{r.id} ({r.what}, {r.holder}, expires {r.expires:.10g})"
                    for r in read_leases(self.store, "delete")
                    if r.live() and r.digests & blocked
                ][:3]
                raise BusyError(
                    f"{self.store.url}: {len(blocked)} digests ({min(blocked)}...) stay named by delete "
                    f"leases for more than {MAX_WAIT_LEASES * self.duration:.0f} s: {', '.join(holders)}; "
                    f"if no gc or rollback runs, remove their refs leases/ID"
                )
            time.sleep(WAIT_POLL_S)
            self.check()
            deleting = leased_digests(self.store, "delete")
            blocked &= deleting

    def _renew(self) -> None:
        while not self._stop.wait(self.duration / 3):
            try:
                with self._lock:
                    self._wanted += 1
                    gen = self._wanted
                self._flush(gen)
            except BusyError as exc:
                log.error("%s", exc)
                return
            except Exception as exc:  # noqa: BLE001 - try again next time; check() says if it was too late
                log.warning("could not renew lease %s on %s: %s", self.id, self.store.url, exc)


def covered(lease: Lease, find: Callable[[], str | None], reached: Callable[[str], Iterable[str]]) -> str | None:
    """The digest ``find()`` names, once ``lease`` names it and the digests
    ``reached(it)`` lists, and ``find()`` still names it (W3 for what a writer
    reuses: ``find`` checks that it and all it reaches are stored, and only
    the check made after the lease is written counts, so a gc that deleted
    them meanwhile makes it a miss); None on a miss (``reached`` raising
    :class:`NotFoundError` included)."""
    hit = find()
    if hit is None:
        return None
    try:
        lease.cover([hit, *reached(hit)])
    except NotFoundError:
        return None
    return hit if find() == hit else None


class LeasedStore(Store):
    """``store`` seen through write lease ``lease``: every chunk, manifest and
    pack stored through it is named in the lease before the store is asked
    whether it holds it (W1-W3 of the module docstring).  Everything else goes
    to ``store`` unchanged."""

    def __init__(self, store: Store, lease: Lease):
        self.inner = store
        self.lease = lease
        self.url = store.url

    def _claim(self, space: str, digest: str) -> None:
        self.lease.cover([digest])

    def expect_chunk(self, plaintext: bytes | bytearray) -> None:
        """Name the chunk of ``plaintext`` in the lease's next write (:meth:`Lease.expect`):
        a :class:`~weenv.packaging.chunksink.ChunkSink` calls it as it hands a chunk to its
        workers, so one lease write covers the chunks in flight, not one each."""
        self.lease.expect([sha256_digest(plaintext)])

    def _has(self, space, digest):
        return self.inner._has(space, digest)

    def _put(self, space, digest, data):
        return self.inner._put(space, digest, data)

    def _get(self, space, digest, max_bytes=None):
        return self.inner._get(space, digest, max_bytes)

    def _stream(self, space, digest, max_bytes=None):
        return self.inner._stream(space, digest, max_bytes)

    def _get_frame(self, digest, stored_digest, max_bytes=None):
        return self.inner._get_frame(digest, stored_digest, max_bytes)

    def _list(self, space):
        return self.inner._list(space)

    def _delete(self, space, digest):
        return self.inner._delete(space, digest)

    def _modified(self, space, digest):
        return self.inner._modified(space, digest)

    def set_ref(self, kind, name, digest):
        return self.inner.set_ref(kind, name, digest)

    def swap_ref(self, kind, name, digest, *, expected):
        return self.inner.swap_ref(kind, name, digest, expected=expected)

    def get_ref(self, kind, name):
        return self.inner.get_ref(kind, name)

    def list_refs(self, kind):
        return self.inner.list_refs(kind)

    def ref_names(self, kind):
        return self.inner.ref_names(kind)

    def delete_ref(self, kind, name, *, expected=None):
        return self.inner.delete_ref(kind, name, expected=expected)

    def close(self) -> None:
        """The inner store is the caller's to close."""


@dataclass(frozen=True)
class Deleted:
    """What :func:`delete_unused` removed and kept."""

    removed: list[str]
    kept: list[str]


def delete_unused(
    store: Store,
    candidates: dict[str, Iterable[str]],
    *,
    reached: Callable[[], set[str]],
    what: str,
    exclude: str | None = None,
    duration: float | None = None,
) -> Deleted:
    """Delete the ``candidates`` (``{space: digests}``, spaces as
    :data:`weenv.store.base.SPACES`) that no live write lease (but lease
    ``exclude``, the caller's own) names and ``reached()`` does not return
    (the digests that published refs reach, read when it is called): D1-D4 of
    the module docstring, in batches of at most :data:`DELETE_BATCH` (a
    lease record stays small).  Stops (what is left is kept) if its own lease
    is lost meanwhile.  Deletes manifests before packs and chunks, so nothing
    stored ever names a chunk that is gone."""
    order = [(space, d) for space in ("manifests", "packs", "chunks") for d in sorted(set(candidates.get(space, ())))]
    removed: list[str] = []
    for start in range(0, len(order), DELETE_BATCH):
        batch = order[start : start + DELETE_BATCH]
        with Lease(store, purpose="delete", what=what, duration=duration, digests=[d for _, d in batch]) as lease:
            keep = leased_digests(store, "write", exclude=exclude)  # D2: leases before refs
            keep |= reached()  # D3
            for space, digest in batch:
                if digest in keep:
                    continue
                try:
                    lease.check(margin=min(5.0, lease.duration / 10))
                except BusyError as exc:
                    log.warning("%s: stopping", exc)
                    return Deleted(removed, sorted({d for _, d in order} - set(removed)))
                store._delete(space, digest)
                removed.append(digest)
    return Deleted(removed, sorted({d for _, d in order} - set(removed)))
