"""Recipes: a template's components in order, each a layer group with its build steps.

A recipe is a TOML file (read with :mod:`tomllib`)::

    [template]
    name = "py-task"
    version = "1"                       # optional label, default "latest"
    [template.runtime]                  # weenv.formats.manifest.RuntimeConfig;
    working_dir = "/workspace"          # env is merged over the defaults (PATH, HOME, LANG)
    env = { PYTHONUNBUFFERED = "1" }

    [[component]]                       # bottom first: the base
    name = "base"                       # the group's name in the store
    [[component.step]]
    kind = "debootstrap"                # or: from_dir, run, pip, copy
    suite = "bookworm"
    packages = ["python3"]

    [[component]]
    name = "tools"
    independent = true                  # its cache key ignores the groups below
    [[component.step]]
    kind = "copy"
    src = "tools/rg"                    # relative to the recipe's directory
    dest = "/usr/local/bin/"

Step kinds (every table is checked: an unknown key or kind is an error):

- ``from_dir``: the contents of a directory (owners, modes, xattrs, links kept) at ``dest``;
- ``debootstrap``: a Debian root file system (suite, variant, extra packages) at ``dest``;
- ``run``: shell commands run in an environment composed of the groups below and
  what the component's earlier steps made; the network is on during the build only;
- ``pip``: Python requirements installed by the base's own ``python3`` inside such an
  environment (see :mod:`weenv.packaging.builder` for why);
- ``copy``: a file or directory into a path, owned by ``owner`` (default root), as
  Docker's ``COPY``.

A component's steps all write one tree, which becomes its group.  Errors:
:class:`~weenv.errors.InvalidInputError` naming the file, the component and the step.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from weenv.errors import InvalidInputError
from weenv.formats.manifest import Name, RuntimeConfig


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _absolute(path: str) -> str:
    if not path.startswith("/") or "\0" in path:
        raise ValueError(f"{path!r} is not an absolute path inside the environment")
    return path


AbsPath = Annotated[str, AfterValidator(_absolute)]


class FromDir(_Model):
    """The contents of a host directory, copied into the component's tree at ``dest``."""

    kind: Literal["from_dir"]
    path: str
    """The directory, relative to the recipe's directory (or absolute)."""
    dest: AbsPath = "/"
    """Where its contents go inside the tree."""


class Debootstrap(_Model):
    """A Debian root file system from debootstrap (cached in ``$WEENV_CACHE``)."""

    kind: Literal["debootstrap"]
    suite: str = "bookworm"
    variant: str = "minbase"
    packages: list[str] = Field(default_factory=list)
    """Extra packages (debootstrap ``--include``)."""
    dest: AbsPath = "/"


