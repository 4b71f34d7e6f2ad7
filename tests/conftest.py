"""Shared fixtures.  Two tiers: ``tests/unit/`` (marker ``unit``) runs as any
user in seconds; every other test runs as root with real mounts, FUSE and runc.

Every test gets its own ``WEENV_HOME`` under a temporary directory; big
downloads (debootstrap output) are shared through ``WEENV_CACHE``
(default /var/cache/weenv), built on first use.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

import ray_fixture
from ray_fixture import ray_nodes  # noqa: F401 (a fixture: one Ray cluster for the modules of a run that use it)
from s3_fixture import s3_server  # noqa: F401 (a fixture: one SeaweedFS for every module of the session)
from weenv.config import Paths
from weenv.packaging.debootstrap import debian_rootfs
from weenv.store.file import FileStore

CACHE = Path(os.environ.get("WEENV_CACHE", "/var/cache/weenv"))
os.environ.setdefault("WEENV_DISK_BYTES", "1T")
"""Every test node's environments' disk (:mod:`weenv.node.disk`): a sparse 1 TiB image, so that the
many environments of default resources (10 GiB of disk each) some tests create at once are admitted;
tests of the disk limit and its admission choose their own sizes."""


UNIT = Path(__file__).parent / "unit"


def pytest_ignore_collect(collection_path, config):
    """``-m unit`` alone collects only ``tests/unit/``: the integration modules
    import what only a root machine's setup installs (the benchmarks, harness
    venvs), so they are not even imported."""
    if (
        config.getoption("markexpr", "").strip() == "unit"
        and collection_path.suffix == ".py"
        and collection_path.name.startswith("test_")
        and not collection_path.is_relative_to(UNIT)
    ):
        return True
    return None


def pytest_collection_modifyitems(config, items):
    """Tests under ``tests/unit/`` get the ``unit`` marker (they need no root);
    every other test is the integration tier and is skipped without root."""
    skip = pytest.mark.skip(reason="weenv's integration tests need root (mounts, FUSE, runc)")
    for item in items:
        if item.path.is_relative_to(UNIT):
            item.add_marker(pytest.mark.unit)
        elif os.geteuid() != 0:
            item.add_marker(skip)


def pytest_collection_finish(session):
    ray_fixture.note_users(session.items)  # which modules share the run's Ray cluster; the last one stops it


def pytest_sessionfinish(session, exitstatus):
    if ray_fixture._shared is not None:  # the run stopped before the last module that uses it (-x, an error)
        ray_fixture.stop()


@pytest.fixture(scope="session")
def debian_root() -> Path:
    """A bookworm minbase + python3 tree (debootstrap, cached).  Never modify it."""
    return debian_rootfs(CACHE)


@pytest.fixture
def paths(tmp_path, monkeypatch) -> Paths:
    """A private WEENV_HOME for one test."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("WEENV_HOME", str(home))
    monkeypatch.setenv("WEENV_CACHE", str(CACHE))
    monkeypatch.delenv("WEENV_STORE", raising=False)
    return Paths.from_env()


@pytest.fixture
def store(paths) -> FileStore:
    return FileStore(paths.home / "store")


def system_snapshot(prefix: Path) -> dict:
    """What a test may leak, seen from the host: mounts below ``prefix`` (an
    environment's network namespace file is one), loop devices of images below it, cgroups named
    weenv, runc containers, FUSE connections and network interfaces named weenv
    (environments' veths)."""
    mounts = []
    with open("/proc/mounts") as f:
        for line in f:
            point = line.split()[1]
            if point.startswith(str(prefix)):
                mounts.append(point)
    # the loop devices of images below ``prefix`` (weenv attaches only its node disks' images, each in
    # its home): another test session on the machine attaches and detaches its own meanwhile
    loops = [
        line
        for line in subprocess.run(["losetup", "-a"], capture_output=True, text=True).stdout.splitlines()
        if f"({prefix}" in line
    ]
    cgroups = sorted(str(p) for p in Path("/sys/fs/cgroup").glob("*/*") if "weenv" in p.name and p.is_dir())
    fuse_conns = sorted(os.listdir("/sys/fs/fuse/connections")) if os.path.isdir("/sys/fs/fuse/connections") else []
    veths = sorted(n for n in os.listdir("/sys/class/net") if n.startswith("weenv"))  # weenv.node.runtime.network's
    return {
        "mounts": mounts,
        "loops": loops,
        "cgroups": cgroups,
        "fuse": fuse_conns,
        "interfaces": veths,
        "nft tables": nft_tables(),
    }


