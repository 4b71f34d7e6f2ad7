"""The CLI's command list reads as one line per command: each command's
summary (its help's first paragraph) is one sentence on one line."""

from __future__ import annotations

import inspect

import typer

from weenv.cli import app


def _commands(a: typer.Typer, prefix: str = ""):
    for c in a.registered_commands:
        yield prefix + (c.name or c.callback.__name__.replace("_", "-")), c.help or inspect.getdoc(c.callback) or ""
    for g in a.registered_groups:
        yield from _commands(g.typer_instance, prefix + g.name + " ")


def test_every_command_summary_is_one_line():
    seen = dict(_commands(app))
    assert {"demo", "gc", "create", "exec", "cluster up"} <= set(seen)
    broken = {name: doc.split("\n\n")[0] for name, doc in seen.items() if "\n" in doc.split("\n\n")[0].strip()}
    assert not broken, broken
    assert all(doc.strip() for doc in seen.values()), [n for n, d in seen.items() if not d.strip()]
