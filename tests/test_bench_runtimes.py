"""``weenv bench fork --runtimes runc,crun`` and ``--userns off,on``, trimmed (one fork
of one child, a 1 MB parent with 10 small files, one repeat, no Docker): one run per OCI
runtime or user-namespace mode, merged into one JSON whose summary holds each one's
figures and their ratios."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from weenv.errors import InvalidInputError
from weenv.node.runtime.runtime import crun_refusal
from weenv_bench.fork import run
from weenv_bench.runtimes import parse_runtimes
from weenv_bench.userns_modes import parse_userns, userns_setting


def trimmed_fork(tmp_path: Path, **kw) -> tuple[dict, Path]:
    """The trimmed fork benchmark run with ``kw``: its JSON as written (checked to be
    the result returned, a PNG beside it) and its work directory."""
    out, work = tmp_path / "fork.json", tmp_path / "work"
    result = run(
        counts=(1,),
        parent_mb=1,
        small_files=10,
        repeats=1,
        docker=False,
        work=work,
        json_path=out,
        log=lambda _m: None,
        **kw,
    )
    written = json.loads(out.read_text())
    assert written == json.loads(json.dumps(result))
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return written, work


@pytest.mark.unit
def test_runtimes_option_is_checked():
    assert parse_runtimes("runc, crun") == ("runc", "crun") and parse_runtimes("") is None
    with pytest.raises(InvalidInputError, match="unknown runtime 'kata'"):
        parse_runtimes("runc,kata")
    with pytest.raises(InvalidInputError, match="twice"):
        parse_runtimes("crun,crun")


def test_fork_benchmark_runs_each_runtime_side_by_side(paths, leak_check, tmp_path):
    if (why := crun_refusal()) is not None:
        pytest.skip(f"crun cannot run here: {why}")
    written, work = trimmed_fork(tmp_path, runtimes=("runc", "crun"))
    s = written["summary"]
    assert set(s["runtimes"]) == {"runc", "crun"} == set(written["by_runtime"])
    for name, figures in s["runtimes"].items():
        assert written["by_runtime"][name]["runtime"] == name  # each run's node used that runtime
        assert 0 < figures["fork_1_s"] < 120 and 0 < figures["reset_s"] < 120
    # the top level is the default runtime's run (crun runs here), the ratios the other's over it
    assert s["runtime"] == "crun" and s["fork_1_s"] == s["runtimes"]["crun"]["fork_1_s"]
    assert set(s["runtime_ratios"]) == {"runc"}
    assert s["runtime_ratios"]["runc"]["fork_1_s"] == round(s["runtimes"]["runc"]["fork_1_s"] / s["fork_1_s"], 3)
    assert not work.exists() or not any(work.iterdir())


@pytest.mark.unit
def test_userns_option_is_checked_and_the_setting_put_back(monkeypatch):
    assert parse_userns("off, on") == ("off", "on") and parse_userns(" ") is None
    with pytest.raises(InvalidInputError, match="unknown mode 'maybe'"):
        parse_userns("off,maybe")
    with pytest.raises(InvalidInputError, match="twice"):
        parse_userns("on,on")
    monkeypatch.delenv("WEENV_USERNS", raising=False)
    with userns_setting("off"):
        assert os.environ["WEENV_USERNS"] == "off"
    assert "WEENV_USERNS" not in os.environ


def test_fork_benchmark_runs_each_userns_mode_side_by_side(paths, leak_check, tmp_path):
    written, work = trimmed_fork(tmp_path, userns=("off", "on"))
    s = written["summary"]
    assert set(s["userns_modes"]) == {"off", "on"} == set(written["by_userns"])
    for mode, figures in s["userns_modes"].items():
        assert written["by_userns"][mode]["userns_on"] is (mode == "on")  # each run's node was in that mode
        assert 0 < figures["fork_1_s"] < 120 and 0 < figures["reset_s"] < 120
    # the top level is the first mode's run, the ratios the other's over it
    assert s["userns"] == "off" and s["fork_1_s"] == s["userns_modes"]["off"]["fork_1_s"]
    assert set(s["userns_ratios"]) == {"on"}
    assert s["userns_ratios"]["on"]["fork_1_s"] == round(s["userns_modes"]["on"]["fork_1_s"] / s["fork_1_s"], 3)
    assert not work.exists() or not any(work.iterdir())
