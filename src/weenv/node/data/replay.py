"""Replay of recorded profiles for :class:`~weenv.node.data.prefetch.Prefetcher`:
a job per environment (:class:`PrefetchJob`) fetching its chunks in recorded
order, from a pack streamed once for every job that reads it
(:class:`PackStream`) or chunk by chunk (:class:`Replay`, a part of the prefetcher)."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future

from weenv.errors import DigestMismatchError, NotFoundError
from weenv.formats.manifest import ChunkRef, GroupManifest
from weenv.packaging.profile import (
    PrefetchPack,
    PrefetchProfile,
)

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


class Replay:
    """The replay of profiles; a part of :class:`~weenv.node.data.prefetch.Prefetcher`."""

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
