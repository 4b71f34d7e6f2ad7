"""No arrows up: a module of ``src/weenv`` imports only from its own layer or
the layers below it (issue 14, item 6).

The layers, bottom first (:data:`LAYERS`, the one statement of the order; the
README's "Where things are" names it):

    base (errors, config) < host < formats < store < packaging < node < sdk < server < cluster < adapters < cli (cli, demo, the package)

Every ``import`` counts, those inside functions and under ``TYPE_CHECKING`` too:
a lazy import is an arrow all the same.  What a lower layer needs of a higher
one is handed to it (the builder's step runner, gc's in-use digests)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("weenv.errors", "weenv.config")),
    ("host", ("weenv.host",)),
    ("formats", ("weenv.formats",)),
    ("store", ("weenv.store",)),
    ("packaging", ("weenv.packaging",)),
    ("node", ("weenv.node",)),
    ("sdk", ("weenv.sdk",)),
    ("server", ("weenv.server",)),
    ("cluster", ("weenv.cluster",)),
    ("adapters", ("weenv.adapters",)),
    ("cli", ("weenv.cli", "weenv.demo", "weenv.__main__", "weenv")),
]
"""Each layer and the modules (dotted prefixes) in it, bottom first."""


def layer_of(module: str) -> int | None:
    """The index in :data:`LAYERS` of ``module`` (its longest matching prefix);
    None for a module outside weenv."""
    best: tuple[int, int] | None = None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[0]:
                    best = (len(prefix), index)
    return None if best is None else best[1]


def module_name(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported(tree: ast.AST, module: str, is_package: bool) -> list[tuple[int, str]]:
    """``(line, dotted name)`` of every import in ``tree`` (``from weenv import
    sdk`` names ``weenv.sdk``; relative imports resolved against ``module``)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".") if is_package else module.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join(package + ([base] if base else []))
            found += [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return found


def upward_imports(src: Path = SRC) -> list[str]:
    """Each import of a higher layer in ``src/weenv``, as ``"file:line: a (layer) imports b (layer)"``."""
    bad = []
    for path in sorted((src / "weenv").rglob("*.py")):
        module = module_name(path, src)
        own = layer_of(module)
        assert own is not None, f"{path}: in no layer of LAYERS"
        for line, name in imported(ast.parse(path.read_text(), str(path)), module, path.name == "__init__.py"):
            other = layer_of(name)
            if other is not None and other > own:
                bad.append(f"{path.relative_to(src)}:{line}: {module} ({LAYERS[own][0]}) imports "
                           f"{name} ({LAYERS[other][0]})")
    return bad


def test_no_module_imports_from_a_higher_layer():
    bad = upward_imports()
    assert bad == [], f"{len(bad)} imports go up a layer:\n" + "\n".join(bad)


def test_the_check_sees_an_arrow_up(tmp_path):
    """A store module importing packaging inside a function is found (the check can fail)."""
    pkg = tmp_path / "weenv" / "store"
    pkg.mkdir(parents=True)
    (tmp_path / "weenv" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from . import base\n")
    (pkg / "base.py").write_text("def f():\n    from weenv.packaging.group import load_group\n")
    assert upward_imports(tmp_path) == [
        "weenv/store/base.py:2: weenv.store.base (store) imports weenv.packaging.group.load_group (packaging)"
    ]
