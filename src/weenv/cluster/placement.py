"""Where an environment goes: the cluster's placement, as plain logic (no Ray,
no I/O; the placement actor of :mod:`weenv.cluster.actors` holds the state and
calls :func:`place`).

The shape is E2B's best-of-K: sample ``k`` eligible nodes, score each, take the
lowest score.  A node's score is its **load** minus a bounded **cache bonus**::

    load(node)  = max over cpu, memory of
                  (reserved + in flight + request + used_share × used) / capacity
    bonus(node) = cache_bonus × (bytes of the template's groups the node holds
                                 / the template's bytes)          in [0, cache_bonus]
    score       = load − bonus − (prefer_bonus if the node is the preferred one)

The bonus is **bounded by load** (consistent hashing with bounded loads,
Mirrokni et al. 2018): a node gets it only while it has fewer than
:func:`bonus_cap` environments (those it runs and creates in flight, this one
counted): ``ceil((1 + balance) × demand / alive nodes) + 1``, ``demand`` the
cluster's recent peak of environments at once (the caller's, a rollout
batch's size as a rule).  Past it the node competes on load alone: a batch of
rollouts does not pile on the nodes that hold its templates (small
environments barely move the load: 16 of 0.05 cores on 2 cores weigh 0.4,
less than a whole template's bonus).

A template **no node holds yet**, started by several creates at once, goes
to two nodes (at least): while the caller passes ``spread`` (per node, the
creates of the template placed there lately), a node that has at least half
of them (rounded up, the one placed counted) gets no bonus for it.  The next
batch then finds the template warm on two nodes, and placing it warm need not
pile on one (with one holder per template, two templates of a batch warm on the
same node either pile there or one goes cold elsewhere); the second node
fetches its chunks from the first (peer sharing), not from the store.

``reserved`` is what the node's environments reserve (their CPU reservations,
their memory limits), ``in flight`` what creates placed there and not done yet
ask, ``used`` what they use now (CPU cores, working set).  The nodes holding
most of the template (up to ``k``) are always among the candidates, so a warm
node is not missed by the sample.

A node is **eligible** only if it is alive, the request fits in what it has
left (``reserved + in flight + request <= capacity``, CPU and memory), it runs
fewer environments than its ``max_environments`` and has fewer than
``max_inflight`` creates in progress: never a node over capacity or swamped by
creates.  The preferred node (a hint's node, the node of the environment a hint
names, the origin of a fork, snapshot or resume) wins whenever it is eligible
(``prefer_bonus`` exceeds any load difference); when it is not, the others
compete as usual.

Errors: :class:`~weenv.errors.InvalidInputError` for a hint naming a node the
cluster never had, :class:`~weenv.errors.CapacityError` when no node is
eligible (the cluster is full, or every node is gone).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from weenv.errors import CapacityError, InvalidInputError

DEFAULT_K = 3
"""Nodes sampled per placement (E2B samples 3)."""
CACHE_BONUS = 0.5
"""The most a template's cached bytes take off a node's score (a fully warm node
at load 0.9 ties a cold one at 0.4)."""
USED_SHARE = 0.5
"""The weight of what a node's environments use now, beside what they reserve."""
PREFER_BONUS = 10.0
"""Taken off the preferred node's score: more than any load difference (loads are <= 1 + used_share)."""
MAX_INFLIGHT = 8
"""Creates in progress a node may have before placement passes it over."""
BALANCE = 0.25
"""How far over the mean of environments per node a node may be and still get the cache bonus (:func:`bonus_cap`)."""


@dataclass
class NodeLoad:
    """One node as placement sees it.  CPU in cores, memory in bytes."""

    node_id: str
    cpu_capacity: float
    memory_capacity: int
    cpu_reserved: float = 0.0
    memory_reserved: int = 0
    cpu_used: float = 0.0
    memory_used: int = 0
    cpu_inflight: float = 0.0
    """CPU asked by creates placed here and not done yet."""
    memory_inflight: int = 0
    inflight: int = 0
    """Creates placed here and not done yet."""
    environments: int = 0
    max_environments: int | None = None
    """None: no bound but capacity."""
    alive: bool = True
    group_bytes: dict[str, int] = field(default_factory=dict)
    """Group digest -> plaintext bytes of its chunks the node holds."""


@dataclass(frozen=True)
class Request:
    """What one environment asks: ``cpus`` cores, ``memory_bytes`` bytes, and its
    template's groups as ``(digest, plaintext bytes)`` (empty: not known to the
    cluster yet, so no node gets a cache bonus)."""

    cpus: float
    memory_bytes: int
    groups: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class Policy:
    k: int = DEFAULT_K
    cache_bonus: float = CACHE_BONUS
    used_share: float = USED_SHARE
    prefer_bonus: float = PREFER_BONUS
    max_inflight: int = MAX_INFLIGHT
    balance: float | None = BALANCE
    """None: the cache bonus is not bounded by load (:func:`bonus_cap`)."""


def bonus_cap(demand: int, alive: int, policy: Policy = Policy()) -> int | None:
    """The environments (run and in flight, the one placed counted) below which
    a node gets the cache bonus: ``ceil((1 + balance) × demand / alive) + 1``.
    ``demand``: the cluster's recent peak of environments at once; ``alive``:
    its alive nodes.  None (no bound) without ``policy.balance`` or nodes."""
    if policy.balance is None or alive <= 0:
        return None
    return math.ceil((1 + policy.balance) * max(1, demand) / alive - 1e-9) + 1


def cached_share(node: NodeLoad, request: Request) -> float:
    """The share, in [0, 1], of the template's bytes that ``node`` holds (0 for an unknown template)."""
    total = sum(size for _, size in request.groups)
    if total <= 0:
        return 0.0
    held = sum(min(node.group_bytes.get(digest, 0), size) for digest, size in request.groups)
    return held / total


