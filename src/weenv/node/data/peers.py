"""Chunks from peer nodes: a node of a cluster asks a peer that holds a chunk
before the store, and serves the chunks it holds to its peers, within bounds.

**Fetching** (:class:`PeerChunks`, the chunk source of the node's
:class:`~weenv.node.data.cache.ChunkCache`).  The node is told its peers (their
daemon's URL, the groups whose chunks each holds: the placement actor's index,
pushed by the node actor every heartbeat, :mod:`weenv.cluster.peers`).  On a
miss for chunk ``c``, the groups ``c`` belongs to are looked up among the
groups the node has mounted (LazyFS's manifests); the peers holding any of
them are asked, at most ``tries`` of them in random order, each once with a
deadline of ``timeout_s`` seconds (connect and whole answer).  A peer is not
trusted: its answer is checked against ``c``'s size and sha256 (a wrong one
counts in ``peer_bad``).  A peer that answers 404 (evicted) or is busy is
passed over for this chunk; one that is slow, gone or wrong, for
``pass_over_s`` seconds (:data:`PASS_OVER_S` by default; so a dead peer costs one
timeout, not one per chunk).  When no peer gave it, the store does
(:meth:`weenv.store.base.Store.get_chunk`, checked there).  A chunk no peer is
known to hold goes to the store at once.

**Hints.**  The table is a heartbeat old, so two creates of one template
placed on two nodes at once would both go to the store.  The cluster's
placement knows better: it names, in a create's metadata
(:data:`PEERS_HINT`, taken off by the node), the other nodes placed with the
template lately or holding it (:class:`weenv.cluster.view.Placed`), and the
node counts them as holders of the create's groups (:meth:`PeerChunks.hint`,
:meth:`PeerChunks.adopt`) for :data:`HINT_S` seconds.  Only peers in the table
are asked (a hint adds no address).

**Packs.**  A prefetch pack (:mod:`weenv.node.data.prefetch`) is one store blob:
it is streamed from the store (:meth:`PeerChunks.stream_pack`, counted in
``pack_bytes``) unless peers hold at least half of the bytes of its chunks the
node lacks, or the node holds half of its bytes already (a shared base); then
its missing chunks are fetched one by one, peers first, as above.  A
node asked for a chunk its own pack is bringing waits for it (up to
``timeout_s``: :meth:`weenv.node.node.Node._held_for_peer`), so a template
started on many nodes at once is streamed from the store about once.

**Serving** (:meth:`PeerChunks.serve`, behind ``GET /peer/v1/chunks/{digest}``
of :mod:`weenv.server.peers`): only with the cluster's peer token (not the
node's API key: a peer may read content-addressed chunks and nothing else),
only chunks this node's cache holds (or is fetching for itself from the
store or in a pack: waited for up to ``SERVE_WAIT_SHARE`` of ``timeout_s``; one
it is asking peers for is waited for only by a node asked by a peer of a
higher **rank**, a random number each node draws and sends with its requests
(:data:`RANK_HEADER`): of two nodes asking each other for a chunk neither
holds, the lower-ranked one's answer waits while the other hears 404 at once
and takes it from the store, and then serves it, so the chunk comes from the
store once, not twice, and neither waits out a timeout (waits go down the
ranks: the lowest asking node waits for none); a peer's request never makes
this node fetch anything), at
most ``serve_concurrency`` at once (more are refused, :class:`BusyError`, and
the asker moves on: at most ``serve_concurrency`` chunks' bytes are in flight),
and at most ``serve_bytes_per_s`` bytes a second (a token bucket: an answer
waits for its bytes' tokens; None: no rate bound).  An answer waits for its
tokens only while its asker still waits for it: the asker sends the seconds
it waits (:data:`WAIT_HEADER`; at most ``timeout_s``, the default without
it), and an answer whose tokens would come later than ``SERVE_WAIT_SHARE`` of
them after its request came is refused at once, its tokens not taken
(:class:`RateBusyError`: 409, kind busy, ``Retry-After``: when the bucket
would have them); the asker passes this node over for that long
(at most ``pass_over_s``) and takes the chunk from another peer or the store.
(A wait for tokens past the asker's timeout was slept out all the same: the
answers it had given up on took their tokens, the debt piled up, held the
serve slots and held up the daemon's stop.)

Counters (:class:`PeerStats`, in ``GET /v1/stats`` and ``/v1/metrics``) count
plaintext bytes: from the store, from peers, served to peers, and the peer
failures by kind.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import random
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

import httpx
from pydantic import BaseModel, ConfigDict, Field

from weenv.errors import BusyError, InvalidInputError
from weenv.formats.limits import MAX_CHUNK_SIZE
from weenv.formats.manifest import GroupManifest, check_digest
from weenv.store.base import Store

log = logging.getLogger(__name__)

TOKEN_HEADER = "x-weenv-peer-token"
"""The header a peer's chunk request carries the cluster's peer token in."""
RANK_HEADER = "x-weenv-peer-rank"
"""The header a peer's chunk request carries its rank in (:meth:`PeerChunks.serve`)."""
WAIT_HEADER = "x-weenv-peer-wait"
"""The header a peer's chunk request carries, in seconds, how long its asker waits for the answer."""
CHUNK_PATH = "/peer/v1/chunks/"
"""``CHUNK_PATH + digest``: a node's chunk route for its peers."""
PASS_OVER_S = 10.0
"""The default of :attr:`PeerSettings.pass_over_s`."""
SERVE_WAIT_SHARE = 0.75
"""Of ``timeout_s``, how long a peer's request waits for a fetch of its chunk in
progress here (then 404: the asker moves on before its own timeout, which
would pass this node over)."""
PEERS_HINT = "weenv.peers"
"""Create metadata key (set by the cluster's gateway, taken off by the node):
the ids, comma-separated, of the peers that hold or fetch the create's
template now (:meth:`PeerChunks.hint`)."""
HINT_S = 60.0
"""Seconds a create's peer hint counts (:meth:`PeerChunks.hint`)."""
MAX_HINTED = 32
"""Peers one hint names at most (more are ignored)."""


