"""Outliers: environments whose usage says little of how their template runs.

A fork bomb, a memory bomb or a loop that never ends is what one environment
did, not what the next environment of its template will do.  Learned as any
other, one of them taught its template a duty cycle near 1 (busy at its
ceiling all the time), and burst admission then refused plain creates of that
template on an idle node.  :func:`outlier_reason` names what makes an ending
environment an outlier; its template's usage profile then weighs it at most
:data:`~weenv.node.provision.profiles.OUTLIER_SHARE`
(:meth:`~weenv.node.provision.profiles.TemplateProfiles.record`).
"""

from __future__ import annotations

import math

from weenv.node.provision.profiles import BUSY_SHARE

RUNAWAY_SHARE = 0.8
"""An environment busy in at least this share of its passes after start-up, and
still busy in its last one, ran away (it was killed busy: a loop, a bomb)."""


def outlier_reason(
    cpu: list[float],
    cpu_ceiling: float,
    interval_s: float,
    *,
    oom_kills: int = 0,
    pids_refused: int = 0,
    startup_s: float = 0.0,
) -> str | None:
    """Why an environment that ends now is an outlier, or None if it is not:
    processes of it were OOM-killed (``oom_kills``), forks were refused at its
    pids limit (``pids_refused``), or it ran away (busy, above
    :data:`~weenv.node.provision.profiles.BUSY_SHARE` of ``cpu_ceiling``, in
    :data:`RUNAWAY_SHARE` of its per-pass ``cpu`` samples after its first
    ``startup_s`` seconds and in the last one)."""
    if oom_kills > 0:
        return f"{oom_kills} process(es) OOM-killed"
    if pids_refused > 0:
        return f"{pids_refused} fork(s) refused at its pids limit"
    after = cpu[math.ceil(startup_s / interval_s - 1e-9) :]
    busy = [x > BUSY_SHARE * cpu_ceiling for x in after]
    if busy and busy[-1] and sum(busy) >= RUNAWAY_SHARE * len(busy):
        return f"busy {sum(busy) / len(busy):.0%} of the time until it ended (a runaway)"
    return None
