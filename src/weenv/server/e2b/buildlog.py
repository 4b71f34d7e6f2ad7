"""The log of one E2B build, bounded in bytes, as the status route pages it.

The SDK pages a build's log by counting: it asks ``logsOffset=N`` with N the
entries it has had so far, so entries once given must keep their places; the
log only grows at its end.  A build's ``RUN`` may print gigabytes, so what
is kept is bounded in bytes (each entry counted as its message's UTF-8 bytes
plus :data:`ENTRY_BYTES` for its timestamp, level and step):

- **per line**: a message is cut to :data:`~weenv.build.stepbuild.MAX_LINE_BYTES`
  bytes, ending ``… [N bytes cut]`` (the step's output is cut the same way as
  it is read, so a line without newline never grows in memory either);
- **the first and the last**: every entry is kept until the log holds
  ``max_bytes - reserve_bytes``.  Past that, a command's output lines are
  counted, and the newest ``tail_bytes`` of them kept aside; the next line of
  the builder's own (a step's end, an error, the next step) first appends a
  ``warn`` entry saying how many lines and bytes were left out, then those
  last lines, then itself.  Builder lines and these tails are appended while
  the log holds less than ``max_bytes``; the build's final line always is.

So a log holds at most ``max_bytes`` plus one line, whatever the build
prints, and it ends with the output just before each step's end or failure.
"""

from __future__ import annotations

import collections
import datetime
import time

from weenv.build.stepbuild import MAX_LINE_BYTES

MAX_LOG_BYTES = 4 << 20
"""Bytes of one build's log."""
LOG_RESERVE_BYTES = 1 << 20
"""Of :data:`MAX_LOG_BYTES`, what is kept for builder lines and output tails once output fills the rest."""
LOG_TAIL_BYTES = 64 << 10
"""Bytes of the newest output lines kept aside once the log is full, shown before the next builder line."""
ENTRY_BYTES = 96
"""Bytes an entry is counted beyond its message (its JSON keys, timestamp, level, step)."""


def now_iso(t: float | None = None) -> str:
    t = time.time() if t is None else t
    return datetime.datetime.fromtimestamp(t, datetime.UTC).isoformat().replace("+00:00", "Z")


def cut_line(message: str, limit: int = MAX_LINE_BYTES) -> str:
    """``message`` cut to ``limit`` UTF-8 bytes, saying how many more it had."""
    data = message.encode(errors="surrogateescape")
    if len(data) <= limit:
        return message
    return data[:limit].decode(errors="ignore") + f" … [{len(data) - limit} bytes cut]"


class BuildLogBook:
    """One build's log entries (E2B's ``BuildLogEntry``: timestamp, level,
    message, step).  Not thread-safe: the caller locks."""

    def __init__(
        self,
        *,
        max_bytes: int = MAX_LOG_BYTES,
        reserve_bytes: int = LOG_RESERVE_BYTES,
        tail_bytes: int = LOG_TAIL_BYTES,
    ):
        self.max_bytes, self.head_bytes, self.tail_bytes = max_bytes, max_bytes - reserve_bytes, tail_bytes
        self.entries: list[dict] = []
        self.bytes = 0
        """What the entries are counted as (see the module docstring)."""
        self._aside: collections.deque[dict] = collections.deque()
        self._aside_bytes = 0
        self._left_lines = 0
        self._left_bytes = 0

    @staticmethod
    def _cost(entry: dict) -> int:
        return len(entry["message"].encode(errors="surrogateescape")) + ENTRY_BYTES

    def add(
        self, message: str, *, level: str = "info", step: str | None = None, output: bool = False, final: bool = False
    ) -> None:
        """Add a line: ``output`` if a command printed it, ``final`` for the build's last."""
        entry = {
            "timestamp": now_iso(),
            "level": level,
            "message": cut_line(message),
            **({"step": step} if step else {}),
        }
        cost = self._cost(entry)
        if output and self.bytes + cost > self.head_bytes:
            self._aside.append(entry)
            self._aside_bytes += cost
            self._left_lines += 1
            self._left_bytes += cost - ENTRY_BYTES
            while self._aside_bytes > self.tail_bytes:
                self._aside_bytes -= self._cost(self._aside.popleft())
            return
        self._flush(step)
        self._append(entry, always=final)

    def _append(self, entry: dict, *, always: bool = False) -> bool:
        cost = self._cost(entry)
        if not always and self.bytes + cost > self.max_bytes:
            return False
        self.entries.append(entry)
        self.bytes += cost
        return True

    def _flush(self, step: str | None) -> None:
        """Append the note of output left out, and the newest lines of it."""
        if not self._left_lines:
            return
        shown = len(self._aside)
        note = {
            "timestamp": now_iso(),
            "level": "warn",
            **({"step": step} if step else {}),
            "message": f"(output past this log's first {self.head_bytes} bytes: {self._left_lines} lines, "
            f"{self._left_bytes} bytes, not kept; the last {shown} lines follow)",
        }
        if self._append(note):
            for entry in self._aside:
                if not self._append(entry):
                    break
        self._aside.clear()
        self._aside_bytes = self._left_lines = self._left_bytes = 0
