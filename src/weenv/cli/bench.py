"""``weenv bench ...``: one subcommand per benchmark (see :mod:`weenv.bench`)."""

from __future__ import annotations

import typer

bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks: weenv against the usual way, side by side.")
