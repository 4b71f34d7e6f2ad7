"""One benchmark run per user-namespace mode (``--userns off,on``), merged into one result.

The node's mode is its ``WEENV_USERNS`` setting (:mod:`weenv.node.runtime.idmap`):
``on`` (the default) gives every environment a user namespace of its own
(Docker's capabilities, a host id range, idmapped lowers, owners shifted into
each child's range at fork and reset), ``off`` only templates with
``runtime.sudo``.  A benchmark given several modes runs itself once per mode,
in the order named, one after the other in the same process on the same
content, with the setting set for that run only, and
:func:`weenv_bench.runtimes.merge_runs` merges the runs: the result is the
first mode's run (Docker is measured only in it), its ``summary`` keeps its
keys and adds ``userns`` (that mode), ``userns_modes`` (mode -> the figures
that tell modes apart), ``userns_ratios`` (each other mode's figures over the
first's: above 1 is slower) and ``by_userns`` holds every run's own summary.
Each run's summary says whether its node did put every environment in a
user namespace (``userns_on``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence

from weenv.errors import InvalidInputError
from weenv.node.runtime.idmap import USERNS_ENV
from weenv_bench.runtimes import merge_runs, side_by_side

MODES = ("off", "on")
"""The modes a benchmark can be asked to run in."""


def parse_userns(value: str | None) -> tuple[str, ...] | None:
    """``"off,on"`` -> ``("off", "on")``; None or empty -> None (the node's
    setting).  Raises :class:`InvalidInputError` on an unknown or repeated mode."""
    if not value or not value.strip():
        return None
    modes = tuple(m.strip() for m in value.split(",") if m.strip())
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise InvalidInputError(f"--userns: unknown mode {unknown[0]!r}; want a comma-separated list of off, on")
    if len(set(modes)) != len(modes):
        raise InvalidInputError(f"--userns: {value!r} names a mode twice")
    return modes


@contextlib.contextmanager
def userns_setting(mode: str) -> Iterator[None]:
    """The node setting :data:`USERNS_ENV` set to ``mode`` for the block (then as it was)."""
    saved = os.environ.get(USERNS_ENV)
    os.environ[USERNS_ENV] = mode
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(USERNS_ENV, None)
        else:
            os.environ[USERNS_ENV] = saved


def each_mode(modes: Sequence[str], run_one: Callable[[str, bool], dict], figures: Callable[[dict], dict]) -> dict:
    """Run ``run_one(mode, first)`` for every mode in ``modes``, in order, with
    the setting set to it (``first`` is True for the first), and merge the
    results as this module says; ``figures(result)`` picks a run's comparable figures."""
    results = {}
    for i, mode in enumerate(modes):
        with userns_setting(mode):
            results[mode] = run_one(mode, i == 0)
    return merge_runs(modes, results, figures, "userns", "userns_modes")


def modes_and_runtimes(
    userns: Sequence[str] | None,
    runtimes: Sequence[str] | None,
    runtime: str | None,
    again: Callable[..., dict],
    figures: Callable[[dict], dict],
) -> dict:
    """A benchmark's run once per mode in ``userns`` (each of them once per runtime
    in ``runtimes`` if any, else with ``runtime``), or else once per runtime in
    ``runtimes``, merged.  ``again(label, sub, first, **kw)`` runs the benchmark
    once with keyword arguments ``kw`` (``runtimes``, ``runtime``) in its work
    directory's ``sub``, logging ``label``; ``first`` for the first run."""
    if userns:
        kw = {"runtimes": runtimes, "runtime": runtime}
        return each_mode(userns, lambda m, first: again(f"userns {m}", f"userns-{m}", first, **kw), figures)
    return side_by_side(runtimes, lambda n, first: again(f"runtime {n}", n, first, runtime=n), figures)