class Run(_Model):
    """Shell commands (``/bin/sh -c``, one after another; the first failure stops the build)."""

    kind: Literal["run"]
    commands: list[str] = Field(min_length=1)
    env: dict[str, str] = Field(default_factory=dict)
    """Variables added to the template's for these commands."""
    workdir: AbsPath = "/"
    timeout: float = Field(default=3600.0, gt=0)
    """Seconds per command; a command past it is killed and the build fails."""

    @field_validator("commands", mode="before")
    @classmethod
    def _one_or_many(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v


class Pip(_Model):
    """Python requirements installed with pip by the environment's own interpreter."""

    kind: Literal["pip"]
    requirements: list[str] = Field(default_factory=list)
    """Requirement specifiers (``"idna==3.7"``)."""
    requirements_file: str | None = None
    """A requirements file, relative to the recipe's directory; its content counts for the cache."""
    python: str = "python3"
    """The interpreter inside the environment."""
    options: list[str] = Field(default_factory=list)
    """Extra ``pip install`` arguments (``"--no-deps"``)."""
    timeout: float = Field(default=3600.0, gt=0)

    @model_validator(mode="after")
    def _something(self) -> Pip:
        if not self.requirements and not self.requirements_file:
            raise ValueError("a pip step needs requirements or requirements_file")
        return self


class Copy(_Model):
    """A file or directory from the host into the tree (Docker ``COPY`` semantics):
    a directory's *contents* go into ``dest``; a file goes to ``dest``, or into it
    if ``dest`` ends with ``/``."""

    kind: Literal["copy"]
    src: str
    """Relative to the recipe's directory (or absolute)."""
    dest: AbsPath
    owner: str = "0:0"
    """``UID:GID`` of everything copied."""
    mode: str | None = None
    """Octal permission bits for everything copied (``"0755"``); default: kept."""

    @field_validator("owner")
    @classmethod
    def _owner(cls, v: str) -> str:
        uid, sep, gid = v.partition(":")
        if not (uid.isdigit() and (not sep or gid.isdigit())):
            raise ValueError(f"owner {v!r} is not numeric UID:GID")
        return v if sep else f"{uid}:{uid}"

    @field_validator("mode")
    @classmethod
    def _mode(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                if not 0 <= int(v, 8) <= 0o7777:
                    raise ValueError
            except ValueError:
                raise ValueError(f"mode {v!r} is not octal permission bits") from None
        return v


Step = Annotated[FromDir | Debootstrap | Run | Pip | Copy, Field(discriminator="kind")]
TREE_STEPS = (FromDir, Debootstrap, Copy)
"""Steps that only place files (no environment needed)."""


class Component(_Model):
    """One layer group of the template and the steps that make its tree."""

    name: Name
    """The group's name in the store (``groups/NAME``); templates sharing a
    component use the same name, so an identical build is one group."""
    version: str = "latest"
    """The group's version label (it fixes the image's file system UUID)."""
    independent: bool = False
    """The component's result does not depend on the exact build of the groups
    below it (static tools, a task repository): its cache key leaves their digests out."""
    step: list[Step] = Field(min_length=1)

    @property
    def needs_environment(self) -> bool:
        """Whether a step runs commands (``run``/``pip``)."""
        return any(not isinstance(s, TREE_STEPS) for s in self.step)


class TemplateSection(_Model):
    name: Name
    version: str = "latest"
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)

    @field_validator("runtime", mode="before")
    @classmethod
    def _merge_env(cls, v: Any) -> Any:
        if isinstance(v, dict) and isinstance(v.get("env"), dict):
            v = {**v, "env": {**RuntimeConfig().env, **v["env"]}}
        return v


class Recipe(_Model):
    """A parsed recipe; ``base_dir`` is where relative paths in it start."""

    template: TemplateSection
    component: list[Component] = Field(min_length=1)
    base_dir: Path = Field(default=Path("."), exclude=True)

    @model_validator(mode="after")
    def _unique_names(self) -> Recipe:
        names = [c.name for c in self.component]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"component names must be unique; repeated: {', '.join(dup)}")
        return self

    def path(self, relative: str) -> Path:
        """A host path named in the recipe, from its directory."""
        return (self.base_dir / relative).absolute()


def parse_recipe(text: str, *, base_dir: str | os.PathLike[str] = ".", origin: str = "recipe") -> Recipe:
    """Parse recipe TOML ``text``; relative paths start at ``base_dir``.

    Raises :class:`InvalidInputError` for TOML syntax errors, unknown keys or
    step kinds and bad values, with where each one is (``component 2 ('tools'),
    step 1``) in the message.  Whether named files exist is checked by the build.
    """
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise InvalidInputError(f"{origin}: not valid TOML: {exc}") from exc
    try:
        return Recipe.model_validate({**data, "base_dir": Path(base_dir).absolute()})
    except ValidationError as exc:
        problems = "; ".join(_where(data, e["loc"]) + e["msg"] for e in exc.errors()[:8])
        raise InvalidInputError(f"{origin}: {problems}") from exc


def load_recipe(path: str | os.PathLike[str]) -> Recipe:
    """Read and parse the recipe file ``path`` (see :func:`parse_recipe`).

    Raises :class:`InvalidInputError` if it cannot be read or is malformed.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidInputError(f"cannot read recipe {path}: {exc}") from exc
    return parse_recipe(text, base_dir=path.absolute().parent, origin=str(path))


def _where(data: dict, loc: tuple) -> str:
    """``component 2 ('tools'), step 1 (run): `` from a pydantic error location."""
    parts: list[str] = []
    node: Any = data
    i = 0
    while i < len(loc):
        key = loc[i]
        if key in ("component", "step") and i + 1 < len(loc) and isinstance(loc[i + 1], int):
            idx = loc[i + 1]
            try:
                node = node[key][idx]
            except (KeyError, IndexError, TypeError):
                node = None
            label = f"{key} {idx + 1}"
            if isinstance(node, dict) and key == "component" and "name" in node:
                label += f" ({node['name']!r})"
            if isinstance(node, dict) and key == "step" and "kind" in node:
                label += f" ({node['kind']})"
            parts.append(label)
            i += 2
            continue
        if key in ("from_dir", "debootstrap", "run", "pip", "copy") and parts and parts[-1].startswith("step"):
            i += 1  # the discriminated union's branch name: already in the label
            continue
        parts.append(str(key))
        node = node.get(key) if isinstance(node, dict) else None
        i += 1
    return (", ".join(parts) + ": ") if parts else ""
