"""``weenv bench cluster``: placement and peer chunk sharing on a real Ray
cluster on this machine, random placement with every chunk from the store
against weenv's placement with peer sharing, side by side in one run; then
:mod:`weenv_bench.cluster_sim` (``--simulate`` alone: only that).

**The store**, the same for both modes: by default (``store="s3"``) a real S3
server on loopback (SeaweedFS, :mod:`weenv_bench.services.seaweedfs`) that
the nodes reach through a model of a store far away
(:mod:`weenv_bench.services.netshape`, a proxy process): every answer
``store_latency_ms`` (20) later, each connection's answers at most
``store_conn_mib_s`` (64 MiB/s: one S3 GET's throughput), all of them together at
most ``store_total_mib_s`` (128 MiB/s, about 1 Gb/s: the cluster's share of the
store's egress).  0 turns a bound off (all three 0: the nodes reach SeaweedFS
directly).  The model is in the JSON (``real.store``).  Peers talk over loopback
unshaped: a cluster's nodes are near each other, its store is not.
``store="file"``: a ``file://`` directory (no cost but this machine's disk and
CPU: what placement saves there is CPU, not transfer).  The templates are
written to the store directly (not through the model: building is not measured).

**Setup.**  ``T`` templates (32; quick 8) sharing a base (the
Debian bookworm minbase + python3 tree of the tests and of ``weenv bench
update``), each with its own task group (``/workspace/task.bin``, random bytes:
8 MiB; quick 4 MiB).  One Ray cluster of 4 nodes (``ray.cluster_utils.Cluster``:
a head and 3 more raylets, one CPU each), each with its own weenv home and
chunk cache.  The warm pool is off (``WEENV_POOL_SIZE=0``): creates are measured,
not pool takes.

**Rollouts.**  ``iterations`` RL iterations (2) over the same task set; each
iteration is batches of ``batch`` creates (32; quick 16), ``G`` (4) rollouts of
``batch / G`` templates, the templates in a shuffled order per iteration; 256
creates in all (quick 64).  A batch's creates run 8 at once; one create is
``create`` + ``cat /workspace/task.bin`` (the environment ready, its task
read); a batch's environments are destroyed when it ends.

**Prefetch profiles** (``profiles``): ``"recorded"`` (the default): before
the modes, each template is started once on fresh homes (thrown away after),
so that both modes find every template's recorded profile and pack in the
store, as an RL run over a task set run before does; ``"fresh"``: the store
holds none when each mode starts (each records its own on its first starts).
Either way neither mode replays what the other recorded.

**Modes**, on fresh homes each (the same Ray cluster):

- ``random``: every create goes to a node drawn at random (a hint), peer
  sharing off: every chunk a node misses comes from the store;
- ``weenv``: weenv's placement (best-of-K with the cache bonus) and peer sharing.

**Measured** per mode: create p50/p99 (s); bytes from the store (chunks no
peer gave, and prefetch packs) and from peers, over all nodes (the daemons'
``/v1/stats`` ``chunks``); ``store_bytes_ratio``: store bytes over the unique
bytes the nodes needed (the union of the chunks in all nodes' caches, which
never evict here); ``local_hit_rate``: of the creates of a template some node
already held (from an earlier batch), the share placed on a node holding at
least half of what any node holds of the template's own group (the base is on
every node); envs per node max/mean (per batch,
the worst batch); ``breakdown``: where the creates' seconds went (:func:`_parts`:
the cluster's calls and the node's admission, the node's create phases, the
task read), the mean over all and over the slowest 5 % (p99 is among them).  And the per-operation costs the simulation uses: a warm
create's seconds (p50 of local hits), a cold one's (p50 of first touches in
``random``), one chunk from the store and from a peer (ms per MiB, this machine: the store
unshaped, ``store_ms_per_mib``, which the simulation takes with its own model of
a store's egress; through the model, ``store_ms_per_mib_modelled``).
Every create's record is in ``log`` (its seconds, batch, start within the
batch, node, parts).

**Rounds** (``rounds``, 1): both modes that many times, each on fresh homes,
random first in even rounds and weenv first in odd ones.  ``modes`` and the
summary's ``create_p99_s`` / ``random_create_p99_s`` are the first round's, as
with one round (a round's p99 of 64 ``--quick`` creates is its slowest one);
``rounds`` adds each round's figures, the p99 of all rounds' creates pooled and
the median of the rounds' weenv/random p99 ratios.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from weenv_bench import machine, write_report

MiB = 1 << 20
NODES = 4
CREATE_CONCURRENCY = 8
SUMMARY_KEYS = (
    "nodes",
    "creates",
    "store_bytes_ratio",
    "peer_bytes",
    "local_hit_rate",
    "create_p99_s",
    "random_create_p99_s",
    "sim_nodes",
    "sim_creates",
    "sim_create_p99_s",
    "sim_store_bytes_ratio",
)


def pct(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) of ``values`` (nearest rank); None if empty."""
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, max(0, int(round(q * len(v) + 0.5)) - 1))]


