"""``weenv bench fork --runtimes runc,crun``, trimmed (one fork of one child, a 1 MB
parent with 10 small files, one repeat, no Docker): one run per OCI runtime, merged into one JSON
whose summary holds each runtime's figures and their ratios."""

from __future__ import annotations

import json

import pytest

from weenv.errors import InvalidInputError
from weenv.node.runtime.runtime import crun_refusal
from weenv_bench.fork import run
from weenv_bench.runtimes import parse_runtimes


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
    out = tmp_path / "fork.json"
    work = tmp_path / "work"
    result = run(
        counts=(1,),
        parent_mb=1,
        small_files=10,
        repeats=1,
        docker=False,
        runtimes=("runc", "crun"),
        work=work,
        json_path=out,
        log=lambda _m: None,
    )

    written = json.loads(out.read_text())
    assert written == json.loads(json.dumps(result))
    s = written["summary"]
    assert set(s["runtimes"]) == {"runc", "crun"} == set(written["by_runtime"])
    for name, figures in s["runtimes"].items():
        assert written["by_runtime"][name]["runtime"] == name  # each run's node used that runtime
        assert 0 < figures["fork_1_s"] < 120 and 0 < figures["reset_s"] < 120
    # the top level is the default runtime's run (crun runs here), the ratios the other's over it
    assert s["runtime"] == "crun" and s["fork_1_s"] == s["runtimes"]["crun"]["fork_1_s"]
    assert set(s["runtime_ratios"]) == {"runc"}
    assert s["runtime_ratios"]["runc"]["fork_1_s"] == round(s["runtimes"]["runc"]["fork_1_s"] / s["fork_1_s"], 3)
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not work.exists() or not any(work.iterdir())
