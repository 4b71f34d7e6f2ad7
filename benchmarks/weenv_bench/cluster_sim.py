"""``weenv bench cluster --simulate``: weenv's placement (:func:`weenv.cluster.placement.place`,
imported, not copied) driven by a model of 100 and 1,000 nodes.

**What runs for real**: :func:`~weenv.cluster.placement.place` with
:class:`~weenv.cluster.placement.NodeLoad`/``Request``/``Policy`` (best-of-K,
load, the cache bonus bounded by :func:`~weenv.cluster.placement.bonus_cap`
over the peak of environments at once so far, as the view's demand,
eligibility); its own wall time per call is measured here.  The view's rules around it are modelled as :mod:`weenv.cluster.view`
has them: a template placed on a node counts as held there from its placement
on (``expected``), the share a node holds is over the template's working
set (the bytes environments read), not its whole size, and the creates of a
template no node's cache holds yet are spread over two nodes at least
(``spread``: per node, the creates of it placed there so far).

**What is modelled** (stated in the JSON's ``model``):

- nodes: 64 cores, 256 GiB, a 200 GiB chunk cache (LRU by template), a 25 Gb/s
  NIC; ``Policy(max_inflight=32)`` (half the cores creating at once);
- templates: ``T`` (2,000; quick and 1,000 nodes: 8,000 too) of 1-3 GB
  (uniform), each its own bytes (no shared base: the worst case for caches);
  a task's popularity Zipf-like (``p(i) ∝ 1 / i^1.1``), as SWE-style task sets are
  drawn;
- a batch: ``B`` concurrent creates (1,000 / 4,000 / 16,000), ``B / 8``
  tasks drawn by popularity, 8 rollouts each (GRPO's group), all asked at
  once; each environment asks 0.25 cores and 1 GiB and lives until the batch
  ends; ``iterations`` batches in a row (caches carry over); placement
  refused (every node at its bound) waits for the next create to end;
- a create: ``warm_create_s`` (measured here: a real warm create's p50) plus
  the bytes it reads before it is ready, ``startup_fraction`` (5 %) of its
  template, at the rate of its source: its own cache (nothing), a peer
  holding it, or fetching it (each chunk as it lands there, no faster than
  that fetch, if a chunk lands within the 2 s peer timeout, else the store;
  ``peer_ms_per_mib``
  measured here, at most the NIC's share), the store (``store_ms_per_mib``
  measured here, at most the NIC's share and a share of the store's 100 Gb/s
  egress).  Rates are set when a transfer starts (no re-sharing midway).
- one placement actor: placements run one after the other, each taking the
  wall time its :func:`~weenv.cluster.placement.place` call took here (the
  warm nodes passed as ``holders``, an index of who holds each template);
- ``random``: a node drawn among the eligible ones, every chunk from the store.

Reported per node count and mode: create p50/p99, store egress over the unique
bytes needed (each template's startup bytes once), cache hit rate (creates on a
node holding the template), envs per node max/mean.
"""

from __future__ import annotations

import heapq
import random
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass

from weenv.cluster import placement
from weenv.errors import CapacityError

GB = 10**9
GiB = 1 << 30
MiB = 1 << 20


@dataclass
class Costs:
    """Per-operation costs (seconds, ms per MiB): measured on this machine by the real run, else these defaults."""

    warm_create_s: float = 0.3
    store_ms_per_mib: float = 2.0
    peer_ms_per_mib: float = 3.0
    source: str = "defaults (no real run)"

    @classmethod
    def from_real(cls, real: dict) -> Costs:
        w = real["modes"]["weenv"]
        return cls(
            warm_create_s=w["warm_create_p50_s"] or cls.warm_create_s,
            store_ms_per_mib=real["store_ms_per_mib"],
            peer_ms_per_mib=w["peer_ms_per_mib"] or cls.peer_ms_per_mib,
            source="measured by this run's real part",
        )


@dataclass
class Model:
    cores: float = 64.0
    memory: int = 256 * GiB
    cache_bytes: int = 200 * GiB
    nic_bytes_s: float = 25e9 / 8
    store_bytes_s: float = 100e9 / 8
    max_inflight: int = 32
    peer_timeout_s: float = 2.0
    env_cpus: float = 0.25
    env_memory: int = 1 * GiB
    startup_fraction: float = 0.05
    group: int = 8
    zipf_s: float = 1.1
    size_min: int = 1 * GB
    size_max: int = 3 * GB


