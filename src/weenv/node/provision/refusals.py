"""What a refusal of admission says: the objective that refused, and the
environments holding the room it counts, most first, so that a refused
create can be understood (and a wrong profile found) from its error alone."""

from __future__ import annotations

OBJECTIVES = {
    "disk": "the disk limits",
    "shortage": "the memory shortage",
    "cpu": "the CPU reservations (cores x WEENV_CPU_OVERCOMMIT)",
    "peak": "the predicted CPU peak (WEENV_ADMISSION=peak)",
    "burst": "the latency objective (WEENV_ADMISSION=burst)",
    "memory": "the memory limits",
    "host": "the host's available memory",
}
"""Each objective :func:`~weenv.node.provision.arbiter.admits` checks, as a refusal names it."""
NAMED = 3
"""Holders a refusal names; the others are counted."""


def held_by(objective: str, rows: list[tuple[float, str]]) -> str:
    """``rows`` (amount held, description) as the refusal's last clause: the
    :data:`NAMED` largest holders, then how many others hold any."""
    rows = sorted((r for r in rows if r[0] > 0), key=lambda r: -r[0])
    if not rows:
        return "no environment holds any of it" if objective != "host" else "the host's other processes hold it"
    named = ", ".join(text for _amount, text in rows[:NAMED])
    more = f" and {len(rows) - NAMED} more" if len(rows) > NAMED else ""
    return f"held by {named}{more}"
