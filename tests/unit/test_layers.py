"""No arrows up: a module of ``src/weenv`` imports only from its own layer or
the layers below it (issue 14, item 6).

The layers, bottom first (:data:`LAYERS`, the one statement of the order; the
README's "Where things are" names it):

    base (errors, config, progress) < host < formats < api < store < packaging < node < build < sdk < server < cluster < adapters < cli (cli, demo, the package)

Inside ``node`` the floors are :data:`NODE_FLOORS` (``weenv/node/__init__.py``
draws them): below the wings, the wings ``data`` and ``runtime`` side by side
(never importing each other), the operations over environments, ``node.py``.

Every ``import`` counts, those inside functions and under ``TYPE_CHECKING`` too:
a lazy import is an arrow all the same.  What a lower layer needs of a higher
one is handed to it (the builder's step runner, gc's in-use digests)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("weenv.errors", "weenv.config", "weenv.progress")),
    ("host", ("weenv.host",)),
    ("formats", ("weenv.formats",)),
    ("api", ("weenv.api",)),
    ("store", ("weenv.store",)),
    ("packaging", ("weenv.packaging",)),
    ("node", ("weenv.node",)),
    ("build", ("weenv.build",)),
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
                bad.append(
                    f"{path.relative_to(src)}:{line}: {module} ({LAYERS[own][0]}) imports {name} ({LAYERS[other][0]})"
                )
    return bad


def test_no_module_imports_from_a_higher_layer():
    bad = upward_imports()
    assert bad == [], f"{len(bad)} imports go up a layer:\n" + "\n".join(bad)


NODE_FLOORS: list[list[tuple[str, tuple[str, ...]]]] = [
    [
        (
            "below the wings",
            ("weenv.node.home", "weenv.node.table", "weenv.node.disk", "weenv.node.cgroups", "weenv.node.manifests"),
        )
    ],
    [("data", ("weenv.node.data",)), ("runtime", ("weenv.node.runtime",))],
    [
        (
            "operations",
            (
                "weenv.node.state",
                "weenv.node.snapshotter",
                "weenv.node.resolver",
                "weenv.node.admission",
                "weenv.node.provision",
            ),
        )
    ],
    [("top", ("weenv.node.node", "weenv.node"))],
]
"""The floors inside ``weenv.node``, bottom first; each floor holds one or more
wings.  A module imports its own wing and the floors below, never a wing beside
it on its floor (``data`` and ``runtime``) nor a floor above."""

NODE_ALLOWANCES: set[tuple[str, str]] = set()
"""``(module, imported module)`` pairs let through though they break a floor
(none today: what a lower module needs of a higher one is handed to it)."""


def node_place(module: str) -> tuple[int, str] | None:
    """``(floor, wing)`` of a module of ``weenv.node`` (its longest matching prefix), None outside it."""
    best: tuple[int, int, str] | None = None
    for floor, wings in enumerate(NODE_FLOORS):
        for wing, prefixes in wings:
            for prefix in prefixes:
                if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > best[0]):
                    best = (len(prefix), floor, wing)
    return None if best is None else best[1:]


def node_floor_breaks(src: Path = SRC) -> list[str]:
    """Each import inside ``weenv.node`` that goes up a floor or sideways between wings."""
    bad = []
    for path in sorted((src / "weenv" / "node").rglob("*.py")):
        module = module_name(path, src)
        own = node_place(module)
        for line, name in imported(ast.parse(path.read_text(), str(path)), module, path.name == "__init__.py"):
            other = node_place(name)
            if other is None or other == own:
                continue
            if (module, name) in NODE_ALLOWANCES or (module, name.rsplit(".", 1)[0]) in NODE_ALLOWANCES:
                continue
            if other[0] > own[0] or (other[0] == own[0] and other[1] != own[1]):
                bad.append(f"{path.relative_to(src)}:{line}: {module} ({own[1]}) imports {name} ({other[1]})")
    return bad


def test_node_modules_keep_their_floors():
    bad = node_floor_breaks()
    assert bad == [], f"{len(bad)} imports inside weenv.node break its floors:\n" + "\n".join(bad)


def test_every_node_module_has_a_floor():
    top = SRC / "weenv" / "node"
    for path in top.rglob("*.py"):
        assert node_place(module_name(path, SRC)) is not None, f"{path}: on no floor of NODE_FLOORS"


def test_node_keeps_at_most_ten_modules_at_its_top():
    top = SRC / "weenv" / "node"
    wings = {"data", "runtime", "state"}
    modules = [
        p.name
        for p in top.iterdir()
        if p.name not in wings
        and p.name not in ("__init__.py", "__pycache__")
        and (p.suffix == ".py" or (p / "__init__.py").exists())
    ]
    assert len(modules) <= 10, f"node/ holds {len(modules)} modules at its top: {sorted(modules)}"


def test_the_check_sees_a_sideways_import_between_wings(tmp_path):
    """A data module importing the runtime is found, and so is the table importing a wing."""
    node = tmp_path / "weenv" / "node"
    for d in (node / "data", node / "runtime"):
        d.mkdir(parents=True)
        (d / "__init__.py").write_text("")
    (tmp_path / "weenv" / "__init__.py").write_text("")
    (node / "__init__.py").write_text("")
    (node / "runtime" / "runc.py").write_text("")
    (node / "data" / "cache.py").write_text("def f():\n    from weenv.node.runtime import runc\n")
    (node / "table.py").write_text("from weenv.node.runtime.runc import X\n")
    assert node_floor_breaks(tmp_path) == [
        "weenv/node/data/cache.py:2: weenv.node.data.cache (data) imports weenv.node.runtime.runc (runtime)",
        "weenv/node/table.py:1: weenv.node.table (below the wings) imports weenv.node.runtime.runc.X (runtime)",
    ]


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
