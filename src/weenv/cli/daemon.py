"""``weenv serve/stop`` and ``weenv demo``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from weenv.cli.common import err
from weenv.config import CONFIG_ENV, Paths

app = typer.Typer()


@app.command()
def serve(
    host: Annotated[str, typer.Option(help="TCP address to listen on (with --port)")] = "127.0.0.1",
    port: Annotated[
        int | None,
        typer.Option(
            help="also serve the API on TCP (0: any free port); clients then need the key in $WEENV_HOME/run/api-key"
        ),
    ] = None,
    max_environments: Annotated[int | None, typer.Option(help="refuse creates past this many (503)")] = None,
    config: Annotated[
        Path | None,
        typer.Option(
            help="settings file (TOML; default: WEENV_CONFIG, else "
            "$WEENV_HOME/config.toml); the environment overrides it"
        ),
    ] = None,
) -> None:
    """Run the node daemon in the foreground (Ctrl-C stops it cleanly).

    It always serves its Unix socket ($WEENV_HOME/run/weenv.sock, owner only, no
    key); with --port also HTTP on HOST:PORT, where every request needs the API
    key (header X-API-Key or Authorization: Bearer)."""
    from weenv.server.daemon import serve as _serve

    if config is not None:  # the daemon and what it starts read the settings through this variable
        os.environ[CONFIG_ENV] = str(config.absolute())
    _serve(Paths.from_env(), host=host, port=port, max_environments=max_environments)


@app.command()
def stop() -> None:
    """Stop the node daemon: destroys its environments and unmounts everything."""
    from weenv.server.daemon import stop as _stop

    if _stop(Paths.from_env()):
        err.print("weenv daemon stopped")
    else:
        err.print("no weenv daemon was running")


@app.command()
def demo(
    library: Annotated[str, typer.Option(help="PyPI library whose sdist test suite runs inside")] = "",
    test_deps: Annotated[str, typer.Option(help="what its tests need, space-separated")] = "",
    keep_daemon: Annotated[bool, typer.Option(help="leave the daemon running afterwards")] = False,
) -> None:
    """The main job on real input: a library's tests in a cold and a warm environment.

    Debian base + deps + a PyPI library's source as three groups; a cold and a
    warm start; the library's test suite run inside."""
    from weenv.demo import DEFAULT_LIBRARY, DEFAULT_TEST_REQUIREMENTS, run_demo

    code = run_demo(
        Paths.from_env(),
        library=library or DEFAULT_LIBRARY,
        test_requirements=tuple(test_deps.split()) if test_deps else DEFAULT_TEST_REQUIREMENTS,
        keep_daemon=keep_daemon,
        console=Console(soft_wrap=True),  # stdout, so `weenv demo > out.txt` keeps it
    )
    raise typer.Exit(code)
