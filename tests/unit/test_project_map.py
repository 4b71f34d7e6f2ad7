"""The project's map, which folder holds what, is written twice: in the docs'
architecture page and in ``weenv/__init__.py``'s docstring.  Both must name
exactly the folders ``src/weenv`` has (the page every folder, the docstring
every top-level one), so a folder added, moved or removed shows here."""

from __future__ import annotations

import re
from pathlib import Path

import weenv

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "weenv"
PAGE = ROOT / "docs" / "concepts" / "architecture.md"


def folders() -> set[str]:
    """Every package folder under ``src/weenv`` (``node/fuse``), and those holding code without ``__init__``."""
    return {
        str(p.relative_to(SRC))
        for p in SRC.rglob("*")
        if p.is_dir() and p.name != "__pycache__" and any(f.suffix in (".py", ".c") for f in p.iterdir())
    }


def test_the_architecture_page_names_every_folder():
    table = [line for line in PAGE.read_text().splitlines() if line.startswith("| `weenv/")]
    named = {m for line in table for m in re.findall(r"^\| `weenv/([\w/]+)/`", line)}
    actual = folders()
    assert named == actual, (
        f"docs/concepts/architecture.md's map: missing {sorted(actual - named)}, "
        f"no such folder {sorted(named - actual)}"
    )


def test_the_package_docstring_names_every_top_level_folder():
    named = set(re.findall(r"^- ``weenv\.(\w+)``", weenv.__doc__, re.M))
    top = {f for f in folders() if "/" not in f}
    missing, stale = top - named, {n for n in named - top if not (SRC / f"{n}.py").exists()}
    assert not missing and not stale, (
        f"weenv/__init__.py's map: missing {sorted(missing)}, no such folder {sorted(stale)}"
    )


def test_the_node_package_docstring_names_every_module_of_its_top_and_wings():
    """``weenv/node/__init__.py`` draws the node's floors: it names every module
    and folder at ``node/``'s top and in each wing (``data/``, ``runtime/``,
    ``state/``), and nothing that is not there."""
    import weenv.node

    node = SRC / "node"
    wings = [p for p in node.iterdir() if p.is_dir() and p.name in ("data", "runtime", "state")]
    actual = set()
    for folder in (node, *wings):
        actual |= {
            p.name + ("/" if p.is_dir() else "")
            for p in folder.iterdir()
            if p.name not in ("__init__.py", "__pycache__") and (p.suffix == ".py" or p.is_dir())
        }
    named = set(re.findall(r"``(\w+(?:\.py|/))``", weenv.node.__doc__))
    assert named == actual, (
        f"weenv/node/__init__.py's map: missing {sorted(actual - named)}, no such module {sorted(named - actual)}"
    )
