"""``weenv cluster up/down/status``: weenv on every node of a running Ray cluster."""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from weenv.cli.common import err
from weenv.cli.progress import shown

app = typer.Typer(no_args_is_help=True, help="weenv on a Ray cluster: one node actor and daemon per node.")

Address = Annotated[str | None, typer.Option(help="the Ray cluster (default: RAY_ADDRESS, else the local one)")]


@app.command()
def up(
    address: Address = None,
    home: Annotated[
        str,
        typer.Option(
            help="each node's WEENV_HOME; {node} becomes the node's id "
            "(distinct homes for several nodes on one machine)"
        ),
    ] = "/var/lib/weenv",
    store: Annotated[str | None, typer.Option(help="the store every node reads (default: WEENV_STORE)")] = None,
    max_environments: Annotated[int | None, typer.Option(help="per node, at most this many environments")] = None,
    timeout: Annotated[float, typer.Option(help="seconds to wait for every node's daemon")] = 120.0,
    gateway_port: Annotated[
        int, typer.Option(help="the cluster's one address: its TCP port on the head node (0: any free one)")
    ] = 8790,
    gateway_host: Annotated[
        str | None, typer.Option(help="the address it listens on (default: the head node's)")
    ] = None,
    no_gateway: Annotated[bool, typer.Option("--no-gateway", help="serve no cluster address")] = False,
) -> None:
    """Start weenv on every node (joining ones too) and the cluster's one address on the head node.

    Waits until every node's daemon answers; the address serves weenv's API and E2B's."""
    from weenv import cluster

    with shown(err) as progress:
        nodes = cluster.up(
            cluster.ClusterConfig(
                home=home,
                store=store,
                max_environments=max_environments,
                gateway=not no_gateway,
                gateway_port=gateway_port,
                gateway_host=gateway_host,
            ),
            address=address,
            timeout=timeout,
            progress=progress,
        )
    err.print(f"weenv cluster up: {len(nodes)} nodes")
    _print(nodes)
    if not no_gateway:
        _print_gateway(cluster.gateway(address=address))


@app.command()
def status(address: Address = None) -> None:
    """Every node as the placement actor sees it."""
    from weenv import cluster

    _print(cluster.status(address=address))
    from weenv.errors import ClosedError

    try:
        _print_gateway(cluster.gateway(address=address))
    except ClosedError:
        err.print("no gateway (brought up with --no-gateway)")


@app.command()
def env(address: Address = None) -> None:
    """Print shell lines pointing weenv's SDK and the e2b SDK at the cluster's address.

    Use as ``eval "$(weenv cluster env)"``."""
    from weenv import cluster

    for k, v in cluster.gateway(address=address).environ().items():
        print(f"export {k}={v}")


@app.command()
def down(address: Address = None) -> None:
    """Stop every node's daemon (destroying its environments) and every weenv actor."""
    from weenv import cluster

    err.print("weenv cluster down" if cluster.down(address=address) else "no weenv cluster was up")


def _print(nodes) -> None:
    table = Table("node", "state", "environments", "creates", "cpus reserved", "cached MB", "heartbeat", "home / why")
    for n in sorted(nodes, key=lambda n: n.node_id):
        age = f"{n.heartbeat_age_s:.1f} s ago" if n.heartbeat_age_s is not None else "-"
        table.add_row(
            n.node_id[:12],
            n.state,
            str(n.environments),
            str(n.inflight),
            f"{n.cpu_reserved:g}/{n.cpu_capacity:g}",
            f"{n.cached_bytes / 1e6:.1f}",
            age,
            n.reason or n.home,
        )
    # piped (not a terminal): wide enough that no cell is cut (rich would take 80 columns)
    Console(soft_wrap=True, width=None if sys.stdout.isatty() else 240).print(table)


def _print_gateway(info) -> None:
    err.print(
        f"cluster address: {info.url} (weenv API {info.url}/v1, E2B {info.url}/e2b), "
        f'API key {info.api_key}; eval "$(weenv cluster env)" for the SDKs\' variables'
    )
