"""``weenv snapshot/fork/reset/pause/resume``: an environment's state, through the node daemon."""

from __future__ import annotations

from typing import Annotated

import typer

from weenv.cli.common import client, err

app = typer.Typer()

EnvId = Annotated[str, typer.Argument(metavar="ID", help="environment id")]


@app.command()
def snapshot(
    env_id: EnvId, name: Annotated[str | None, typer.Option(help="the snapshot's template name")] = None
) -> None:
    """Capture the environment's file system and publish it as a template (prints its name)."""
    with client() as c:
        info = c.snapshot(env_id, name)
    err.print(
        f"captured in {info.capture_s * 1000:.1f} ms, published {info.bytes_published} bytes in {info.publish_s:.2f} s"
    )
    print(info.name)


@app.command()
def fork(
    env_id: EnvId,
    count: Annotated[int, typer.Option(help="children")] = 1,
    timeout: Annotated[float | None, typer.Option(help="each child's timeout, seconds")] = None,
) -> None:
    """New environments starting from this one's file system (prints their ids; exits 1 if one failed)."""
    with client() as c:
        r = c.fork(env_id, count, timeout=timeout)
    failed = 0
    for child in r.children:
        if child.environment is not None:
            print(child.environment.id)
        else:
            failed += 1
            err.print(f"a child failed: {child.error.message if child.error else 'unknown error'}")
    err.print(
        f"{len(r.children) - failed} of {len(r.children)} children in {r.total_s:.3f} s "
        f"(parent paused {r.pause_s * 1000:.1f} ms)"
    )
    if failed:
        raise typer.Exit(1)


@app.command()
def reset(
    env_id: EnvId, snapshot: Annotated[str | None, typer.Option(help="a snapshot taken on its node")] = None
) -> None:
    """Back to the template's (or a snapshot's) state in place; its first process starts again."""
    with client() as c:
        info = c.reset(env_id, snapshot)
    err.print(f"reset in {info.timing.total_s * 1000:.1f} ms")


@app.command()
def pause(
    env_id: EnvId,
    release_memory: Annotated[
        bool,
        typer.Option("--release-memory", help="end its processes, keep its files (resume restarts its first process)"),
    ] = False,
) -> None:
    """Freeze every process of the environment (memory kept) until resumed."""
    with client() as c:
        c.pause(env_id, release_memory=release_memory)


@app.command()
def resume(
    env_id: EnvId, timeout: Annotated[float | None, typer.Option(help="its timeout from now, seconds")] = None
) -> None:
    """Thaw a paused environment."""
    with client() as c:
        c.resume(env_id, timeout=timeout)
