"""One benchmark run per OCI runtime (``--runtimes runc,crun``), merged into one result.

The node's runtime is its ``runtime`` setting (:mod:`weenv.node.runtime.runtime`);
a benchmark given several runs itself once per runtime, one after the other
in the same process on the same content, and :func:`side_by_side` merges the
runs: the result is the default runtime's run (the one the setting chooses
here, else the first named; Docker is measured only in that run), its
``summary`` keeps its keys and adds ``runtime`` (its name), ``runtimes``
(runtime name -> the figures that tell runtimes apart) and
``runtime_ratios`` (each other runtime's figures over the default's: below 1
is faster), and ``by_runtime`` holds every run's own summary.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from weenv.errors import InvalidInputError, ToolMissingError

NAMES = ("runc", "crun")
"""The runtimes a benchmark can be asked to run with."""


def parse_runtimes(value: str | None) -> tuple[str, ...] | None:
    """``"runc,crun"`` -> ``("runc", "crun")``; None or empty -> None (the
    node's setting).  Raises :class:`InvalidInputError` on an unknown or
    repeated name."""
    if not value or not value.strip():
        return None
    names = tuple(n.strip() for n in value.split(",") if n.strip())
    unknown = [n for n in names if n not in NAMES]
    if unknown:
        raise InvalidInputError(
            f"--runtimes: unknown runtime {unknown[0]!r}; want a comma-separated list of {', '.join(NAMES)}"
        )
    if len(set(names)) != len(names):
        raise InvalidInputError(f"--runtimes: {value!r} names a runtime twice")
    return names


def default_first(names: Sequence[str]) -> tuple[str, ...]:
    """``names`` with the runtime the node's setting chooses here first (when named)."""
    from weenv.node.runtime.runtime import choose_runtime, runtime_setting

    try:
        default, _why = choose_runtime(runtime_setting())
    except ToolMissingError:  # the setting asks for crun and crun cannot run: keep the order given
        return tuple(names)
    return tuple(sorted(names, key=lambda n: n != default))


def side_by_side(names: Sequence[str], run_one: Callable[[str, bool], dict], figures: Callable[[dict], dict]) -> dict:
    """Run ``run_one(runtime, first)`` for every runtime in ``names`` (the
    default one first, :func:`default_first`; ``first`` is True for it) and
    merge the results as this module says; ``figures(result)`` picks a run's
    comparable figures (name -> number or None)."""
    order = default_first(names)
    results = {name: run_one(name, i == 0) for i, name in enumerate(order)}
    return merge_runs(order, results, figures, "runtime", "runtimes")


def merge_runs(
    order: Sequence[str], results: dict[str, dict], figures: Callable[[dict], dict], label: str, plural: str
) -> dict:
    """The run of ``order[0]`` (``results``: name -> one run's result), its
    summary given ``label`` (that name), ``plural`` (name -> ``figures`` of
    that run), ``<label>_ratios`` (each other run's figures over the first's)
    and the result ``by_<label>`` (name -> that run's summary)."""
    merged = results[order[0]]
    per = {name: figures(results[name]) for name in order}
    base = per[order[0]]
    merged["summary"][label] = order[0]
    merged["summary"][plural] = per
    merged["summary"][f"{label}_ratios"] = {
        name: {k: round(v / base[k], 3) if v is not None and base.get(k) else None for k, v in per[name].items()}
        for name in order[1:]
    }
    merged[f"by_{label}"] = {name: results[name]["summary"] for name in order}
    return merged
