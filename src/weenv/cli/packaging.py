"""``weenv group ...`` and ``weenv template ...``: publishing to the store."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from weenv.cli.common import err, human_bytes, parse_env, parse_size, store
from weenv.formats.manifest import Resources, RuntimeConfig

group_app = typer.Typer(no_args_is_help=True, help="Build and list layer groups.")
template_app = typer.Typer(no_args_is_help=True, help="Compose and list templates.")


@group_app.command("build")
def group_build(
    directory: Annotated[Path, typer.Argument(help="the tree that becomes the group's root")],
    name: Annotated[str, typer.Option("--name", "-n", help="group name (a ref in the store)")],
    version: Annotated[str, typer.Option(help="version label")] = "latest",
    chunk_size: Annotated[str, typer.Option(help="chunk size, e.g. 1M")] = "1M",
) -> None:
    """Build a layer group from DIRECTORY and publish it to the store."""
    from weenv.packaging.group import build_group

    r = build_group(directory, store(), name=name, version=version, chunk_size=parse_size(chunk_size))
    err.print(
        f"group {name}: {r.manifest.file_count} files, image {human_bytes(r.manifest.image_size)}, "
        f"{len(r.manifest.chunks)} chunks ({human_bytes(r.manifest.stored_size)} stored), "
        f"{r.chunks_written} new ({human_bytes(r.bytes_written)}), {r.seconds:.1f} s"
    )
    print(r.digest)


@group_app.command("ls")
def group_ls() -> None:
    """List the store's groups."""
    for name, digest in store().list_refs("groups").items():
        print(f"{name}\t{digest}")


@template_app.command("create")
def template_create(
    name: Annotated[str, typer.Argument(help="template name")],
    groups: Annotated[list[str], typer.Argument(help="groups (names or digests), bottom to top")],
    cmd: Annotated[list[str] | None, typer.Option("--cmd", help="first process argv (repeat)")] = None,
    env: Annotated[list[str] | None, typer.Option("--env", "-e", help="KEY=VALUE (repeat)")] = None,
    workdir: Annotated[str, typer.Option(help="working directory")] = "/",
    user: Annotated[str, typer.Option(help="UID:GID")] = "0:0",
    cpus: Annotated[float, typer.Option(help="CPU quota in cores")] = 1.0,
    memory: Annotated[str, typer.Option(help="memory limit, e.g. 2G")] = "2G",
    pids: Annotated[int, typer.Option(help="pids limit")] = 1024,
    disk: Annotated[str, typer.Option(help="disk limit (what an environment may write), e.g. 10G")] = "10G",
    version: Annotated[str, typer.Option(help="version label")] = "latest",
) -> None:
    """Compose a template from groups and publish it."""
    from weenv.packaging.template import create_template

    base = RuntimeConfig()
    runtime = RuntimeConfig(
        command=cmd or base.command,
        env={**base.env, **parse_env(env)},
        working_dir=workdir,
        user=user,
        resources=Resources(cpus=cpus, memory_bytes=parse_size(memory), pids=pids, disk_bytes=parse_size(disk)),
    )
    digest, _ = create_template(store(), name, groups, runtime=runtime, version=version)
    print(digest)


@template_app.command("ls")
def template_ls() -> None:
    """List the store's templates."""
    for name, digest in store().list_refs("templates").items():
        print(f"{name}\t{digest}")


@template_app.command("profile")
def template_profile(
    name: Annotated[str, typer.Argument(help="template name or digest")],
    reset: Annotated[bool, typer.Option("--reset", help="forget its usage profile (node and store)")] = False,
) -> None:
    """A template's usage profile on the daemon: what its environments taught admission and sizing.

    --reset forgets it on this home's daemon and in the store: new environments of the
    template are sized and admitted as those of an unknown one until others teach it again."""
    from weenv.cli.common import client
    from weenv.errors import InvalidInputError

    if not reset:
        raise InvalidInputError("weenv template profile NAME --reset: say --reset to forget the usage profile")
    with client() as c:
        r = c.reset_profile(name)
    print(f"usage profile of {r.template} ({r.digest}) " + ("forgotten" if r.had_profile else "was not known"))
