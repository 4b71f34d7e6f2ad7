"""The warm pool (weenv.node.state.pool): environments created ahead with ``runc
create``, started by the next create of their template; real runc, overlay
and group mounts."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from weenv.formats.manifest import Resources
from weenv.host import mounts
from weenv.node.node import Node
from weenv.packaging.group import load_group
from weenv.packaging.template import load_template


def _containers(node) -> dict[str, str]:
    """runc's containers of ``node``: id -> status."""
    return {s["id"]: s["status"] for s in node.runc.list()}


def _wait_ready(node, n: int = 1, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while node.pool.stats().ready < n:
        assert time.monotonic() < deadline, f"the pool holds {node.pool.stats()} after {timeout} s"
        time.sleep(0.01)


def _overlays(paths) -> list[str]:
    return [p for t, p in mounts.mounts_under(paths.environments) if t == "overlay"]


@pytest.fixture
def pooled_node(paths, shared_store, leak_check):
    n = Node(paths, store=shared_store, pool_size=1).start()
    try:
        yield n
    finally:
        n.close()
        assert not _overlays(paths)
        assert not _containers(n)


def _warm_up(node, template: str = "task", **kwargs) -> None:
    """Two creates of ``template`` (destroyed): the pool then fills it."""
    for _ in range(2):
        node.destroy(node.create(template, **kwargs).id)


def test_second_create_fills_the_pool_and_the_next_create_starts_the_pooled_environment(pooled_node, paths):
    node = pooled_node
    first = node.create("task")
    assert not first.timing.pooled
    node.destroy(first.id)
    time.sleep(0.3)
    assert node.pool.stats().ready == 0 and not _containers(node)  # created once: nothing ahead

    _warm_up(node)
    _wait_ready(node)
    ((cid, status),) = _containers(node).items()
    assert status == "created" and node.list() == []  # waiting in the runtime's exec FIFO, not an environment yet
    name, root = node.runtime.name, paths.runtime_roots[node.runtime.name]
    pid = json.loads(
        subprocess.run([name, "--root", str(root), "state", cid], capture_output=True, text=True, check=True).stdout
    )["pid"]
    with open(f"/proc/{pid}/cmdline", "rb") as f:  # nothing of the template ran yet: still the runtime's process
        argv = f.read().split(b"\0")
    if name == "runc":
        assert argv[1:2] == [b"init"]
        assert os.readlink(f"/proc/{pid}/exe").startswith("/memfd:runc")  # runc's sealed copy
    else:
        assert Path(argv[0].decode()).name == name and b"create" in argv

    hits = node.stats().pool_hits
    info = node.create("task")
    assert info.timing.pooled and info.timing.first_command_s is not None
    assert cid == f"weenv-{info.id}" and [e.id for e in node.list()] == [info.id]
    assert _containers(node)[cid] == "running"
    r = node.exec(info.id, "hostname; pwd; python3 hello.py")
    assert r.stdout == f"weenv-{info.id}\n/workspace\nhello from the task\n".encode()
    stats = node.stats()
    assert (stats.pool_hits, stats.environments) == (hits + 1, 1)
    node.destroy(info.id)
    _wait_ready(node)  # taken: filled again


def test_a_pooled_environment_is_new_never_a_reused_one(pooled_node):
    node = pooled_node
    _warm_up(node)
    seen = set()
    for i in range(3):
        _wait_ready(node)
        info = node.create("task")
        assert info.timing.pooled and info.id not in seen
        seen.add(info.id)
        r = node.exec(info.id, "find /root /tmp -mindepth 1 -newer /etc/hostname")
        assert (r.exit_code, r.stdout) == (0, b""), r.stdout  # nothing an earlier one wrote
        assert node.exec(info.id, "ls /root/mine /tmp/t*").exit_code != 0
        node.exec(info.id, f"echo {i} > /root/mine; touch /tmp/t{i}")
        node.destroy(info.id)


def test_only_an_identical_request_takes_a_pooled_environment(pooled_node):
    node = pooled_node
    _warm_up(node)
    _wait_ready(node)
    ahead = set(_containers(node))

    other = node.create("task", resources=Resources(cpus=0.5, memory_bytes=256 << 20))
    assert not other.timing.pooled
    assert node.get(other.id).resources.memory_bytes == 256 << 20  # its own request's resources
    # its limit is its own: at most what it declared (elastic: a usage profile of
    # "task" that earlier tests left in the shared store may start it lower)
    limit = int(node.exec(other.id, "cat /sys/fs/cgroup/memory/memory.limit_in_bytes").stdout)
    assert 0 < limit <= 256 << 20, limit
    node.destroy(other.id)
    caps = node.create("task", capabilities=("CAP_KILL",))
    assert not caps.timing.pooled
    node.destroy(caps.id)
    build = node.create("task", prefetch=False)  # transient (build) environments never use the pool
    assert not build.timing.pooled
    node.destroy(build.id)
    assert ahead <= set(_containers(node))  # still there for the next plain create
    assert node.create("task").timing.pooled


def test_drop_caches_removes_the_pool_and_the_next_start_is_cold(pooled_node, paths):
    node = pooled_node
    _warm_up(node)
    _wait_ready(node)
    node.drop_caches()
    assert node.pool.stats().ready == 0 and not _containers(node) and not _overlays(paths)
    assert not any(paths.environments.iterdir())
    info = node.create("task")
    assert not info.timing.pooled and info.timing.chunks_fetched > 0
    node.destroy(info.id)
    time.sleep(0.3)
    assert not _containers(node)  # drop_caches forgot the uses: one create is not enough


def test_a_pooled_environment_whose_process_died_is_created_anew(pooled_node, paths):
    node = pooled_node
    _warm_up(node)
    _wait_ready(node)
    (cid,) = _containers(node)
    pid = int((paths.environments / cid.removeprefix("weenv-") / "bundle" / "init.pid").read_text())
    os.kill(pid, signal.SIGKILL)
    info = node.create("task")
    assert not info.timing.pooled and info.id == cid.removeprefix("weenv-")
    assert node.exec(info.id, ["python3", "hello.py"]).stdout == b"hello from the task\n"
    node.destroy(info.id)


def test_a_pooled_environment_on_a_superseded_lazy_mount_is_not_started(pooled_node, paths, shared_store):
    """Once a group's image is assembled, new environments mount it directly:
    one pooled before, reading that group through FUSE, is removed instead."""
    node = pooled_node
    task_digest = load_template(shared_store, "task")[1].groups[1]
    _warm_up(node)
    _wait_ready(node)
    (cid,) = _containers(node)
    node.lazyfs.image_path(task_digest).read_bytes()  # every chunk of the task group into the cache
    assert node.groups.assemble_if_complete(task_digest, load_group(shared_store, task_digest))
    node.groups.wait_assembled()
    info = node.create("task")  # under the pooled one's id, made anew
    assert not info.timing.pooled and cid == f"weenv-{info.id}"
    # the group mount points under its rootfs (through its idmapped clones in a user namespace)
    assert node.groups.direct_path(task_digest) in node.snapshotter.overlay_lowers(node.snapshotter.dir(info.id))
    node.destroy(info.id)


def test_a_failed_fill_leaves_nothing_and_waits(paths, shared_store, leak_check):
    with Node(paths, store=shared_store, pool_size=0) as node:
        _warm_up(node)  # created twice, nothing ahead yet
        binary, node.runc.binary = node.runc.binary, str(paths.home / "no-runc")
        try:
            node.pool.configure(size=1)  # the fill starts and fails: runc is gone
            deadline = time.monotonic() + 30
            while node.pool.stats().failed == 0:
                assert time.monotonic() < deadline, node.pool.stats()
                time.sleep(0.01)
        finally:
            node.runc.binary = binary
        assert not _overlays(paths) and not any(paths.environments.iterdir()) and not _containers(node)
        info = node.create("task")  # the failed key backs off: a create neither waits nor finds one
        assert not info.timing.pooled
        node.destroy(info.id)
        time.sleep(0.3)
        assert node.pool.stats().ready == 0 and not _containers(node)


def test_idle_and_least_recent_keys_are_removed(pooled_node, paths):
    node = pooled_node
    node.pool.configure(max_templates=1)
    _warm_up(node)
    _wait_ready(node)
    (first,) = _containers(node)
    _warm_up(node, resources=Resources(cpus=1.0))  # another key: the same template with other resources
    deadline = time.monotonic() + 30
    while first in _containers(node) or len(_containers(node)) != 1:
        assert time.monotonic() < deadline, _containers(node)
        time.sleep(0.01)
    time.sleep(0.3)
    assert len(_containers(node)) == 1 and node.pool.stats().filled == 2  # no churn between the two keys

    node.pool.configure(idle_s=0.5)
    deadline = time.monotonic() + 10
    while _containers(node) or node.pool.stats().removed < 2:  # counted once its removal has ended
        assert time.monotonic() < deadline, (_containers(node), node.pool.stats())
        time.sleep(0.05)
    assert not _overlays(paths) and node.pool.stats().removed == 2


def test_concurrent_creates_share_one_pooled_environment(pooled_node, paths):
    node = pooled_node
    _warm_up(node)
    _wait_ready(node)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        infos = list(pool.map(lambda _: node.create("task"), range(8)))
    assert sum(i.timing.pooled for i in infos) >= 1  # the ready one, and maybe fills that followed
    assert len({i.id for i in infos}) == 8
    for i in infos:
        assert node.exec(i.id, ["true"]).exit_code == 0
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(node.destroy, [i.id for i in infos]))
    node.pool.drain()
    assert not _containers(node) and not _overlays(paths)


