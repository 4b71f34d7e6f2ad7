"""Shared pieces of the CLI: consoles, parsing of sizes and KEY=VALUE, printing."""

from __future__ import annotations

import re
import sys

from rich.console import Console
from rich.table import Table

from weenv.api.models import CreateTiming, ExecResult
from weenv.config import Paths
from weenv.errors import InvalidInputError
from weenv.store import open_store

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


def command_from(args: list[str]) -> list[str] | str:
    """One argument with white space is a shell string; otherwise argv."""
    if not args:
        raise InvalidInputError("no command given (put it after --)")
    if len(args) == 1 and any(c.isspace() for c in args[0]):
        return args[0]
    return args


def client():
    """The SDK's :class:`~weenv.sdk.NodeClient` on this home's daemon (started if none runs)."""
    from weenv.server import daemon

    return daemon.connect(Paths.from_env())


def store():
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
    if t.resolved_from == "node":
        age = "" if t.resolved_age_s is None else f", which it named {t.resolved_age_s:.0f} s ago"
        err.print(f"[yellow]the store did not answer: started the node's last known digest{age}[/yellow]")
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