class SimNode:
    def __init__(self, i: int, m: Model):
        self.load = placement.NodeLoad(node_id=f"n{i:04d}", cpu_capacity=m.cores, memory_capacity=m.memory)
        self.cache: OrderedDict[int, int] = OrderedDict()  # template -> bytes held (LRU first)
        self.cached = 0
        self.fetching: dict[int, float] = {}  # template -> when its fetch here ends
        self.rates: dict[int, float] = {}  # template -> the bytes/s of its fetch here
        self.streams = 0
        self.envs = 0

    def hold(self, t: int, size: int, bound: int) -> None:
        if t in self.cache:
            self.cache.move_to_end(t)
            return
        while self.cached + size > bound and self.cache:
            old, b = self.cache.popitem(last=False)
            self.cached -= b
            self.load.group_bytes.pop(str(old), None)
        self.cache[t] = size
        self.cached += size
        self.load.group_bytes[str(t)] = size


def zipf_weights(n: int, s: float) -> list[float]:
    return [1.0 / (i + 1) ** s for i in range(n)]


def simulate(
    nodes: int, templates: int, batches: list[int], mode: str, costs: Costs, m: Model = Model(), seed: int = 0
) -> dict:
    """``batches``: concurrent creates per batch, in order.  Returns per-batch and overall figures."""
    rng = random.Random(seed)
    sizes = [rng.randint(m.size_min, m.size_max) for _ in range(templates)]
    weights = zipf_weights(templates, m.zipf_s)
    fleet = [SimNode(i, m) for i in range(nodes)]
    by_id = {n.load.node_id: n for n in fleet}
    policy = placement.Policy(max_inflight=m.max_inflight)
    peers_on = mode == "weenv"
    holders: dict[int, set[str]] = {}  # template -> nodes holding or fetching it
    store_bytes = peer_bytes = 0
    needed: set[int] = set()
    out_batches = []
    place_s = place_n = 0
    peak = 0  # the most environments at once so far: the view's demand (its window outlasts these batches)
    for size_b in batches:
        tasks = rng.choices(range(templates), weights=weights, k=max(1, size_b // m.group))
        queue = [t for t in tasks for _ in range(m.group)][:size_b]
        for n in fleet:
            n.envs = 0
            n.load.cpu_reserved, n.load.memory_reserved, n.load.environments = 0.0, 0, 0
        now = place_clock = 0.0
        ends: list[tuple[float, str, int]] = []  # (end time, node, template)
        latencies, hits, active = [], 0, [0]  # active: transfers from the store
        live = 0  # environments of this batch placed so far (they run until it ends)
        cold: dict[int, dict[str, int]] = {}  # template no cache holds -> creates of it placed per node
        i = 0
        while i < len(queue):
            t = queue[i]
            ws = int(sizes[t] * m.startup_fraction)
            req = placement.Request(cpus=m.env_cpus, memory_bytes=m.env_memory, groups=((str(t), ws),))
            loads = [n.load for n in fleet]
            try:
                c0 = time.perf_counter()
                held = any(t in by_id[h].cache for h in holders.get(t, ()))
                if peers_on:
                    chosen = placement.place(
                        loads,
                        req,
                        policy=policy,
                        rng=rng,
                        holders=[by_id[h].load for h in holders.get(t, ())],
                        cap=placement.bonus_cap(max(peak, live + 1), nodes, policy),
                        spread=None if held else cold.get(t, {}),
                    )
                else:
                    ok = [x for x in loads if placement.eligible(x, req, policy)]
                    if not ok:
                        raise CapacityError("full")
                    chosen = rng.choice(ok).node_id
                took = time.perf_counter() - c0
                place_s += took
                place_n += 1
                # one placement actor: placements one after the other, each costing what it cost here
                place_clock = max(place_clock, now) + took
            except CapacityError:
                end, nid, src = heapq.heappop(ends)  # the next create ends first
                now = max(now, end)
                _end(by_id[nid], m, src, active)
                continue
            live += 1
            peak = max(peak, live)
            if not held:
                cold.setdefault(t, {})[chosen] = cold.get(t, {}).get(chosen, 0) + 1
            node = by_id[chosen]
            node.load.inflight += 1
            node.load.cpu_inflight += m.env_cpus
            node.load.memory_inflight += m.env_memory
            needed.add(t)
            if t in node.cache:
                start, rate, src = place_clock, None, "local"
                node.cache.move_to_end(t)
                hits += 1
            elif t in node.fetching:
                start, rate, src = max(place_clock, node.fetching[t]), None, "local"
                hits += 1
            else:
                # a peer serves what it holds, and what it is fetching as each chunk lands there (the
                # node asks it chunk by chunk behind it) if a chunk lands within the peer timeout
                others = (
                    [
                        by_id[h]
                        for h in holders.get(t, ())
                        if h != chosen
                        and (
                            by_id[h].fetching.get(t, 0.0) <= place_clock or MiB / by_id[h].rates[t] <= m.peer_timeout_s
                        )
                    ]
                    if peers_on
                    else []
                )
                nic = m.nic_bytes_s / (node.streams + 1)
                if others:
                    peer = min(others, key=lambda o: o.fetching.get(t, 0.0))
                    start = place_clock
                    rate, src = (
                        min(MiB / (costs.peer_ms_per_mib / 1000), nic, m.nic_bytes_s / (peer.streams + 1)),
                        "peer",
                    )
                    if peer.fetching.get(t, 0.0) > place_clock:  # its last chunk lands, then comes here
                        rate = min(rate, peer.rates[t])
                    peer_bytes += ws
                else:
                    rate = min(MiB / (costs.store_ms_per_mib / 1000), nic, m.store_bytes_s / (active[0] + 1))
                    start, src = place_clock, "store"
                    store_bytes += ws
                    active[0] += 1
                node.streams += 1
                node.load.group_bytes[str(t)] = ws  # the view's "expected": placed here, counts as held
            fetch_end = start + (ws / rate if rate else 0.0)
            if src != "local":
                node.fetching[t], node.rates[t] = fetch_end, rate
                holders.setdefault(t, set()).add(chosen)
            ready = fetch_end + costs.warm_create_s
            latencies.append(ready)
            heapq.heappush(ends, (ready, chosen, src))
            node.envs += 1
            i += 1
        while ends:
            end, nid, src = heapq.heappop(ends)
            _end(by_id[nid], m, src, active)
        for n in fleet:  # fetches done: the bytes are in the node's cache
            for t in list(n.fetching):
                n.hold(t, int(sizes[t] * m.startup_fraction), m.cache_bytes)
                del n.fetching[t]
            n.streams = 0
        for t in list(holders):
            holders[t] = {nid for nid in holders[t] if t in by_id[nid].cache}
        counts = [n.envs for n in fleet]
        mean = sum(counts) / len(counts)
        out_batches.append(
            {
                "creates": len(queue),
                "p50_s": _pct(latencies, 0.5),
                "p99_s": _pct(latencies, 0.99),
                "hit_rate": hits / len(queue),
                "max_over_mean": max(counts) / mean if mean else None,
            }
        )
    unique = sum(int(sizes[t] * m.startup_fraction) for t in needed)
    last = out_batches[-1]
    return {
        "batches": out_batches,
        "create_p50_s": last["p50_s"],
        "create_p99_s": last["p99_s"],
        "hit_rate": last["hit_rate"],
        "max_over_mean": last["max_over_mean"],
        "store_bytes": store_bytes,
        "peer_bytes": peer_bytes,
        "unique_bytes": unique,
        "store_bytes_ratio": store_bytes / unique if unique else None,
        "place_us": place_s / max(1, place_n) * 1e6,
    }


def _end(node: SimNode, m: Model, src: str, active: list[int]) -> None:
    """A create on ``node`` ended: its environment runs (reserved) until the batch ends."""
    node.load.inflight -= 1
    node.load.cpu_inflight -= m.env_cpus
    node.load.memory_inflight -= m.env_memory
    node.load.cpu_reserved += m.env_cpus
    node.load.memory_reserved += m.env_memory
    node.load.environments += 1
    if src != "local":
        node.streams -= 1
    if src == "store":
        active[0] -= 1


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))]


