"""Prefetch by recorded access order: record a template's first reads, replay them on cold starts.

**Recording.**  The first start of a template on a node that finds no profile for
it records which chunks the start reads, in order: LazyFS numbers the first read
of every chunk (:meth:`LazyFS.read_seq` / :meth:`LazyFS.first_reads`), and the
window runs from the create's start until the environment's first command
(after the create's own ``true``) ends, the environment is destroyed, or
``record_s`` seconds pass, whichever comes first.  Reads another environment
makes in the same groups during the window are included (they are reads of
the same content).  Chunks first read *before* the window (a group already
mounted and read by another template) do not reach LazyFS again (the page
cache serves them): such a group's mount reads (:meth:`LazyFS.mount_reads`)
go first, and the chunks and ranges of it that the other profiles the node
holds name are added after the recorded ones (:meth:`Prefetcher._carried`),
so that a template republished over a group it shares keeps that group's
working set in its profile and pack.  The profile is published beside
the template, in a background thread (the format: :mod:`weenv.packaging.profile`):
first its **pack**, the frames of its first ``pack_bytes`` of plaintext as one
blob (built from the node cache, where the recorded chunks just arrived), then
the profile naming it, then the ref ``prefetch/<hex of the template digest>``.

**Replay.**  A create that finds a profile, and groups not fully cached, starts
a :class:`PrefetchJob`.  With a pack, one thread streams it (one request for
the whole working set; concurrent cold starts of the template share that
stream, one starting while its last frames are still being cached too (see
:class:`PackStream`), and at most ``workers`` packs stream at once) and hands
each frame, as it arrives, to the ``workers`` threads, which check and cache it
(:meth:`ChunkCache.put_frame`; zstd and sha256 release the GIL, so two cores
decode two frames at once).  A demand read of a chunk whose frame arrived
and waits for a worker takes it (:meth:`Prefetcher.frame_for`, the cache's
:attr:`~weenv.node.data.cache.ChunkCache.frames`) rather than asking the store
again, one of a frame the stream brings soon waits for it (bounded), and one
of a chunk a worker is checking waits for that check.
Measured on 2 cores from a loopback registry,
the 24 chunks (8 MB stored) a Debian + Python start reads arrive in ~60 ms this
way against ~135 ms one by one with 4 workers.  Chunks past
the pack, and every chunk of a profile without one (or whose pack fails:
missing, cut off, a bad frame), are fetched one by one, in order, by the same
workers (from a registry a chunk then costs ~3 ms of the registry's time and
~3 ms of this process's, so a few in flight keep both busy), each first waiting
while any *demand* fetch runs (:meth:`ChunkCache.wait_demand_idle`), so
on-demand reads go first.  A chunk a demand read fetched first is skipped.

The job starts as soon as the create has resolved the template's digest
(:meth:`Prefetcher.begin_early`), while the group manifests load and the
mounts and the runtime are set up: at once when the node holds the profile,
else after looking it up in the store (two requests, beside the manifests').
A job ends when its list is done, when its environment is destroyed
(:meth:`Prefetcher.cancel`), or when it has fetched half of the cache's byte
bound (it would otherwise evict its own work).  When a job ends, groups it
completed are handed to ``on_group_complete`` (the node assembles their image
for direct mounts).

This is the ordering idea of eStargz's prioritized files and of REAP (record and
prefetch the working set of a first start).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from weenv.errors import DigestMismatchError, InvalidInputError, NotFoundError, StoreUnavailableError
from weenv.formats.limits import MAX_PROFILE_CHUNKS
from weenv.formats.manifest import ChunkRef, GroupManifest, sha256_digest
from weenv.node.data.cache import ChunkCache
from weenv.node.data.lazyfs import LazyFS
from weenv.node.data.peers import PeerChunks
from weenv.packaging.profile import (
    PrefetchPack,
    PrefetchProfile,
    build_pack,
    carried_manifests,
    load_profile,
    publish_profile,
)
from weenv.store.base import Store
from weenv.store.lease import Lease, LeasedStore

log = logging.getLogger(__name__)

PACK_BYTES = 64 << 20
"""Default plaintext bytes a published pack holds (the profile's first chunks):
what a start reads is usually far less; building holds the pack in memory."""
PACK_BUFFER_BYTES = 16 << 20
"""Bytes of frames a pack's reader gets ahead of the workers before it waits."""
PACK_POLL_S = 0.02
"""Seconds between looks at the cache while a peer waits for a chunk of a pack streaming here."""
READER_JOIN_S = 1.0
"""How long :meth:`Prefetcher.close` waits for a pack reader blocked in a store
read (it ends by itself once the read returns or times out: the store's read
timeout)."""
LOOKUP_WAIT_S = 1.0
"""How long :meth:`Prefetcher.begin` waits for a template's profile lookup (the one
:meth:`Prefetcher.begin_early` started, or its own): a frozen store must not hold
a create; the lookup's answer, when it comes, still serves later creates."""
PACK_WAIT_S = 0.25
"""How long a demand read waits for a chunk's frame that a streaming pack brings
soon (:meth:`Prefetcher.frame_for`) before it fetches the chunk itself."""
PACK_WAIT_AHEAD_BYTES = 2 << 20
"""A demand read waits for a pack's frame only if at most this many bytes of the
pack (that frame's included) are still to arrive before it: a few frames, which
a stream brings in a few ms, about what a fetch of the chunk alone costs (a
frame farther back is fetched at once)."""
TAKEN = object()
"""What :meth:`Prefetcher._take` hands out for a pack position whose frame
another job's worker took (and is done with) or a demand read took or
claimed: the chunk is skipped if cached, else fetched (see :class:`PackStream`)."""


class PackStream:
    """One pack being read, shared by every job replaying it (concurrent cold
    starts of one template read their pack once).

    **The stream** goes through three states:

    - *reading*: its reader runs (:attr:`ended` False);
    - *draining*: the reader stopped (every frame arrived, or it failed: the
      positions not received are fetched one by one), but a chunk of it is
      still on its way to the cache: its frame buffered in :attr:`frames` for
      a job of it, :attr:`claimed` by a demand read, or in a worker's hand
      (:attr:`in_hand`), or the chunk being fetched or decoded in the cache
      (by a demand read that took its frame or asks the store, or a worker);
    - *settled*: none of that.  It leaves :attr:`Prefetcher._streams`, and a
      later job of the pack (some of its chunks not cached: evicted, dropped,
      a put that failed) reads the pack anew.

    A job of the pack joins the stream while it is reading or draining
    (:meth:`Prefetcher._joinable_locked`): a cold start arriving while the
    frames are being checked and cached must not read the pack a second
    time.  A stream whose pack turned out bad leaves at once (its pack is
    not read again on this node).

    **A position**, for a job of the stream coming to it (:meth:`Prefetcher._take`):

    - not received, the reader running: the job waits;
    - buffered: the job's worker takes it and caches it (a bad frame: it
      fetches the chunk itself); it is in hand until that worker is done;
    - in another worker's hand: the job waits until that worker is done;
    - claimed by, or taken by, a demand read, or taken and done by another
      worker (:data:`TAKEN`): skipped if cached, else fetched one by one
      (the taker failed, was cancelled, or the chunk went since; a demand
      read's fetch still running is waited for by the cache, not repeated);
    - not received, the reader stopped: fetched one by one.

    So a chunk another job took is never lost to a job that skips it."""

    def __init__(self, pack: PrefetchPack, key: tuple):
        self.pack = pack
        self.key = key
        """The pack's digest and the chunks its frames are (see :meth:`Prefetcher._start_job`)."""
        self.frames: dict[int, bytes] = {}
        """Frames received that no worker took yet, by position."""
        self.buffered = 0
        """Bytes in :attr:`frames`."""
        self.received = 0
        """How many frames arrived (positions below it were handed out, or are here)."""
        self.ended = False
        """The reader stopped: all received, or failed (the rest is fetched one by one), or nobody waits."""
        self.jobs: list[PrefetchJob] = []
        self.claimed: set[int] = set()
        """Positions a demand read waits for (:meth:`Prefetcher.frame_for`): no worker takes their frames."""
        self.in_hand: set[int] = set()
        """Positions whose frame a worker took and is caching (or, the frame bad, fetching): not done yet."""
        self._positions: dict[str, int] | None = None

    def position(self, digest: str) -> int | None:
        """The position of chunk ``digest``'s frame in the pack, or None.  Caller holds the Prefetcher's lock."""
        if self._positions is None:
            self._positions = {}
            for pos, d in enumerate(self.key[1]):
                self._positions.setdefault(d, pos)
        return self._positions.get(digest)

    def take(self, pos: int) -> bytes | object:
        """Frame ``pos``, or :data:`TAKEN` if another job's worker took it.  Caller holds the Prefetcher's lock."""
        frame = self.frames.pop(pos, None)
        if frame is None:
            return TAKEN
        self.buffered -= len(frame)
        return frame

    def wanted(self) -> bool:
        """Whether a job still waits for frames.  Caller holds the Prefetcher's lock."""
        return not self.ended and any(not j.exhausted for j in self.jobs)


class PrefetchJob:
    """The background prefetch of one environment's profile."""

    def __init__(self, env_id: str, chunks: list[tuple[str, ChunkRef]], budget: int):
        self.env_id = env_id
        self.chunks = chunks
        """``(group digest, chunk)`` in profile order."""
        self.budget = budget
        self.stream: PackStream | None = None
        """The stream of the profile's pack (None: every chunk is fetched on its own)."""
        self.next = 0
        self.pending = 0
        self.fetched: list[int] = []
        """Positions in ``chunks`` this job fetched from the store one by one, in the order the fetches started."""
        self.from_pack = 0
        """Chunks this job's workers cached from the pack."""
        self.skipped = 0
        self.errors = 0
        self.bytes = 0
        self.cancelled = False
        self.started = time.monotonic()
        self.ended: float | None = None
        self.done = threading.Event()
        self.groups: dict[str, GroupManifest] | None = None
        """The template's groups, handed to ``on_group_complete`` at the end (None until known)."""

    @property
    def exhausted(self) -> bool:
        return self.cancelled or self.next >= len(self.chunks) or self.bytes >= self.budget

    @property
    def ready(self) -> bool:
        """Whether position :attr:`next` can be taken now: past the pack, or its
        frame arrived (here, or taken by another job whose worker is done with
        it), or the pack's reader stopped.  Caller holds the Prefetcher's lock."""
        s = self.stream
        if s is None or self.next >= len(s.pack.frames):
            return True
        return self.next not in s.in_hand and (self.next < s.received or s.ended)


class Prefetcher:
    """Records profiles and replays them for one node.  Thread-safe.

    ``workers``: threads that fetch and cache chunks (shared by all jobs); as
    many packs are streamed at once at most (a job beyond fetches chunk by
    chunk).  ``record_s``: the longest recording window (seconds).
    ``pack_bytes``: plaintext bytes of the profile's first chunks a published
    pack holds (0: no packs).  ``publish_lock()``: a context manager held while
    a profile and its pack are published (the node's shared store lock: a
    ``weenv gc`` of the same home waits; a write lease keeps any other gc from
    removing a pack between its upload and its profile's).
    ``on_group_complete(digest, manifest)``: called (in a thread) for each group
    of a finished job.  ``peers``: the node's
    :class:`~weenv.node.data.peers.PeerChunks` (the cache's chunk source) or None:
    a job learns it which groups its chunks are in before they are mounted
    (:meth:`~weenv.node.data.peers.PeerChunks.learn`: an early job's chunks then
    come from peers too) and which peers the create's hint names
    (:meth:`~weenv.node.data.peers.PeerChunks.adopt`), fetches a pack's chunks one
    by one instead of streaming the pack when peers hold at least half of the
    bytes of them the cache lacks, or (in a cluster) the cache holds half of
    its bytes already
    (:meth:`~weenv.node.data.peers.PeerChunks.peers_hold`), tells a peer asking for
    a chunk of a pack streaming here to wait for it (:meth:`wait_packed`), and
    streams and puts packs through it (it counts their bytes); profiles are always loaded from
    and published to ``store``."""

    def __init__(
        self,
        cache: ChunkCache,
        store: Store,
        lazyfs: LazyFS,
        *,
        workers: int = 4,
        record_s: float = 10.0,
        pack_bytes: int = PACK_BYTES,
        publish_lock: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        on_group_complete: Callable[[str, GroupManifest], object] | None = None,
        peers: PeerChunks | None = None,
    ):
        if workers < 1 or record_s <= 0 or pack_bytes < 0:
            raise InvalidInputError("prefetch wants workers >= 1, record_s > 0 and pack_bytes >= 0")
        self.cache, self.store, self.lazyfs = cache, store, lazyfs
        self.peers = peers
        self.packs: Store | PeerChunks = peers if peers is not None else store
        self.workers = workers
        self.record_s = record_s
        self.pack_bytes = pack_bytes
        self.publish_lock = publish_lock
        self.on_group_complete = on_group_complete
        self._lock = threading.Condition()
        self._profiles: dict[str, PrefetchProfile | None] = {}  # template digest -> profile (cached lookups)
        self._recording: dict[str, dict] = {}  # env id -> recording state
        self._recorded: set[str] = set()  # templates this node records or recorded
        self._jobs: dict[str, PrefetchJob] = {}  # env id -> job
        self._early: dict[str, PrefetchJob] = {}  # env id -> job begin_early started, until begin
        self._lookups: dict[str, Future] = {}  # env id -> begin_early's profile lookup, until begin
        self._looking: dict[str, Future] = {}  # template digest -> the store lookup of its profile under way
        self._queue: deque[PrefetchJob] = deque()
        self._threads: list[threading.Thread] = []
        self._streams: dict[tuple, PackStream] = {}  # (pack digest, its chunks) -> the stream reading it
        self._bad_packs: set[str] = set()  # digests of packs that turned out bad here: not read again
        self._readers: list[threading.Thread] = []  # pack readers and profile lookups (joined at close)
        self._closed = False
        self._publisher = ThreadPoolExecutor(1, thread_name_prefix="weenv-prefetch-publish")
        cache.frames = self.frame_for  # a demand read takes a frame the pack brought before a worker did

    def frame_for(self, digest: str) -> bytes | None:
        """The zstd frame of chunk ``digest`` if a pack streaming now brings it
        and no worker took it yet (it is taken: the caller, a demand read,
        decodes and checks it, which costs less than asking the store again);
        else None.  The cache's :attr:`~weenv.node.data.cache.ChunkCache.frames`.

        A frame not received yet, with at most :data:`PACK_WAIT_AHEAD_BYTES`
        of the pack before it still to come, is waited for, at most
        :data:`PACK_WAIT_S` seconds (claimed meanwhile: no worker takes it):
        the stream is already under way, while a fetch of its own would be one
        more request racing it for the same bytes (``weenv bench start``: a
        cold start's mount read a chunk that way, ~10 ms from a registry on a
        busy 2-core host, while the pack brought it a few ms later).  None if
        the stream ends or the wait runs out first (the caller fetches it)."""
        deadline = None
        with self._lock:
            while True:
                waiting = None
                for stream in self._streams.values():
                    pos = stream.position(digest)
                    if pos is None:
                        continue
                    if pos < stream.received:
                        if pos in stream.frames:
                            stream.claimed.discard(pos)
                            frame = stream.take(pos)
                            self._lock.notify_all()  # room in the reader's buffer
                            return frame if isinstance(frame, bytes) else None
                    elif (
                        not stream.ended and sum(stream.pack.frames[stream.received : pos + 1]) <= PACK_WAIT_AHEAD_BYTES
                    ):
                        waiting = (stream, pos)
                if waiting is None or self._closed:
                    for stream in self._streams.values():  # a claim of this read's is let go
                        pos = stream.position(digest)
                        if pos is not None:
                            stream.claimed.discard(pos)
                    return None
                now = time.monotonic()
                deadline = now + PACK_WAIT_S if deadline is None else deadline
                stream, pos = waiting
                if now >= deadline:
                    stream.claimed.discard(pos)  # not received: a worker takes it when it comes
                    return None
                stream.claimed.add(pos)
                self._lock.wait(deadline - now)

    # --- the create's hooks ----------------------------------------------------------
    def begin_early(self, env_id: str, template_digest: str) -> bool:
        """As soon as a create knows its template's digest, before the group
        manifests are loaded: start replaying the template's profile (when its
        chunks are not cached: evicted, or dropped), so that the first chunks
        arrive while the manifests, the mounts and the runtime are set up.  A
        profile this node holds starts at once; one it has not looked up yet is
        looked up in a background thread, which starts the job if the create
        has not reached :meth:`begin` by then.  True if a job or a lookup
        started (:meth:`begin` completes it; :meth:`cancel` if the create
        fails before).  Never raises."""
        if self._closed:
            return False
        with self._lock:
            known = template_digest in self._profiles
            profile = self._profiles.get(template_digest)
        if known:
            return self._start_early(env_id, profile)
        return self._look_up(template_digest, env_id) is not None

    def _look_up(self, template_digest: str, env_id: str | None = None) -> Future | None:
        """Look up ``template_digest``'s profile in a thread of its own, or join
        the lookup of it under way (one store lookup however many creates of
        the template start at once); the Future is done when the lookup is
        (its result: the profile or None, never an exception), and the answer
        is in ``_profiles`` unless the store did not give one.  With
        ``env_id`` (:meth:`begin_early`'s): the create's lookup, which starts
        its early job.  None if no thread could be started."""
        lookup: Future = Future()
        thread = None
        with self._lock:
            shared = self._looking.get(template_digest)
            if shared is None:
                shared = self._looking[template_digest] = Future()
                thread = threading.Thread(
                    target=self._run_lookup, args=(template_digest, shared), name="weenv-prefetch-lookup", daemon=True
                )
                self._readers = [t for t in self._readers if t.is_alive()] + [thread]
            if env_id is not None:
                self._lookups[env_id] = lookup
        if thread is not None:
            try:
                thread.start()
            except Exception as exc:  # no thread to be had: no prefetch for this create
                log.warning("cannot look up the prefetch profile of %s: %s", template_digest, exc)
                with self._lock:
                    if env_id is not None:
                        self._lookups.pop(env_id, None)
                    del self._looking[template_digest]
                shared.set_result(None)  # the creates that joined it go without
                lookup.set_result(None)
                return None
        shared.add_done_callback(lambda done: self._looked_up(env_id, lookup, done.result()))
        return lookup

    def _run_lookup(self, template_digest: str, shared: Future) -> None:
        profile = None
        try:
            profile = load_profile(self.store, template_digest)
            with self._lock:
                self._profiles.setdefault(template_digest, profile)
        except Exception as exc:  # prefetch is an optimization; the store's trouble is not 'no profile'
            log.warning("looking up the prefetch profile of %s: %s", template_digest, exc)
        finally:
            with self._lock:
                if self._looking.get(template_digest) is shared:
                    del self._looking[template_digest]
            shared.set_result(profile)

    def _looked_up(self, env_id: str | None, lookup: Future, profile: PrefetchProfile | None) -> None:
        """One create's part of a profile lookup that ended: its early job started (``env_id``'s, if still its)."""
        if lookup.done():  # the thread could not start: answered already
            return
        try:
            if env_id is not None:
                self._start_early(env_id, profile, lookup=lookup)
        except Exception as exc:
            log.warning("starting the prefetch of %s: %s", env_id, exc)
        finally:
            lookup.set_result(profile)

    def _start_early(self, env_id: str, profile: PrefetchProfile | None, lookup: Future | None = None) -> bool:
        """Start ``profile``'s job as the early one of ``env_id`` (and only if
        ``lookup`` is still that create's: begin or cancel did not come yet)."""
        if profile is None or not profile.refs or len(profile.refs) != len(profile.chunks):
            return False
        try:
            chunks = [(profile.groups[gi], ref) for (gi, _ci), ref in zip(profile.chunks, profile.refs)]
        except IndexError:
            return False
        return self._start_job(env_id, chunks, groups=None, pack=profile.pack, early=True, lookup=lookup) is not None

    def begin(self, env_id: str, template_digest: str, groups: list[tuple[str, GroupManifest]]) -> None:
        """At a create's start, with the group manifests: replay the template's
        profile if it has one (or complete the job :meth:`begin_early` started),
        else record one.  Never raises for store trouble (prefetch is an optimization);
        waits at most :data:`LOOKUP_WAIT_S` for the profile's lookup (begin_early's,
        or its own, in a thread, when begin_early did not run): one still
        unanswered then, or that the store did not answer, is left behind (no
        replay and no recording for this create)."""
        if self._closed:
            return
        if self.peers is not None:
            self.peers.adopt(env_id, [d for d, _m in groups])  # on-demand reads ask them too
        with self._lock:
            lookup = self._lookups.pop(env_id, None)
            known = template_digest in self._profiles
        if lookup is None and not known:
            lookup = self._look_up(template_digest)
        if lookup is not None:
            try:
                lookup.result(timeout=LOOKUP_WAIT_S)  # never raises; the lookup may have started the job
            except FutureTimeout:  # a slow or frozen store: this create goes on without prefetch
                log.info(
                    "no prefetch for %s: the store did not answer its profile's lookup in %g s", env_id, LOOKUP_WAIT_S
                )
                return
        with self._lock:
            early = self._early.pop(env_id, None)
        if early is not None:
            self._adopt_groups(early, groups)
            return
        with self._lock:
            known = template_digest in self._profiles
            profile = self._profiles.get(template_digest)
        if not known:  # neither replay nor record: the store did not answer (it could not take a profile)
            log.info("no prefetch for %s: the store did not answer its profile's lookup", env_id)
            return
        if profile is not None:
            self._replay(env_id, profile, groups)
            return
        with self._lock:
            if template_digest in self._recorded:
                return
            self._recorded.add(template_digest)
            timer = threading.Timer(self.record_s, self.end_recording, (env_id,))
            timer.daemon = True
            self._recording[env_id] = {
                "template": template_digest,
                "groups": [d for d, _m in groups],
                "manifests": [m for _d, m in groups],
                "mark": self.lazyfs.read_seq(),
                "start": time.monotonic(),
                "timer": timer,
            }
            self.lazyfs.record_ranges(True)
        timer.start()

    def end_recording(self, env_id: str, *, publish: bool = True) -> None:
        """Close ``env_id``'s recording window (idempotent); publish what it read."""
        with self._lock:
            rec = self._recording.pop(env_id, None)
        if rec is None:
            return
        rec["timer"].cancel()
        ranges = self.lazyfs.read_ranges(rec["groups"])
        self.lazyfs.record_ranges(False)
        if not publish:
            with self._lock:
                self._recorded.discard(rec["template"])
            return
        reads = self.lazyfs.first_reads(rec["groups"], rec["mark"])
        index = {}
        for i, d in enumerate(rec["groups"]):
            index.setdefault(d, i)
        chunks = [(index[d], c) for d, c in reads]
        carried, carried_spans = [], []
        if chunks:  # a group mounted before the window (another template's) was not read by its mount in it:
            # its mount's chunks go first, so a cold start mounting it finds them in the pack
            seen = set(chunks)
            mount = [
                (gi, c)
                for gi, d in enumerate(rec["groups"])
                if index[d] == gi
                for c in self.lazyfs.mount_reads(d)
                if (gi, c) not in seen and c < len(rec["manifests"][gi].chunks)
            ]
            carried, carried_spans = self._carried(rec, index)
            chunks = list(dict.fromkeys(mount + chunks + carried))[:MAX_PROFILE_CHUNKS]
        if not chunks:
            with self._lock:
                self._recorded.discard(rec["template"])  # nothing read through FUSE: try another time
            return
        refs = [rec["manifests"][gi].chunks[ci] for gi, ci in chunks]
        spans = ([(index[d], off, n) for d, off, n in ranges] + carried_spans)[:MAX_PROFILE_CHUNKS]
        profile = PrefetchProfile(
            template=rec["template"],
            groups=rec["groups"],
            chunks=chunks,
            refs=refs,
            ranges=spans,
            window_s=round(time.monotonic() - rec["start"], 3),
            manifests=carried_manifests(zip(rec["groups"], rec["manifests"])),
        )
        with self._lock:
            self._profiles[rec["template"]] = profile
            if self._closed:
                return
        self._publisher.submit(self._publish, profile)

    def _carried(self, rec: dict, index: dict[str, int]) -> tuple[list[tuple[int, int]], list[tuple[int, int, int]]]:
        """What a recording cannot see of the groups read *before* its window
        (another template's start read them on this node: their pages are in
        the kernel's page cache, so this start's reads of them never reach
        LazyFS): the chunks and ranges of those groups that the other profiles
        this node holds name (each a start's working set of that group),
        mapped to the recording's group indexes, oldest profile first.  Without
        them a cold start of a template republished over a group it shares
        (``weenv update``, one group at a time) fetches its reads of that group
        on demand.  Returns ``(chunks, ranges)`` as :class:`PrefetchProfile`
        holds them (``(group index, chunk index)``, ``(group index, offset, bytes)``)."""
        groups, manifests = rec["groups"], rec["manifests"]
        before = {d for d, _c in self.lazyfs.first_reads(groups, 0, until=rec["mark"])}
        if not before:
            return [], []
        with self._lock:
            others = [p for t, p in self._profiles.items() if p is not None and t != rec["template"]]
        chunks, spans = [], []
        for other in others:
            for ogi, ci in other.chunks:
                d = other.groups[ogi] if 0 <= ogi < len(other.groups) else None
                if d in before and ci < len(manifests[index[d]].chunks):
                    chunks.append((index[d], ci))
            for ogi, off, n in other.ranges:
                d = other.groups[ogi] if 0 <= ogi < len(other.groups) else None
                if d in before:
                    spans.append((index[d], off, n))
        return chunks, spans

    def _publish(self, profile: PrefetchProfile) -> None:
        # The write lease names the pack from before it is stored until the
        # profile naming it is published (weenv.store.lease): a gc of another
        # node or home in between keeps it.
        try:
            with self.publish_lock(), Lease(self.store, what=f"prefetch profile of {profile.template}") as lease:
                profile = self._with_pack(profile, lease)
                lease.check()
                digest = publish_profile(LeasedStore(self.store, lease), profile)
            log.info(
                "published prefetch profile %s of %s: %d chunks, %s",
                digest,
                profile.template,
                len(profile.chunks),
                f"a pack of {len(profile.pack.frames)}" if profile.pack else "no pack",
            )
        except Exception as exc:
            log.warning("cannot publish the prefetch profile of %s: %s", profile.template, exc)

    def _with_pack(self, profile: PrefetchProfile, lease: Lease) -> PrefetchProfile:
        """``profile`` with a pack of its first ``pack_bytes`` of chunks, stored
        once ``lease`` names it (the chunks read from the node cache);
        ``profile`` itself if packs are off or the pack cannot be made."""
        refs, total = [], 0
        for ref in profile.refs:
            if total + ref.size > self.pack_bytes:
                break
            refs.append(ref)
            total += ref.size
        if not refs:
            return profile
        try:
            data, frames = build_pack(self.cache.read(ref, 0, ref.size, prefetch=True) for ref in refs)
            lease.cover([sha256_digest(data)])  # before put_pack looks whether it is stored
            pack = PrefetchPack(digest=self.packs.put_pack(data), frames=frames)
        except Exception as exc:
            log.warning("no prefetch pack for %s: %s", profile.template, exc)
            return profile
        packed = profile.model_copy(update={"pack": pack})
        with self._lock:
            if self._profiles.get(profile.template) is profile:
                self._profiles[profile.template] = packed
        return packed

    def watch_command(self, env_id: str, wait: Callable[[float], object]) -> None:
        """A command started in ``env_id``; if it is recording, the window closes
        when ``wait(seconds)`` returns (the command ended) or the window's time is up."""
        with self._lock:
            rec = self._recording.get(env_id)
            if rec is None or rec.get("watched"):
                return
            rec["watched"] = True
            left = max(0.0, rec["start"] + self.record_s - time.monotonic())

        def watch() -> None:
            wait(left)
            self.end_recording(env_id)

        threading.Thread(target=watch, name="weenv-prefetch-watch", daemon=True).start()

    def cancel(self, env_id: str) -> None:
        """The environment goes: stop its prefetch, close its recording (publishing it)."""
        self.end_recording(env_id)
        with self._lock:  # one hold: a job the early start registers is seen here, or never starts
            self._lookups.pop(env_id, None)
            self._early.pop(env_id, None)
            job = self._jobs.get(env_id)
            if job is not None:
                job.cancelled = True
                self._finish_locked(job)
                self._lock.notify_all()

    def job(self, env_id: str) -> PrefetchJob | None:
        with self._lock:
            return self._jobs.get(env_id)

    def profile(self, template_digest: str) -> PrefetchProfile | None:
        """The profile known for ``template_digest`` (looked up once per node)."""
        with self._lock:
            if template_digest in self._profiles:
                return self._profiles[template_digest]
        try:
            return load_profile(self.store, template_digest)
        except StoreUnavailableError:
            return None

    def known_groups(self, template_digest: str) -> list[str]:
        """The group digests of ``template_digest``'s profile if this node
        holds it already, else [] (never a store request): a hint for loading
        its manifests (:meth:`weenv.node.resolver.Resolver.load`)."""
        with self._lock:
            profile = self._profiles.get(template_digest)
        return list(profile.groups) if profile is not None else []

    def known_manifests(self, template_digest: str) -> dict[str, bytes]:
        """The group manifests ``template_digest``'s profile carries, if this
        node holds the profile (never a store request), by digest, unchecked:
        :meth:`weenv.node.manifests.NodeManifests.adopt` checks each before it
        is used."""
        with self._lock:
            profile = self._profiles.get(template_digest)
        return {d: text.encode() for d, text in profile.manifests.items()} if profile is not None else {}

    def wait_published(self) -> None:
        """Wait for the profiles being published (tests)."""
        self._publisher.submit(lambda: None).result()

    # --- replay ----------------------------------------------------------------------
    def _replay(self, env_id: str, profile: PrefetchProfile, groups: list[tuple[str, GroupManifest]]) -> None:
        if [d for d, _m in groups] != profile.groups:
            log.warning("prefetch profile of %s names other groups; ignored", profile.template)
            return
        chunks = []
        for gi, ci in profile.chunks:
            if 0 <= gi < len(groups) and 0 <= ci < len(groups[gi][1].chunks):
                chunks.append((groups[gi][0], groups[gi][1].chunks[ci]))
        pack = profile.pack if len(chunks) == len(profile.chunks) else None  # positions must match the frames
        self._start_job(env_id, chunks, groups=groups, pack=pack)

    def _start_job(
        self,
        env_id: str,
        chunks: list[tuple[str, ChunkRef]],
        groups: list[tuple[str, GroupManifest]] | None,
        pack: PrefetchPack | None = None,
        *,
        early: bool = False,
        lookup: Future | None = None,
    ) -> PrefetchJob | None:
        """Queue a job fetching ``chunks`` (the first ones from ``pack``) unless
        all are cached; the job if queued.  ``groups`` (None: not known yet, see
        :meth:`_adopt_groups`) are handed to ``on_group_complete`` when the job
        ends.  ``early``: register it as ``env_id``'s early job, in the same
        lock hold as the check that ``lookup`` (if given) is still pending."""
        if self.peers is not None:
            self.peers.adopt(env_id, {g for g, _c in chunks})  # the peers placement said fetch them too
        if self.cache.has_all(c.digest for _d, c in chunks):
            return None
        if self.peers is not None:
            self.peers.learn((c.digest, g) for g, c in chunks)  # an early job's groups are not mounted yet
            if pack is not None and self._peers_have_pack(chunks[: len(pack.frames)]):
                pack = None  # its chunks one by one, from peers
        job = PrefetchJob(env_id, chunks, budget=self.cache.max_bytes // 2)
        job.groups = dict(groups) if groups is not None else None
        with self._lock:
            if self._closed or env_id in self._jobs:
                return None
            if lookup is not None and self._lookups.get(env_id) is not lookup:
                return None  # begin or cancel came first
            self._jobs[env_id] = job
            if early:
                self._early[env_id] = job
            self._queue.append(job)
            while len(self._threads) < self.workers:
                t = threading.Thread(target=self._work, name=f"weenv-prefetch-{len(self._threads)}", daemon=True)
                self._threads.append(t)
                t.start()
            if pack is not None and pack.digest not in self._bad_packs:
                # shared only by jobs that read its frames as the same chunks
                key = (pack.digest, tuple(c.digest for _g, c in chunks[: len(pack.frames)]))
                for stream in list(self._streams.values()):
                    self._retire_locked(stream)  # a settled stream is not joined: its frames are gone
                job.stream = self._streams.get(key)  # reading or draining (see PackStream)
                if (
                    job.stream is None
                    and len(self._streams) < self.workers  # the first job of this pack: read it
                    and not self.cache.has_all(key[1])
                ):  # unless it was all cached meanwhile
                    job.stream = self._streams[key] = PackStream(pack, key)
                    reader = threading.Thread(
                        target=self._read_pack, args=(job.stream,), name="weenv-prefetch-pack", daemon=True
                    )
                    self._readers = [t for t in self._readers if t.is_alive()] + [reader]
                    reader.start()
                if job.stream is not None:
                    job.stream.jobs.append(job)
            self._lock.notify_all()
        return job

    def _peers_have_pack(self, head: list[tuple[str, ChunkRef]]) -> bool:
        """Whether a pack whose chunks are ``head`` is better not streamed, its
        missing chunks fetched one by one instead (peers first): in a cluster
        (peer settings given), when the cache holds at least half of its bytes
        already (a shared base the node holds: streaming the pack would take
        those from the store again), or when peers hold at least half of the
        bytes the cache lacks (a group every node holds does not make the rest
        come one by one from the store)."""
        missing = [(g, c) for g, c in head if not self.cache.has(c.digest)]
        lacking = sum(c.size for _g, c in missing)
        if lacking == 0:
            return False
        if self.peers.settings() is not None and 2 * lacking <= sum(c.size for _g, c in head):
            return True
        held = {g: self.peers.peers_hold({g}) for g in {g for g, _c in missing}}
        return 2 * sum(c.size for g, c in missing if held[g]) >= lacking

    def wait_packed(self, digest: str, wait_s: float) -> bool:
        """Whether chunk ``digest`` is in the cache within ``wait_s`` seconds,
        waiting only while a job replaying a pack that holds it runs here (its
        frame is on its way from the store, or being checked); False at once
        when none does.  For a peer asking for it (:meth:`Node._held_for_peer`):
        a pack never asks peers, so two nodes cannot wait for each other."""
        deadline = time.monotonic() + wait_s
        while True:
            with self._lock:
                coming = any(
                    j.stream is not None
                    and not j.done.is_set()
                    and not j.cancelled
                    and j.stream.position(digest) is not None
                    for j in self._jobs.values()
                )
            if self.cache.has(digest):
                return True
            left = deadline - time.monotonic()
            if not coming or left <= 0:
                return False
            with self._lock:
                self._lock.wait(min(PACK_POLL_S, left))

    def _read_pack(self, stream: PackStream) -> None:
        """Read ``stream``'s pack, cutting it into frames for the workers, until
        every frame arrived, no job waits for it any more, or a frame turned out
        bad; on a failure, the positions not received are fetched one by one."""
        digest, frames = stream.pack.digest, stream.pack.frames
        buf = bytearray()
        got = 0
        try:
            pieces = self.packs.stream_pack(digest, stream.pack.size)
            try:
                for piece in pieces:
                    buf += piece
                    with self._lock:
                        if self._closed or not stream.wanted():
                            return
                    while got < len(frames) and len(buf) >= frames[got]:
                        n = frames[got]
                        with self._lock:
                            while stream.buffered >= PACK_BUFFER_BYTES and not self._closed and stream.wanted():
                                self._lock.wait()
                            if self._closed or not stream.wanted():
                                return
                            stream.frames[got] = bytes(buf[:n])
                            stream.buffered += n
                            got += 1
                            stream.received = got
                            self._lock.notify_all()
                        del buf[:n]
                    if got == len(frames) and buf:
                        raise DigestMismatchError(f"pack {digest} is longer than its {len(frames)} frames")
            finally:
                pieces.close()
            if got < len(frames):
                raise DigestMismatchError(f"pack {digest} ends after {got} of its {len(frames)} frames")
        except Exception as exc:
            log.warning("prefetch pack %s: %s; fetching the rest chunk by chunk", digest, exc)
            with self._lock:
                self._end_stream_locked(stream, bad=isinstance(exc, (DigestMismatchError, NotFoundError)))
        finally:
            with self._lock:
                self._end_stream_locked(stream)

    def _end_stream_locked(self, stream: PackStream, *, bad: bool = False) -> None:
        """No more frames come from ``stream`` (the positions not received are
        fetched one by one); it is joined until it settles (see
        :class:`PackStream`), then a later job of its pack starts a new one,
        unless the pack is ``bad`` (its bytes are wrong: it leaves at once, and
        this node never reads it again)."""
        stream.ended = True
        if bad:
            self._bad_packs.add(stream.pack.digest)
            if self._streams.get(stream.key) is stream:
                del self._streams[stream.key]
        self._retire_locked(stream)
        self._lock.notify_all()

    def _joinable_locked(self, stream: PackStream) -> bool:
        """Whether ``stream`` is reading or draining (:class:`PackStream`): a
        job of its pack joins it rather than reading the pack again.  (The
        cache's lock is taken inside this one: the cache never calls the
        Prefetcher while it holds its own.)"""
        if not stream.ended or stream.in_hand or stream.claimed:
            return True
        if stream.frames and any(not j.exhausted for j in stream.jobs):
            return True
        return self.cache.fetching_any(stream.key[1])

    def _retire_locked(self, stream: PackStream) -> None:
        """``stream`` leaves :attr:`_streams` once it settled (:class:`PackStream`)."""
        if self._streams.get(stream.key) is stream and not self._joinable_locked(stream):
            del self._streams[stream.key]

    def _adopt_groups(self, job: PrefetchJob, groups: list[tuple[str, GroupManifest]]) -> None:
        """Give an early job its group manifests; if it already ended, hand its
        groups to ``on_group_complete`` now (it could not at its end)."""
        with self._lock:
            job.groups = dict(groups)
            ended = job.done.is_set() and not job.cancelled
        if ended:
            self._hand_over(job)

    def _take(self) -> tuple[PrefetchJob, int, bytes | object | None] | None:
        """The next (job, position, frame) to do, oldest job first (a job waiting
        for its pack's next frame lets younger jobs go); None once closed.  The
        frame is None for a position fetched one by one, :data:`TAKEN` for one
        whose frame another job's worker took."""
        with self._lock:
            while True:
                if self._closed:
                    return None
                while self._queue and self._queue[0].exhausted:
                    self._queue.popleft()
                for job in self._queue:
                    if job.exhausted or not job.ready:
                        continue
                    pos = job.next
                    job.next += 1
                    job.pending += 1
                    frame = None
                    if job.stream is not None and pos < job.stream.received:
                        # a frame a demand read waits for is that read's (frame_for)
                        frame = TAKEN if pos in job.stream.claimed else job.stream.take(pos)
                        if frame is not TAKEN:
                            job.stream.in_hand.add(pos)  # until this worker is done with it (_work)
                        self._lock.notify_all()  # room in the reader's buffer
                    return job, pos, frame
                self._lock.wait()

    def _work(self) -> None:
        while (item := self._take()) is not None:
            job, pos, frame = item
            _group, chunk = job.chunks[pos]
            try:
                # TAKEN: another job's worker is done with it (or a demand read has it): skipped
                # if it is cached, else fetched here (that worker failed, or it went since)
                if self.cache.has(chunk.digest):
                    with self._lock:
                        job.skipped += 1
                    continue
                if isinstance(frame, bytes):  # in hand: checking it costs less than waiting
                    try:
                        cached = self.cache.put_frame(chunk, frame)
                    except DigestMismatchError as exc:  # the pack is bad: the rest comes one by one
                        log.warning("prefetch pack %s: %s", job.stream.pack.digest, exc)
                        with self._lock:
                            self._end_stream_locked(job.stream, bad=True)
                    else:
                        with self._lock:
                            if cached:
                                job.from_pack += 1
                                job.bytes += chunk.size
                            else:
                                job.skipped += 1
                        continue
                while not self.cache.wait_demand_idle(0.1):  # on-demand reads go first
                    if job.cancelled or self._closed:
                        break
                if job.cancelled or self._closed:
                    continue
                if self.cache.has(chunk.digest):  # a demand read brought it meanwhile
                    with self._lock:
                        job.skipped += 1
                    continue
                with self._lock:
                    job.fetched.append(pos)
                    job.bytes += chunk.size
                self.cache.ensure(chunk, prefetch=True)
            except Exception as exc:
                with self._lock:
                    job.errors += 1
                log.debug("prefetch of %s failed: %s", chunk.digest, exc)
            finally:
                with self._lock:
                    if isinstance(frame, bytes):
                        job.stream.in_hand.discard(pos)  # a job waiting at pos goes on (PackStream)
                        self._lock.notify_all()
                    if job.stream is not None:
                        self._retire_locked(job.stream)
                    job.pending -= 1
                    if job.exhausted and job.pending == 0:
                        self._finish_locked(job)

    def _finish_locked(self, job: PrefetchJob) -> None:
        if job.pending or job.done.is_set():
            return
        if job.stream is not None:
            self._retire_locked(job.stream)  # its buffered frames may be nobody's now
        job.ended = time.monotonic()
        job.done.set()
        self._jobs.pop(job.env_id, None)
        if job.cancelled or job.groups is None:  # early job: _adopt_groups hands them over
            return
        self._hand_over(job)

    def _hand_over(self, job: PrefetchJob) -> None:
        if self.on_group_complete is None:
            return
        for digest, manifest in job.groups.items():
            threading.Thread(target=self._complete, args=(digest, manifest), daemon=True).start()

    def _complete(self, digest: str, manifest: GroupManifest) -> None:
        try:
            self.on_group_complete(digest, manifest)
        except Exception as exc:
            log.warning("after prefetching group %s: %s", digest, exc)

    # --- life cycle --------------------------------------------------------------------
    def close(self, timeout: float = 30.0) -> None:
        """Cancel every job, end every recording without publishing, join the
        workers (``timeout`` seconds) and the pack readers and profile lookups
        (:data:`READER_JOIN_S`: one blocked in a store read is left to end with
        that read, within the store's read timeout)."""
        with self._lock:
            self._closed = True
            for job in list(self._jobs.values()):
                job.cancelled = True
                self._finish_locked(job)  # those no worker holds end now
            recording = list(self._recording)
            self._lock.notify_all()
            workers, self._threads = self._threads, []
            readers, self._readers = self._readers, []
        for env_id in recording:
            self.end_recording(env_id, publish=False)
        for t in workers:
            t.join(timeout)
        deadline = time.monotonic() + READER_JOIN_S
        for t in readers:  # a reader blocked in a store read leaves when that read returns
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                log.warning("%s is still in a store read; it ends when the read does", t.name)
        self._publisher.shutdown(wait=True)
