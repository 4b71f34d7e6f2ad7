"""Prefetch by recorded access order: record a template's first reads, replay them on cold starts.

**Recording.**  The first start of a template on a node that finds no profile for
it records which chunks the start reads, in order: LazyFS numbers the first read
of every chunk (:meth:`LazyFS.read_seq` / :meth:`LazyFS.first_reads`), and the
window runs from the create's start until the environment's first command
(after the create's own ``true``) ends, the environment is destroyed, or
``record_s`` seconds pass, whichever comes first.  Reads another environment
makes in the same groups during the window are included (they are reads of
the same content); chunks first read *before* the window (a group already
mounted and read by another template) are not.  The profile is published beside
the template, in a background thread:

- its canonical JSON as a manifest (:class:`PrefetchProfile`,
  media type ``application/vnd.weenv.prefetch.v1+json``);
- the ref ``prefetch/<hex of the template digest>`` pointing at it (templates are
  content-addressed, so the profile cannot be a field of the template itself;
  ``TemplateManifest.prefetch`` stays for profiles baked in at build time).

**Replay.**  A create that finds a profile, and groups not fully cached, starts
a :class:`PrefetchJob`: ``workers`` threads (default 4: from a registry a chunk
costs ~2 ms of the registry's time and ~5 ms of this process's, so a few in
flight keep both busy) shared by all jobs fetch the profile's chunks in order
(chunks already cached are skipped) with ``prefetch=True``, and before each
fetch wait while any *demand* fetch runs (:meth:`ChunkCache.wait_demand_idle`),
so on-demand reads go first.  A profile keeps its chunks' refs, so when the
node already knows it the job starts as soon as the create has resolved the
template's digest (:meth:`Prefetcher.begin_early`), while the group manifests
load and the mounts and the runtime are set up.  A job ends when its list is
done, when its environment is destroyed (:meth:`Prefetcher.cancel`), or when it
has fetched half of the cache's byte bound (it would otherwise evict its own
work).  When a job ends, groups it completed are handed to
``on_group_complete`` (the node assembles their image for direct mounts).

This is the ordering idea of eStargz's prioritized files and of REAP (record and
prefetch the working set of a first start).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from weenv.errors import InvalidInputError, NotFoundError, WeenvError
from weenv.node.cache import ChunkCache
from weenv.node.lazyfs import LazyFS
from weenv.packaging.manifest import (
    ChunkRef,
    Digest,
    GroupManifest,
    canonical_json,
    utc_now,
)
from weenv.store.base import Store

log = logging.getLogger(__name__)

REF_KIND = "prefetch"
PROFILE_MEDIA_TYPE = "application/vnd.weenv.prefetch.v1+json"


class PrefetchProfile(BaseModel):
    """The chunks a template's first start read, in the order it read them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: Literal[1] = 1
    media_type: Literal["application/vnd.weenv.prefetch.v1+json"] = PROFILE_MEDIA_TYPE
    template: Digest
    groups: list[Digest] = Field(min_length=1)
    """The template's group digests, bottom to top (what ``chunks`` indexes)."""
    chunks: list[tuple[int, int]]
    """``(index into groups, chunk index in that group)`` in first-read order."""
    refs: list[ChunkRef] = Field(default_factory=list)
    """The same chunks, in the same order, as chunk refs: a replay can start
    fetching before the group manifests are loaded (empty in profiles recorded
    before weenv kept them)."""
    window_s: float
    """How long the recording ran (seconds)."""
    created: str = Field(default_factory=utc_now)


def ref_name(template_digest: str) -> str:
    return template_digest.split(":", 1)[1]


def load_profile(store: Store, template_digest: str) -> PrefetchProfile | None:
    """The published profile of ``template_digest``, or None (none, or unreadable)."""
    try:
        digest = store.get_ref(REF_KIND, ref_name(template_digest))
        profile = PrefetchProfile.model_validate_json(store.get_manifest(digest))
    except NotFoundError:
        return None
    except (ValueError, WeenvError) as exc:
        log.warning("prefetch profile of %s unreadable: %s", template_digest, exc)
        return None
    return profile if profile.template == template_digest else None


def publish_profile(store: Store, profile: PrefetchProfile) -> str:
    """Store ``profile`` and point ``prefetch/<hex>`` at it; return its digest."""
    digest = store.put_manifest(canonical_json(profile))
    store.set_ref(REF_KIND, ref_name(profile.template), digest)
    return digest