def plan(templates: int, batch: int, group: int, iterations: int, seed: int = 0) -> list[list[str]]:
    """Batches of template names: per iteration, the templates shuffled, ``group`` creates each."""
    rng = random.Random(seed)
    per_batch = batch // group
    out = []
    for _ in range(iterations):
        order = [f"c{i}" for i in range(templates)]
        rng.shuffle(order)
        for k in range(0, templates, per_batch):
            out.append([t for t in order[k : k + per_batch] for _ in range(group)])
    return out


PARTS = (
    "cluster_s",
    "manifest_s",
    "reserve_s",
    "groups_s",
    "overlay_s",
    "runtime_s",
    "first_command_s",
    "node_other_s",
    "read_s",
)
"""A create's parts (:func:`_parts`), in order."""


def _parts(timing, create_s: float, read_s: float) -> dict[str, float]:
    """Where one create's seconds went: ``cluster_s``, the create's call less the
    node's own create (placement's calls, the HTTP request, waiting for the
    node's admission to let it in); the node's phases (manifest, the
    provisioner's admission, group mounts and their first chunks, overlay,
    runc, the first command) and
    ``node_other_s``, the rest of the node's create (resolving the name,
    reserving, the prefetch's start, the environment's record); ``read_s``, the
    task read through the lazy file system (its chunks from the cache, a peer or
    the store)."""
    node = {k: getattr(timing, k) or 0.0 for k in PARTS[1:-2]} if timing is not None else {}
    total = timing.total_s if timing is not None else 0.0
    return {
        "cluster_s": max(0.0, create_s - total),
        **node,
        "node_other_s": max(0.0, total - sum(node.values())),
        "read_s": read_s,
    }