def test_pool_size_zero_creates_nothing_ahead(paths, shared_store, leak_check):
    with Node(paths, store=shared_store, pool_size=0) as node:
        _warm_up(node)
        _warm_up(node)
        time.sleep(0.3)
        assert not _containers(node) and node.pool.stats().filled == 0


def test_the_pool_respects_max_environments(paths, shared_store, leak_check):
    with Node(paths, store=shared_store, pool_size=1, max_environments=2) as node:
        _warm_up(node)
        _wait_ready(node)
        a = node.create("task")  # takes it; 1 running + 1 ahead = 2: allowed
        _wait_ready(node)
        b = node.create("task")
        time.sleep(0.5)
        assert node.pool.stats().ready == 0 and len(_containers(node)) == 2  # 2 running: none ahead
        node.destroy(a.id)
        node.destroy(b.id)


def test_a_killed_node_leaves_its_pooled_environments_to_the_next(paths, shared_store, leak_check, tmp_path):
    """A node process killed with pooled environments: the next node on the
    home removes them (they never had an env.json)."""
    kill_a_node_holding_a_pooled_environment(paths, shared_store, tmp_path)
    node = Node(paths, store=shared_store, pool_size=0)
    pooled = [s["id"] for s in node.runc.list() if s["status"] == "created"]
    assert len(pooled) == 1 and _overlays(paths)
    with node:
        assert not _containers(node) and not _overlays(paths) and not any(paths.environments.iterdir())
        assert not list(Path("/sys/fs/cgroup/memory").glob(pooled[0]))


