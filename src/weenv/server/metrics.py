"""Prometheus metrics of one daemon (``prometheus_client``), in a registry of
their own (no module-level state: each app has its :class:`Metrics`).

Exposed at ``GET /v1/metrics`` in the text format::

    weenv_environments                  gauge    environments running now (paused ones too)
    weenv_environments_paused           gauge    of those, paused (frozen: no CPU, memory kept)
    weenv_creates_total{result}         counter  creates by result: ok, error
    weenv_create_seconds                histogram wall time of successful creates
    weenv_commands_total{mode}          counter  commands by mode: captured, stream, background
    weenv_reaped_total                  counter  environments destroyed when their timeout passed
    weenv_bytes_fetched_total           counter  stored bytes fetched from the store (chunk cache misses)
    weenv_chunks_fetched_total          counter  chunks fetched from the store
    weenv_chunk_source_bytes_total{source} counter plaintext chunk bytes fetched: store, peer (weenv.node.data.peers)
    weenv_peer_failures_total{kind}     counter  peer chunk requests that gave none: missing, busy, bad, unreachable
    weenv_peer_served_bytes_total       counter  plaintext chunk bytes served to peers
    weenv_pool_ready                    gauge    environments the warm pool holds created ahead
    weenv_pool_takes_total{result}      counter  creates that looked in the warm pool: hit, miss
    weenv_env_seconds_total{phase}      counter  seconds of environment operations the node served, by
                                                 phase: create, exec (beyond the commands' own run time),
                                                 files, destroy, other (:mod:`weenv.server.tax`)
    weenv_memory_reclaimed_bytes_total{env} counter bytes reclaimed from an idle environment (its limit kept)
    weenv_memory_refaults_total{env}    counter  pages an environment needed again after they were evicted
    weenv_memory_stall_seconds_total{env} counter seconds an environment's tasks waited for memory
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from weenv.node.node import Node
from weenv.node.provision import ProvisionStats
from weenv.server.tax import TaxBook

CREATE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class _NodeCollector:
    """Counters the node keeps itself (the chunk cache's), read at scrape time."""

    def __init__(self, node: Node, tax: TaxBook):
        self.node = node
        self.tax = tax

    def collect(self):
        yield CounterMetricFamily(
            "weenv_bytes_fetched", "Stored bytes fetched from the store", value=self.node.cache.bytes_fetched
        )
        yield CounterMetricFamily(
            "weenv_chunks_fetched", "Chunks fetched from the store", value=self.node.cache.chunks_fetched
        )
        pool = self.node.pool.stats()
        yield GaugeMetricFamily("weenv_pool_ready", "Environments the warm pool holds created ahead", value=pool.ready)
        takes = CounterMetricFamily(
            "weenv_pool_takes", "Creates that looked in the warm pool, by result", labels=["result"]
        )
        takes.add_metric(["hit"], pool.hits)
        takes.add_metric(["miss"], pool.misses)
        yield takes
        peers = self.node.peers.stats()
        source = CounterMetricFamily(
            "weenv_chunk_source_bytes", "Plaintext chunk bytes fetched, by source", labels=["source"]
        )
        source.add_metric(["store"], peers.store_bytes)
        source.add_metric(["peer"], peers.peer_bytes)
        yield source
        failures = CounterMetricFamily(
            "weenv_peer_failures", "Peer chunk requests that gave no chunk, by why", labels=["kind"]
        )
        for kind in ("missing", "busy", "bad", "unreachable"):
            failures.add_metric([kind], getattr(peers, f"peer_{kind}"))
        yield failures
        yield CounterMetricFamily(
            "weenv_peer_served_bytes", "Plaintext chunk bytes served to peers", value=peers.served_bytes
        )
        env = CounterMetricFamily(
            "weenv_env_seconds", "Seconds of environment operations served, by phase", labels=["phase"]
        )
        for phase, seconds in self.tax.report().node.items():
            env.add_metric([phase], seconds)
        yield env
        yield from _reclaim_metrics(self.node.provisioner.stats(history=False))


def _reclaim_metrics(stats: ProvisionStats):
    """Idle memory reclaim per environment (``ProvisionConfig.reclaim``): what went, what it cost."""
    families = (
        (
            CounterMetricFamily(
                "weenv_memory_reclaimed_bytes", "Bytes reclaimed from an idle environment", labels=["env"]
            ),
            "memory_reclaimed",
        ),
        (
            CounterMetricFamily(
                "weenv_memory_refaults", "Pages an environment needed again after they were evicted", labels=["env"]
            ),
            "memory_refaults",
        ),
        (
            CounterMetricFamily(
                "weenv_memory_stall_seconds", "Seconds an environment's tasks waited for memory", labels=["env"]
            ),
            "memory_stall_s",
        ),
    )
    for family, key in families:
        for e in stats.environments:
            family.add_metric([e.id], getattr(e, key))
        yield family


class Metrics:
    def __init__(self, node: Node):
        self.registry = r = CollectorRegistry()
        self.environments = Gauge("weenv_environments", "Environments running", registry=r)
        self.environments.set_function(node.count)
        self.paused = Gauge("weenv_environments_paused", "Environments paused", registry=r)
        self.paused.set_function(lambda: sum(e.info.state == "paused" for e in node.table.all()))
        self.creates = Counter("weenv_creates", "Environment creates by result", ["result"], registry=r)
        self.create_seconds = Histogram(
            "weenv_create_seconds", "Wall time of successful creates", buckets=CREATE_BUCKETS, registry=r
        )
        self.commands = Counter("weenv_commands", "Commands run, by mode", ["mode"], registry=r)
        self.reaped = Counter("weenv_reaped", "Environments destroyed when their timeout passed", registry=r)
        self.tax = TaxBook()
        r.register(_NodeCollector(node, self.tax))

    def render(self) -> bytes:
        return generate_latest(self.registry)
