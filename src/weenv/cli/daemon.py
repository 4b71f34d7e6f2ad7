"""``weenv serve/stop`` and ``weenv demo``."""

from __future__ import annotations

from typing import Annotated

import typer

from weenv.cli.common import err
from weenv.config import Paths

app = typer.Typer()


@app.command()
def serve() -> None:
    """Run the node daemon in the foreground (Ctrl-C stops it cleanly)."""
    from weenv.server.daemon import serve as _serve

    _serve(Paths.from_env())


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
    """The main job on real input: Debian base + deps + a PyPI library's source as
    three groups; a cold and a warm start; the library's test suite run inside."""
    from weenv.demo import DEFAULT_LIBRARY, DEFAULT_TEST_REQUIREMENTS, run_demo

    code = run_demo(
        Paths.from_env(),
        library=library or DEFAULT_LIBRARY,
        test_requirements=tuple(test_deps.split()) if test_deps else DEFAULT_TEST_REQUIREMENTS,
        keep_daemon=keep_daemon,
        console=err,
    )
    raise typer.Exit(code)