def nft_tables() -> list[str]:
    """weenv's nft tables (``weenv``, the shared one, and each environment's ``weenv-ID``); none without nft."""
    try:
        out = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout
    except FileNotFoundError:
        return []
    return sorted(w[-1] for w in map(str.split, out.splitlines()) if w and w[-1].startswith("weenv"))


@pytest.fixture
def leak_check(tmp_path):
    """Fails the test if mounts, loop devices, weenv cgroups, FUSE connections,
    weenv network interfaces or nft tables remain at its end that were not there
    at its start (checked after the ``node`` fixture's close: a test that fails
    with environments alive is not reported as leaking theirs)."""
    before = system_snapshot(tmp_path)
    yield
    after = system_snapshot(tmp_path)
    for key in after:
        new = sorted(set(after[key]) - set(before[key]))
        assert not new, f"leaked {key}: {new}"


@pytest.fixture(scope="session")
def shared_store(tmp_path_factory, debian_root):
    """A store holding the Debian base group, a small task group and template
    ``task`` (base + task, working dir /workspace), built once per session."""
    from weenv.formats.manifest import RuntimeConfig
    from weenv.packaging.group import build_group
    from weenv.packaging.template import create_template

    root = tmp_path_factory.mktemp("shared-store")
    store = FileStore(root / "store")
    task = root / "task"
    (task / "workspace").mkdir(parents=True)
    (task / "workspace" / "hello.py").write_text("print('hello from the task')\n")
    (task / "workspace" / "big.bin").write_bytes(os.urandom(4 << 20))
    build_group(debian_root, store, name="base")
    build_group(task, store, name="task")
    create_template(store, "task", ["base", "task"], runtime=RuntimeConfig(working_dir="/workspace"))
    yield store
    check_at_session_end(store)


def check_at_session_end(store: FileStore) -> None:
    """What the session's tests published into the shared store (snapshots, profiles, templates) is
    all there: ``weenv store check --quick`` (every ref's manifests, every group's chunks present)
    passes, or the run fails (an error at the teardown of its last test) listing what is missing."""
    from weenv.store.check import check_store

    report = check_store(store, deep=False)
    problems = "\n".join(report.problems)
    assert report.ok, f"weenv store check --quick of the shared store {store.url} after the session:\n{problems}"


def store_copy_without_profiles(store: FileStore, root: Path) -> FileStore:
    """A hard-linked copy of ``store`` at ``root`` without the prefetch profiles
    and packs other tests recorded in it (a template's first start here records its own)."""
    from weenv.packaging.profile import REF_KIND

    subprocess.run(["cp", "-al", str(store.root), str(root)], check=True)
    subprocess.run(["rm", "-rf", str(root / "refs" / REF_KIND), str(root / "packs")], check=True)
    return FileStore(root)


def forget_usage_profiles(store: FileStore) -> None:
    """Remove every usage profile published to ``store`` (refs ``usage/*``)."""
    for name in store.list_refs("usage"):
        store.delete_ref("usage", name)


@pytest.fixture(autouse=True)
def fresh_usage_profiles(request):
    """Each test that uses the session's shared store starts with its
    templates' usage profiles unknown, and leaves none (issue 19).  Every test
    of the session runs its own workload on the one template ``task``, and a
    profile is a fact about a template's workload: what earlier tests' environments
    taught it (a CPU loop, a memory hog, commands every second) predicts
    nothing of the next test's, yet the default burst admission acts on it,
    as it should on a real template's: 8 concurrent 1-core creates on 2 cores
    are within the objective (2 % of bursts contended) only while the
    template uses less than ~0.017 cores on average, and the warm pool's test
    was refused after earlier tests had taught more.  Tests of profiles teach
    their own within the test."""
    if "shared_store" not in request.fixturenames:
        yield
        return
    store = request.getfixturevalue("shared_store")
    forget_usage_profiles(store)
    yield
    forget_usage_profiles(store)


@pytest.fixture
def node(paths, shared_store, leak_check):
    """A started in-process Node over the shared store, closed (and checked for
    leaks) at the end of the test."""
    from weenv.node.node import Node

    n = Node(paths, store=shared_store).start()
    try:
        yield n
    finally:
        n.close()
