"""``weenv cluster up/down/status``: weenv on every node of a running Ray cluster."""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from weenv.cli.common import err

app = typer.Typer(no_args_is_help=True, help="weenv on a Ray cluster: one node actor and daemon per node.")

Address = Annotated[Optional[str], typer.Option(help="the Ray cluster (default: RAY_ADDRESS, else the local one)")]


@app.command()
def up(
    address: Address = None,
    home: Annotated[str, typer.Option(help="each node's WEENV_HOME; {node} becomes the node's id "
                                           "(distinct homes for several nodes on one machine)")] = "/var/lib/weenv",
    store: Annotated[Optional[str], typer.Option(help="the store every node reads (default: WEENV_STORE)")] = None,
    max_environments: Annotated[Optional[int], typer.Option(help="per node, at most this many environments")] = None,
    timeout: Annotated[float, typer.Option(help="seconds to wait for every node's daemon")] = 120.0,
) -> None:
    """Start weenv on every node (nodes joining later get it too) and wait until each answers."""
    from weenv import cluster

    nodes = cluster.up(cluster.ClusterConfig(home=home, store=store, max_environments=max_environments),
                       address=address, timeout=timeout)
    err.print(f"weenv cluster up: {len(nodes)} nodes")
    _print(nodes)


@app.command()
def status(address: Address = None) -> None:
    """Every node as the placement actor sees it."""
    from weenv import cluster

    _print(cluster.status(address=address))


@app.command()
def down(address: Address = None) -> None:
    """Stop every node's daemon (destroying its environments) and every weenv actor."""
    from weenv import cluster

    err.print("weenv cluster down" if cluster.down(address=address) else "no weenv cluster was up")


def _print(nodes) -> None:
    table = Table("node", "state", "environments", "creates", "cpus reserved", "cached MB", "heartbeat", "home / why")
    for n in sorted(nodes, key=lambda n: n.node_id):
        age = f"{n.heartbeat_age_s:.1f} s ago" if n.heartbeat_age_s is not None else "-"
        table.add_row(n.node_id[:12], n.state, str(n.environments), str(n.inflight),
                      f"{n.cpu_reserved:g}/{n.cpu_capacity:g}", f"{n.cached_bytes / 1e6:.1f}", age,
                      n.reason or n.home)
    Console(soft_wrap=True).print(table)
