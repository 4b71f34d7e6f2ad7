"""The cluster's view, as the placement actor holds it (plain state, no Ray):
its nodes with their last heartbeats, creates in progress, which node each
environment is on, and the environments lost with a node.

Thread-safe (the placement actor serves calls from several threads).  Times
are ``time.monotonic()`` seconds unless named ``at`` (Unix seconds).

Life of a node: ``starting`` (its actor is being made) -> ``alive`` (heartbeats
come) -> ``gone`` (Ray reports the node dead, or no heartbeat for
``heartbeat_timeout_s``), or ``failed`` (its actor could not start: the reason
is kept).  When a node goes, every environment it had is **lost**: looking it
up raises :class:`~weenv.errors.LostError` naming the node, and
:meth:`ClusterView.lost` lists them.  A node reported gone for silence whose
heartbeats come back is alive again, and its environments that it still runs
are found again.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import time
from dataclasses import dataclass, field

from weenv.cluster import placement
from weenv.cluster.node import NodeReport, TemplateFacts
from weenv.errors import InvalidInputError, LostError, NotFoundError
from weenv.formats.manifest import Resources
from weenv.node.data.peers import MAX_HINTED, PeerInfo

HEARTBEAT_TIMEOUT_S = 10.0
"""A node silent this long is gone."""
RESERVATION_TTL_S = 600.0
"""A create in progress not reported done within this long is dropped (its client died)."""


EXPECT_S = 30.0
"""The default of ``expect_s``: seconds a node counts as holding a template placed there (:attr:`_Node.expected`)."""
DEMAND_WINDOW_S = 300.0
"""Seconds over which the cluster's peak of environments at once is its demand
(:func:`weenv.cluster.placement.bonus_cap`: an RL run's rollout batches come
round within it)."""
REPORT_GRACE_S = 5.0
"""Seconds an environment recorded by a create's end stays routed though a
node's report lacks it (the report's listing may predate the create)."""


@dataclass(frozen=True)
class Route:
    """Where to send an environment's traffic: its node and that node's daemon (``api_url``, ``api_key``)."""

    node_id: str
    api_url: str
    api_key: str


@dataclass(frozen=True)
class Placed:
    """A placement: the node to create on, the token to report the create done
    with, and ``peers``: the other alive nodes holding the template's own
    groups or placed with it lately (within the view's ``expect_s``), which the node
    asks for its chunks before the store (the gateway passes them with the
    create: the peer table the node has may be a heartbeat older than them)."""

    route: Route
    token: int
    peers: tuple[str, ...] = ()


@dataclass
class _Node:
    node_id: str
    state: str = "starting"
    reason: str = ""
    report: NodeReport | None = None
    seen: float = 0.0
    inflight: dict[int, tuple[float, int, float]] = field(default_factory=dict)
    """token -> (cpus, memory bytes, placed at)."""
    pending: dict[str, tuple[float, int, float]] = field(default_factory=dict)
    """env id -> (cpus, memory bytes, done at, Unix s): made, not yet in a report's
    reservations (so placement does not see a node as emptier than it is).
    Ends with the first report listing it, a report taken ``REPORT_GRACE_S``
    after the create ended that does not (the node destroyed it), or its
    destroy through the cluster (:meth:`ClusterView.forget`)."""
    released: dict[str, float] = field(default_factory=dict)
    """env id -> destroyed at (Unix s): destroyed through the cluster.  While a
    report lists it in its reservations (one taken before the destroy, perhaps
    arriving after it), what it reserves there is taken off that report's sums,
    and it is not routed again (so a node whose environments were just killed
    is not seen as fuller than it is).  Ends with a report that lacks it taken
    ``REPORT_GRACE_S`` after the destroy."""
    expected: dict[str, tuple[float, int, float]] = field(default_factory=dict)
    """Template -> (until when, monotonic s, the node counts as holding it; the
    creates of it placed there since it began; when it began): placed there
    lately, before its reports show the chunks (creates of a template started
    together go to the same nodes, two of them at least,
    :mod:`weenv.cluster.placement`; the nodes placed with it later may ask
    this one for its chunks, :meth:`ClusterView._fetching_locked`)."""


@dataclass
class NodeStatus:
    """One node in :meth:`ClusterView.status`."""

    node_id: str
    state: str
    reason: str
    home: str
    api_url: str
    environments: int
    inflight: int
    cpu_capacity: float
    cpu_reserved: float
    cached_bytes: int
    heartbeat_age_s: float | None


class ClusterView:
    """See the module docstring.  ``max_environments``: per node, at most this many (None: capacity only);
    ``expect_s``: seconds a node counts as holding a template placed there."""

    def __init__(
        self,
        *,
        policy: placement.Policy = placement.Policy(),
        max_environments: int | None = None,
        heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S,
        expect_s: float = EXPECT_S,
    ):
        self.policy, self.max_environments, self.heartbeat_timeout_s = policy, max_environments, heartbeat_timeout_s
        self.expect_s = expect_s
        self._lock = threading.Lock()
        self._nodes: dict[str, _Node] = {}
        self._envs: dict[str, tuple[str, float]] = {}  # env id -> (node id, recorded at, Unix s)
        self._lost: dict[str, tuple[str, float]] = {}  # env id -> (node id, lost at, Unix s)
        self._templates: dict[str, TemplateFacts] = {}
        self._group_sizes: dict[str, int] = {}
        self._tokens = itertools.count(1)
        self._demand: collections.deque[tuple[float, int]] = collections.deque()  # (monotonic s, peak) per second

    # --- nodes ---------------------------------------------------------------------------
    def starting(self, node_id: str) -> None:
        with self._lock:
            self._nodes.setdefault(node_id, _Node(node_id))

    def failed(self, node_id: str, reason: str) -> None:
        with self._lock:
            node = self._nodes.setdefault(node_id, _Node(node_id))
            node.state, node.reason = "failed", reason[:2000]

    def heartbeat(self, report: NodeReport) -> None:
        """Take ``report`` as its node's latest state."""
        with self._lock:
            node = self._nodes.setdefault(report.node_id, _Node(report.node_id))
            if node.state == "gone" and node.reason.startswith("ray"):
                return  # Ray declared the node dead: a late heartbeat does not revive it
            node.state, node.reason, node.report, node.seen = "alive", "", report, time.monotonic()
            present = set(report.environments)
            # a create's reservation counts until a report lists the environment, or one taken well
            # after the create ended does not (destroyed or expired on the node before any report)
            node.pending = {
                e: r for e, r in node.pending.items() if e not in present and r[2] >= report.at - REPORT_GRACE_S
            }
            # a destroy's release lasts while reports (taken before it, perhaps) may still list the environment
            node.released = {
                e: at
                for e, at in node.released.items()
                if (e in report.reservations or e in present or report.at < at + REPORT_GRACE_S)
                and report.at - at < RESERVATION_TTL_S / 20
            }
            for env_id in present:
                if env_id in node.released:
                    continue  # destroyed through the cluster since: not routed again
                self._envs[env_id] = (report.node_id, report.at)
                self._lost.pop(env_id, None)
            for env_id, (where, at) in list(self._envs.items()):
                # destroyed on the node (or expired there); a create that ended (done) while the node
                # was making this report may be missing from it: only entries older than the grace go
                if where == report.node_id and env_id not in present and at < report.at - REPORT_GRACE_S:
                    del self._envs[env_id]
            self._templates.update(report.templates)
            self._group_sizes.update(report.group_sizes)

    def gone(self, node_id: str, reason: str) -> list[str]:
        """Mark ``node_id`` gone (``reason`` in words); its environments become lost.  Returns their ids."""
        with self._lock:
            return self._gone_locked(node_id, reason)

    def _gone_locked(self, node_id: str, reason: str) -> list[str]:
        node = self._nodes.setdefault(node_id, _Node(node_id))
        if node.state == "gone":
            return []
        node.state, node.reason, node.inflight = "gone", reason, {}
        lost = [e for e, (where, _) in self._envs.items() if where == node_id]
        now = time.time()
        for env_id in lost:
            del self._envs[env_id]
            self._lost[env_id] = (node_id, now)
        node.pending, node.released = {}, {}
        return lost

    def expire(self) -> list[str]:
        """Nodes silent past the timeout go (returns their ids); stale reservations are dropped."""
        now = time.monotonic()
        went = []
        with self._lock:
            for node in self._nodes.values():
                node.inflight = {t: r for t, r in node.inflight.items() if now - r[2] < RESERVATION_TTL_S}
                if node.state == "alive" and now - node.seen > self.heartbeat_timeout_s:
                    self._gone_locked(node.node_id, f"no heartbeat for {now - node.seen:.0f} s")
                    went.append(node.node_id)
        return went

    def node_ids(self) -> list[str]:
        with self._lock:
            return list(self._nodes)

    # --- placement -----------------------------------------------------------------------
    def place(
        self,
        template: str,
        *,
        cpus: float | None = None,
        memory_bytes: int | None = None,
        node: str | None = None,
        near: str | None = None,
    ) -> Placed:
        """Choose a node for one environment of ``template`` and hold its request
        there until :meth:`done`.  ``node``: a node id to prefer; ``near``: an
        environment whose node to prefer (forks, snapshots, resumes pass their
        origin this way).  Raises :class:`InvalidInputError` (a node the cluster
        never had), :class:`NotFoundError` / :class:`LostError` (``near`` unknown or
        lost), :class:`CapacityError` (no node can take it now)."""
        with self._lock:
            if near is not None:
                node = self._route_locked(near).node_id
            request = self._request(template, cpus, memory_bytes)
            loads = [self._load(n) for n in self._nodes.values()]
            if node is not None and node not in self._nodes:
                raise InvalidInputError(f"no node {node!r} in the cluster (nodes: {', '.join(self._nodes) or 'none'})")
            alive = [n for n in loads if n.alive]
            demand = self._note_demand(sum(n.environments + n.inflight for n in alive) + 1)
            chosen = placement.place(
                loads,
                request,
                policy=self.policy,
                preferred=node,
                cap=placement.bonus_cap(demand, len(alive), self.policy),
                spread=self._spread_locked(template, request),
            )
            token = next(self._tokens)
            target = self._nodes[chosen]
            now = time.monotonic()
            target.inflight[token] = (request.cpus, request.memory_bytes, now)
            peers = self._fetching_locked(template, chosen)
            until, count, since = target.expected.get(template, (0.0, 0, now))
            target.expected[template] = (
                (now + self.expect_s, count + 1, since) if until > now else (now + self.expect_s, 1, now)
            )
            return Placed(_route_of(target), token, peers)

    def _spread_locked(self, template: str, request: placement.Request) -> dict[str, int] | None:
        """For a template no alive node's report holds (some bytes of each of
        its groups placement weighs): the creates of it placed lately per node
        (:func:`weenv.cluster.placement.has_bonus`); None once a node holds it."""
        now = time.monotonic()
        spread = {}
        for n in self._nodes.values():
            if n.state != "alive" or n.report is None:
                continue
            if all(n.report.group_bytes.get(g, 0) > 0 for g, _ in request.groups):
                return None
            until, count, _since = n.expected.get(template, (0.0, 0, 0.0))
            if until > now:
                spread[n.node_id] = count
        return spread

    def _fetching_locked(self, template: str, other_than: str) -> tuple[str, ...]:
        """The alive nodes but ``other_than`` that hold chunks of ``template``'s
        own groups or were placed with it lately *before* ``other_than`` was
        (holders, then the first placed first; at most
        :data:`~weenv.node.data.peers.MAX_HINTED`).  The first node placed with a
        template no node holds is named to the others, never they to it: it
        streams the template's prefetch pack from the store and they follow
        it.  (Naming each to each made every node placed with it take its
        peers for holders, so none streamed the pack: ``weenv bench cluster``
        measured 3 of 4 nodes with no pack bytes in the first batch, the
        chunks one by one from the store after a 404 from the other node.)"""
        now = time.monotonic()
        groups = [g for g, _ws in self._groups_of(template, self._templates.get(template)) if g.startswith("sha256:")]
        until, _count, since = self._nodes[other_than].expected.get(template, (0.0, 0, 0.0))
        mine = since if until > now else float("inf")
        found = []
        for n in self._nodes.values():
            if n.node_id == other_than or n.state != "alive" or n.report is None:
                continue
            until, _count, since = n.expected.get(template, (0.0, 0, 0.0))
            before = until > now and since < mine
            if before or any(n.report.group_bytes.get(g, 0) > 0 for g in groups):
                found.append((since if before else 0.0, n.node_id))
        return tuple(node_id for _, node_id in sorted(found))[:MAX_HINTED]

    def _note_demand(self, now_at_once: int) -> int:
        """Record ``now_at_once`` environments (run and being made); the most at once over ``DEMAND_WINDOW_S``."""
        now = time.monotonic()
        d = self._demand
        if d and now - d[-1][0] < 1.0:
            d[-1] = (d[-1][0], max(d[-1][1], now_at_once))
        else:
            d.append((now, now_at_once))
        while now - d[0][0] > DEMAND_WINDOW_S:
            d.popleft()
        return max(v for _, v in d)

    def _request(self, template: str, cpus: float | None, memory_bytes: int | None) -> placement.Request:
        """What one environment of ``template`` asks (the template's defaults where None)."""
        facts = self._templates.get(template)
        default = Resources()
        return placement.Request(
            cpus=cpus if cpus is not None else (facts.cpus if facts else default.cpus),
            memory_bytes=memory_bytes
            if memory_bytes is not None
            else (facts.memory_bytes if facts else default.memory_bytes),
            groups=self._groups_of(template, facts),
        )

    def room(self, items: list[tuple[str, float | None, int | None]]) -> int:
        """How many of ``items`` (``(template, cpus, memory_bytes)``, None: the
        template's) the cluster could hold at once now: each placed in turn on
        the least loaded node it fits (alive, within capacity and
        ``max_environments``; creates in progress count, their number per node
        does not: that bounds admission, not room)."""
        policy = dataclasses.replace(self.policy, max_inflight=1 << 62)
        with self._lock:
            loads = [self._load(n) for n in self._nodes.values()]
            fits = 0
            for template, cpus, memory_bytes in items:
                request = self._request(template, cpus, memory_bytes)
                ok = [n for n in loads if placement.eligible(n, request, policy)]
                if not ok:
                    continue
                n = min(ok, key=lambda n: placement.load(n, request, policy))
                n.cpu_inflight += request.cpus
                n.memory_inflight += request.memory_bytes
                n.inflight += 1
                fits += 1
            return fits

    def _groups_of(self, template: str, facts: TemplateFacts | None) -> tuple[tuple[str, int], ...]:
        """The template's groups and their bytes for placement (without those
        every node holds, :meth:`_everywhere`, unless that is all); one stand-in
        ``template:NAME`` of 1 byte while no node knows it (a node it was
        placed on lately holds that, :meth:`_expected_bytes`)."""
        if facts is None:
            return ((f"template:{template}", 1),)
        groups = tuple((g, self._working_set(g)) for g in facts.groups)
        distinct = tuple((g, ws) for g, ws in groups if not self._everywhere(g, ws))
        return distinct or groups

    def _everywhere(self, group: str, ws: int) -> bool:
        """Whether every alive node (two or more) holds at least half of ``group``'s
        working set ``ws``: a shared base, whose bonus would be the same on every
        node and only dilute the template's own groups'."""
        alive = [n for n in self._nodes.values() if n.state == "alive" and n.report is not None]
        return len(alive) > 1 and ws > 0 and all(2 * n.report.group_bytes.get(group, 0) >= ws for n in alive)

    def _working_set(self, group: str) -> int:
        """The bytes of ``group`` placement weighs: the most any node holds of it
        (what its environments read: a few percent of a template, as a rule),
        its whole size while no node holds any.  A node holding that much has
        the template's whole share (cache bonus)."""
        held = max(
            (
                n.report.group_bytes.get(group, 0)
                for n in self._nodes.values()
                if n.report is not None and n.state == "alive"
            ),
            default=0,
        )
        return held if held > 0 else self._group_sizes.get(group, 0)

    def _expected_bytes(self, node: _Node) -> dict[str, int]:
        """Group (or stand-in) -> bytes the node is expected to hold for templates placed there lately."""
        now = time.monotonic()
        node.expected = {t: e for t, e in node.expected.items() if e[0] > now}
        out: dict[str, int] = {}
        for template in node.expected:
            for g, size in self._groups_of(template, self._templates.get(template)):
                out[g] = max(out.get(g, 0), size)
        return out

    def peers(self, node_id: str) -> list[PeerInfo]:
        """The peer table of ``node_id``: every other alive node, its daemon's URL
        and the groups it holds chunks of (or was placed lately)."""
        with self._lock:
            out = []
            for n in self._nodes.values():
                if n.node_id == node_id or n.state != "alive" or n.report is None:
                    continue
                groups = {g for g, b in n.report.group_bytes.items() if b > 0}
                groups |= {g for g in self._expected_bytes(n) if g.startswith("sha256:")}
                out.append(PeerInfo(node_id=n.node_id, url=n.report.api_url, groups=sorted(groups)))
            return out

    def done(self, token: int, node_id: str, env_id: str | None) -> None:
        """The create holding ``token`` on ``node_id`` ended: made ``env_id``, or failed (None).
        Token 0 (never a placement's) records ``env_id`` alone: one its node made
        itself, such as a fork's child.  An environment lost with its node and
        resumed on this one (its published pause) is found again."""
        with self._lock:
            node = self._nodes.get(node_id)
            if node is None:
                return
            held = node.inflight.pop(token, None)
            if env_id is not None and held is not None and node.state != "gone":
                node.pending[env_id] = (held[0], held[1], time.time())
            if env_id is not None:
                if node.state == "gone":
                    self._lost[env_id] = (node_id, time.time())
                else:
                    self._envs[env_id] = (node_id, time.time())
                    self._lost.pop(env_id, None)

    def _load(self, node: _Node) -> placement.NodeLoad:
        r = node.report
        if r is None:
            return placement.NodeLoad(node.node_id, 0.0, 0, alive=False)
        freed = [r.reservations[e] for e in node.released if e in r.reservations]
        cpu_reserved = r.cpu_reserved + sum(c for c, _, _ in node.pending.values()) - sum(c for c, _ in freed)
        memory_reserved = r.memory_reserved + sum(m for _, m, _ in node.pending.values()) - sum(m for _, m in freed)
        return placement.NodeLoad(
            node_id=node.node_id,
            cpu_capacity=r.cpu_capacity,
            memory_capacity=r.memory_capacity,
            cpu_reserved=max(0.0, cpu_reserved),
            memory_reserved=max(0, memory_reserved),
            cpu_used=r.cpu_used,
            memory_used=r.memory_used,
            cpu_inflight=sum(c for c, _, _ in node.inflight.values()),
            memory_inflight=sum(m for _, m, _ in node.inflight.values()),
            inflight=len(node.inflight),
            environments=sum(1 for where, _ in self._envs.values() if where == node.node_id),
            max_environments=self.max_environments,
            alive=node.state == "alive",
            group_bytes=_merged(self._expected_bytes(node), r.group_bytes),
        )

    # --- routing -------------------------------------------------------------------------
    def route(self, env_id: str) -> Route:
        """Where ``env_id`` runs.  Raises :class:`LostError` if its node is gone,
        :class:`NotFoundError` if the cluster does not know it."""
        with self._lock:
            return self._route_locked(env_id)

    def _route_locked(self, env_id: str) -> Route:
        if env_id in self._lost:
            node_id, _ = self._lost[env_id]
            raise LostError(
                f"environment {env_id} was lost with node {node_id} "
                f"({self._nodes[node_id].reason if node_id in self._nodes else 'gone'})"
            )
        found = self._envs.get(env_id)
        if found is None:
            raise NotFoundError(f"no environment {env_id} in the cluster")
        return _route_of(self._nodes[found[0]])

    def routes(self) -> list[Route]:
        """The route of every alive node."""
        with self._lock:
            return [_route_of(n) for n in self._nodes.values() if n.state == "alive" and n.report is not None]

    def forget(self, env_id: str) -> None:
        """``env_id`` was destroyed (through the cluster): no longer routed, and what
        its create reserved on its node is free at once (not a heartbeat or
        ``REPORT_GRACE_S`` later), so the next creates placed see that room."""
        with self._lock:
            found = self._envs.pop(env_id, None)
            self._lost.pop(env_id, None)
            node = self._nodes.get(found[0]) if found is not None else None
            if node is None:
                return
            node.pending.pop(env_id, None)
            # taken off the sums of the reports that list it, this one or one taken before the destroy
            node.released[env_id] = time.time()

    def environments(self) -> dict[str, str]:
        """Environment id -> node id, for every environment the cluster knows to run."""
        with self._lock:
            return {e: n for e, (n, _) in self._envs.items()}

    def lost(self) -> dict[str, str]:
        """Environment id -> the node id it was lost with."""
        with self._lock:
            return {e: n for e, (n, _) in self._lost.items()}

    def status(self) -> list[NodeStatus]:
        now = time.monotonic()
        with self._lock:
            out = []
            for n in self._nodes.values():
                r = n.report
                out.append(
                    NodeStatus(
                        node_id=n.node_id,
                        state=n.state,
                        reason=n.reason,
                        home=r.home if r else "",
                        api_url=r.api_url if r else "",
                        environments=len(r.environments) if r else 0,
                        inflight=len(n.inflight),
                        cpu_capacity=r.cpu_capacity if r else 0.0,
                        cpu_reserved=r.cpu_reserved if r else 0.0,
                        cached_bytes=sum(r.group_bytes.values()) if r else 0,
                        heartbeat_age_s=(now - n.seen) if r else None,
                    )
                )
            return out


def _route_of(node: _Node) -> Route:
    """The route to ``node`` (one that has reported)."""
    assert node.report is not None
    return Route(node.node_id, node.report.api_url, node.report.api_key)


def _merged(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    """Per key, the larger of ``a``'s and ``b``'s bytes."""
    out = dict(a)
    for k, v in b.items():
        if v > out.get(k, 0):
            out[k] = v
    return out
