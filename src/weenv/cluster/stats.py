"""The cluster's figures at its gateway, from every alive node's.

- ``GET /v1/stats``: one :class:`~weenv.api.models.NodeStats` (the shape one
  node answers, so ``NodeClient.stats()`` works against the cluster): counts
  summed over the nodes, maps summed key by key (``groups_mounted``,
  ``chunks``), ``exec_agent_error`` the first node's that has one (its node
  id in front).  ``GET /v1/stats/nodes``: ``{node_id: NodeStats}``.
- ``GET /v1/tax``: one :class:`~weenv.formats.tax.TaxReport`: each phase's
  seconds and requests summed over the nodes (what each measured of the
  requests it served, those relayed by the gateway among them), and the
  batches SDK meters reported (``POST /v1/tax`` at the gateway, kept there,
  and those reported to a node directly), oldest first, the newest
  :data:`~weenv.formats.tax.MAX_BATCHES`.
- ``GET /v1/metrics``: the Prometheus text of every node, each sample
  labelled ``node="NODE_ID"`` (a family's samples from every node together,
  as the format wants), then the gateway's own ``weenv_cluster_nodes``
  (alive nodes) and ``weenv_cluster_nodes_answered`` (those whose metrics are
  in this scrape).  A node that does not answer is left out (logged).

Source: the Prometheus text exposition format 0.0.4
(https://prometheus.io/docs/instrumenting/exposition_formats/).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from weenv.api.models import NodeStats
from weenv.formats.tax import MAX_BATCHES, PHASES, TaxBatch, TaxReport

NODE_LABEL = "node"


def summed(per_node: dict[str, dict[str, Any]]) -> NodeStats:
    """One :class:`NodeStats` of the nodes' (``node id -> NodeStats`` as JSON), see the module docstring."""
    total: dict[str, Any] = {}
    for node_id, stats in sorted(per_node.items()):
        for key, value in NodeStats.model_validate(stats).model_dump().items():
            if isinstance(value, bool) or value is None:
                continue
            if isinstance(value, (int, float)):
                total[key] = total.get(key, 0) + value
            elif isinstance(value, dict):
                into = total.setdefault(key, {})
                for k, v in value.items():
                    into[k] = into.get(k, 0) + v
            elif isinstance(value, str) and total.get(key) is None:
                total[key] = f"node {node_id[:12]}: {value}"
    total.setdefault("environments", 0)
    total.setdefault("groups_mounted", {})
    total.setdefault("cache_chunks_fetched", 0)
    total.setdefault("cache_bytes_fetched", 0)
    return NodeStats.model_validate(total)


def summed_tax(per_node: dict[str, dict[str, Any]], batches: list[TaxBatch]) -> TaxReport:
    """One :class:`TaxReport` of the nodes' (``node id -> TaxReport`` as JSON) and the
    gateway's own ``batches`` (see the module docstring).  Raises pydantic's
    ``ValidationError`` for a node's report that is not one."""
    seconds, requests = dict.fromkeys(PHASES, 0.0), dict.fromkeys(PHASES, 0)
    every = list(batches)
    for report in map(TaxReport.model_validate, per_node.values()):
        for phase in PHASES:
            seconds[phase] += report.node.get(phase, 0.0)
            requests[phase] += report.requests.get(phase, 0)
        every.extend(report.batches)
    every.sort(key=lambda b: b.started_at)
    return TaxReport(node=seconds, requests=requests, batches=every[-MAX_BATCHES:])


class _Families:
    """A collector yielding already-made families (for :func:`generate_latest`)."""

    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self):
        return iter(self.families)


def labelled_metrics(texts: dict[str, str], alive: int) -> bytes:
    """Every node's Prometheus text (``node id -> text``) as one, each sample
    labelled with its node; then the gateway's gauges (``alive``: nodes alive).
    Raises ``ValueError`` for a text that is not the format."""
    families: dict[str, Metric] = {}
    for node_id, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            into = families.get(family.name)
            if into is None:
                into = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            into.samples.extend(
                Sample(s.name, {**s.labels, NODE_LABEL: node_id}, s.value, s.timestamp, s.exemplar)
                for s in family.samples
            )
    out = list(families.values())
    out.append(GaugeMetricFamily("weenv_cluster_nodes", "Nodes of the cluster alive now", value=alive))
    out.append(
        GaugeMetricFamily("weenv_cluster_nodes_answered", "Nodes whose metrics this scrape holds", value=len(texts))
    )
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(out))
    return generate_latest(registry)