def test_a_create_refused_after_taking_gives_the_pooled_environment_back(paths, shared_store, leak_check):
    """Admission refuses a create that already took a pooled environment: it
    goes back to the pool untouched (not removed, nothing made again)."""
    from weenv.errors import CapacityError
    from weenv.node.provision import ProvisionConfig

    cores = os.cpu_count()
    big = Resources(cpus=float(cores), memory_bytes=256 << 20)  # one fills the node's budget
    config = ProvisionConfig(mode="static", cpu_overcommit=1.0)
    with Node(paths, store=shared_store, pool_size=1, provisioning=config) as node:
        _warm_up(node, resources=big)
        _wait_ready(node)
        a = node.create("task", resources=big)
        assert a.timing.pooled
        _wait_ready(node)
        (ahead,) = set(_containers(node)) - {f"weenv-{a.id}"}
        before = node.pool.stats()
        for _ in range(3):
            with pytest.raises(CapacityError):
                node.create("task", resources=big)
        after = node.pool.stats()
        assert (after.ready, after.removed, after.filled, after.hits) == (1, before.removed, before.filled, before.hits)
        assert _containers(node)[ahead] == "created"
        node.destroy(a.id)
        b = node.create("task", resources=big)
        assert b.timing.pooled and f"weenv-{b.id}" == ahead
        node.destroy(b.id)


