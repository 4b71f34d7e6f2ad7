"""The rollout benchmark's figures: one table row per system, the comparison of
rewards, a text table and the PNG (stacked bars of where rollout time goes).

**Environment share** (``env_share``): over all rollouts of the iteration, the
environment's time (create + setup + destroy + exec overhead, see
:mod:`weenv_bench.rollout.systems`) over the rollouts' wall time (create
request to destroy return), i.e. the fraction of the rollout workers' time the
environment took; ``env_share_of_iteration`` divides the same sum by the
iteration's wall time times its concurrency (workers idle at the batch's tail
count against it).  Percentiles are nearest-rank.
"""

from __future__ import annotations

import math
from pathlib import Path

from weenv_bench.rollout.iteration import IterationResult

PHASES = (
    ("create_s", "create", "#c44"),
    ("setup_s", "task setup", "#e7c"),
    ("exec_overhead_s", "exec overhead", "#e93"),
    ("destroy_s", "destroy", "#a5c"),
    ("command_s", "commands (incl. reward)", "#27a"),
    ("think_s", "model think time", "#bbb"),
)
"""Parts of a rollout's wall time, as drawn (bottom first)."""


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile ``q`` in (0, 1] of ``values`` (None if empty)."""
    if not values:
        return None
    values = sorted(values)
    return values[max(0, min(len(values), math.ceil(q * len(values))) - 1)]


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(x, nd)


def system_row(it: IterationResult) -> dict:
    """The table row of one system's iteration."""
    ok = [r for r in it.rollouts if r.error is None]
    env = sum(r.env_s for r in it.rollouts)
    wall = sum(r.wall_s for r in it.rollouts)
    overheads = [s.overhead_s for r in it.rollouts for s in r.steps + ([r.reward_step] if r.reward_step else [])]
    firsts = [r.first_step_s for r in it.rollouts if r.first_step_s is not None]
    creates = [r.create_s for r in ok]
    destroys = [r.destroy_s for r in ok]
    setups = [r.setup_s for r in ok]
    parts = {key: round(sum(getattr(r, key) for r in it.rollouts), 3) for key, _, _ in PHASES}
    other = wall - sum(parts.values())
    return {
        "system": it.system,
        "rollouts": len(it.rollouts),
        "failed": len(it.rollouts) - len(ok),
        "concurrency": it.concurrency,
        "iteration_wall_s": round(it.wall_s, 3),
        "env_share": _r(env / wall if wall else None),
        "env_share_of_iteration": _r(env / (it.wall_s * it.concurrency) if it.wall_s else None),
        "env_s": round(env, 3),
        "rollout_wall_s": round(wall, 3),
        "time_s": {**parts, "other_s": round(max(0.0, other), 3)},
        "create_p50_s": _r(percentile(creates, 0.5)),
        "create_p99_s": _r(percentile(creates, 0.99)),
        "setup_p50_s": _r(percentile(setups, 0.5)),
        "setup_p99_s": _r(percentile(setups, 0.99)),
        "first_step_p50_s": _r(percentile(firsts, 0.5)),
        "first_step_p99_s": _r(percentile(firsts, 0.99)),
        "exec_overhead_p50_s": _r(percentile(overheads, 0.5)),
        "exec_overhead_p99_s": _r(percentile(overheads, 0.99)),
        "destroy_p50_s": _r(percentile(destroys, 0.5)),
        "destroy_p99_s": _r(percentile(destroys, 0.99)),
        "steps": len(overheads),
        "reward_mean": _r(sum(r.reward or 0 for r in ok) / len(ok) if ok else None),
        "bytes_fetched": it.bytes_fetched,
        "daemon_peak_bytes": it.daemon_peak_bytes,
        "loadavg": it.loadavg,
    }