def load(node: NodeLoad, request: Request, policy: Policy = Policy()) -> float:
    """The node's load with ``request`` placed on it (see the module's formula); inf without capacity."""
    if node.cpu_capacity <= 0 or node.memory_capacity <= 0:
        return float("inf")
    cpu = (node.cpu_reserved + node.cpu_inflight + request.cpus + policy.used_share * node.cpu_used) / node.cpu_capacity
    mem = (
        node.memory_reserved + node.memory_inflight + request.memory_bytes + policy.used_share * node.memory_used
    ) / node.memory_capacity
    return max(cpu, mem)


def eligible(node: NodeLoad, request: Request, policy: Policy = Policy()) -> bool:
    """Whether ``request`` may go to ``node`` (alive, within capacity, below its bounds)."""
    return (
        node.alive
        and node.inflight < policy.max_inflight
        and (node.max_environments is None or node.environments + node.inflight < node.max_environments)
        and node.cpu_reserved + node.cpu_inflight + request.cpus <= node.cpu_capacity + 1e-9
        and node.memory_reserved + node.memory_inflight + request.memory_bytes <= node.memory_capacity
    )


def has_bonus(node: NodeLoad, cap: int | None = None, spread: dict[str, int] | None = None) -> bool:
    """Whether ``node`` may get the cache bonus: below ``cap`` environments
    (:func:`bonus_cap`; None: no bound) and, with ``spread`` (creates of a
    template no node holds yet placed lately, per node id), holding fewer than
    half of them, the one placed counted (see the module docstring)."""
    if cap is not None and node.environments + node.inflight + 1 > cap:
        return False
    if spread:
        mine = spread.get(node.node_id, 0)
        return mine == 0 or mine < math.ceil((sum(spread.values()) + 1) / 2)
    return True


def score(
    node: NodeLoad,
    request: Request,
    policy: Policy = Policy(),
    *,
    preferred: str | None = None,
    cap: int | None = None,
    spread: dict[str, int] | None = None,
) -> float:
    """Lower is better: load minus the cache bonus (only where :func:`has_bonus`),
    minus ``prefer_bonus`` on the preferred node."""
    s = load(node, request, policy)
    if has_bonus(node, cap, spread):
        s -= policy.cache_bonus * cached_share(node, request)
    return s - policy.prefer_bonus if node.node_id == preferred else s


SAMPLE_TRIES = 8
"""Random draws per sampled node before :func:`place` filters every node (a nearly full cluster)."""


def place(
    nodes: list[NodeLoad],
    request: Request,
    *,
    policy: Policy = Policy(),
    preferred: str | None = None,
    rng: random.Random | None = None,
    holders: list[NodeLoad] | None = None,
    cap: int | None = None,
    spread: dict[str, int] | None = None,
) -> str:
    """The id of the node ``request`` goes to, from ``nodes``.

    ``preferred``: a node id that wins if eligible (a hint, an origin);
    :class:`InvalidInputError` if no node of ``nodes`` has it.  ``holders``:
    the nodes holding any of the template's groups, when the caller keeps an
    index of them (None: every node is looked at).  ``cap``: environments
    per node from which the cache bonus is off (:func:`bonus_cap`; None: never).  ``spread``:
    for a template no node holds yet, the creates of it placed lately per node
    id (:func:`has_bonus`; None: the template is held, or not known).  Raises
    :class:`CapacityError` when no node is eligible.

    Cost: O(k + holders) on a cluster with room (the ``k`` sampled nodes are
    drawn at random and kept if eligible, up to ``SAMPLE_TRIES × k`` draws),
    O(nodes) when the draws find too few eligible ones or without ``holders``."""
    rng = rng or random
    if preferred is not None and not any(n.node_id == preferred for n in nodes):
        raise InvalidInputError(f"no node {preferred!r} in the cluster (nodes: {', '.join(n.node_id for n in nodes)})")
    candidates: dict[str, NodeLoad] = {}
    if len(nodes) > 4 * policy.k:
        for _ in range(SAMPLE_TRIES * policy.k):
            n = rng.choice(nodes)
            if eligible(n, request, policy):
                candidates[n.node_id] = n
                if len(candidates) == policy.k:
                    break
    ok = None
    if len(candidates) < policy.k:
        ok = [n for n in nodes if eligible(n, request, policy)]
        if not ok:
            alive = sum(n.alive for n in nodes)
            raise CapacityError(
                f"no node can take {request.cpus:g} cpus and {request.memory_bytes >> 20} MiB now "
                f"({alive} of {len(nodes)} nodes alive, all full or busy with creates)"
            )
        candidates = {n.node_id: n for n in (rng.sample(ok, policy.k) if len(ok) > policy.k else ok)}
    if request.groups:
        pool = holders if holders is not None else ok if ok is not None else nodes
        warm = [n for n in pool if cached_share(n, request) > 0 and eligible(n, request, policy)]
        # those that may get the bonus first: a warm node past the cap gets none (it need not be a candidate)
        warm.sort(key=lambda n: (not has_bonus(n, cap, spread), -cached_share(n, request)))
        candidates.update((n.node_id, n) for n in warm[: policy.k])
    if preferred is not None:
        for n in nodes:
            if n.node_id == preferred and eligible(n, request, policy):
                candidates[n.node_id] = n
    # equal scores (empty nodes, as a rule): a random one, not always the same (the lowest id)
    ties = {n.node_id: rng.random() for n in candidates.values()}
    return min(
        candidates.values(),
        key=lambda n: (
            round(score(n, request, policy, preferred=preferred, cap=cap, spread=spread), 9),
            ties[n.node_id],
        ),
    ).node_id
