"""The harnesses' resource requests as weenv's (shared by the adapters)."""

from __future__ import annotations

from weenv.errors import InvalidInputError

MIB = 1 << 20
GIB = 1 << 30


def ceiling(
    *,
    cpus: float | None = None,
    memory_bytes: int | None = None,
    disk_bytes: int | None = None,
    gpus: int | None = None,
) -> dict | None:
    """A create's ``resources`` (the environment's elastic ceiling) from a
    harness's request; None if it names nothing (the template's own
    resources then).  A request naming some resources overrides the template's
    whole set: the others are weenv's defaults (1 core, 2 GiB, 10 GiB of disk).  Raises :class:`InvalidInputError` for a
    GPU (weenv environments have none) and for values weenv refuses (checked
    by :class:`~weenv.formats.manifest.Resources` at create)."""
    if gpus:
        raise InvalidInputError(f"a GPU was asked ({gpus}): weenv environments have no GPUs")
    out = {
        k: v for k, v in (("cpus", cpus), ("memory_bytes", memory_bytes), ("disk_bytes", disk_bytes)) if v is not None
    }
    return out or None