class PeerSettings(BaseModel):
    """How a node fetches from and serves to its peers (the same on every node of a cluster)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    token: str = Field(min_length=32, max_length=128, pattern=r"^[0-9a-f]+$")
    """The cluster's peer secret (hex): what a peer presents, and what this node presents to peers."""
    timeout_s: float = Field(default=2.0, gt=0, le=60)
    """Seconds one peer has to answer one chunk (then the next peer, then the store)."""
    tries: int = Field(default=2, ge=1, le=8)
    """Peers asked for one chunk before the store."""
    serve_concurrency: int = Field(default=8, ge=1, le=256)
    """Chunks served to peers at once; more are refused (the asker moves on)."""
    serve_bytes_per_s: int | None = Field(default=None, ge=1)
    """Bytes a second served to peers (None: no bound)."""
    pass_over_s: float = Field(default=PASS_OVER_S, gt=0, le=600)
    """Seconds a peer that was slow, gone or wrong is not asked again (its chunks come from others, or the store)."""


class PeerInfo(BaseModel):
    """One peer: its node id, its daemon's URL, the groups (digests) whose chunks it holds."""

    model_config = ConfigDict(extra="forbid")

    node_id: str = Field(max_length=128)
    url: str = Field(max_length=2048, pattern=r"^https?://")
    groups: list[str] = Field(default_factory=list, max_length=100_000)


class PeerUpdate(BaseModel):
    """``PUT /v1/peers``: new settings, a new peer table, or both (None: unchanged)."""

    model_config = ConfigDict(extra="forbid")

    settings: PeerSettings | None = None
    peers: list[PeerInfo] | None = Field(default=None, max_length=10_000)


