"""The suite's own layout: pytest (rootdir-relative imports, ``from conftest
import ...``) cannot collect two test files of one basename, and the error only
shows when both tiers are collected together (the README's test command)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_no_two_test_files_share_a_basename():
    seen: dict[str, list[str]] = defaultdict(list)
    for path in TESTS.rglob("test_*.py"):
        seen[path.name].append(str(path.relative_to(TESTS)))
    clashes = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not clashes, f"test files sharing a basename (pytest collects only one): {clashes}"
