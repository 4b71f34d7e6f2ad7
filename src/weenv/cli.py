"""The ``weenv`` command (typer + rich).

Packaging commands (``group``, ``template``) work on the store directly;
environment commands (``run``, ``create``, ``exec``, ``ps``, ``rm``) go through the
node daemon, which is started on demand.  A user mistake prints one line,
``weenv: error: ...``, and exits non-zero, without a traceback.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from weenv.config import Paths
from weenv.errors import InvalidInputError, WeenvError
from weenv.node.models import CreateTiming, ExecResult
from weenv.packaging.manifest import Resources, RuntimeConfig
from weenv.store import open_store

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  help="weenv: environments for agentic RL, started lazily from layer groups.")
group_app = typer.Typer(no_args_is_help=True, help="Build and list layer groups.")
template_app = typer.Typer(no_args_is_help=True, help="Compose and list templates.")
app.add_typer(group_app, name="group")
app.add_typer(template_app, name="template")

out = Console()
err = Console(stderr=True)

_SIZE_RE = re.compile(r"^(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``"512M"``, ``"2G"``, ``"1.5GiB"`` or a byte count -> bytes (powers of 1024)."""
    m = _SIZE_RE.match(text.strip())
    if not m:
        raise InvalidInputError(f"not a size: {text!r} (examples: 512M, 2G, 1073741824)")
    unit = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[m.group(2).upper()]
    return int(float(m.group(1)) * unit)


def parse_env(items: list[str] | None) -> dict[str, str]:
    env = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise InvalidInputError(f"not KEY=VALUE: {item!r}")
        env[key] = value
    return env


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _command(args: list[str]) -> list[str] | str:
    """One argument with white space is a shell string; otherwise argv."""
    if not args:
        raise InvalidInputError("no command given (put it after --)")
    if len(args) == 1 and any(c.isspace() for c in args[0]):
        return args[0]
    return args


def _client():
    from weenv.server.client import NodeClient

    return NodeClient(Paths.from_env())


def _store():
    return open_store(Paths.from_env().store_url)


def print_timing(t: CreateTiming, *, title: str = "create") -> None:
    table = Table(title=title, show_header=True, header_style="bold")
    table.add_column("phase")
    table.add_column("seconds", justify="right")
    for label, value in (
        ("manifest fetch", t.manifest_s),
        ("group mounts", t.groups_s),
        ("overlay", t.overlay_s),
        ("runtime create/start", t.runtime_s),
        ("first command", t.first_command_s),
        ("total", t.total_s),
    ):
        table.add_row(label, "-" if value is None else f"{value:.3f}")
    err.print(table)
    share = t.bytes_fetched / t.template_stored_bytes if t.template_stored_bytes else 0.0
    err.print(
        f"fetched {human_bytes(t.bytes_fetched)} ({t.chunks_fetched} chunks) of a template of "
        f"{human_bytes(t.template_bytes)} ({human_bytes(t.template_stored_bytes)} stored): {share:.1%}"
    )


def print_result(r: ExecResult) -> None:
    sys.stdout.buffer.write(r.stdout)
    sys.stdout.flush()
    sys.stderr.buffer.write(r.stderr)
    sys.stderr.flush()
    if r.timed_out:
        err.print(f"[red]weenv: command timed out after {r.duration_s:.1f} s and was killed[/red]")


# --- packaging -------------------------------------------------------------------------
@group_app.command("build")
def group_build(
    directory: Annotated[Path, typer.Argument(help="the tree that becomes the group's root")],
    name: Annotated[str, typer.Option("--name", "-n", help="group name (a ref in the store)")],
    version: Annotated[str, typer.Option(help="version label")] = "latest",
    chunk_size: Annotated[str, typer.Option(help="chunk size, e.g. 1M")] = "1M",
) -> None:
    """Build a layer group from DIRECTORY and publish it to the store."""
    from weenv.packaging.group import build_group

    r = build_group(directory, _store(), name=name, version=version, chunk_size=parse_size(chunk_size))
    err.print(
        f"group {name}: {r.manifest.file_count} files, image {human_bytes(r.manifest.image_size)}, "
        f"{len(r.manifest.chunks)} chunks ({human_bytes(r.manifest.stored_size)} stored), "
        f"{r.chunks_written} new ({human_bytes(r.bytes_written)}), {r.seconds:.1f} s"
    )
    print(r.digest)


@group_app.command("ls")
def group_ls() -> None:
    """List the store's groups."""
    for name, digest in _store().list_refs("groups").items():
        print(f"{name}\t{digest}")


