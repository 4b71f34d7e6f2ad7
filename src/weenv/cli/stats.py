"""``weenv stats [ID]``: each environment's usage and quota over time, and the node's totals.

``weenv stats --tax``: the environment tax instead (:mod:`weenv.formats.tax`): one row
per rollout batch an SDK meter reported (``weenv.meter()``), seconds by phase
against the rollouts' time, and the node's own measure of the environment
operations it served (``GET /v1/tax``).

The data is the node daemon's (``GET /v1/stats/provision``, the same
:class:`~weenv.node.provision.models.ProvisionStats` that
:meth:`Node.provision_stats <weenv.node.node.Node.provision_stats>` returns in
Python).  ``--plot PATH`` draws CPU (used vs quota) and memory (working set vs
limit) over time as a PNG; it needs matplotlib (``weenv[plot]``), which a plain
install leaves out.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from weenv.cli.common import client, err, human_bytes, out
from weenv.errors import InvalidInputError, ToolMissingError
from weenv.formats.tax import PHASES, TaxReport
from weenv.node.provision.models import ProvisionStats

app = typer.Typer()


def totals_table(s: ProvisionStats) -> Table:
    t = s.totals
    table = Table(title=f"node ({s.mode}, every {s.interval_s:g} s)", show_header=True, header_style="bold")
    for col in ("", "used", "reserved", "predicted peak", "quotas / limits", "budget", "capacity"):
        table.add_column(col, justify="right")
    table.add_row(
        "CPU (cores)",
        f"{t.cpu_used:.2f}",
        f"{t.cpu_reservation_sum:.2f}",
        f"{t.cpu_peak_predicted:.2f}",
        f"{t.cpu_quota_sum:.2f}",
        f"{t.cpu_budget:.2f}",
        f"{t.cpu_capacity:.2f}",
    )
    table.add_row(
        "memory",
        human_bytes(t.working_set),
        "",
        "",
        human_bytes(t.memory_limit_sum),
        human_bytes(t.memory_budget),
        human_bytes(t.memory_capacity),
    )
    table.caption = (
        f"{t.environments} environments, {t.frozen} frozen; host memory available "
        f"{human_bytes(t.memory_available)}; admitting: {'yes' if t.admitting else 'no'}"
    )
    return table


def environments_table(s: ProvisionStats) -> Table:
    table = Table(show_header=True, header_style="bold")
    for col in (
        "ID",
        "PRIO",
        "CPU USED",
        "RESERVED",
        "CPU QUOTA",
        "CEILING",
        "THROTTLED",
        "WORKING SET",
        "MEM LIMIT",
        "CEILING",
        "RECLAIMED",
        "REFAULTS",
        "MEM STALL",
        "OOM KILLS",
        "STATE",
    ):
        table.add_column(col, justify="right" if col not in ("ID", "STATE") else "left", no_wrap=col == "ID")
    for e in s.environments:
        last = e.history[-1] if e.history else None
        table.add_row(
            e.id,
            str(e.priority),
            f"{last.cpu_used:.2f}" if last else "-",
            "-" if e.cpu_reservation is None else f"{e.cpu_reservation:.2f}",
            "max" if e.cpu_quota is None else f"{e.cpu_quota:.2f}",
            f"{e.cpu_ceiling:g}",
            f"{e.throttled_s:.1f} s",
            human_bytes(last.working_set) if last else "-",
            "max" if e.memory_limit is None else human_bytes(e.memory_limit),
            human_bytes(e.memory_ceiling),
            human_bytes(e.memory_reclaimed),
            str(e.memory_refaults),
            f"{e.memory_stall_s:.1f} s",
            str(e.oom_kills),
            "frozen" if e.frozen else "running",
        )
    return table


def history_table(s: ProvisionStats, rows: int) -> Table:
    e = s.environments[0]
    table = Table(title=f"{e.id}: last {rows} passes", show_header=True, header_style="bold")
    for col in ("TIME", "CPU USED", "RESERVED", "QUOTA", "THROTTLED", "USAGE", "WORKING SET", "LIMIT", "PIDS"):
        table.add_column(col, justify="right")
    for h in e.history[-rows:]:
        table.add_row(
            time.strftime("%H:%M:%S", time.localtime(h.t)),
            f"{h.cpu_used:.2f}",
            "-" if h.cpu_reservation is None else f"{h.cpu_reservation:.2f}",
            "max" if h.cpu_quota is None else f"{h.cpu_quota:.2f}",
            f"{h.throttled:.0%}",
            human_bytes(h.memory_usage),
            human_bytes(h.working_set),
            "max" if h.memory_limit is None else human_bytes(h.memory_limit),
            str(h.pids),
        )
    return table


def tax_table(report: TaxReport, rows: int) -> Table:
    """The newest ``rows`` batches, then the node's totals."""
    table = Table(title="environment tax (seconds)", show_header=True, header_style="bold")
    for col in (
        "BATCH",
        "STARTED",
        "ENVS",
        "WALL",
        "ROLLOUTS",
        *(p.upper() for p in PHASES),
        "COMMANDS",
        "NON-ENV",
        "SHARE",
    ):
        table.add_column(col, justify="left" if col == "BATCH" else "right", no_wrap=col == "BATCH")
    for b in report.batches[-rows:]:
        table.add_row(
            b.name,
            time.strftime("%H:%M:%S", time.localtime(b.started_at)),
            str(b.environments),
            f"{b.wall_s:.2f}",
            f"{b.rollout_s:.2f}",
            *(f"{b.phases[p]:.3f}" for p in PHASES),
            f"{b.command_s:.2f}",
            f"{b.other_s:.2f}",
            f"{b.share:.1%}",
        )
    table.add_row(
        "node (all clients)", "", "", "", "", *(f"{report.node[p]:.3f}" for p in PHASES), "", "", "", style="dim"
    )
    table.caption = (
        "phases: seconds the rollouts waited on the environment (exec: beyond the commands' own "
        "run time); share = their sum / the rollouts' time; node: what the node measured itself, "
        f"over {sum(report.requests.values())} requests"
    )
    return table