class PrefetchJob:
    """The background prefetch of one environment's profile."""

    def __init__(self, env_id: str, chunks: list[tuple[str, ChunkRef]], budget: int):
        self.env_id = env_id
        self.chunks = chunks
        """``(group digest, chunk)`` in profile order."""
        self.budget = budget
        self.next = 0
        self.pending = 0
        self.fetched: list[int] = []
        """Positions in ``chunks`` this job fetched from the store, in the order the fetches started."""
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


class Prefetcher:
    """Records profiles and replays them for one node.  Thread-safe."""

    def __init__(
        self,
        cache: ChunkCache,
        store: Store,
        lazyfs: LazyFS,
        *,
        workers: int = 4,
        record_s: float = 10.0,
        on_group_complete: Callable[[str, GroupManifest], object] | None = None,
    ):
        if workers < 1 or record_s <= 0:
            raise InvalidInputError("prefetch wants workers >= 1 and record_s > 0")
        self.cache, self.store, self.lazyfs = cache, store, lazyfs
        self.workers = workers
        self.record_s = record_s
        self.on_group_complete = on_group_complete
        self._lock = threading.Condition()
        self._profiles: dict[str, PrefetchProfile | None] = {}  # template digest -> profile (cached lookups)
        self._recording: dict[str, dict] = {}  # env id -> recording state
        self._recorded: set[str] = set()  # templates this node records or recorded
        self._jobs: dict[str, PrefetchJob] = {}  # env id -> job
        self._early: dict[str, PrefetchJob] = {}  # env id -> job begin_early started, until begin
        self._queue: deque[PrefetchJob] = deque()
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._publisher = ThreadPoolExecutor(1, thread_name_prefix="weenv-prefetch-publish")

    # --- the create's hooks ----------------------------------------------------------
    def begin_early(self, env_id: str, template_digest: str) -> bool:
        """As soon as a create knows its template's digest: if this node already
        holds the template's profile in memory (an earlier start of it here) and
        the profile carries chunk refs, start replaying it now, before the group
        manifests are loaded: when the chunks are not cached (evicted, or
        dropped) the first ones arrive while the manifests, the mounts and the
        runtime are set up.  A node that never started the template loads its
        profile later, in :meth:`begin`.  True if a job started; :meth:`begin`
        then completes it.  Never raises."""
        if self._closed:
            return False
        with self._lock:
            profile = self._profiles.get(template_digest)
        if profile is None or not profile.refs or len(profile.refs) != len(profile.chunks):
            return False
        try:
            chunks = [(profile.groups[gi], ref) for (gi, _ci), ref in zip(profile.chunks, profile.refs)]
        except IndexError:
            return False
        job = self._start_job(env_id, chunks, groups=None)
        if job is None:
            return False
        with self._lock:
            self._early[env_id] = job
        return True

    def begin(self, env_id: str, template_digest: str, groups: list[tuple[str, GroupManifest]]) -> None:
        """At a create's start, with the group manifests: replay the template's
        profile if it has one (or complete the job :meth:`begin_early` started),
        else record one.  Never raises for store trouble (prefetch is an optimization)."""
        if self._closed:
            return
        with self._lock:
            early = self._early.pop(env_id, None)
        if early is not None:
            self._adopt_groups(early, groups)
            return
        with self._lock:
            known = template_digest in self._profiles
            profile = self._profiles.get(template_digest)
        if not known:
            profile = load_profile(self.store, template_digest)
            with self._lock:
                self._profiles[template_digest] = profile
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
                "template": template_digest, "groups": [d for d, _m in groups], "manifests": [m for _d, m in groups],
                "mark": self.lazyfs.read_seq(), "start": time.monotonic(), "timer": timer,
            }  # fmt: skip
        timer.start()

    def end_recording(self, env_id: str, *, publish: bool = True) -> None:
        """Close ``env_id``'s recording window (idempotent); publish what it read."""
        with self._lock:
            rec = self._recording.pop(env_id, None)
        if rec is None:
            return
        rec["timer"].cancel()
        if not publish:
            with self._lock:
                self._recorded.discard(rec["template"])
            return
        reads = self.lazyfs.first_reads(rec["groups"], rec["mark"])
        index = {}
        for i, d in enumerate(rec["groups"]):
            index.setdefault(d, i)
        chunks = [(index[d], c) for d, c in reads]
        if not chunks:
            with self._lock:
                self._recorded.discard(rec["template"])  # nothing read through FUSE: try another time
            return
        refs = [rec["manifests"][gi].chunks[ci] for gi, ci in chunks]
        profile = PrefetchProfile(template=rec["template"], groups=rec["groups"], chunks=chunks, refs=refs,
                                  window_s=round(time.monotonic() - rec["start"], 3))
        with self._lock:
            self._profiles[rec["template"]] = profile
            if self._closed:
                return
        self._publisher.submit(self._publish, profile)

    def _publish(self, profile: PrefetchProfile) -> None:
        try:
            digest = publish_profile(self.store, profile)
            log.info("published prefetch profile %s of %s: %d chunks", digest, profile.template, len(profile.chunks))
        except Exception as exc:
            log.warning("cannot publish the prefetch profile of %s: %s", profile.template, exc)

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
        with self._lock:
            self._early.pop(env_id, None)
            job = self._jobs.get(env_id)
            if job is not None:
                job.cancelled = True
                self._finish_locked(job)

    def job(self, env_id: str) -> PrefetchJob | None:
        with self._lock:
            return self._jobs.get(env_id)

    def profile(self, template_digest: str) -> PrefetchProfile | None:
        """The profile known for ``template_digest`` (looked up once per node)."""
        with self._lock:
            if template_digest in self._profiles:
                return self._profiles[template_digest]
        return load_profile(self.store, template_digest)

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
        self._start_job(env_id, chunks, groups=groups)

    def _start_job(self, env_id: str, chunks: list[tuple[str, ChunkRef]],
                   groups: list[tuple[str, GroupManifest]] | None) -> PrefetchJob | None:
        """Queue a job fetching ``chunks`` unless all are cached; the job if queued.
        ``groups`` (None: not known yet, see :meth:`_adopt_groups`) are handed to
        ``on_group_complete`` when the job ends."""
        if self.cache.has_all(c.digest for _d, c in chunks):
            return None
        job = PrefetchJob(env_id, chunks, budget=self.cache.max_bytes // 2)
        job.groups = dict(groups) if groups is not None else None
        with self._lock:
            if self._closed or env_id in self._jobs:
                return None
            self._jobs[env_id] = job
            self._queue.append(job)
            while len(self._threads) < self.workers:
                t = threading.Thread(target=self._work, name=f"weenv-prefetch-{len(self._threads)}", daemon=True)
                self._threads.append(t)
                t.start()
            self._lock.notify_all()
        return job

    def _adopt_groups(self, job: PrefetchJob, groups: list[tuple[str, GroupManifest]]) -> None:
        """Give an early job its group manifests; if it already ended, hand its
        groups to ``on_group_complete`` now (it could not at its end)."""
        with self._lock:
            job.groups = dict(groups)
            ended = job.done.is_set() and not job.cancelled
        if ended:
            self._hand_over(job)

    def _take(self) -> tuple[PrefetchJob, int] | None:
        """The next (job, position) to fetch, oldest job first; None once closed."""
        with self._lock:
            while True:
                if self._closed:
                    return None
                while self._queue and self._queue[0].exhausted:
                    self._queue.popleft()
                if self._queue:
                    job = self._queue[0]
                    pos = job.next
                    job.next += 1
                    job.pending += 1
                    return job, pos
                self._lock.wait()

    def _work(self) -> None:
        while (item := self._take()) is not None:
            job, pos = item
            _group, chunk = job.chunks[pos]
            try:
                if self.cache.has(chunk.digest):
                    job.skipped += 1
                    continue
                while not self.cache.wait_demand_idle(0.1):  # on-demand reads go first
                    if job.cancelled or self._closed:
                        break
                if job.cancelled or self._closed:
                    continue
                with self._lock:
                    job.fetched.append(pos)
                    job.bytes += chunk.size
                self.cache.ensure(chunk, prefetch=True)
            except Exception as exc:
                job.errors += 1
                log.debug("prefetch of %s failed: %s", chunk.digest, exc)
            finally:
                with self._lock:
                    job.pending -= 1
                    if job.exhausted and job.pending == 0:
                        self._finish_locked(job)

    def _finish_locked(self, job: PrefetchJob) -> None:
        if job.pending or job.done.is_set():
            return
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
        """Cancel every job, end every recording without publishing, join the workers."""
        with self._lock:
            self._closed = True
            for job in self._jobs.values():
                job.cancelled = True
            recording = list(self._recording)
            self._lock.notify_all()
            threads, self._threads = self._threads, []
        for env_id in recording:
            self.end_recording(env_id, publish=False)
        for t in threads:
            t.join(timeout)
        self._publisher.shutdown(wait=True)
