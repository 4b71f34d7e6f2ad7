"""The node's state as plain rows for the dashboard's pages (reads only)."""

from __future__ import annotations

import time
from typing import Any

from weenv.errors import WeenvError
from weenv.server.ui.charts import stacked_bars, usage_spark

MAX_TEMPLATES = 100
"""Templates the templates page describes in full (one store read each)."""
MAX_BARS = 24
"""Batches the tax chart shows (the newest)."""


def age(seconds: float) -> str:
    """``42 s``, ``7 min``, ``3.5 h``, ``2.1 d``."""
    s = max(0.0, seconds)
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    if s < 172800:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} d"


def size(n: float | None) -> str:
    """Bytes in binary units (``1.5 GiB``); ``-`` for None."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def environments(node) -> list[dict[str, Any]]:
    """One row per environment: what it is, its state and its usage against its quota."""
    provision = {p.id: p for p in node.provision_stats().environments}
    now = time.time()
    rows = []
    for info in sorted(node.list(), key=lambda i: i.created_at):
        p = provision.get(info.id)
        history = p.history if p is not None else []
        last = history[-1] if history else None
        cpu_quota = p.cpu_quota if p is not None and p.cpu_quota is not None else info.resources.cpus
        memory_limit = p.memory_limit if p is not None and p.memory_limit is not None else info.resources.memory_bytes
        rows.append(
            {
                "id": info.id,
                "template": info.template,
                "state": info.state,
                "age": age(now - info.created_at),
                "paused": age(now - info.paused_at) if info.paused_at else None,
                "memory_released": info.memory_released,
                "network": (info.address or "on") if info.network else "off",
                "cpu": f"{last.cpu_used:.2f} / {cpu_quota:.2f}"
                if last and cpu_quota
                else (f"- / {cpu_quota:.2f}" if cpu_quota else "-"),
                "memory": f"{size(last.working_set if last else None)} / {size(memory_limit)}",
                "cpu_chart": usage_spark(
                    [h.cpu_used for h in history],
                    [h.cpu_quota for h in history],
                    title="cores used (filled) against the CPU quota (dashed)",
                ),
                "memory_chart": usage_spark(
                    [h.working_set for h in history],
                    [h.memory_limit for h in history],
                    title="working set (filled) against the memory limit (dashed)",
                ),
                "oom_kills": p.oom_kills if p is not None else 0,
            }
        )
    return rows


def node_health(node) -> dict[str, Any]:
    """Chunk cache, where chunks came from, admission, OOM kills and the runtime."""
    stats = node.stats()
    cache = node.cache.stats()
    peers = node.peers.stats()
    provision = node.provision_stats()
    hit_rate = cache_hit_rate(cache)
    waited, refused = admissions(provision)
    totals = provision.totals
    return {
        "runtime": stats.runtime,
        "exec_agent_error": stats.exec_agent_error,
        "environments": stats.environments,
        "paused": totals.paused,
        "hit_rate": f"{hit_rate:.1%}" if hit_rate is not None else "-",
        "reads": f"{cache.reads_hit} hit, {cache.reads_missed} missed, {cache.chunks_prefetched} chunks prefetched",
        "cache": f"{size(cache.bytes_cached)} in {cache.chunks_cached} chunks"
        + (f" of {size(cache.max_bytes)}" if cache.max_bytes else ""),
        "served": size(cache.bytes_served),
        "from_store": size(peers.store_bytes),
        "from_peers": size(peers.peer_bytes),
        "served_to_peers": size(peers.served_bytes),
        "fetch_errors": cache.fetch_errors,
        "admitting": totals.admitting,
        "waited": waited,
        "refused": refused,
        "oom_kills": sum(e.oom_kills for e in provision.environments),
        "cpu": f"{totals.cpu_used:.2f} used, {totals.cpu_quota_sum:.2f} quota, {totals.cpu_capacity:.2f} cores",
        "memory": f"{size(totals.working_set)} used, {size(totals.memory_limit_sum)} limits, "
        f"{size(totals.memory_capacity)} on the node",
        "pool": f"{stats.pool_ready} ready, {stats.pool_hits} hits, {stats.pool_misses} misses",
        "events": [
            {
                "t": time.strftime("%H:%M:%S", time.localtime(e.t)),
                "env": e.env_id or "",
                "kind": e.kind,
                "message": e.message,
            }
            for e in provision.events[-12:][::-1]
        ],
    }


def admissions(provision) -> tuple[int, int]:
    """Of the provisioner's recent events (:class:`ProvisionStats`), the creates
    that waited for room and those refused."""
    events = [e for e in provision.events if e.kind == "admission"]
    return sum(e.message.startswith("waiting") for e in events), sum(e.message.startswith("refused") for e in events)


def cache_hit_rate(cache) -> float | None:
    """The share of reads that found their chunk in the node cache (None before any read)."""
    reads = cache.reads_hit + cache.reads_missed
    return cache.reads_hit / reads if reads else None


def templates(node) -> dict[str, Any]:
    """The store's templates (groups, sizes) and the groups this node has mounted."""
    mounted = node.groups.mounted()
    rows = []
    for t in node.templates()[:MAX_TEMPLATES]:
        try:
            full = node.template(t.name)
        except WeenvError as exc:  # a template whose manifest cannot be read now: say so on its row
            rows.append({"name": t.name, "digest": t.digest[:19], "error": str(exc), "groups": []})
            continue
        rows.append(
            {
                "name": full.name,
                "digest": full.digest[:19],
                "version": full.version,
                "image": size(full.image_bytes),
                "stored": size(full.stored_bytes),
                "dedupe": f"{full.image_bytes / full.stored_bytes:.1f}x" if full.stored_bytes else "-",
                "groups": [{"name": g, "mounted": mounted.get(g, 0)} for g in full.groups],
                "error": None,
            }
        )
    return {"templates": rows, "mounted": sorted(mounted.items())}


def tax(book) -> dict[str, Any]:
    """The batches meters posted (newest last, as a stacked chart) and the node's own seconds by phase."""
    report = book.report()
    batches = report.batches[-MAX_BARS:]
    return {
        "chart": stacked_bars([(b.name, dict(b.phases)) for b in batches]),
        "batches": [
            {
                "name": b.name,
                "started": time.strftime("%H:%M:%S", time.localtime(b.started_at)),
                "wall": f"{b.wall_s:.2f}",
                "environments": b.environments,
                "share": f"{b.share:.1%}",
                "phases": {k: f"{v:.3f}" for k, v in b.phases.items()},
                "command": f"{b.command_s:.3f}",
                "other": f"{b.other_s:.3f}",
            }
            for b in reversed(batches)
        ],
        "node": [
            {"phase": k, "seconds": f"{v:.3f}", "requests": report.requests.get(k, 0)} for k, v in report.node.items()
        ],
    }