@dataclass
class PeerStats:
    """Counters since the daemon started.  Bytes are plaintext bytes."""

    store_chunks: int = 0
    store_bytes: int = 0
    """Fetched from the store: chunks no peer gave (plaintext), and prefetch packs."""
    pack_bytes: int = 0
    """Of ``store_bytes``, the stored (zstd) bytes of prefetch packs streamed from the store."""
    peer_chunks: int = 0
    peer_bytes: int = 0
    """Fetched from peers (checked)."""
    peer_failures: int = 0
    """Peer requests that gave no chunk: the kinds below, summed."""
    peer_missing: int = 0
    """The peer did not hold it (404: evicted since its report)."""
    peer_busy: int = 0
    """The peer refused: at its serving bound, or its rate's tokens would come too late (409)."""
    peer_bad: int = 0
    """The peer's answer was not the chunk (size or sha256): a peer is not trusted."""
    peer_unreachable: int = 0
    """Slow (past ``timeout_s``), gone (refused, reset) or another HTTP error."""
    served_chunks: int = 0
    served_bytes: int = 0
    """Served to peers."""
    served_refused: int = 0
    """Peer requests refused: over ``serve_concurrency``, or the rate's tokens too late for the asker."""
    served_missing: int = 0
    """Peer requests for chunks this node does not hold."""
    peers: int = 0
    """Peers in the table now."""


class RateBusyError(BusyError):
    """A peer's chunk request refused: ``serve_bytes_per_s``'s tokens for its
    bytes would come after its asker stopped waiting; ``retry_after_s``: when
    they would not."""

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = retry_after_s


def parse_wait(value: str | None) -> float | None:
    """A :data:`WAIT_HEADER` value: seconds, > 0 and at most 60 (None: absent or not that)."""
    if value is None or len(value) > 16 or not value.isascii():
        return None
    try:
        wait = float(value)
    except ValueError:
        return None
    return wait if 0 < wait <= 60 else None


