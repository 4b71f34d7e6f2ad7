"""Every test in the tree can fail: a scan of ``tests/`` (its Python sources, read
with :mod:`ast`, never imported) for checks that cannot fail.

What is flagged:

- an ``or`` inside an assert whose last operand is a truthy constant
  (``assert x or True``): the assert holds whatever ``x`` is;
- an assert of a truthy constant (``assert True``, ``assert 1``, ``assert "x"``),
  or of a non-empty tuple (``assert (x, "message")``: a tuple is always true);
- a test function (``test_*`` in a module ``test_*.py``, at module level or in a
  ``Test*`` class) that checks nothing: no ``assert``, no ``raise AssertionError``,
  and no call of ``pytest.raises`` / ``pytest.warns`` / ``pytest.fail``, nor of a
  checking helper (a name in :data:`CHECKING_PREFIXES`: ``assert_...``,
  ``check_...``, ``expect_...``, whether a function or a method).  A helper
  defined in the same module that itself asserts counts as a check, one level
  deep (a test that only calls ``_wait_ready()`` which asserts is checking).

``assert False`` and ``pytest.fail(...)`` are checks (they always fail where
they are reached).  A test that checks through a helper that raises is fixed by
naming the helper for what it does (``check_...``), not by a list of exceptions
here: there is none.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
"""The test tree scanned: ``tests/`` with everything under it."""

CHECKING_PREFIXES = ("assert_", "check_", "expect_")
"""A call of a function or method whose name starts with one of these is a check."""

PYTEST_CHECKS = {"raises", "warns", "fail", "deprecated_call"}
"""``pytest.X`` calls that are checks."""


def _truthy_constant(node: ast.expr) -> bool:
    if isinstance(node, ast.Constant):
        return bool(node.value)
    return isinstance(node, ast.Tuple) and bool(node.elts)


def _call_name(call: ast.Call) -> str | None:
    f = call.func
    if isinstance(f, ast.Name):
        return f.id
    if isinstance(f, ast.Attribute):
        return f.attr
    return None


def _is_pytest_check(call: ast.Call) -> bool:
    f = call.func
    return (
        isinstance(f, ast.Attribute)
        and f.attr in PYTEST_CHECKS
        and isinstance(f.value, ast.Name)
        and f.value.id == "pytest"
    )


def _raises_assertion(node: ast.Raise) -> bool:
    exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
    return isinstance(exc, ast.Name) and exc.id == "AssertionError"


def _checks_directly(fn: ast.AST) -> bool:
    """Whether ``fn``'s body (nested functions included: callbacks assert too) holds a check."""
    for node in ast.walk(fn):
        if isinstance(node, ast.Assert):
            return True
        if isinstance(node, ast.Raise) and node.exc is not None and _raises_assertion(node):
            return True
        if isinstance(node, ast.Call):
            name = _call_name(node)
            if _is_pytest_check(node) or (name and name.startswith(CHECKING_PREFIXES)):
                return True
    return False


def _calls(fn: ast.AST) -> set[str]:
    return {name for node in ast.walk(fn) if isinstance(node, ast.Call) and (name := _call_name(node))}


def _test_functions(tree: ast.Module):
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            yield node.name, node
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name.startswith("test"):
                    yield f"{node.name}.{item.name}", item


def findings(source: str, filename: str = "test_x.py") -> list[str]:
    """What in ``source`` (a module named ``filename``) cannot fail, one line each (``LINE: what``)."""
    tree = ast.parse(source, filename)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assert):
            continue
        if _truthy_constant(node.test):
            out.append(f"{node.lineno}: assert of a constant that is always true: {ast.unparse(node.test)[:60]}")
            continue
        for sub in ast.walk(node.test):
            if isinstance(sub, ast.BoolOp) and isinstance(sub.op, ast.Or) and _truthy_constant(sub.values[-1]):
                out.append(f"{node.lineno}: `or` ending in a true constant, always true: {ast.unparse(sub)[:60]}")
    if Path(filename).name.startswith("test_"):
        # module-level helpers that check: a test calling one checks (followed one level)
        helpers = {
            n.name
            for n in tree.body
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and not n.name.startswith("test")
            and _checks_directly(n)
        }
        for name, fn in _test_functions(tree):
            if not _checks_directly(fn) and not (_calls(fn) & helpers):
                out.append(
                    f"{fn.lineno}: test {name} checks nothing (no assert, pytest.raises/fail, "
                    f"or call of {'/'.join(p + '...' for p in CHECKING_PREFIXES)} or of a helper that asserts)"
                )
    return sorted(out, key=lambda line: int(line.split(":")[0]))


