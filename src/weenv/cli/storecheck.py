"""``weenv store check``: walk the store and report what is missing or corrupt."""

from __future__ import annotations

from typing import Annotated

import typer

from weenv.cli.common import err, out, store

app = typer.Typer(no_args_is_help=True, help="The store itself: check it.")


@app.command("check")
def check(
    quick: Annotated[bool, typer.Option("--quick", help="only check that chunks are there, do not read them")] = False,
) -> None:
    """Report every missing or corrupt ref, manifest or chunk of the store; exit 1 if any.

    Walks every ref, template, group manifest and chunk of ``WEENV_STORE``."""
    from weenv.store.check import check_store

    s = store()
    try:
        report = check_store(s, deep=not quick)
    finally:
        s.close()
    for problem in report.problems:
        out.print(problem, markup=False, highlight=False, soft_wrap=True)
    err.print(
        f"{s.url}: {report.refs} refs, {report.manifests} manifests, {report.chunks} chunks checked; "
        f"problems: {len(report.problems)}",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
    if report.problems:
        raise typer.Exit(1)