def _pyplot():
    """matplotlib's pyplot on the Agg backend; :class:`ToolMissingError` if matplotlib is not installed."""
    try:
        import matplotlib
    except ModuleNotFoundError as exc:
        raise ToolMissingError("--plot needs matplotlib: pip install 'weenv[plot]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(s: ProvisionStats, path: Path) -> Path:
    """CPU and memory of every environment over time, as a PNG at ``path``.

    Raises :class:`~weenv.errors.ToolMissingError` if matplotlib is not installed."""
    plt = _pyplot()

    fig, (ax_cpu, ax_mem) = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    t0 = min((e.history[0].t for e in s.environments if e.history), default=time.time())
    for i, e in enumerate(s.environments):
        if not e.history:
            continue
        color = f"C{i % 10}"
        ts = [h.t - t0 for h in e.history]
        ax_cpu.plot(ts, [h.cpu_used for h in e.history], color=color, label=f"{e.id} used")
        ax_cpu.plot(ts, [h.cpu_quota or 0 for h in e.history], color=color, linestyle="--", label=f"{e.id} quota")
        if any(h.cpu_reservation is not None for h in e.history):
            ax_cpu.plot(
                ts, [h.cpu_reservation or 0 for h in e.history], color=color, linestyle=":", label=f"{e.id} reserved"
            )
        ax_mem.plot(ts, [h.working_set / 2**20 for h in e.history], color=color, label=f"{e.id} working set")
        ax_mem.plot(
            ts, [(h.memory_limit or 0) / 2**20 for h in e.history], color=color, linestyle="--", label=f"{e.id} limit"
        )
    ax_cpu.set_ylabel("cores")
    ax_cpu.set_title(f"weenv elastic provisioning ({s.mode}): solid = used, dashed = quota / limit, dotted = reserved")
    ax_mem.set_ylabel("MiB")
    ax_mem.set_xlabel("seconds")
    for ax in (ax_cpu, ax_mem):
        ax.grid(alpha=0.3)
        if len(s.environments) <= 6 and ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


@app.command()
def stats(
    env_id: Annotated[str | None, typer.Argument(metavar="[ID]", help="one environment")] = None,
    plot_path: Annotated[Path | None, typer.Option("--plot", help="draw a PNG here")] = None,
    rows: Annotated[int, typer.Option(help="history rows shown for one environment (with --tax: batches)")] = 20,
    tax: Annotated[bool, typer.Option("--tax", help="the environment tax per rollout batch instead")] = False,
) -> None:
    """Usage and quotas of environments over time, and the node's totals."""
    if tax:
        if env_id is not None or plot_path is not None:
            raise InvalidInputError("--tax shows batches: give it without an ID or --plot")
        with client() as c:
            out.print(tax_table(c.tax(), rows))
        return
    if plot_path is not None:
        _pyplot()  # no matplotlib: say so before asking the daemon
    with client() as c:
        s = c.provision_stats(env_id)
        runtime = c.stats().runtime
    out.print(f"OCI runtime: {runtime}", highlight=False)
    out.print(totals_table(s))
    out.print(environments_table(s))
    if env_id is not None and s.environments:
        out.print(history_table(s, rows))
        events = [e for e in s.events if e.env_id == env_id][-rows:]
        for ev in events:
            out.print(f"{time.strftime('%H:%M:%S', time.localtime(ev.t))} {ev.kind:9} {ev.message}", highlight=False)
    if plot_path is not None:
        err.print(f"plot: {plot(s, plot_path)}")
