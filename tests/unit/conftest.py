"""The unit tier: pure logic, run as any user in seconds (``pytest tests/unit``).

A test here uses no mount, FUSE, runc, cgroup, daemon, root or host tool
(mkfs.erofs, gcc, docker): only Python and temporary directories.  The root
tier's fixtures that need those are refused at setup with one clear line."""

from __future__ import annotations

import pytest

ROOT_FIXTURES = {"debian_root", "shared_store", "node", "leak_check"}
"""Fixtures of ``tests/conftest.py`` that need root (debootstrap, mounts, runc, host-wide checks)."""


def pytest_runtest_setup(item):
    defs = getattr(item, "_fixtureinfo", None)
    used = {
        name
        for name, fixturedefs in (defs.name2fixturedefs.items() if defs else ())
        if name in ROOT_FIXTURES and fixturedefs[-1].baseid in ("", "tests")
    }
    if used:
        pytest.fail(
            f"{item.nodeid}: a unit test may not use the root tier's fixtures {sorted(used)}; "
            "move it out of tests/unit/",
            pytrace=False,
        )