def _breakdown(creates: list[dict]) -> dict:
    """Per part, its mean over all creates and over the slowest 5 % (at least 3): what p99 is made of."""
    slow = sorted(creates, key=lambda d: -d["s"])[: max(3, len(creates) // 20)]
    return {
        "all": {k: statistics.mean(d["parts"][k] for d in creates) for k in PARTS} if creates else {},
        "slowest": {k: statistics.mean(d["parts"][k] for d in slow) for k in PARTS} if slow else {},
        "slowest_n": len(slow),
    }


def _chunk_files(home: Path) -> dict[str, int]:
    base = home / "node" / "cache" / "sha256"
    out = {}
    if base.is_dir():
        for p in base.glob("*/*"):
            if not p.name.startswith(".tmp-"):
                out[p.name] = p.stat().st_size
    return out


def build_store(store, root: Path, templates: int, task_bytes: int, log) -> dict[str, set[str]]:
    """Write the base and the templates to ``store``; the chunk digests (hex) of each template's own group
    (the base's are on every node that ran anything: they tell nothing of placement)."""
    from weenv.config import Paths
    from weenv.formats.manifest import RuntimeConfig, parse_group_manifest
    from weenv.packaging.debootstrap import debian_rootfs
    from weenv.packaging.group import build_group
    from weenv.packaging.template import create_template

    t = time.monotonic()
    base_root = debian_rootfs(Paths.from_env().cache, log=log)
    build_group(base_root, store, name="base")
    rng = random.Random(1)
    for i in range(templates):
        d = root / "tasks" / f"c{i}" / "workspace"
        d.mkdir(parents=True)
        (d / "task.bin").write_bytes(rng.randbytes(task_bytes))
        build_group(d.parent, store, name=f"task-c{i}")
        create_template(store, f"c{i}", ["base", f"task-c{i}"], runtime=RuntimeConfig(working_dir="/workspace"))
    chunks = {}
    for i in range(templates):
        g = parse_group_manifest(store.get_manifest(store.get_ref("groups", f"task-c{i}")))
        chunks[f"c{i}"] = {c.digest[7:] for c in g.chunks}
    log(f"store: base + {templates} templates in {time.monotonic() - t:.1f} s")
    return chunks


def run_mode(
    mode: str,
    root: Path,
    store_url: str,
    chunks: dict[str, set[str]],
    batches: list[list[str]],
    log,
    settle=None,
    seed: int = 7,
    homes: Path | None = None,
) -> dict:
    """One mode on fresh homes (``homes``, default ``root / mode``): its creates,
    bytes, hits and balance.  ``settle()``: called once the last batch is done,
    before the nodes go (``record``: until the profiles are published).
    ``seed``: random placement's draws."""

    from weenv import cluster
    from weenv.cluster.client import ClusterClient
    from weenv.config import Paths
    from weenv.formats.manifest import Resources
    from weenv.sdk import NodeClient

    homes = homes or root / mode
    config = cluster.ClusterConfig(
        home=f"{homes}/{{node}}",
        store=store_url,
        cache=str(Paths.from_env().cache),
        heartbeat_s=0.5,
        reconcile_s=0.5,
        cache_scan_s=0.5,
        peers=(mode == "weenv"),
    )
    nodes = sorted(s.node_id for s in cluster.up(config, timeout=180))
    home_of = {n: config.home_of(n) for n in nodes}
    small = Resources(cpus=0.05, memory_bytes=64 << 20)
    rng = random.Random(seed)
    creates, hits, counted, per_batch, batch_at = [], 0, 0, [], []
    t_mode = time.monotonic()
    with ClusterClient() as client:
        for b, names in enumerate(batches):
            held = {n: set(_chunk_files(home_of[n])) for n in nodes}
            anywhere = set().union(*held.values())

            t_batch = time.monotonic()
            batch_at.append(time.time())

            def one(name: str) -> dict:
                node = rng.choice(nodes) if mode == "random" else None
                t = time.monotonic()
                e = client.create(name, resources=small, node=node)
                made = time.monotonic()
                r = client.exec(e.id, "cat /workspace/task.bin > /dev/null")
                if r.exit_code != 0:
                    raise RuntimeError(f"reading the task failed in {e.id}: {r.stderr[-300:]!r}")
                end = time.monotonic()
                return {
                    "template": name,
                    "node": e.node_id,
                    "id": e.id,
                    "s": end - t,
                    "at": t - t_batch,
                    "parts": _parts(e.info.timing, made - t, end - made),
                }

            with concurrent.futures.ThreadPoolExecutor(CREATE_CONCURRENCY) as pool:
                done = list(pool.map(one, names))
            for d in done:
                d["batch"] = b
                ws = chunks[d["template"]] & anywhere
                d["first_touch"] = not ws
                d["held_share"] = len(ws & held[d["node"]]) / len(ws) if ws else 0.0
                if ws:
                    counted += 1
                    hits += d["held_share"] >= 0.5
            counts = [sum(d["node"] == n for d in done) for n in nodes]
            per_batch.append(max(counts) / statistics.mean(counts))
            creates += done
            with concurrent.futures.ThreadPoolExecutor(CREATE_CONCURRENCY) as pool:
                list(pool.map(lambda d: client.destroy(d["id"]), done))
            log(
                f"{mode}: batch {b + 1}/{len(batches)}: p50 {pct([d['s'] for d in done], 0.5):.2f} s, "
                f"envs per node {counts}"
            )
    if settle is not None:
        settle()
    stats = {}
    for n in nodes:
        with NodeClient(socket=Paths(home=home_of[n], cache=Path("/"), store_url="").socket) as c:
            stats[n] = c.stats().chunks
    peer_ms = _peer_ms_per_mib(nodes, home_of, config) if mode == "weenv" else None
    cluster.down()
    union: dict[str, int] = {}
    for n in nodes:
        union.update(_chunk_files(home_of[n]))
    store_bytes = sum(s["store_bytes"] for s in stats.values())
    times = [d["s"] for d in creates]
    return {
        "mode": mode,
        "seconds": time.monotonic() - t_mode,
        "creates": len(creates),
        "create_p50_s": pct(times, 0.5),
        "create_p99_s": pct(times, 0.99),
        "warm_create_p50_s": pct([d["s"] for d in creates if d["held_share"] >= 0.5], 0.5),
        "cold_create_p50_s": pct([d["s"] for d in creates if d["first_touch"]], 0.5),
        "store_bytes": store_bytes,
        "peer_bytes": sum(s["peer_bytes"] for s in stats.values()),
        "pack_bytes": sum(s["pack_bytes"] for s in stats.values()),
        "peer_failures": sum(s["peer_failures"] for s in stats.values()),
        "unique_bytes": sum(union.values()),
        "store_bytes_ratio": store_bytes / max(1, sum(union.values())),
        "local_hit_rate": hits / counted if counted else None,
        "local_counted": counted,
        "envs_per_node_max_over_mean": max(per_batch),
        "envs_per_node_max_over_mean_by_batch": per_batch,
        "creates_per_node": {n[:12]: sum(d["node"] == n for d in creates) for n in nodes},
        "node_stats": {n[:12]: s for n, s in stats.items()},
        "peer_ms_per_mib": peer_ms,
        "breakdown": _breakdown(creates),
        "slowest": [
            {
                "s": round(d["s"], 3),
                "batch": d["batch"],
                "template": d["template"],
                "node": d["node"][:12],
                "first_touch": d["first_touch"],
                "held_share": round(d["held_share"], 2),
                "parts": {k: round(v, 3) for k, v in d["parts"].items()},
            }
            for d in sorted(creates, key=lambda d: -d["s"])[:4]
        ],
        "batch_started_at": batch_at,
        "log": [
            {
                "s": round(d["s"], 3),
                "batch": d["batch"],
                "at": round(d["at"], 3),
                "template": d["template"],
                "node": d["node"][:12],
                "first_touch": d["first_touch"],
                "parts": {k: round(v, 3) for k, v in d["parts"].items()},
            }
            for d in creates
        ],
    }


def _peer_ms_per_mib(nodes, home_of, config) -> float | None:
    """Milliseconds per MiB of chunks one node serves another over HTTP (its peer route), median of 16."""
    import httpx
    import ray

    from weenv import cluster
    from weenv.node.data.peers import CHUNK_PATH, TOKEN_HEADER

    settings = ray.get(cluster.placement_actor().peer_settings.remote())
    for n in nodes:
        files = _chunk_files(home_of[n])
        big = [h for h, size in files.items() if size == MiB][:16]
        if len(big) < 8:
            continue
        url = (home_of[n] / "run" / "api-url").read_text().strip()
        times = []
        with httpx.Client(timeout=10) as h:
            for hx in big:
                t = time.monotonic()
                r = h.get(url + CHUNK_PATH + "sha256:" + hx, headers={TOKEN_HEADER: settings.token})
                data = r.content
                assert r.status_code == 200 and hashlib.sha256(data).hexdigest() == hx
                times.append((time.monotonic() - t) * 1000)
        return statistics.median(times)
    return None


def _store_ms_per_mib(store, chunks: set[str]) -> float:
    """Milliseconds per MiB of one chunk from the store (read, decompressed, checked), median of 16."""
    from weenv.store.base import Store

    assert isinstance(store, Store)
    times = []
    for hx in sorted(chunks)[:16]:
        t = time.monotonic()
        data = store.get_chunk("sha256:" + hx)
        times.append((time.monotonic() - t) * 1000 * MiB / max(1, len(data)))
    return statistics.median(times)


@dataclass(frozen=True)
class StoreSetup:
    """The bench's store: ``kind`` ``"s3"`` (SeaweedFS behind the link model) or
    ``"file"``; the model's bounds (ms, MiB/s; 0: that bound off)."""

    kind: str = "s3"
    latency_ms: float = 20.0
    conn_mib_s: float = 64.0
    total_mib_s: float = 128.0

    def model(self):
        """The :class:`~weenv_bench.services.netshape.LinkModel`, or None (no bound at all, or a file store)."""
        from weenv_bench.services.netshape import LinkModel

        if self.kind != "s3" or not (self.latency_ms or self.conn_mib_s or self.total_mib_s):
            return None
        return LinkModel(self.latency_ms / 1000, self.conn_mib_s * MiB or None, self.total_mib_s * MiB or None)


def run(
    *,
    quick: bool = False,
    simulate_only: bool = False,
    json_path: Path | None = None,
    store: StoreSetup = StoreSetup(),
    profiles: str = "recorded",
    rounds: int = 1,
    log=print,
) -> dict:
    from weenv_bench import cluster_sim

    result: dict = {"machine": machine(), "quick": quick}
    real = None
    if not simulate_only:
        real = run_real(quick=quick, store=store, profiles=profiles, rounds=rounds, log=log)
        result["real"] = real
    costs = cluster_sim.Costs.from_real(real) if real else cluster_sim.Costs()
    sim = cluster_sim.run(quick=quick, costs=costs, log=log)
    result["simulation"] = sim
    w = real["modes"]["weenv"] if real else {}
    r = real["modes"]["random"] if real else {}
    head = sim["runs"][0] if sim["runs"] else {}
    result["summary"] = {
        "nodes": NODES if real else None,
        "creates": w.get("creates"),
        "store_bytes_ratio": w.get("store_bytes_ratio"),
        "peer_bytes": w.get("peer_bytes"),
        "local_hit_rate": w.get("local_hit_rate"),
        "create_p99_s": w.get("create_p99_s"),
        "random_create_p99_s": r.get("create_p99_s"),
        "sim_nodes": head.get("nodes"),
        "sim_creates": head.get("creates"),
        "sim_create_p99_s": head.get("weenv", {}).get("create_p99_s"),
        "sim_store_bytes_ratio": head.get("weenv", {}).get("store_bytes_ratio"),
        "store": real["store"] if real else None,
        "profiles": real["profiles"] if real else None,
        # create_p99_s and random_create_p99_s: the first round's, as ever; over all rounds' creates pooled:
        "rounds": real["rounds"]["n"] if real else None,
        "create_p99_s_pooled": real["rounds"]["pooled"]["weenv"]["create_p99_s"] if real else None,
        "random_create_p99_s_pooled": real["rounds"]["pooled"]["random"]["create_p99_s"] if real else None,
        "p99_ratio_median_of_rounds": real["rounds"]["p99_ratio_median"] if real else None,
    }
    if json_path is not None:
        write_report(result, json_path, plot)
    return result


def _drop_profiles(store) -> int:
    """Remove every prefetch profile ref and pack from ``store`` (each mode
    starts from the same store: its first starts record, neither replays the
    other's recordings); how many refs went."""
    refs = store.list_refs("prefetch")
    for name in refs:
        store.delete_ref("prefetch", name)
    for digest in list(store.list_packs()):
        store.delete_pack(digest)
    return len(refs)


@contextlib.contextmanager
def _the_store(setup: StoreSetup, root: Path, log):
    """``(store to build into, the URL the nodes use, its description)``: SeaweedFS
    (and the link model's proxy in front of it) started and stopped here."""
    if setup.kind == "file":
        from weenv.store.file import FileStore

        store = FileStore(root / "store")
        yield store, store.url, {"kind": "file", "model": None}
        return
    if setup.kind != "s3":
        raise ValueError(f"unknown store kind {setup.kind!r} (s3 or file)")
    from weenv.store import open_store
    from weenv_bench.services.netshape import Shaper
    from weenv_bench.services.seaweedfs import CREDENTIALS, Seaweed

    os.environ.update(CREDENTIALS)  # the raylets, their actors and daemons inherit them
    (root / "seaweedfs").mkdir()
    with Seaweed(root / "seaweedfs") as server:
        direct = server.url("bench")
        store = open_store(direct)
        model = setup.model()
        if model is None:
            yield store, direct, {"kind": "s3 (SeaweedFS on loopback, no model)", "model": None}
            return
        with Shaper(server.endpoint, model, root / "netshape") as shaper:
            log(f"store: SeaweedFS at {server.endpoint}, the nodes' link {model.describe()} at {shaper.endpoint}")
            yield (
                store,
                server.url("bench", endpoint=shaper.endpoint),
                {
                    "kind": "s3 (SeaweedFS on loopback) through a modelled link",
                    "model": model.describe(),
                    "shaper": shaper,
                },
            )


def _record_profiles(root: Path, store, node_url: str, chunks: dict[str, set[str]], log) -> dict:
    """Before the modes (``profiles="recorded"``): each template started once
    (weenv's placement, no peers, fresh homes thrown away after), so that both
    modes find every template's prefetch profile and pack in the store, as an RL
    run over a task set run before does.  Waits until all are published."""
    names = sorted(chunks)
    _drop_profiles(store)

    def published() -> None:
        deadline = time.monotonic() + 60
        while len(store.list_refs("prefetch")) < len(names) and time.monotonic() < deadline:
            time.sleep(0.5)

    out = run_mode(
        "record", root, node_url, chunks, [names[i : i + 8] for i in range(0, len(names), 8)], log, settle=published
    )
    out["profiles"] = len(store.list_refs("prefetch"))
    out["packs"] = len(list(store.list_packs()))
    log(f"recorded: {out['profiles']} profiles, {out['packs']} packs for {len(names)} templates")
    return {k: out[k] for k in ("seconds", "creates", "profiles", "packs", "store_bytes")}


def run_real(
    *, quick: bool, store: StoreSetup = StoreSetup(), profiles: str = "recorded", rounds: int = 1, log
) -> dict:
    """The real part; ``rounds``: both modes that many times on fresh homes (the
    same Ray cluster and store; random first in even rounds, weenv first in odd
    ones), pooled in ``rounds`` (:func:`_rounds`)."""
    from weenv.cluster.loopback import LOOPBACK, keep_on_loopback, node_args

    keep_on_loopback()  # every Ray process, daemon and the gateway on 127.0.0.1
    import ray
    from ray.cluster_utils import Cluster

    from weenv import cluster
    from weenv.store import open_store

    templates, task_bytes, batch = (8, 4 * MiB, 16) if quick else (32, 8 * MiB, 32)
    group, iterations = 4, 2
    batches = plan(templates, batch, group, iterations)
    os.environ["WEENV_POOL_SIZE"] = "0"  # inherited by the raylets, their actors and daemons
    with (
        tempfile.TemporaryDirectory(prefix="weenv-bench-cluster-") as tmp,
        _the_store(store, Path(tmp), log) as (built, node_url, described),
    ):
        root = Path(tmp)
        shaper = described.pop("shaper", None)
        chunks = build_store(built, root, templates, task_bytes, log)
        some = set().union(*chunks.values())
        store_ms = _store_ms_per_mib(built, some)
        modelled_ms = None
        if node_url != built.url:
            far = open_store(node_url)
            modelled_ms = _store_ms_per_mib(far, some)
            far.close()
        described.update(store_ms_per_mib=store_ms, store_ms_per_mib_modelled=modelled_ms)
        log(
            f"store: a chunk {store_ms:.1f} ms/MiB"
            + (f", through the model {modelled_ms:.1f} ms/MiB" if modelled_ms else "")
        )
        c = Cluster(initialize_head=True, head_node_args=node_args(num_cpus=1, include_dashboard=False))
        try:
            for _ in range(NODES - 1):
                c.add_node(**node_args(num_cpus=1))
            ray.init(address=c.address, namespace=cluster.NAMESPACE, log_to_driver=False, _node_ip_address=LOOPBACK)
            c.wait_for_nodes()
            modes: dict[str, dict] = {}
            by_round: list[dict[str, dict]] = []
            recording = _record_profiles(root, built, node_url, chunks, log) if profiles == "recorded" else None
            for r in range(rounds):
                this: dict[str, dict] = {}
                for mode in ("random", "weenv") if r % 2 == 0 else ("weenv", "random"):  # drift hits both
                    dropped = _drop_profiles(built) if profiles == "fresh" else 0
                    carried0 = shaper.stats().get("answer_bytes", 0) if shaper else None
                    m = this[mode] = run_mode(
                        mode,
                        root,
                        node_url,
                        chunks,
                        batches,
                        log,
                        seed=7 + r,
                        homes=root / (f"{mode}-{r}" if r else mode),
                    )
                    m["profiles_dropped_before"] = dropped
                    if shaper is not None:
                        time.sleep(1.2)  # its counters are written every second
                        m["link_bytes"] = shaper.stats().get("answer_bytes", 0) - carried0
                    log(
                        f"{mode}"
                        + (f" (round {r + 1}/{rounds})" if rounds > 1 else "")
                        + f": p50 {m['create_p50_s']:.2f} s p99 {m['create_p99_s']:.2f} s, store "
                        f"{m['store_bytes'] / MiB:.0f} MiB ({m['store_bytes_ratio']:.2f}x unique), peers "
                        f"{m['peer_bytes'] / MiB:.0f} MiB, local hits {m['local_hit_rate']}"
                    )
                if r == 0:
                    modes = {k: this[k] for k in ("random", "weenv")}
                by_round.append(this)
        finally:
            if ray.is_initialized():
                try:
                    cluster.down()
                except Exception as exc:  # already down
                    log(f"cluster down: {exc}")
                ray.shutdown()
            c.shutdown()
            built.close()
    return {
        "nodes": NODES,
        "templates": templates,
        "task_bytes": task_bytes,
        "batch": batch,
        "group": group,
        "iterations": iterations,
        "create_concurrency": CREATE_CONCURRENCY,
        "store_ms_per_mib": store_ms,
        "store": described,
        "profiles": profiles,
        "recording_pass": recording,
        "modes": modes,
        "rounds": _rounds(by_round),
    }


ROUND_KEYS = ("create_p50_s", "create_p99_s", "store_bytes_ratio", "local_hit_rate", "envs_per_node_max_over_mean")


def _rounds(by_round: list[dict[str, dict]]) -> dict:
    """Every round's figures per mode (``modes`` holds the first round's whole),
    and the creates of all rounds pooled: p50/p99 over ``rounds`` x the creates
    of one round (a round's p99 of 64 creates is its slowest create), and the
    median over rounds of each round's weenv/random p99."""
    pooled = {}
    for mode in ("random", "weenv"):
        times = [d["s"] for rnd in by_round for d in rnd[mode]["log"]]
        pooled[mode] = {"creates": len(times), "create_p50_s": pct(times, 0.5), "create_p99_s": pct(times, 0.99)}
    ratios = [rnd["weenv"]["create_p99_s"] / rnd["random"]["create_p99_s"] for rnd in by_round]
    return {
        "n": len(by_round),
        "by_round": [{mode: {k: rnd[mode][k] for k in ROUND_KEYS} for mode in rnd} for rnd in by_round],
        "pooled": pooled,
        "p99_ratio_by_round": ratios,
        "p99_ratio_median": statistics.median(ratios),
        "p99_ratio_pooled": pooled["weenv"]["create_p99_s"] / pooled["random"]["create_p99_s"],
    }


def plot(result: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    real = result.get("real")
    if real:
        modes = real["modes"]
        names = list(modes)
        ax = axes[0]
        x = range(len(names))
        ax.bar([i - 0.2 for i in x], [modes[n]["create_p50_s"] for n in names], 0.4, label="p50")
        ax.bar([i + 0.2 for i in x], [modes[n]["create_p99_s"] for n in names], 0.4, label="p99")
        ax.set_xticks(list(x), names)
        ax.set_ylabel("create + task read (s)")
        ax.set_title(f"real: {real['nodes']} Ray nodes, {modes['weenv']['creates']} creates")
        ax.legend()
        ax = axes[1]
        ax.bar([i - 0.2 for i in x], [modes[n]["store_bytes"] / MiB for n in names], 0.4, label="from store")
        ax.bar([i + 0.2 for i in x], [modes[n]["peer_bytes"] / MiB for n in names], 0.4, label="from peers")
        ax.axhline(modes["weenv"]["unique_bytes"] / MiB, color="k", ls="--", label="unique bytes needed")
        ax.set_xticks(list(x), names)
        ax.set_ylabel("MiB")
        ax.set_title("chunk bytes by source")
        ax.legend()
    ax = axes[2]
    for run_ in result["simulation"]["runs"]:
        for mode, style in (("weenv", "-"), ("random", "--")):
            ax.plot(
                run_["batch_sizes"],
                run_[mode]["p99_by_batch"],
                style,
                marker="o",
                label=f"{mode}, {run_['nodes']} nodes",
            )
    ax.set_xlabel("concurrent creates in the batch")
    ax.set_ylabel("create p99 (s, modelled)")
    ax.set_title("simulation")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