def run(*, quick: bool = False, costs: Costs = Costs(), log=print) -> dict:
    """The simulation's runs: 100 and 1,000 nodes, weenv and random, batch sizes swept (the last batch: 16,000)."""
    m = Model()
    setups = [(100, 2000), (1000, 8000)] if not quick else [(100, 2000), (1000, 8000)]
    sweep = [1000, 4000, 16000]
    warmup = 1 if quick else 2
    runs = []
    for nodes, templates in setups:
        row = {"nodes": nodes, "templates": templates, "creates": sweep[-1], "batch_sizes": sweep}
        for mode in ("weenv", "random"):
            t = time.monotonic()
            # warm-up iterations of the largest batch (an RL run's earlier iterations), then the sweep
            res = simulate(nodes, templates, [sweep[-1]] * warmup + sweep, mode, costs, m)
            res["p99_by_batch"] = [b["p99_s"] for b in res["batches"][warmup:]]
            res["sim_seconds"] = time.monotonic() - t
            row[mode] = res
            log(
                f"sim {nodes} nodes, {templates} templates, {mode}: p50 {res['create_p50_s']:.2f} s "
                f"p99 {res['create_p99_s']:.2f} s, store {res['store_bytes_ratio']:.2f}x unique, hits "
                f"{res['hit_rate']:.2f}, max/mean {res['max_over_mean']:.2f}, place {res['place_us']:.0f} us "
                f"({res['sim_seconds']:.0f} s)"
            )
        runs.append(row)
    return {"model": asdict(m), "costs": asdict(costs), "warmup_batches": warmup, "runs": runs}
