"""``weenv run/create/exec/ps/rm``: environments, through the node daemon."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from weenv.api.models import BatchCreateEvent, CreateRequest
from weenv.cli.common import (
    client,
    command_from,
    err,
    human_bytes,
    out,
    parse_env,
    parse_size,
    print_result,
    print_timing,
)
from weenv.errors import InvalidInputError
from weenv.formats.manifest import Resources

app = typer.Typer()


@app.command()
def run(
    template: Annotated[str, typer.Argument(help="template name or digest")],
    command: Annotated[list[str], typer.Argument(help="command (after --)")],
    timeout: Annotated[float | None, typer.Option(help="seconds")] = None,
    env: Annotated[list[str] | None, typer.Option("--env", "-e", help="KEY=VALUE")] = None,
    workdir: Annotated[str | None, typer.Option(help="working directory")] = None,
    timings: Annotated[bool, typer.Option(help="print the create's phases")] = False,
) -> None:
    """Create an environment, run one command in it, print its output, destroy it."""
    cmd = command_from(command)
    with client() as c:
        info = c.create(template)
        try:
            if timings:
                print_timing(info.timing, title=f"create {info.id}")
            r = c.exec(info.id, cmd, env=parse_env(env), cwd=workdir, timeout=timeout)
        finally:
            c.destroy(info.id)
    print_result(r)
    raise typer.Exit(r.exit_code)


@app.command()
def create(
    template: Annotated[str, typer.Argument(help="template name or digest")],
    cpus: Annotated[float | None, typer.Option(help="CPU quota in cores")] = None,
    memory: Annotated[str | None, typer.Option(help="memory limit, e.g. 2G")] = None,
    pids: Annotated[int | None, typer.Option(help="pids limit")] = None,
    disk: Annotated[str | None, typer.Option(help="disk limit (what it may write), e.g. 10G")] = None,
    timeout: Annotated[float, typer.Option(help="seconds until the daemon destroys it")] = 3600.0,
    count: Annotated[int, typer.Option("--count", "-n", help="create this many at once (a batch)")] = 1,
    concurrency: Annotated[int | None, typer.Option(help="creates running at once in a batch")] = None,
    timings: Annotated[bool, typer.Option(help="print the create's phases")] = True,
    priority: Annotated[int, typer.Option(help="elastic provisioning: higher grows first, is frozen last")] = 0,
) -> None:
    """Create and start environments; print their ids, one a line."""
    resources = None
    if cpus is not None or memory is not None or pids is not None or disk is not None:
        d = Resources()
        resources = Resources(
            cpus=cpus if cpus is not None else d.cpus,
            memory_bytes=parse_size(memory) if memory is not None else d.memory_bytes,
            pids=pids if pids is not None else d.pids,
            disk_bytes=parse_size(disk) if disk is not None else d.disk_bytes,
        )
    if count < 1:
        raise InvalidInputError(f"--count must be at least 1, not {count}")
    if count == 1:
        with client() as c:
            info = c.create(template, resources=resources, timeout=timeout, priority=priority)
        if timings:
            print_timing(info.timing, title=f"create {info.id}")
        print(info.id)
        return
    _create_batch(
        [CreateRequest(template=template, resources=resources, timeout=timeout, priority=priority)] * count, concurrency
    )


def _create_batch(items: list[CreateRequest], concurrency: int | None) -> None:
    """One batch create with a progress bar; ids printed in request order."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    ids: list[str | None] = [None] * len(items)
    failures: list[str] = []
    with (
        client() as c,
        Progress(
            TextColumn("creating"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[note]}"),
            console=err,
        ) as bar,
    ):
        task = bar.add_task("create", total=len(items), note="")

        def done(ev: BatchCreateEvent) -> None:
            if ev.environment is not None:
                ids[ev.index] = ev.environment.id
                note = f"{ev.environment.id} in {ev.environment.timing.total_s:.2f} s"
            else:
                failures.append(f"#{ev.index}: {ev.error.message if ev.error else '?'}")
                note = f"#{ev.index} failed"
            bar.update(task, advance=1, note=note)

        try:
            c.create_many(items, concurrency=concurrency, on_event=done)
        finally:  # the ids received are printed even when the answer broke off (the daemon died)
            bar.stop()
            for env_id in ids:
                if env_id is not None:
                    print(env_id, flush=True)
    if failures:
        raise InvalidInputError(f"{len(failures)} of {len(items)} creates failed: " + "; ".join(failures[:5]))


@app.command("exec")
def exec_(
    env_id: Annotated[str, typer.Argument(metavar="ID", help="environment id")],
    command: Annotated[list[str], typer.Argument(help="command (after --)")],
    timeout: Annotated[float | None, typer.Option(help="seconds")] = None,
    env: Annotated[list[str] | None, typer.Option("--env", "-e", help="KEY=VALUE")] = None,
    workdir: Annotated[str | None, typer.Option(help="working directory")] = None,
) -> None:
    """Run a command in an environment; exit with its exit code."""
    with client() as c:
        r = c.exec(env_id, command_from(command), env=parse_env(env), cwd=workdir, timeout=timeout)
    print_result(r)
    raise typer.Exit(r.exit_code)


@app.command()
def ps() -> None:
    """List environments."""
    with client() as c:
        envs = c.list()
    table = Table(show_header=True, header_style="bold")
    for col in ("ID", "TEMPLATE", "STATE", "CPUS", "MEMORY", "CREATE (s)"):
        table.add_column(col)
    for e in envs:
        table.add_row(
            e.id,
            e.template,
            e.state,
            f"{e.resources.cpus:g}",
            human_bytes(e.resources.memory_bytes),
            f"{e.timing.total_s:.3f}",
        )
    out.print(table)


@app.command()
def rm(env_ids: Annotated[list[str], typer.Argument(metavar="ID...", help="environment ids")]) -> None:
    """Destroy environments."""
    with client() as c:
        for env_id in env_ids:
            c.destroy(env_id)
            print(env_id)
