"""The ``weenv`` command (typer + rich).

Packaging commands (``group``, ``template``: :mod:`weenv.cli.packaging`) work on
the store directly; environment commands (``run``, ``create``, ``exec``, ``ps``,
``rm``: :mod:`weenv.cli.environments`) go through the node daemon, started on
demand (``serve``, ``stop``, ``demo``: :mod:`weenv.cli.daemon`).  A user mistake
prints one line, ``weenv: error: ...``, and exits non-zero, without a traceback.
"""

from __future__ import annotations

import sys

import typer
from rich.markup import escape

from weenv.cli import bench, daemon, environments, packaging
from weenv.cli.common import err
from weenv.errors import WeenvError

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  help="weenv: environments for agentic RL, started lazily from layer groups.")
app.add_typer(packaging.group_app, name="group")
app.add_typer(packaging.template_app, name="template")
app.add_typer(bench.bench_app, name="bench")
for sub in (environments.app, daemon.app):
    app.registered_commands += sub.registered_commands


def main() -> None:
    try:
        app()
    except WeenvError as exc:
        err.print(f"[red]weenv: error:[/red] {escape(str(exc))}", highlight=False)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
