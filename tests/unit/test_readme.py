"""README.md is one screen that points into the docs: at most 150 lines, the two
quick-start commands CI runs, the Python examples exactly as the snippet files
``tests/test_docs_snippets.py`` runs, and links that lead to existing pages."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
QUICK_START = ("./scripts/setup.sh && .venv/bin/weenv demo", "./scripts/setup.sh && .venv/bin/pytest")


def test_one_screen():
    assert len(README.splitlines()) <= 150


def test_the_quick_start_commands():
    lines = [line.split("#")[0].strip() for line in README.splitlines()]
    for command in QUICK_START:
        assert command in lines, f"README's quick start lost {command!r}"


def test_the_python_examples_are_the_tested_snippets():
    blocks = re.findall(r"```python\n(.*?)```", README, re.S)
    snippets = {p.name: p.read_text() for p in (ROOT / "docs" / "snippets").glob("*.py")}
    assert blocks and all(block in snippets.values() for block in blocks), (
        "a README Python example differs from docs/snippets/ (edit the snippet, then copy it)"
    )
    assert {"sdk_quickstart.py", "e2b_quickstart.py"} <= {n for n, text in snippets.items() if text in blocks}


def test_links_lead_to_pages():
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README):
        if not target.startswith(("http://", "https://")):
            assert (ROOT / target).is_file(), f"README links to {target}, which does not exist"