@template_app.command("create")
def template_create(
    name: Annotated[str, typer.Argument(help="template name")],
    groups: Annotated[list[str], typer.Argument(help="groups (names or digests), bottom to top")],
    cmd: Annotated[Optional[list[str]], typer.Option("--cmd", help="first process argv (repeat)")] = None,
    env: Annotated[Optional[list[str]], typer.Option("--env", "-e", help="KEY=VALUE (repeat)")] = None,
    workdir: Annotated[str, typer.Option(help="working directory")] = "/",
    user: Annotated[str, typer.Option(help="UID:GID")] = "0:0",
    cpus: Annotated[float, typer.Option(help="CPU quota in cores")] = 1.0,
    memory: Annotated[str, typer.Option(help="memory limit, e.g. 2G")] = "2G",
    pids: Annotated[int, typer.Option(help="pids limit")] = 1024,
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
        resources=Resources(cpus=cpus, memory_bytes=parse_size(memory), pids=pids),
    )
    digest, _ = create_template(_store(), name, groups, runtime=runtime, version=version)
    print(digest)


@template_app.command("ls")
def template_ls() -> None:
    """List the store's templates."""
    for name, digest in _store().list_refs("templates").items():
        print(f"{name}\t{digest}")


# --- environments ----------------------------------------------------------------------
@app.command()
def run(
    template: Annotated[str, typer.Argument(help="template name or digest")],
    command: Annotated[list[str], typer.Argument(help="command (after --)")],
    timeout: Annotated[Optional[float], typer.Option(help="seconds")] = None,
    env: Annotated[Optional[list[str]], typer.Option("--env", "-e", help="KEY=VALUE")] = None,
    workdir: Annotated[Optional[str], typer.Option(help="working directory")] = None,
    timings: Annotated[bool, typer.Option(help="print the create's phases")] = False,
) -> None:
    """Create an environment, run one command in it, print its output, destroy it."""
    cmd = _command(command)
    with _client() as c:
        info = c.create(template)
        try:
            if timings:
                print_timing(info.timing, title=f"create {info.id}")
            r = c.exec(info.id, cmd, env=parse_env(env), cwd=workdir, timeout=timeout)
        finally:
            c.destroy(info.id)
    print_result(r)
    raise typer.Exit(r.exit_code)


@app.command()
def create(
    template: Annotated[str, typer.Argument(help="template name or digest")],
    cpus: Annotated[Optional[float], typer.Option(help="CPU quota in cores")] = None,
    memory: Annotated[Optional[str], typer.Option(help="memory limit, e.g. 2G")] = None,
    pids: Annotated[Optional[int], typer.Option(help="pids limit")] = None,
    timings: Annotated[bool, typer.Option(help="print the create's phases")] = True,
) -> None:
    """Create and start an environment; print its id."""
    resources = None
    if cpus is not None or memory is not None or pids is not None:
        d = Resources()
        resources = Resources(
            cpus=cpus if cpus is not None else d.cpus,
            memory_bytes=parse_size(memory) if memory is not None else d.memory_bytes,
            pids=pids if pids is not None else d.pids,
        )
    with _client() as c:
        info = c.create(template, resources=resources)
    if timings:
        print_timing(info.timing, title=f"create {info.id}")
    print(info.id)


@app.command("exec")
def exec_(
    env_id: Annotated[str, typer.Argument(metavar="ID", help="environment id")],
    command: Annotated[list[str], typer.Argument(help="command (after --)")],
    timeout: Annotated[Optional[float], typer.Option(help="seconds")] = None,
    env: Annotated[Optional[list[str]], typer.Option("--env", "-e", help="KEY=VALUE")] = None,
    workdir: Annotated[Optional[str], typer.Option(help="working directory")] = None,
) -> None:
    """Run a command in an environment; exit with its exit code."""
    with _client() as c:
        r = c.exec(env_id, _command(command), env=parse_env(env), cwd=workdir, timeout=timeout)
    print_result(r)
    raise typer.Exit(r.exit_code)


@app.command()
def ps() -> None:
    """List environments."""
    with _client() as c:
        envs = c.list()
    table = Table(show_header=True, header_style="bold")
    for col in ("ID", "TEMPLATE", "STATE", "CPUS", "MEMORY", "CREATE (s)"):
        table.add_column(col)
    for e in envs:
        table.add_row(e.id, e.template, e.state, f"{e.resources.cpus:g}",
                      human_bytes(e.resources.memory_bytes), f"{e.timing.total_s:.3f}")
    out.print(table)


@app.command()
def rm(env_ids: Annotated[list[str], typer.Argument(metavar="ID...", help="environment ids")]) -> None:
    """Destroy environments."""
    with _client() as c:
        for env_id in env_ids:
            c.destroy(env_id)
            print(env_id)


# --- daemon ----------------------------------------------------------------------------
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


def main() -> None:
    try:
        app()
    except WeenvError as exc:
        err.print(f"[red]weenv: error:[/red] {escape(str(exc))}", highlight=False)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