class PeerChunks:
    """The chunk source of a node's cache: peers first, then ``store`` (see the
    module docstring).  ``groups()``: the groups the node has mounted, as
    ``(digest, manifest)`` pairs (which groups a chunk belongs to).
    ``held(digest, wait_s)``: the node's own chunk, or None (set by the node
    once its cache exists).  Thread-safe; no peers until :meth:`update`."""

    def __init__(
        self,
        store: Store,
        groups: Callable[[], Iterable[tuple[str, GroupManifest]]],
        *,
        clock: Callable[[], float] = time.monotonic,
    ):
        """``clock``: monotonic seconds, for the serving rate's bucket and the
        peers' deadlines (a test's own clock makes the rate's arithmetic exact)."""
        self.store = store
        self._clock = clock
        self.url = store.url
        self._groups = groups
        self.held: Callable[[str, float], bytes | None] = lambda digest, wait_s: None
        self._lock = threading.Lock()
        self._settings: PeerSettings | None = None
        self._peers: list[PeerInfo] = []
        self._by_group: dict[str, list[PeerInfo]] = {}
        self._chunk_groups: dict[str, list[str]] = {}
        self._indexed: set[str] = set()
        self._passed_over: dict[str, float] = {}  # node id -> until (monotonic s)
        self._hints: dict[str, tuple[tuple[str, ...], float]] = {}  # env id -> (peer ids, until)
        self._asking: dict[str, int] = {}  # chunk digest -> this node's fetches asking peers for it now
        self._adopted: dict[str, dict[str, float]] = {}  # group -> {peer id: until}: from hints
        self._stats = PeerStats()
        self._http: httpx.Client | None = None
        self._serving = 0
        self._bucket = 0.0
        self._bucket_at = self._clock()
        self._bucket_lock = threading.Lock()
        self.rank = random.getrandbits(62)
        """Sent with this node's chunk requests: which of two nodes asking each other waits (:meth:`serve`)."""

    # --- the table -----------------------------------------------------------------------
    def update(self, update: PeerUpdate) -> None:
        """Take new settings and/or a new peer table."""
        with self._lock:
            if update.settings is not None:
                self._settings = update.settings
            if update.peers is not None:
                self._peers = list(update.peers)
                by_group: dict[str, list[PeerInfo]] = {}
                for p in self._peers:
                    for g in p.groups:
                        by_group.setdefault(g, []).append(p)
                self._by_group = by_group
                self._merge_adopted_locked()
                self._stats.peers = len(self._peers)
            if self._http is None and self._settings is not None:
                self._http = httpx.Client(limits=httpx.Limits(max_connections=64, max_keepalive_connections=16))

    def settings(self) -> PeerSettings | None:
        return self._settings

    def hint(self, env_id: str, node_ids: Iterable[str]) -> None:
        """The create of ``env_id`` was placed here while ``node_ids`` hold or
        fetch its template (the cluster's placement knew it, this node's table
        may not yet: it is a heartbeat old).  :meth:`adopt` makes them holders
        of the create's groups.  At most :data:`MAX_HINTED` ids, for
        :data:`HINT_S` seconds; ids not in the table are ignored then (a hint
        adds no address: a wrong one costs one 404 and the store)."""
        now = self._clock()
        with self._lock:
            self._hints = {e: h for e, h in self._hints.items() if h[1] > now}
            self._hints[env_id] = (tuple(dict.fromkeys(node_ids))[:MAX_HINTED], now + HINT_S)

    def adopt(self, env_id: str, groups: Iterable[str]) -> None:
        """The groups of ``env_id``'s create are known: the peers its hint names
        hold them, for what is left of the hint's time, through table updates."""
        now = self._clock()
        with self._lock:
            h = self._hints.get(env_id)
            if h is None or h[1] <= now:
                return
            for g in groups:
                held = self._adopted.setdefault(g, {})
                for node_id in h[0]:
                    held[node_id] = max(held.get(node_id, 0.0), h[1])
            self._merge_adopted_locked()

    def _merge_adopted_locked(self) -> None:
        now = self._clock()
        self._adopted = {
            g: live for g, ids in self._adopted.items() if (live := {n: u for n, u in ids.items() if u > now})
        }
        if not self._adopted:
            return
        by_id = {p.node_id: p for p in self._peers}
        for g, ids in self._adopted.items():
            known = self._by_group.setdefault(g, [])
            have = {p.node_id for p in known}
            known.extend(by_id[n] for n in ids if n in by_id and n not in have)
            if not known:
                del self._by_group[g]

    def stats(self) -> PeerStats:
        with self._lock:
            return PeerStats(**asdict(self._stats))

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for k, v in deltas.items():
                setattr(self._stats, k, getattr(self._stats, k) + v)

    def _candidates(self, digest: str) -> list[PeerInfo]:
        """The peers holding a group ``digest`` belongs to, shuffled."""
        with self._lock:
            if not self._by_group or self._settings is None:
                return []
            groups = self._chunk_groups.get(digest)
        if groups is None:
            self._index()
            with self._lock:
                groups = self._chunk_groups.get(digest, [])
        now = self._clock()
        with self._lock:
            found = {
                p.node_id: p
                for g in groups
                for p in self._by_group.get(g, ())
                if self._passed_over.get(p.node_id, 0.0) <= now
            }
        peers = list(found.values())
        random.shuffle(peers)
        return peers

    def _index(self) -> None:
        """Index the chunks of mounted groups not indexed yet (chunk -> groups)."""
        for gdigest, manifest in list(self._groups()):
            with self._lock:
                if gdigest in self._indexed:
                    continue
            pairs = [c.digest for c in manifest.chunks]
            with self._lock:
                self._indexed.add(gdigest)
                for c in pairs:
                    known = self._chunk_groups.setdefault(c, [])
                    if gdigest not in known:  # learnt from a profile before
                        known.append(gdigest)

    def learn(self, pairs: Iterable[tuple[str, str]]) -> None:
        """``(chunk digest, group digest)`` pairs known before the group is
        mounted: a prefetch profile's, replayed while the create still loads its
        manifests (without them a chunk of no mounted group has no peer)."""
        with self._lock:
            for chunk, group in pairs:
                known = self._chunk_groups.setdefault(chunk, [])
                if group not in known:
                    known.append(group)

    def peers_hold(self, groups: set[str]) -> bool:
        """Whether peers are known to hold chunks of any of ``groups``: a
        prefetch then takes its chunks one by one, peers first, rather than a
        pack from the store."""
        with self._lock:
            return self._settings is not None and any(g in self._by_group for g in groups)

    # --- fetching ------------------------------------------------------------------------
    def get_chunk(self, digest: str, *, stored_digest: str | None = None, size: int | None = None) -> bytes:
        """Plaintext of chunk ``digest``, checked: from a peer holding it, else
        from the store (what :meth:`Store.get_chunk` raises, then)."""
        check_digest(digest)
        settings = self._settings
        candidates = self._candidates(digest)[: settings.tries if settings else 0]
        if candidates:
            with self._lock:
                self._asking[digest] = self._asking.get(digest, 0) + 1
            try:
                for peer in candidates:
                    data = self._from_peer(peer, digest, size, settings)
                    if data is not None:
                        self._count(peer_chunks=1, peer_bytes=len(data))
                        return data
            finally:
                with self._lock:
                    if (left := self._asking.pop(digest) - 1) > 0:
                        self._asking[digest] = left
        data = self.store.get_chunk(digest, stored_digest=stored_digest, size=size)
        self._count(store_chunks=1, store_bytes=len(data))
        return data

    def _from_peer(self, peer: PeerInfo, digest: str, size: int | None, settings: PeerSettings) -> bytes | None:
        """The chunk from ``peer``, checked, or None (counted by why)."""
        http = self._http
        assert http is not None
        limit = MAX_CHUNK_SIZE if size is None else size
        deadline = self._clock() + settings.timeout_s
        try:
            with http.stream(
                "GET",
                peer.url.rstrip("/") + CHUNK_PATH + digest,
                headers={
                    TOKEN_HEADER: settings.token,
                    RANK_HEADER: str(self.rank),
                    WAIT_HEADER: f"{settings.timeout_s:.3f}",
                },
                timeout=settings.timeout_s,
            ) as r:
                if r.status_code == 404:
                    self._count(peer_failures=1, peer_missing=1)
                    return None
                if r.status_code == 409:
                    self._count(peer_failures=1, peer_busy=1)
                    retry = r.headers.get("retry-after", "")
                    if retry.isascii() and retry.isdigit() and len(retry) <= 4:  # rate-bound: not before then
                        self._pass_over(peer, settings, float(retry))
                    return None
                if r.status_code != 200:
                    raise httpx.HTTPStatusError(f"HTTP {r.status_code}", request=r.request, response=r)
                buf = bytearray()
                for piece in r.iter_bytes():
                    buf += piece
                    if len(buf) > limit:
                        break
                    if self._clock() > deadline:
                        raise httpx.ReadTimeout(f"more than {settings.timeout_s} s", request=r.request)
        except httpx.HTTPError as exc:
            log.info("peer %s did not serve chunk %s: %s", peer.node_id, digest, exc or type(exc).__name__)
            self._count(peer_failures=1, peer_unreachable=1)
            self._pass_over(peer, settings)
            return None
        data = bytes(buf)
        if (size is not None and len(data) != size) or "sha256:" + hashlib.sha256(data).hexdigest() != digest:
            log.warning(
                "peer %s (%s) served other bytes for chunk %s: taking it from the store", peer.node_id, peer.url, digest
            )
            self._count(peer_failures=1, peer_bad=1)
            self._pass_over(peer, settings)
            return None
        return data

    def _pass_over(self, peer: PeerInfo, settings: PeerSettings, for_s: float | None = None) -> None:
        """Ask ``peer`` nothing for ``pass_over_s`` (or ``for_s``, if shorter)."""
        s = settings.pass_over_s if for_s is None else min(for_s, settings.pass_over_s)
        with self._lock:
            self._passed_over[peer.node_id] = self._clock() + s

    def stream_pack(self, digest: str, size: int | None = None):
        """The store's :meth:`~weenv.store.base.Store.stream_pack`, its bytes
        counted in ``store_bytes`` and ``pack_bytes`` (a pack is one store blob;
        its chunks come from peers instead when they hold them: the module docstring)."""
        for piece in self.store.stream_pack(digest, size):
            self._count(store_bytes=len(piece), pack_bytes=len(piece))
            yield piece

    def put_pack(self, data: bytes) -> str:
        return self.store.put_pack(data)

    # --- serving -------------------------------------------------------------------------
    def check_token(self, presented: str | None) -> bool:
        """Whether ``presented`` is the cluster's peer token (constant time); False before settings."""
        settings = self._settings
        return bool(settings and presented and hmac.compare_digest(presented.encode(), settings.token.encode()))

    def serve(self, digest: str, asker_rank: int | None = None, asker_wait_s: float | None = None) -> bytes | None:
        """Plaintext of chunk ``digest`` for a peer, if this node holds it (None
        otherwise), within the serving bounds; ``asker_rank``, the asking
        peer's :attr:`rank` (None: not sent; a fetch of the chunk asking peers
        here is waited for only for a peer ranked above this node);
        ``asker_wait_s``: how long the asker waits for the answer (at most,
        and by default, ``timeout_s``).  Raises :class:`BusyError` past
        ``serve_concurrency``, :class:`RateBusyError` when the rate's tokens for
        the chunk would come later than ``SERVE_WAIT_SHARE`` of the asker's
        wait (not taken, then), :class:`InvalidInputError` for a bad digest or
        before the node is in a cluster."""
        check_digest(digest)
        start = self._clock()
        settings = self._settings
        if settings is None:
            raise InvalidInputError("this node serves no peers (it is not in a cluster)")
        with self._lock:
            if self._serving >= settings.serve_concurrency:
                self._stats.served_refused += 1
                raise BusyError(
                    f"serving {self._serving} chunks to peers already (at most {settings.serve_concurrency})"
                )
            self._serving += 1
        with self._lock:
            asking = digest in self._asking
        try:
            # a fetch here asking peers for it is not waited for (it may be asking the asker: each would wait
            # out the other's timeout) unless the asker ranks higher (then this node's ask of it hears 404
            # at once); others are, for less than the asker waits (it hears 404, not a timeout)
            waits = not asking or (asker_rank is not None and self.rank < asker_rank)
            wait_s = settings.timeout_s if asker_wait_s is None else min(asker_wait_s, settings.timeout_s)
            data = self.held(digest, wait_s * SERVE_WAIT_SHARE if waits else 0.0)
            if data is None:
                self._count(served_missing=1)
                return None
            if settings.serve_bytes_per_s is not None:
                self._take_tokens(len(data), settings.serve_bytes_per_s, start + wait_s * SERVE_WAIT_SHARE)
            self._count(served_chunks=1, served_bytes=len(data))
            return data
        finally:
            with self._lock:
                self._serving -= 1

    def _take_tokens(self, n: int, rate: int, until: float) -> None:
        """Wait until ``n`` bytes may go at ``rate`` bytes/s (a bucket of one
        second's bytes); :class:`RateBusyError`, the tokens not taken, if that
        is later than ``until`` (monotonic s)."""
        with self._bucket_lock:
            now = self._clock()
            level = min(float(rate), self._bucket + (now - self._bucket_at) * rate)
            wait = (n - level) / rate if level < n else 0.0
            if now + wait > until:
                with self._lock:
                    self._stats.served_refused += 1
                late = now + wait - until
                raise RateBusyError(
                    f"{n} bytes at {rate} bytes/s go in {wait:.2f} s, after the asker stops "
                    f"waiting ({max(0.0, until - now):.2f} s)",
                    retry_after_s=late,
                )
            self._bucket, self._bucket_at = level - n, now
        if wait > 0:
            time.sleep(wait)

    def close(self) -> None:
        with self._lock:
            http, self._http = self._http, None
        if http is not None:
            http.close()
