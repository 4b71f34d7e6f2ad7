"""Progress of long work in both forms: plain lines (not a terminal) and rich
bars (a terminal), from the same calls."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from weenv.cli.progress import BarProgress, LineProgress, shown
from weenv.progress import QUIET, Progress


def _console(terminal: bool) -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=terminal, width=120, color_system="standard" if terminal else None), out


def _work(p: Progress) -> None:
    p.start("layers", total=3)
    p.start("bytes", total=4000, unit="B")
    for i in range(3):
        p.advance("bytes", 1000)
        p.advance("layers", status=f"layer {i}: 10 entries")
    p.advance("bytes", 1000)
    p.say("a line of its own")
    p.finish("layers")
    p.finish("bytes")


def test_lines_say_each_status_each_quarter_of_bytes_and_each_end():
    console, out = _console(terminal=False)
    with shown(console) as p:
        assert isinstance(p, LineProgress)
        _work(p)
    assert out.getvalue().splitlines() == [
        "layers 0/3",
        "bytes 0 B of 3.9 KiB",
        "bytes 25% (1000 B of 3.9 KiB)",
        "layers 1/3: layer 0: 10 entries",
        "bytes 50% (2.0 KiB of 3.9 KiB)",
        "layers 2/3: layer 1: 10 entries",
        "bytes 75% (2.9 KiB of 3.9 KiB)",
        "layers 3/3: layer 2: 10 entries",
        "a line of its own",
        "layers 3/3: done",
        "bytes 3.9 KiB of 3.9 KiB: done",
    ]


def test_bars_on_a_terminal_show_counts_bytes_and_the_last_status():
    console, out = _console(terminal=True)
    with shown(console) as p:
        assert isinstance(p, BarProgress)
        _work(p)
    text = out.getvalue()
    assert "\x1b[" in text and "━" in text
    assert "3/3" in text and "4.0/4.0 kB" in text and "done" in text
    assert "a line of its own" in text
    assert "layers 1/3:" not in text  # no plain lines on a terminal


@pytest.mark.parametrize("terminal", [False, True])
def test_a_failure_marks_the_unfinished_tasks_and_raises(terminal):
    console, out = _console(terminal)
    with pytest.raises(RuntimeError, match="broke"), shown(console) as p:
        p.start("groups", total=2)
        p.advance("groups", status="g.0 published")
        p.finish("groups", status="failed", failed=True)
        raise RuntimeError("broke")
    text = out.getvalue()
    assert "failed" in text and "2/2" not in text


def test_the_quiet_default_and_a_collector():
    QUIET.start("x", total=1, status="s")
    QUIET.finish("x")
    said: list[str] = []
    p = Progress(said.append)
    p.start("groups", total=2, status="planned")
    p.advance("groups", status="g.0 published")
    p.advance("groups")
    p.finish("groups")
    assert said == ["groups: planned", "groups: g.0 published", "groups: done"]
