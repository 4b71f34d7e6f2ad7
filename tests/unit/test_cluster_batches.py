"""Rollout batches through the cluster's view (weenv.cluster.view and
weenv.cluster.placement): plain state, no Ray.  The flow of ``weenv bench
cluster``: 8 templates sharing a base over 4 nodes, two iterations of batches of
16 creates (4 rollouts of 4 templates), 8 at once, each batch's environments
destroyed when it ends; the nodes' reports show what their creates fetched."""

import random
import time

from weenv.cluster.node import NodeReport, TemplateFacts
from weenv.cluster.view import ClusterView

GiB, MiB = 1 << 30, 1 << 20
BASE, BASE_READ, TASK = 300 * MiB, 40 * MiB, 4 * MiB
SEEDS = 6
NODES = ["n0", "n1", "n2", "n3"]


def plan(templates: int, batch: int, group: int, iterations: int, seed: int) -> list[list[str]]:
    """As weenv_bench.cluster.plan: per iteration the templates shuffled, ``group`` creates of each in a row."""
    rng = random.Random(seed)
    out = []
    for _ in range(iterations):
        order = [f"c{i}" for i in range(templates)]
        rng.shuffle(order)
        for k in range(0, templates, batch // group):
            out.append([t for t in order[k : k + batch // group] for _ in range(group)])
    return out


class Nodes:
    """What the nodes hold and run, and the reports they send."""

    def __init__(self, view: ClusterView, templates: int):
        self.view = view
        self.facts = {
            f"c{i}": TemplateFacts(groups=["sha256:base", f"sha256:task{i}"], cpus=0.05, memory_bytes=64 * MiB)
            for i in range(templates)
        }
        self.sizes = {"sha256:base": BASE, **{f"sha256:task{i}": TASK for i in range(templates)}}
        self.held: dict[str, dict[str, int]] = {n: {} for n in NODES}
        self.envs: dict[str, dict[str, str]] = {n: {} for n in NODES}  # env id -> template
        self.known: set[str] = set()  # templates some node has resolved (and so reports)
        for n in NODES:
            self.report(n)

    def report(self, n: str) -> None:
        envs = self.envs[n]
        self.view.heartbeat(
            NodeReport(
                node_id=n,
                home=f"/h/{n}",
                api_url=f"http://{n}:1",
                api_key="k" * 40,
                at=time.time(),
                cpu_capacity=2.0,
                memory_capacity=8 * GiB,
                cpu_reserved=0.05 * len(envs),
                memory_reserved=64 * MiB * len(envs),
                cpu_used=0.0,
                memory_used=0,
                environments=list(envs),
                group_bytes=dict(self.held[n]),
                group_sizes=self.sizes,
                templates={t: self.facts[t] for t in self.known},
                reservations={e: (0.05, 64 * MiB) for e in envs},
            )
        )

    def made(self, n: str, env_id: str, template: str) -> None:
        """A create ended on ``n``: the base's read part and the whole task are in its cache."""
        self.envs[n][env_id] = template
        self.known.add(template)
        task = self.facts[template].groups[1]
        self.held[n]["sha256:base"] = BASE_READ
        self.held[n][task] = TASK


def test_a_batch_of_many_templates_sharing_a_base_is_balanced_and_stays_warm():
    """bench cluster --quick measured envs per node max/mean 1.75 (a node took 7 of a
    batch's 16: the cache bonus held to ceil(1.3 x 16 / 4) + 1 = 7) with 0.94 of
    the creates on a node holding their template; each template had been started
    cold on one node only, so two templates of a later batch warm on the same node
    either piled there or went cold elsewhere.  Now both hold: every batch within
    1.5 x the mean, and at least 0.9 of the second iteration's creates (whose
    templates some node holds) on a node holding their template."""
    for seed in range(SEEDS):
        view = ClusterView()
        nodes = Nodes(view, 8)
        rng = random.Random(seed)
        ratios, hits, counted = [], 0, 0
        for b, names in enumerate(plan(8, 16, 4, 2, seed)):
            holders = {t: {n for n in NODES if nodes.held[n].get(nodes.facts[t].groups[1])} for t in nodes.facts}
            queue, running, placed = list(names), [], []
            while queue or running:
                while queue and len(running) < 8:  # 8 creates at once
                    t = queue.pop(0)
                    p = view.place(t, cpus=0.05, memory_bytes=64 * MiB)  # as the bench asks
                    running.append((p, t))
                # one of those in progress ends (not always the oldest), its node reports now and then
                p, t = running.pop(rng.randrange(len(running)))
                env_id = f"e{b}-{len(placed)}"
                n = p.route.node_id
                nodes.made(n, env_id, t)
                view.done(p.token, n, env_id)
                placed.append((n, t, env_id))
                if rng.random() < 0.5:
                    nodes.report(n)
            counts = [sum(where == m for where, _, _ in placed) for m in NODES]
            ratios.append(max(counts) / (len(placed) / len(NODES)))
            for n, t, _ in placed:
                if holders[t]:
                    counted += 1
                    hits += n in holders[t]
            for n, _t, env_id in placed:
                view.forget(env_id)
                del nodes.envs[n][env_id]
            for n in NODES:
                nodes.report(n)
        assert counted == 32, "the second iteration's creates: their templates held since the first"
        assert max(ratios) <= 1.5, (seed, ratios)
        assert hits / counted >= 0.9, (seed, hits, counted)
