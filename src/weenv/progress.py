"""Progress of long work (an import, a build, a cluster coming up), told by the
work and shown by whoever called it.

The work names its tasks and moves them on; it never draws anything.  The
command line shows them as rich bars on a terminal and as plain lines
otherwise (:mod:`weenv.cli.progress`); a library caller passes nothing and
hears nothing, or passes a :class:`Progress` with ``on_line`` to collect the
lines.

A task is named by a short string (``"layers"``, ``"bytes"``, a recipe
component's name) and may have a ``total`` in its ``unit`` (``""`` for a
count, ``"B"`` for bytes)::

    progress.start("layers", total=7)
    progress.advance("layers", status="layer 0: 1,203 entries")
    progress.finish("layers")
"""

from __future__ import annotations

from collections.abc import Callable


class Progress:
    """What long work tells of itself.  This base shows nothing but the lines
    given to ``on_line`` (each status and :meth:`say`), so it serves as the
    quiet default and as a collector in tests and scripts; the command line's
    displays subclass it."""

    def __init__(self, on_line: Callable[[str], None] | None = None) -> None:
        self._on_line = on_line

    def start(self, task: str, *, total: float | None = None, unit: str = "", status: str = "") -> None:
        """A task begins (``total`` in ``unit``, or unknown)."""
        if status:
            self.say(f"{task}: {status}")

    def advance(self, task: str, amount: float = 1, *, status: str | None = None) -> None:
        """``task`` moved ``amount`` on; ``status`` says what it does now."""
        if status:
            self.say(f"{task}: {status}")

    def finish(self, task: str, *, status: str = "done", failed: bool = False) -> None:
        """``task`` ended, completed or (``failed``) not."""
        self.say(f"{task}: {status}")

    def say(self, line: str) -> None:
        """A line of its own, beside the tasks."""
        if self._on_line is not None:
            self._on_line(line)


QUIET = Progress()
"""Progress that shows nothing: the default of every long operation."""
