"""The ``weenv`` command (typer + rich).

Packaging commands (``group``, ``template``: :mod:`weenv.cli.packaging`) work on
the store directly; environment commands (``run``, ``create``, ``exec``, ``ps``,
``rm``: :mod:`weenv.cli.environments`) go through the node daemon, started on
demand (``serve``, ``stop``, ``demo``: :mod:`weenv.cli.daemon`).  ``bench``
comes from the separate benchmarks package (:mod:`weenv_bench`, ``weenv[bench]``)
when it is installed.  A user mistake prints one line, ``weenv: error: ...``, and
exits non-zero, without a traceback.
"""

from __future__ import annotations

import sys

import typer
from pydantic import ValidationError
from rich.markup import escape

from weenv.cli import build as build_cli
from weenv.cli import cluster, daemon, environments, image, packaging, state, storecheck
from weenv.cli import settings as settings_cli
from weenv.cli import stats as stats_cli
from weenv.cli.common import err
from weenv.errors import ToolMissingError, WeenvError

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    help="weenv: environments for agentic RL, started lazily from layer groups.",
)
app.add_typer(packaging.group_app, name="group")
app.add_typer(packaging.template_app, name="template")
app.add_typer(cluster.app, name="cluster")
app.add_typer(storecheck.app, name="store")
for sub in (environments.app, state.app, daemon.app):
    app.registered_commands += sub.registered_commands
app.registered_commands += build_cli.app.registered_commands  # build, update, gc, dedupe
app.registered_commands += image.app.registered_commands  # import
app.registered_commands += stats_cli.app.registered_commands  # stats (issue 5)
app.registered_commands += settings_cli.app.registered_commands  # config

BENCH_MISSING = "the benchmarks are not installed: pip install 'weenv[bench]' (from a checkout: pip install '.[bench]')"


def _add_bench(app: typer.Typer) -> None:
    """``weenv bench ...``: the benchmarks' commands if :mod:`weenv_bench` is
    importable, else one command that says how to install them."""
    try:
        from weenv_bench.cli import bench_app
    except ModuleNotFoundError as exc:
        if exc.name != "weenv_bench":
            raise
    else:
        app.add_typer(bench_app, name="bench")
        return

    @app.command(
        "bench",
        add_help_option=False,
        help="Benchmarks: not installed (run it to see how to install them).",
        context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    )
    def bench() -> None:
        raise ToolMissingError(BENCH_MISSING)


_add_bench(app)


def main() -> None:
    """Run the ``weenv`` command (see :func:`run_app`)."""
    run_app(app)


def run_app(app: typer.Typer) -> None:
    """Run ``app``; a weenv error, an invalid field (pydantic) or a failed system
    call (full disk, read-only or unreadable path, ...) is one line on stderr and exit 1."""
    try:
        app()
    except WeenvError as exc:
        _fail(str(exc))
    except ValidationError as exc:
        _fail(describe_validation(exc))
    except OSError as exc:
        _fail(describe_os_error(exc))
    except KeyboardInterrupt:
        sys.exit(130)


def _fail(message: str) -> None:
    err.print(f"[red]weenv: error:[/red] {escape(message)}", highlight=False, soft_wrap=True)
    sys.exit(1)


def describe_validation(exc: ValidationError) -> str:
    """A pydantic error as one line: ``Resources: cpus: Input should be a finite number``."""
    parts = []
    for e in exc.errors()[:5]:
        where = ".".join(str(x) for x in e.get("loc", ())) or "value"
        msg = str(e.get("msg", "invalid")).removeprefix("Value error, ")
        parts.append(f"{where}: {msg}")
    more = f" (+{exc.error_count() - 5} more)" if exc.error_count() > 5 else ""
    return f"invalid {exc.title}: " + "; ".join(parts) + more


def describe_os_error(exc: OSError) -> str:
    """A failed system call as one line: ``No space left on device: /path``."""
    what = exc.strerror or str(exc) or type(exc).__name__
    names = [n for n in (exc.filename, exc.filename2) if n is not None]
    if len(names) == 1 and len(str(names[0])) > 300:
        names = [str(names[0])[:150] + "..." + str(names[0])[-100:]]
    return what + (": " + " -> ".join(str(n) for n in names) if names else "")