def rewards(iterations: list[IterationResult]) -> dict:
    """Rewards per rollout on each system; whether they match between systems
    and whether each equals the expected one (1 for the right patch, else 0)."""
    by_key: dict[tuple[str, int], dict] = {}
    for it in iterations:
        for r in it.rollouts:
            entry = by_key.setdefault(
                (r.task, r.rollout),
                {"task": r.task, "rollout": r.rollout, "patch": r.patch, "expected": r.expected_reward},
            )
            entry[it.system] = r.reward
    rows = list(by_key.values())
    systems = [it.system for it in iterations]
    match = all(all(row.get(s) is not None for s in systems) and len({row[s] for s in systems}) == 1 for row in rows)
    correct = all(row.get(s) == row["expected"] for row in rows for s in systems)
    return {"rewards_match": match, "rewards_correct": correct, "per_rollout": rows}


def text_table(rows: list[dict]) -> str:
    """The main figures of each system, as aligned text."""
    lines = [
        ("rollouts (failed)", lambda r: f"{r['rollouts']} ({r['failed']})"),
        ("iteration wall", lambda r: f"{r['iteration_wall_s']:.1f} s"),
        ("env share", lambda r: _pct(r["env_share"])),
        ("env share of iteration", lambda r: _pct(r["env_share_of_iteration"])),
        ("create p50 / p99", lambda r: f"{_s(r['create_p50_s'])} / {_s(r['create_p99_s'])}"),
        *(
            [
                ("setup p50 / p99", lambda r: f"{_s(r['setup_p50_s'])} / {_s(r['setup_p99_s'])}"),
                ("setup paid per rollout", lambda r: _s(r.get("setup_s_per_rollout"))),
            ]
            if any("setup_s_per_rollout" in r for r in rows)
            else []
        ),
        ("first step p50 / p99", lambda r: f"{_s(r['first_step_p50_s'])} / {_s(r['first_step_p99_s'])}"),
        ("exec overhead p50 / p99", lambda r: f"{_s(r['exec_overhead_p50_s'])} / {_s(r['exec_overhead_p99_s'])}"),
        ("destroy p50 / p99", lambda r: f"{_s(r['destroy_p50_s'])} / {_s(r['destroy_p99_s'])}"),
        ("reward mean", lambda r: f"{r['reward_mean']}"),
        ("bytes fetched", lambda r: f"{r['bytes_fetched'] / 1e6:.1f} MB"),
        ("daemon peak memory", lambda r: f"{r['daemon_peak_bytes'] / 2**20:.0f} MiB"),
    ]
    width = max(len(name) for name, _ in lines)
    out = [" " * width + "".join(f"  {r.get('label', r['system']):>18}" for r in rows)]
    for name, fn in lines:
        out.append(f"{name:<{width}}" + "".join(f"  {fn(r):>18}" for r in rows))
    return "\n".join(out)


def _label(r: dict) -> str:
    """A bar's name: the system's label, and its iteration when there are several."""
    return r.get("label", r["system"]) + (f"\n#{r['iteration']}" if "iteration" in r else "")


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.2f}%"


def _s(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x * 1000:.0f} ms" if x < 1 else f"{x:.2f} s"


def plot(result: dict, png: Path) -> None:
    """Stacked bars per system: the share of rollout time in each phase
    (:data:`PHASES`), the environment share written above each bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["table"]
    fig, ax = plt.subplots(figsize=(max(8.5, 3.5 + 1.1 * len(rows)), 4.5))
    xs = range(len(rows))
    bottoms = [0.0] * len(rows)
    for key, label, color in PHASES:
        values = [r["time_s"][key] / r["rollout_wall_s"] * 100 if r["rollout_wall_s"] else 0 for r in rows]
        ax.bar(xs, values, 0.55, bottom=bottoms, label=label, color=color)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    for x, r, b in zip(xs, rows, bottoms):
        ax.annotate(f"env {_pct(r['env_share'])}", (x, b), ha="center", va="bottom", fontsize=9)
    ax.set_xticks(list(xs), [_label(r) for r in rows], fontsize=8)
    ax.set_ylabel("% of rollout time")
    ax.set_ylim(0, 110)
    s = result["summary"]
    ax.set_title(
        f"rollout stage: {s['rollouts']} rollouts ({s['tasks']} tasks x G={s['group']}), "
        f"concurrency {s['concurrency']}, think x{s['think_scale']:g}",
        fontsize=9,
    )
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