# --- the scanner itself -------------------------------------------------------------------
MUST_FLAG = {
    "or True": "def test_a():\n    assert f() or True\n",
    "or a string": "def test_a():\n    assert not g('x') or 'never'\n",
    "or True nested": "def test_a():\n    assert (f() or 1) and g()\n",
    "assert True": "def test_a():\n    x = 1\n    assert True\n",
    "assert 1": "def test_a():\n    assert 1, 'always'\n",
    "assert a string": "def test_a():\n    assert 'x'\n",
    "assert a tuple": "def test_a():\n    assert (f() == 1, 'message')\n",
    "prints": "def test_a():\n    print(f())\n",
    "method prints": "class TestX:\n    def test_a(self):\n        f()\n",
    "async": "async def test_a():\n    await f()\n",
    "helper not asserting": "def _h():\n    return 1\n\ndef test_a():\n    _h()\n",
    "check=True alone": "import subprocess\n\ndef test_a():\n    subprocess.run(['true'], check=True)\n",
}
MUST_PASS = {
    "plain assert": "def test_a():\n    assert f() == 2\n",
    "assert False": "def test_a():\n    if f():\n        assert False, 'unreachable'\n",
    "or of non-constants": "def test_a():\n    assert f() or g()\n",
    "or with a false last": "def test_a():\n    assert f() or 0\n",
    "pytest.raises": "import pytest\n\ndef test_a():\n    with pytest.raises(ValueError):\n        f()\n",
    "pytest.fail": "import pytest\n\ndef test_a():\n    if f():\n        pytest.fail('bad')\n",
    "raise AssertionError": "def test_a():\n    if f():\n        raise AssertionError('bad')\n",
    "check_ helper": "def test_a(node):\n    check_clean(node)\n",
    "assert_ method": "def test_a(m):\n    m.assert_called_once()\n",
    "expect_ helper": "def test_a():\n    expect_gone(1)\n",
    "helper that asserts": "def _h():\n    assert f()\n\ndef test_a():\n    _h()\n",
    "callback asserts": "def test_a():\n    def cb(x):\n        assert x\n    run(cb)\n",
    "not a test": "def helper():\n    print(1)\n",
}


@pytest.mark.parametrize("case", sorted(MUST_FLAG))
def test_the_scanner_flags(case):
    assert findings(MUST_FLAG[case]), case


@pytest.mark.parametrize("case", sorted(MUST_PASS))
def test_the_scanner_passes(case):
    assert findings(MUST_PASS[case]) == [], case


def test_only_test_modules_are_held_to_checking():
    src = "def test_a():\n    print(1)\n"
    assert findings(src, "test_x.py") and not findings(src, "helpers.py")
    assert findings("assert True\n", "helpers.py"), "constant asserts are flagged anywhere"


def test_no_test_in_the_tree_that_cannot_fail():
    sources = sorted(p for p in TESTS.rglob("*.py") if "data" not in p.relative_to(TESTS).parts[:-1])
    assert len(sources) > 50, f"the scan found only {len(sources)} files under {TESTS}"
    found = {}
    for path in sources:
        lines = findings(path.read_text(), path.name)
        if lines:
            found[str(path.relative_to(TESTS))] = lines
    assert not found, "tests that cannot fail:\n" + "\n".join(
        f"  {p}:{line}" for p, lines in found.items() for line in lines
    )
