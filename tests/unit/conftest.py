"""The unit tier: pure logic, run as any user in seconds (``pytest tests/unit``).

A test here uses no mount, FUSE, runc, cgroup, daemon, root or host tool
(mkfs.erofs, gcc, docker): only Python and temporary directories.  The root
tier's fixtures that need those are refused at setup with one clear line."""

from __future__ import annotations

import pytest

ROOT_FIXTURES = {"debian_root", "shared_store", "node", "leak_check", "daemon", "oci_registry", "dockerd"}


def pytest_runtest_setup(item):
    wanted = ROOT_FIXTURES & set(getattr(item, "fixturenames", ()))
    if wanted:
        pytest.fail(f"{item.nodeid}: a unit test may not use the root tier's fixtures {sorted(wanted)}; "
                    "move it out of tests/unit/", pytrace=False)
