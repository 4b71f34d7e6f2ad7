"""The per-component build cache: cache keys and their index in the store.

A component's **cache key** is the sha256 of the canonical JSON of:

- the builder's format number (:data:`BUILD_FORMAT`; bumped when a build of
  the same inputs would give another tree);
- the component's name and version (they fix the group image's UUID);
- each step's settings and inputs: a ``from_dir`` or ``copy`` source by its
  :func:`~weenv.packaging.treedigest.tree_digest` (contents, modes, owners,
  xattrs, links; not its host path or mtimes), a ``pip`` step's requirements
  file by its content, the pip version that installs them; a ``run`` step's
  commands, env and working dir (not its timeout);
- the digests of the groups below, bottom to top, **unless** the component is
  ``independent`` or has no ``run``/``pip`` step (then it never sees them:
  its tree is made on its own).

The **index** is one store ref per key, ``buildcache/<hex key>`` -> group
manifest digest.  A hit counts only if the group manifest and all its chunks are
still in the store (``weenv gc`` may have removed them); the ref is removed by
gc with the group.  Unpinned inputs (``apt-get install foo``, ``idna>=3``) are
keyed by their text, not by what they resolved to, as in Docker's build cache.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

from weenv.config import Paths
from weenv.errors import InvalidInputError, NotFoundError, WeenvError
from weenv.packaging.group import load_group
from weenv.packaging.recipe import (
    Component,
    Copy,
    Debootstrap,
    FromDir,
    Pip,
    Recipe,
    Run,
)
from weenv.packaging.treedigest import file_sha256, tree_digest
from weenv.store.base import Store

BUILD_FORMAT = 1
PIP_VERSION = "24.3.1"
"""The pip that ``pip`` steps run inside build environments (supports Python >= 3.8)."""
REF_KIND = "buildcache"


def _source(recipe: Recipe, relative: str, *, want_dir: bool) -> Path:
    path = recipe.path(relative)
    if want_dir and not path.is_dir():
        raise InvalidInputError(f"{path} is not a directory")
    if not want_dir and not (path.is_dir() or path.is_file() or path.is_symlink()):
        raise InvalidInputError(f"{path} does not exist")
    return path


def step_inputs(recipe: Recipe, step) -> dict:
    """The part of a cache key one step contributes (hashes its input files).

    Raises :class:`InvalidInputError` for a missing source.
    """
    if isinstance(step, FromDir):
        return {"kind": step.kind, "dest": step.dest, "tree": tree_digest(_source(recipe, step.path, want_dir=True))}
    if isinstance(step, Copy):
        src = _source(recipe, step.src, want_dir=False)
        return {
            **step.model_dump(exclude={"src"}),
            "name": src.name,
            "is_dir": src.is_dir(),
            "tree": tree_digest(src),
        }
    if isinstance(step, Debootstrap):
        return {**step.model_dump(), "packages": sorted(step.packages)}
    if isinstance(step, Run):
        return step.model_dump(exclude={"timeout"})
    if isinstance(step, Pip):
        data = step.model_dump(exclude={"timeout", "requirements_file"})
        if step.requirements_file:
            path = recipe.path(step.requirements_file)
            if not path.is_file():
                raise InvalidInputError(f"requirements file {path} does not exist")
            data["requirements_file_sha256"] = file_sha256(path)
        data["pip"] = PIP_VERSION
        return data
    raise InvalidInputError(f"unknown step {step!r}")


def depends_on_below(component: Component) -> bool:
    """Whether the component's result may depend on the groups below it."""
    return component.needs_environment and not component.independent


def component_key(recipe: Recipe, component: Component, below: list[str]) -> str:
    """The cache key (64 hex digits) of ``component`` built over the group digests
    ``below`` (bottom to top).  Raises :class:`InvalidInputError` for a missing source."""
    data = {
        "format": BUILD_FORMAT,
        "name": component.name,
        "version": component.version,
        "steps": [step_inputs(recipe, s) for s in component.step],
        "below": list(below) if depends_on_below(component) else None,
    }
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def lookup(store: Store, key: str) -> str | None:
    """The group digest built for ``key``, if it and all its chunks are in the store."""
    try:
        digest = store.get_ref(REF_KIND, key)
        manifest = load_group(store, digest)
    except (NotFoundError, InvalidInputError):
        return None
    except WeenvError:
        return None  # a corrupt entry is a miss; the rebuild replaces it
    if all(store.has_chunk(c.digest) for c in manifest.chunks):
        return digest
    return None


def record(store: Store, key: str, digest: str) -> None:
    """Remember that ``key`` built group ``digest``."""
    store.set_ref(REF_KIND, key, digest)


@contextlib.contextmanager
def store_lock(paths: Paths, *, exclusive: bool) -> Iterator[None]:
    """Builds hold this lock shared, ``weenv gc`` exclusive (without waiting):
    a gc never removes what a build of the same home is about to reference.

    Raises :class:`InvalidInputError` if ``exclusive`` and a build holds it.
    """
    paths.run.mkdir(parents=True, exist_ok=True)
    with open(paths.run / "store.lock", "w") as f:
        if exclusive:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise InvalidInputError(f"a build is running in {paths.home}; run gc when it has finished") from None
        else:
            fcntl.flock(f, fcntl.LOCK_SH)
        yield
