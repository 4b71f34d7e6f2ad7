"""Showing long work's :class:`~weenv.progress.Progress` on the command line:
rich bars on a terminal, plain lines otherwise (a log file, CI, a pipe).

Plain lines are few enough to read in a log: one when a task starts, one per
status it reports, one at each quarter of a byte count, and one when it ends::

    layers: 0/7
    layers 1/7: layer 0: 1,203 entries, 0 whiteouts, 0 opaque dirs
    bytes 25% (11.5 MiB of 46.0 MiB)
    layers 7/7: done
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    ProgressColumn,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.progress import Progress as RichProgress
from rich.text import Text

from weenv.cli.common import human_bytes
from weenv.progress import Progress


@dataclass
class _Task:
    total: float | None
    unit: str
    done: float = 0.0
    quarter: int = 0  # the last quarter of a byte count said


class LineProgress(Progress):
    """Plain lines on ``console`` (see the module's docstring)."""

    def __init__(self, console: Console) -> None:
        super().__init__()
        self.console = console
        self.tasks: dict[str, _Task] = {}

    def _count(self, name: str) -> str:
        t = self.tasks[name]
        if t.total is None:
            return name
        if t.unit == "B":
            return f"{name} {human_bytes(t.done)} of {human_bytes(t.total)}"
        return f"{name} {t.done:.0f}/{t.total:.0f}"

    def start(self, task: str, *, total: float | None = None, unit: str = "", status: str = "") -> None:
        self.tasks[task] = _Task(total, unit)
        self.say(f"{self._count(task)}: {status}" if status else f"{self._count(task)}")

    def advance(self, task: str, amount: float = 1, *, status: str | None = None) -> None:
        t = self.tasks.setdefault(task, _Task(None, ""))
        t.done += amount
        if status:
            self.say(f"{self._count(task)}: {status}")
        elif t.unit == "B" and t.total:
            quarter = min(4, int(4 * t.done / t.total))
            if 0 < quarter < 4 and quarter > t.quarter:
                t.quarter = quarter
                self.say(f"{task} {25 * quarter}% ({human_bytes(t.done)} of {human_bytes(t.total)})")

    def finish(self, task: str, *, status: str = "done", failed: bool = False) -> None:
        t = self.tasks.setdefault(task, _Task(None, ""))
        if t.total is not None and not failed:
            t.done = t.total
        self.say(f"{self._count(task)}: {status}")

    def say(self, line: str) -> None:
        self.console.print(line, highlight=False, markup=False, soft_wrap=True)


class _Count(ProgressColumn):
    """``3/7`` for a count, ``12.1/48.2 MB`` for bytes, nothing without a total."""

    def __init__(self) -> None:
        super().__init__()
        self._count = MofNCompleteColumn()
        self._bytes = DownloadColumn()

    def render(self, task) -> Text:
        if task.total is None:
            return Text("")
        return (self._bytes if task.fields.get("unit") == "B" else self._count).render(task)


class BarProgress(Progress):
    """rich bars on ``console``, a terminal: one bar per task, its status beside it."""

    def __init__(self, console: Console) -> None:
        super().__init__()
        self.bars = RichProgress(
            SpinnerColumn(finished_text="[green]✓[/green]"),
            TextColumn("[bold]{task.fields[name]:<14}"),
            BarColumn(bar_width=28),
            _Count(),
            TextColumn("{task.description}"),
            TimeElapsedColumn(),
            console=console,
            transient=False,
        )
        self.ids: dict[str, int] = {}

    def start(self, task: str, *, total: float | None = None, unit: str = "", status: str = "") -> None:
        self.ids[task] = self.bars.add_task(status, name=task, total=total, unit=unit)

    def _id(self, task: str) -> int:
        if task not in self.ids:
            self.start(task)
        return self.ids[task]

    def advance(self, task: str, amount: float = 1, *, status: str | None = None) -> None:
        update = {"description": status} if status else {}
        self.bars.update(self._id(task), advance=amount, **update)

    def finish(self, task: str, *, status: str = "done", failed: bool = False) -> None:
        tid = self._id(task)
        t = next((t for t in self.bars.tasks if t.id == tid), None)
        description = f"[red]{status}[/red]" if failed else status
        if failed or t is None:
            self.bars.update(tid, description=description)
        else:
            total = t.total if t.total is not None else 1
            self.bars.update(tid, description=description, total=total, completed=total)
        self.bars.stop_task(tid)

    def say(self, line: str) -> None:
        self.bars.console.print(line, highlight=False, markup=False, soft_wrap=True)


@contextlib.contextmanager
def shown(console: Console) -> Iterator[Progress]:
    """A :class:`Progress` drawing on ``console``: bars on a terminal, lines
    otherwise.  Tasks still running when the block raises are marked failed."""
    if not console.is_terminal:
        yield LineProgress(console)
        return
    display = BarProgress(console)
    with display.bars:
        try:
            yield display
        except BaseException:
            for t in display.bars.tasks:
                if not t.finished:
                    display.bars.update(t.id, description="[red]failed[/red]")
                    display.bars.stop_task(t.id)
            raise
