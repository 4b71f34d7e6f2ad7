"""``weenv config``: every effective setting, its value and where it came from.

Reads the environment and the settings file only (:mod:`weenv.config`): no
daemon is needed."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
from rich.table import Table

from weenv.cli.common import out

app = typer.Typer()

HIDDEN = "(set, hidden)"
"""What a secret setting (an API key) shows instead of its value."""


def rows() -> tuple[list[dict[str, Any]], str]:
    """One row per setting (group, key, variable, value, source) and the settings file's path."""
    from weenv.config import extra, fields, load

    loaded = load()
    result = []
    for group, key, info in fields():
        value = getattr(getattr(loaded.settings, group), key)
        meta = extra(info)
        if meta["secret"] and value is not None:
            value = HIDDEN
        elif value is not None and not isinstance(value, bool | int | float | str):
            value = str(value)
        result.append(
            {
                "group": group,
                "key": key,
                "variable": meta["env"],
                "value": value,
                "unit": meta["unit"],
                "source": loaded.origin(group, key),
            }
        )
    return result, str(loaded.path) + ("" if loaded.path.exists() else " (absent)")


@app.command("config")
def config(
    as_json: Annotated[
        bool, typer.Option("--json", help="print JSON: the settings file and one object per setting")
    ] = False,
) -> None:
    """Print every effective setting, its value and where it came from (env, file or default).

    Precedence: the WEENV_* variable, then the settings file (WEENV_CONFIG, else
    $WEENV_HOME/config.toml), then the default.  Needs no daemon."""
    settings, path = rows()
    if as_json:
        out.print_json(json.dumps({"file": path, "settings": settings}))
        return
    table = Table(title=f"settings (file: {path})", title_justify="left")
    for column in ("variable", "key", "value", "source"):
        table.add_column(column)
    for row in settings:
        value = "" if row["value"] is None else str(row["value"])
        table.add_row(row["variable"], f"[{row['group']}] {row['key']}", value, row["source"])
    out.print(table, markup=False, highlight=False)
