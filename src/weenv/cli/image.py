"""``weenv import SOURCE``: an existing container image as groups and a template."""

from __future__ import annotations

from typing import Annotated

import typer

from weenv.cli.common import err, human_bytes, parse_size, store
from weenv.cli.progress import shown

app = typer.Typer()


@app.command("import")
def import_(
    source: Annotated[
        str,
        typer.Argument(help="an OCI image layout directory, a docker save (or OCI) archive, or docker://HOST/REPO:TAG"),
    ],
    name: Annotated[str | None, typer.Option("--name", "-n", help="template name (default: from SOURCE)")] = None,
    ref: Annotated[str | None, typer.Option(help="which image of a layout/archive holding several")] = None,
    merge_small: Annotated[
        str | None, typer.Option(help="merge adjacent layers smaller than this (e.g. 1M) into one group")
    ] = None,
    insecure: Annotated[bool, typer.Option(help="reach a non-loopback registry without TLS verification")] = False,
    chunk_size: Annotated[str, typer.Option(help="chunk size, e.g. 1M")] = "1M",
) -> None:
    """Import a container image: one group per layer (or merged), and a template."""
    from weenv.packaging.importer import import_image

    with shown(err) as progress:
        r = import_image(
            source,
            store(),
            name=name,
            ref=ref,
            insecure=insecure,
            merge_small=parse_size(merge_small) if merge_small else None,
            chunk_size=parse_size(chunk_size),
            progress=progress,
        )
    for g, layers in zip(r.groups, r.group_layers):
        span = f"layer {layers[0]}" if len(layers) == 1 else f"layers {layers[0]}-{layers[-1]}"
        err.print(
            f"group {g.manifest.name} ({span}): {g.manifest.file_count} files, image "
            f"{human_bytes(g.manifest.image_size)}, {g.chunks_written} new chunks "
            f"({human_bytes(g.bytes_written)})",
            highlight=False,
        )
    rt = r.template.runtime
    err.print(
        f"template {r.template.name}: {len(r.groups)} groups, user {rt.user}, workdir {rt.working_dir}, "
        f"image command {rt.default_command or '-'}, {r.seconds:.1f} s",
        highlight=False,
    )
    print(r.template_digest)
