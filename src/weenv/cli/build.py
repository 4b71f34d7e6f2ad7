"""``weenv build``, ``weenv update``, ``weenv gc`` and ``weenv dedupe``: recipes, updates, garbage."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from weenv.cli.common import err, human_bytes, store
from weenv.cli.progress import shown
from weenv.config import Paths

app = typer.Typer()


@app.command("build")
def build(
    recipe: Annotated[Path, typer.Argument(help="the recipe (TOML)")],
) -> None:
    """Build every component of RECIPE (cached per component) and publish the template."""
    from weenv.build.buildenv import NodeBuildEnvironments
    from weenv.packaging.builder import build_recipe
    from weenv.packaging.recipe import load_recipe

    parsed = load_recipe(recipe)
    with shown(err) as progress:
        result = build_recipe(
            parsed, store(), Paths.from_env(), progress=progress, environments=NodeBuildEnvironments()
        )
    table = Table(show_header=True, header_style="bold")
    for col in ("component", "status", "group", "image", "new chunks", "published", "seconds"):
        table.add_column(
            col, justify="right" if col in ("image", "new chunks", "published", "seconds") else "left", no_wrap=True
        )
    for c in result.components:
        table.add_row(
            c.name,
            "cached" if c.cached else "built",
            c.digest[7:19],
            human_bytes(c.image_size),
            str(c.chunks_written),
            human_bytes(c.bytes_written),
            f"{c.seconds:.1f}",
        )
    err.print(table)
    state = "published" if result.template_changed else "unchanged"
    err.print(
        f"template {result.template} {state}: {len(result.rebuilt)} of {len(result.components)} components "
        f"rebuilt, {human_bytes(result.bytes_published)} published in {result.seconds:.1f} s"
    )
    print(result.template_digest)


@app.command("update")
def update(
    template: Annotated[str, typer.Argument(help="template name or digest")],
    component: Annotated[str, typer.Option("--component", "-c", help="the group (by name) to replace")],
    from_dir: Annotated[Path, typer.Option("--from-dir", help="the component's new tree")],
    version: Annotated[str | None, typer.Option(help="new template version label")] = None,
    profile: Annotated[
        bool,
        typer.Option(
            "--profile",
            help="lay out the files the template's prefetch profile read first, contiguous, in access order",
        ),
    ] = False,
) -> None:
    """Publish a new version of TEMPLATE with one component rebuilt from a directory.

    With --profile and the same directory: the same tree, its startup files together."""
    from weenv.packaging.update import update_component

    with shown(err) as progress:
        r = update_component(
            store(), template, component, from_dir, version=version, profile=profile, progress=progress
        )
    err.print(
        f"template {r.template} version {r.version}: {component} -> {r.group_digest[7:19]}, "
        f"{r.chunks_written} new chunks, {human_bytes(r.bytes_published)} ({r.bytes_published} bytes) "
        f"published in {r.seconds:.2f} s"
    )
    print(r.template_digest)


def _print_report(report) -> None:
    err.print(
        f"{report.templates} templates, {report.groups} groups, {report.chunks} chunks: "
        f"logical {human_bytes(report.logical_bytes)}, distinct groups {human_bytes(report.group_bytes)}, "
        f"unique chunks {human_bytes(report.unique_bytes)}, stored {human_bytes(report.stored_bytes)}; "
        f"dedupe {report.dedupe_ratio:.1f}x, with compression {report.ratio:.1f}x"
    )


@app.command("gc")
def gc(
    dry_run: Annotated[bool, typer.Option("--dry-run", "-n", help="only report what would go")] = False,
) -> None:
    """Remove from the store and the chunk cache what nothing in use reaches.

    Groups, templates and chunks that no template ref or running environment
    reaches go, from the store and the node chunk cache."""
    from weenv.packaging.gc import collect, dedupe_report
    from weenv.server import daemon

    s = store()
    paths = Paths.from_env()
    r = collect(s, paths, in_use=lambda: daemon.running_templates(paths), dry_run=dry_run)
    verb = "would remove" if dry_run else "removed"
    err.print(
        f"{verb} {len(r.manifests_removed)} manifests, {r.chunks_removed} chunks "
        f"({human_bytes(r.bytes_freed)}) and {r.packs_removed} prefetch packs from the store, {r.cache_chunks_removed} chunks "
        f"({human_bytes(r.cache_bytes_freed)}) from the node cache, {len(r.refs_removed)} refs"
        + (f"; kept {len(r.kept_for_running)} manifests that running environments use" if r.kept_for_running else "")
    )
    _print_report(dedupe_report(s))


@app.command("dedupe")
def dedupe() -> None:
    """Report the store's dedupe: the templates' logical bytes against the bytes stored."""
    from weenv.packaging.gc import dedupe_report

    _print_report(dedupe_report(store()))
