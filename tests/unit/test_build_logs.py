"""A build's log bounded in bytes (:mod:`weenv.server.e2b.buildlog`) and a step's
output cut into bounded lines as it is read (``weenv.build.stepbuild._Lines``)."""

from __future__ import annotations

import json

from weenv.build.stepbuild import MAX_LINE_BYTES, _Lines
from weenv.server.e2b.buildlog import BuildLogBook


def test_output_lines_are_cut_as_they_are_read():
    said: list[str] = []
    lines = _Lines(said.append)
    for _ in range(1024):  # one 64 MiB line, no newline until the end
        lines.feed(b"a" * (64 << 10))
    lines.feed(b"\nshort\r\nlast without newline")
    lines.close()
    assert said[0] == "a" * MAX_LINE_BYTES + f" … [{(64 << 20) - MAX_LINE_BYTES} bytes cut]"
    assert said[1:] == ["short", "last without newline"] and lines.tail == said
    assert len(lines._line) == 0


def _size(book: BuildLogBook) -> int:
    return len(json.dumps(book.entries))


def test_a_log_keeps_its_first_and_last_bytes_and_never_moves_an_entry():
    book = BuildLogBook(max_bytes=200_000, reserve_bytes=50_000, tail_bytes=10_000)
    book.add("[builder 1/2] RUN spam", step="1")
    seen = []
    for i in range(100_000):  # 100,000 lines of ~1 KB: 100 MB printed
        book.add(f"{i:06d} " + "x" * 1000, step="1", output=True)
        if i == 100:
            seen = list(book.entries)
    book.add("[builder 1/2] RUN spam: done in 3 s", step="1")
    for _ in range(100_000):
        book.add("y" * 100_000, step="2", output=True)  # a 100 KB line, 100,000 times: 10 GB printed
    book.add("step 2 exited 1", level="error", step="2", final=True)
    assert book.bytes <= 200_000 + 4096 + 200 and _size(book) < 220_000, book.bytes
    assert book.entries[: len(seen)] == seen  # append-only: the SDK's logsOffset stays valid
    messages = [e["message"] for e in book.entries]
    assert messages[0] == "[builder 1/2] RUN spam" and messages[1].startswith("000000 ")
    done = messages.index("[builder 1/2] RUN spam: done in 3 s")
    assert messages[done - 1].startswith("099999 ")  # the last lines before the step's end are there
    note = messages[done - 10]
    assert note.startswith("(output past this log's first 150000 bytes:") and "the last 9 lines follow" in note
    assert messages[-1] == "step 2 exited 1"
    assert messages[-2].startswith("y" * MAX_LINE_BYTES + " … [")  # the newest output before the error
    assert all(len(m.encode()) <= MAX_LINE_BYTES + 40 for m in messages)
