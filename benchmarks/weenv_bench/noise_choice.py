"""``python -m weenv_bench.noise_choice RUN.json ... [--held-out RUN.json ...]``:
which noise the calibration (:func:`weenv_bench.simulate.calibrate`)
composes with the model's slowdowns, chosen leave-one-out on recorded runs
of ``weenv bench provision``.

Each candidate is a way to draw the noise of a burst that had its core from
a run's own measurements (none sees the elastic mode's bursts); the
fallbacks (fewer than :data:`~weenv_bench.simulate.MIN_QUIET_BURSTS` quiet
static bursts: the unloaded runs; no background recorded: all the static
bursts) are the same for all.  For each run left out in turn, the candidate
with the smallest errors of the predicted p95 on the others (the worst
first, then the next) is chosen and scored on the one left out; runs given
with ``--held-out`` are scored only.  Candidates tied on every run are
ordered as :data:`CANDIDATES` lists them (the first: the one
:func:`~weenv_bench.simulate.calibrate` uses)."""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path
from statistics import NormalDist

from weenv.formats.manifest import Resources
from weenv.node.provision import ProvisionConfig
from weenv_bench.provision import elastic_config
from weenv_bench.simulate import (
    GIB,
    MIN_QUIET_BURSTS,
    compare,
    parse_background,
    parse_traces,
    quiet_static_bursts,
    unloaded_spread,
    with_noise,
    workload_noise,
)

POINTS = 200
"""Quantiles drawn from a fitted lognormal."""


def lognormal(values: list[float], *, robust: bool, points: int = POINTS) -> list[float]:
    """``points`` evenly spaced quantiles of a lognormal fitted to ``values``:
    by the mean and standard deviation of their logarithms, or (``robust``)
    by their median and interquartile range."""
    logs = [math.log(v) for v in values]
    if robust:
        q1, _, q3 = statistics.quantiles(logs, n=4, method="inclusive")
        mu, sigma = statistics.median(logs), (q3 - q1) / 1.349
    else:
        mu, sigma = statistics.fmean(logs), statistics.pstdev(logs)
    return [math.exp(mu + sigma * NormalDist().inv_cdf((j + 0.5) / points)) for j in range(points)]


def per_kind(bursts: list[dict], *, robust: bool) -> list[float]:
    """A lognormal per kind of burst (each kind's quantiles, kinds weighing
    alike as each environment cycles through them); a kind with fewer than 3
    bursts is fitted on all of them."""
    kinds: dict[str, list[float]] = {}
    for b in bursts:
        kinds.setdefault(b["kind"], []).append(b["slowdown"])
    everything = [b["slowdown"] for b in bursts]
    return [x for xs in kinds.values() for x in lognormal(xs if len(xs) >= 3 else everything, robust=robust)]


CANDIDATES = (
    "quiet static, first runs weighted",
    "quiet static",
    "unloaded runs",
    "pooled",
    "lognormal",
    "lognormal robust",
    "lognormal per kind",
    "lognormal per kind robust",
)


def candidates(
    run: dict, sim: dict, cores: float, *, background: bool
) -> dict[str, tuple[list[float], list[int] | None]]:
    """Each candidate's noise (values, weights or None) for ``run``, whose
    simulation is ``sim`` (:func:`~weenv_bench.simulate.compare`);
    ``background``: the elastic mode's was recorded."""
    if not background:
        return dict.fromkeys(CANDIDATES, ([b["slowdown"] for b in run["static"].get("bursts", [])], None))
    unloaded = unloaded_spread(run, cold=True)
    quiet = quiet_static_bursts(run, cores)
    if len(quiet) < MIN_QUIET_BURSTS:
        return dict.fromkeys(CANDIDATES, (unloaded, None))
    q = [b["slowdown"] for b in quiet]
    return {
        "quiet static, first runs weighted": workload_noise(
            run, cores, envs=sim["elastic"]["envs"], bursts=sim["elastic"]["bursts"]
        ),
        "quiet static": (q, None),
        "unloaded runs": (unloaded, None),
        "pooled": (unloaded + q, None),
        "lognormal": (lognormal(q, robust=False), None),
        "lognormal robust": (lognormal(q, robust=True), None),
        "lognormal per kind": (per_kind(quiet, robust=False), None),
        "lognormal per kind robust": (per_kind(quiet, robust=True), None),
    }


def errors(run: dict) -> dict[str, float]:
    """Each candidate's relative error of the predicted elastic p95 on ``run``
    (a recorded run's JSON, as ``weenv bench provision --simulate`` reads it)."""
    cfg, cores = run["config"], float(run["machine"]["cpus"])
    background = {m: parse_background(run[m].get("background"), cores) for m in ("static", "elastic")}
    sim = compare(
        parse_traces(run["static"]["traces"]),
        cores=cores,
        memory=max(GIB, run["machine"]["memory_bytes"] - ProvisionConfig().memory_reserve),
        elastic=elastic_config(cfg),
        declared=Resources(**cfg["declared"]),
        max_envs=cfg["max_envs"],
        duration_s=cfg["duration_s"],
        background=background,
    )
    real = run["elastic"]["p95_burst_slowdown"]
    noises = candidates(run, sim, cores, background=bool(background["elastic"]))
    return {c: abs(with_noise(sim["_slowdowns"], noise, weights) / real - 1) for c, (noise, weights) in noises.items()}


def choose(table: dict[str, dict[str, float]], runs: list[str]) -> str:
    """The candidate whose errors on ``runs``, the worst first, are smallest."""

    def key(c: str):
        return sorted((round(table[r][c], 6) for r in runs), reverse=True), CANDIDATES.index(c)

    return min(CANDIDATES, key=key)


def leave_one_out(table: dict[str, dict[str, float]], runs: list[str]) -> dict[str, tuple[str, float]]:
    """For each of ``runs``: the candidate chosen on the others, and its error on it."""
    out = {}
    for r in runs:
        c = choose(table, [o for o in runs if o != r])
        out[r] = (c, table[r][c])
    return out


def main(argv: list[str]) -> None:
    held = argv.index("--held-out") if "--held-out" in argv else len(argv)
    paths, held_out = argv[:held], argv[held + 1 :]
    table = {Path(p).stem: errors(json.loads(Path(p).read_text())) for p in paths + held_out}
    names = list(table)
    widths = [max(7, len(n)) + 2 for n in names]
    print(f"{'p95 error':34s}" + "".join(f"{n:>{w}s}" for n, w in zip(names, widths)))
    for c in CANDIDATES:
        print(f"{c:34s}" + "".join(f"{table[n][c]:{w}.3f}" for n, w in zip(names, widths)))
    train = [Path(p).stem for p in paths]
    for r, (c, e) in leave_one_out(table, train).items():
        print(f"left out {r}: chosen {c!r}, its error there {e:.3f}")
    best = choose(table, train)
    print(
        f"chosen on all {len(train)}: {best!r}"
        + "".join(f"; {Path(p).stem} {table[Path(p).stem][best]:.3f}" for p in held_out)
    )


if __name__ == "__main__":
    main(sys.argv[1:])