def test_a_create_waiting_for_a_fill_gets_what_it_makes(pooled_node):
    """Creates arriving while a fill is under way: the first waits for it and
    gets it, whatever arrives meanwhile."""
    node = pooled_node
    _warm_up(node)
    _wait_ready(node)
    for _ in range(5):
        a = node.create("task")  # takes the ready one; its fill starts when it ends
        assert a.timing.pooled
        deadline = time.monotonic() + 10
        while not node.pool._inflight:  # the fill is under way
            assert time.monotonic() < deadline
            time.sleep(0.001)
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            infos = list(pool.map(lambda _: node.create("task"), range(3)))
        assert sum(i.timing.pooled for i in infos) >= 1
        for i in [a, *infos]:
            node.destroy(i.id)
        _wait_ready(node)


def test_drain_returns_once_everything_is_removed(pooled_node, paths):
    node = pooled_node
    _warm_up(node)
    _wait_ready(node)
    node.pool.configure(idle_s=0.05)  # the fill thread removes it by itself...
    node.pool.drain()  # ...and drain waits for that removal too
    assert not _containers(node) and not _overlays(paths) and not any(paths.environments.iterdir())
    assert node.pool.stats().ready == 0


def test_a_moved_name_forgets_the_old_templates_pooled_environments(private_store_for_pool, paths):
    from weenv.formats.manifest import RuntimeConfig
    from weenv.packaging.template import create_template

    store = private_store_for_pool
    with Node(paths, store=store, pool_size=1) as node:
        _warm_up(node, "moving")
        _wait_ready(node)
        (old,) = _containers(node)
        create_template(store, "moving", ["base", "task"], runtime=RuntimeConfig(working_dir="/tmp"))
        info = node.create("moving")  # starts the old one speculatively, undoes it, starts the new
        assert node.exec(info.id, ["pwd"]).stdout == b"/tmp\n"
        time.sleep(0.3)
        assert old not in _containers(node) and node.pool.stats().ready == 0  # not made again either
        node.destroy(info.id)


@pytest.fixture
def private_store_for_pool(tmp_path, shared_store, leak_check):
    """The shared store's files (hard links) and a template ``moving`` of its own."""
    from weenv.formats.manifest import RuntimeConfig
    from weenv.packaging.template import create_template
    from weenv.store.file import FileStore

    root = tmp_path / "store"
    subprocess.run(["cp", "-al", str(shared_store.root), str(root)], check=True)
    store = FileStore(root)
    create_template(store, "moving", ["base", "task"], runtime=RuntimeConfig(working_dir="/workspace"))
    return store


def kill_a_node_holding_a_pooled_environment(paths, store, tmp_path) -> int | None:
    """Run a node in a process of its own on ``paths``'s home until its pool
    holds an environment, then SIGKILL that process; the pid of its FUSE
    holder (which outlives it), if one runs."""
    script = tmp_path / "node.py"
    script.write_text(
        "import sys, time\n"
        "from weenv.config import Paths\nfrom weenv.node.node import Node\nfrom weenv.store.file import FileStore\n"
        "node = Node(Paths.from_env(), store=FileStore(sys.argv[1]), pool_size=1).start()\n"
        "for _ in range(2):\n    node.destroy(node.create('task').id)\n"
        "while node.pool.stats().ready < 1:\n    time.sleep(0.01)\n"
        "print('ready', flush=True)\ntime.sleep(600)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, str(script), str(store.root)],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        assert proc.stdout.readline() == b"ready\n"
        from weenv.node.data.fuse import holder

        return holder.pid_of(paths.run)
    finally:
        proc.kill()
        proc.wait()
