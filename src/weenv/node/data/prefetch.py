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

from weenv.errors import InvalidInputError, StoreUnavailableError
from weenv.formats.limits import MAX_PROFILE_CHUNKS
from weenv.formats.manifest import GroupManifest, sha256_digest
from weenv.node.data.cache import ChunkCache
from weenv.node.data.lazyfs import LazyFS
from weenv.node.data.peers import PeerChunks
from weenv.node.data.replay import (
    LOOKUP_WAIT_S,
    PACK_BYTES,
    PACK_WAIT_AHEAD_BYTES,
    PACK_WAIT_S,
    READER_JOIN_S,
    PackStream,
    PrefetchJob,
    Replay,
)
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


class Prefetcher(Replay):
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
