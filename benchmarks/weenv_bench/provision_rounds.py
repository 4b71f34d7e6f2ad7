"""``weenv bench provision --rounds N``: the benchmark N times, its headline figures as medians.

One run is mostly noise: in a quick run the bootstrap interval of
``p95_slowdown_vs_static`` spans about 0.98-1.77, and density moves in whole
environments.  Each round is a whole run of :func:`weenv_bench.provision.run`
in a fresh home (template built, both modes, their bracketing unloaded runs,
the simulation); the order of the modes alternates (static first in odd
rounds, elastic first in even ones), so that a drift of the machine's load
during a round weighs on both modes alike over the rounds.

The JSON: ``rounds`` (each round's whole result), ``config`` and ``machine``
(the first round's), and ``summary``: the headline keys
(:data:`HEADLINE`: ``density_ratio``, ``p95_slowdown_vs_static``,
``oom_kills`` per mode) as medians over the rounds, ``oom_kills_max`` (the
most of any round, per mode), and ``rounds``: each round's own summary with
its ``order``.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from weenv.errors import InvalidInputError
from weenv_bench import write_report

HEADLINE = ("density_ratio", "p95_slowdown_vs_static", "oom_kills")
"""Summary keys that become medians over the rounds."""
MODES = ("static", "elastic")


def order_of(i: int) -> tuple[str, str]:
    """Round ``i``'s (from 0) order of the modes: static first in every other round."""
    return MODES if i % 2 == 0 else MODES[::-1]


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def combine(rounds: list[dict]) -> dict:
    """The summary of ``rounds`` (each a result of :func:`weenv_bench.provision.run`):
    medians of :data:`HEADLINE` over them (``oom_kills`` per mode, with
    ``oom_kills_max``), and each round's summary under ``rounds``."""
    if not rounds:
        raise InvalidInputError("no round to summarize")
    summaries = [r["summary"] for r in rounds]
    out: dict = {
        "density_ratio": _median([s.get("density_ratio") for s in summaries]),
        "p95_slowdown_vs_static": _median([s.get("p95_slowdown_vs_static") for s in summaries]),
        "oom_kills": {m: _median([s["oom_kills"][m] for s in summaries]) for m in MODES},
        "oom_kills_max": {m: max(s["oom_kills"][m] for s in summaries) for m in MODES},
    }
    out["rounds"] = [
        {"order": r.get("config", {}).get("order", list(order_of(i))), **s}
        for i, (r, s) in enumerate(zip(rounds, summaries))
    ]
    return out


def run_rounds(n: int, *, json_path: Path | None = None, log=print, **kwargs) -> dict:
    """:func:`weenv_bench.provision.run` ``n`` times (``kwargs`` passed on), the
    order of the modes alternating; the result with :func:`combine`'s summary
    (and JSON + the last round's PNG when ``json_path`` is given)."""
    from weenv_bench.provision import plot, run

    if n < 1:
        raise InvalidInputError(f"--rounds {n}: want at least 1")
    rounds = []
    for i in range(n):
        order = order_of(i)
        log(f"round {i + 1} of {n}: {order[0]} first")
        rounds.append(run(order=order, log=log, **kwargs))
    result = {"config": rounds[0]["config"], "machine": rounds[0]["machine"], "rounds": rounds}
    result["summary"] = combine(rounds)
    if json_path is not None:
        write_report(result, json_path, lambda _result, png: plot(rounds[-1], png))
    return result
