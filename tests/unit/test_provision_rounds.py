"""``weenv bench provision --rounds N``: how the rounds' results become one summary
(the rounds themselves are whole runs of the benchmark: ``tests/test_bench_provision.py``
runs one)."""

from __future__ import annotations

import pytest

from weenv.errors import InvalidInputError
from weenv_bench.provision_rounds import combine, order_of


def one_round(i: int, density, slowdown, oom_static=0, oom_elastic=0) -> dict:
    return {
        "config": {"order": list(order_of(i))},
        "summary": {
            "density_ratio": density,
            "p95_slowdown_vs_static": slowdown,
            "oom_kills": {"static": oom_static, "elastic": oom_elastic},
            "static_envs": 2,
        },
    }


def test_the_headline_keys_are_medians_and_each_round_is_kept_with_its_order():
    assert [order_of(i) for i in range(3)] == [("static", "elastic"), ("elastic", "static"), ("static", "elastic")]
    rounds = [one_round(0, 2.0, 1.30), one_round(1, 1.5, 0.98, oom_elastic=2), one_round(2, 2.5, 1.02)]
    s = combine(rounds)
    assert s["density_ratio"] == 2.0 and s["p95_slowdown_vs_static"] == 1.02
    assert s["oom_kills"] == {"static": 0, "elastic": 0} and s["oom_kills_max"] == {"static": 0, "elastic": 2}
    assert [r["order"] for r in s["rounds"]] == [["static", "elastic"], ["elastic", "static"], ["static", "elastic"]]
    assert s["rounds"][1]["density_ratio"] == 1.5 and s["rounds"][1]["static_envs"] == 2
    # an even count: the mean of the middle two; a round without a ratio (a mode held none) is left out
    s = combine([one_round(0, 2.0, None), one_round(1, 3.0, 1.1)])
    assert s["density_ratio"] == 2.5 and s["p95_slowdown_vs_static"] == 1.1
    assert combine([one_round(0, None, None)])["density_ratio"] is None
    with pytest.raises(InvalidInputError, match="no round"):
        combine([])
