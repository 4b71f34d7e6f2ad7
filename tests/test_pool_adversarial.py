"""Adversarial tests of the warm pool (weenv.node.state.pool wired into Node):
races between creates, fills, close, drop_caches and configure; pooled
containers damaged from outside; admission and capacity around a take;
templates that move; a killed node.  Real runc, overlay and group mounts.

Where a race needs a wide window, ``runc`` is wrapped by a shell script that
sleeps before one verb and then execs the real runc (nothing is mocked: the
containers, mounts and cgroups are real, only slower to appear).

Tests marked "fixed" in their docstring failed on the pool's first version
(each names the fault); the others guard behaviour worth keeping.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from test_pool import kill_a_node_holding_a_pooled_environment
from weenv.errors import CapacityError, MountError, NotFoundError
from weenv.formats.manifest import Resources, RuntimeConfig
from weenv.node.data.fuse import holder
from weenv.node.node import Node, _overlay_lowers
from weenv.node.provision import ProvisionConfig
from weenv.packaging.template import create_template, load_template

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def on_runc(monkeypatch):
    """These tests put slow or failing runc wrappers in the node's way: its
    nodes run runc (the node's runtime under WEENV_RUNTIME=runc)."""
    monkeypatch.setenv("WEENV_RUNTIME", "runc")


REAL_RUNC = shutil.which("runc") or "runc"


# --- what a test may leave behind ------------------------------------------------------
def _containers(paths) -> dict[str, str]:
    """runc's containers under the home: id -> status."""
    r = subprocess.run(
        [REAL_RUNC, "--root", str(paths.runc_root), "list", "--format", "json"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if r.returncode != 0:
        return {}
    return {s["id"]: s["status"] for s in (json.loads(r.stdout or "null") or [])}


def _created(paths) -> list[str]:
    """Containers waiting in runc's exec FIFO: the pool's."""
    return sorted(c for c, s in _containers(paths).items() if s == "created")


def _mounts(paths) -> list[str]:
    with open("/proc/mounts") as f:
        return [line.split()[1] for line in f if line.split()[1].startswith(str(paths.home))]


def _weenv_cgroups() -> set[str]:
    return {str(p) for p in Path("/sys/fs/cgroup").glob("*/weenv-*") if p.is_dir()}


def _leaks(paths, cgroups_before: set[str]) -> dict:
    return {
        "containers": _containers(paths),
        "mounts": _mounts(paths),
        "cgroups": sorted(_weenv_cgroups() - cgroups_before),
    }


def _wait_for(cond, what: str = "", timeout: float = 30.0, poll: float = 0.01) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"not after {timeout} s: {what}"
        time.sleep(poll)


def _wait_ready(node, n: int = 1, timeout: float = 30.0) -> None:
    _wait_for(lambda: node.pool.stats().ready >= n, f"{n} ready in {node.pool.stats()}", timeout)


def _warm_up(node, template: str = "task", **kwargs) -> None:
    """Two creates of ``template`` (destroyed): the pool then fills it."""
    for _ in range(2):
        node.destroy(node.create(template, **kwargs).id)


def _slow_runc(tmp_path: Path, **delays: float) -> str:
    """A runc that sleeps ``delays[verb]`` seconds before ``runc --root R VERB ...``."""
    script = tmp_path / "slow-runc"
    cases = "".join(f"  {verb}) sleep {s};;\n" for verb, s in delays.items())
    script.write_text(f'#!/bin/sh\ncase "$3" in\n{cases}esac\nexec {REAL_RUNC} "$@"\n')
    script.chmod(0o755)
    return str(script)


def _in_thread(fn, out: dict, name: str) -> threading.Thread:
    def run():
        try:
            out[name] = fn()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            out[name] = exc

    t = threading.Thread(target=run, name=name, daemon=True)
    t.start()
    return t


def _pooled_pid(paths, cid: str) -> int:
    return int((paths.environments / cid.removeprefix("weenv-") / "bundle" / "init.pid").read_text())


@pytest.fixture
def home(paths, shared_store, leak_check):
    """The test's nodes (append them), closed at the end; whatever a test
    leaked is then cleared (a fresh node on the home, then by hand) so that a
    failing test leaves nothing on the machine."""
    nodes: list[Node] = []
    before = _weenv_cgroups()
    nodes_and_cgroups = (nodes, before)
    yield nodes_and_cgroups
    for n in nodes:
        with contextlib.suppress(Exception):
            n.runc.binary = REAL_RUNC
            n.close()
    if any(_leaks(paths, before).values()):
        with contextlib.suppress(Exception):
            Node(paths, store=shared_store, pool_size=0).start().close()
    for cid in _containers(paths):
        subprocess.run(
            [REAL_RUNC, "--root", str(paths.runc_root), "delete", "--force", cid], capture_output=True, timeout=60
        )
    for point in sorted(_mounts(paths), key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True)
    for cg in sorted(_weenv_cgroups() - before, key=len, reverse=True):
        with contextlib.suppress(OSError):
            os.rmdir(cg)
    pid = holder.pid_of(paths.run)
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)


def _start(home, paths, store, **kwargs) -> Node:
    node = Node(paths, store=store, **kwargs).start()
    home[0].append(node)
    return node


# --- races ------------------------------------------------------------------------------
def test_close_while_a_create_waits_for_a_fill_leaves_nothing(paths, shared_store, home, tmp_path):
    """Fixed (it failed before).  Scenario: a create waits in WarmPool.take for the fill under way
    (the claim-wait) when node.close() runs.  close() wakes it with no
    environment; the create then builds a new one from scratch on the node
    being closed, after close has destroyed the environments it knew and
    unmounted the groups.  Before the fix, depending on what the page cache still
    holds once LazyFS stopped: the create returns a running environment that
    the closed node no longer knows (container, overlay and cgroups leaked),
    or it fails and its undo raises MountError "group ... is not acquired"
    (close reset the group references under it).  Expected: once both calls
    have returned nothing of the home remains, and the create either failed
    cleanly (e.g. the node is not started) or was destroyed by close."""
    node = _start(home, paths, shared_store, pool_size=0)
    _warm_up(node)
    node.runc.binary = _slow_runc(tmp_path, create=1.0, run=2.0)  # the fill: 1 s; a create anew: 2 s
    node.pool.configure(size=1)
    _wait_for(lambda: any(paths.environments.iterdir()), "the fill began")
    out: dict = {}
    creator = _in_thread(lambda: node.create("task"), out, "create")
    time.sleep(0.3)  # it claims the fill under way and waits for it
    closer = _in_thread(node.close, out, "close")
    creator.join(60)
    closer.join(60)
    assert not creator.is_alive() and not closer.is_alive(), "hung"
    time.sleep(0.5)
    leaks = _leaks(paths, home[1])
    r = out.get("create")
    chain, e = [], r if isinstance(r, BaseException) else None
    while e is not None:  # an undo's error hides the create's own: show both
        chain.append(repr(e)[:300])
        e = e.__context__
    assert not any(leaks.values()) and not isinstance(r, MountError), (
        f"after close: leaked {leaks}; the create -> {chain or repr(r)[:200]}"
    )


def test_drop_caches_waits_for_pooled_environments_being_removed(paths, shared_store, home, tmp_path):
    """Fixed (it failed before).  Scenario: the fill thread has taken an idle key's environment
    out of the pool and is removing it (outside the pool's lock, not counted
    as a fill under way) when drop_caches runs.  drain() sees an empty pool
    and returns at once, drop_caches unmounts "unused" groups while the
    environment still holds them.  Expected (drain's contract, "the pool
    starts empty"): when drop_caches returns no pooled container remains, and
    every group is unmounted."""
    node = _start(home, paths, shared_store, pool_size=1)
    _warm_up(node)
    _wait_ready(node)
    node.runc.binary = _slow_runc(tmp_path, delete=0.5)  # a removal takes 0.5 s longer
    node.pool.configure(idle_s=0.3)
    _wait_for(lambda: node.pool.stats().ready == 0, "the idle key's environment taken out", poll=0.001)
    node.drop_caches()
    left = _containers(paths)
    _wait_for(lambda: not _containers(paths), "the removal ended")
    mounted = node.groups.mounted()
    assert not left and not mounted, (
        f"drop_caches returned while pooled containers remained: {left}; groups mounted once they went: {mounted}"
    )


def test_the_pool_never_holds_more_than_max_environments_allow(paths, shared_store, home, tmp_path):
    """Fixed (it failed before).  Scenario: max_environments=1; a fill begins (the node is empty:
    allowed) and, while it runs, a create of another key takes the node's one
    place.  The fill then keeps its environment anyway: 1 running + 1 ahead
    with max 1, the pooled one useless (every create of its key now raises
    CapacityError) until idle.  Expected, as test_the_pool_respects_max_environments
    has it: running + ready <= max_environments."""
    node = _start(home, paths, shared_store, pool_size=0, max_environments=1)
    _warm_up(node)
    node.runc.binary = _slow_runc(tmp_path, create=1.0)  # only fills use runc create
    node.pool.configure(size=1)
    _wait_for(lambda: any(paths.environments.iterdir()), "the fill began")
    other = node.create("task", resources=Resources(cpus=0.5, memory_bytes=256 << 20))  # another key
    time.sleep(1.5)  # the fill ends
    held = node.count() + node.pool.stats().ready
    node.destroy(other.id)
    assert held <= 1, f"{held} environments on a node of max_environments=1 (containers {_containers(paths)})"


# --- what a take does with what it finds -----------------------------------------------
def test_a_create_refused_admission_keeps_the_pooled_environment(paths, shared_store, home):
    """Fixed (it failed before).  Scenario: static provisioning with room for one environment;
    one runs (it took the pooled one), the pool is filled again, and the next
    create is refused (CapacityError).  It took the pooled environment first,
    so the refusal destroys it, counts a pool hit, and the pool builds yet
    another: a full node churns one create+destroy per refused request.
    Expected: the refused create leaves the ready environment in the pool and
    is not counted as a hit."""
    node = _start(
        home,
        paths,
        shared_store,
        pool_size=1,
        provisioning=ProvisionConfig(mode="static", cpu_capacity=1.0, cpu_overcommit=1.0),
    )
    _warm_up(node)
    _wait_ready(node)
    a = node.create("task")  # 1 of 1 core reserved
    assert a.timing.pooled
    _wait_ready(node)
    (ready,) = _created(paths)
    hits = node.pool.stats().hits
    with pytest.raises(CapacityError):
        node.create("task")
    still = _containers(paths).get(ready)
    stats = node.pool.stats()
    node.destroy(a.id)
    assert still == "created", f"the ready environment {ready} was used up by a refused create"
    assert stats.hits == hits, f"a refused create counted as a pool hit: {stats}"


def test_a_create_that_could_not_start_the_pooled_environment_is_not_a_hit(paths, shared_store, home):
    """Fixed (it failed before).  Scenario: the pooled environment's waiting process was killed;
    the next create takes it, cannot start it, and creates one anew (not
    pooled).  PoolStats.hits is documented as "creates that started a pooled
    environment".  Expected: a miss; before the fix: counted as a hit."""
    node = _start(home, paths, shared_store, pool_size=1)
    _warm_up(node)
    _wait_ready(node)
    (cid,) = _created(paths)
    os.kill(_pooled_pid(paths, cid), signal.SIGKILL)
    before = node.pool.stats()
    info = node.create("task")
    after = node.pool.stats()
    node.destroy(info.id)
    assert not info.timing.pooled
    assert (after.hits, after.misses) == (before.hits, before.misses + 1), f"{before} -> {after}"


def test_a_stopped_pooled_process_does_not_hold_a_create(paths, shared_store, home):
    """Fixed (it failed before).  Scenario: the pooled container's waiting process is stopped
    (SIGSTOP; still "created" to runc).  The next create takes it and runs
    ``runc start``, which blocks reading the exec FIFO that the stopped
    process never writes, until runc's command timeout (60 s by default, 6 s
    here).  Expected: the create does not wait on a broken pooled
    environment longer than a create from scratch takes (a few seconds at most)."""
    node = _start(home, paths, shared_store, pool_size=1)
    node.runc.command_timeout = 6.0
    _warm_up(node)
    _wait_ready(node)
    (cid,) = _created(paths)
    os.kill(_pooled_pid(paths, cid), signal.SIGSTOP)
    t = time.monotonic()
    info = node.create("task")
    took = time.monotonic() - t
    assert node.exec(info.id, ["true"]).exit_code == 0
    node.destroy(info.id)
    assert cid not in _containers(paths)
    assert took < 3.0, f"the create took {took:.1f} s behind a stopped pooled environment"


def test_a_frozen_pooled_container_is_replaced(paths, shared_store, home):
    """Scenario: the pooled container's cgroup is frozen (freezer
    FROZEN; runc then calls it "paused").  The next create must not hang
    on it: it is removed and the environment created anew, and works."""
    node = _start(home, paths, shared_store, pool_size=1)
    _warm_up(node)
    _wait_ready(node)
    (cid,) = _created(paths)
    state = Path("/sys/fs/cgroup/freezer") / cid / "freezer.state"
    state.write_text("FROZEN")
    _wait_for(lambda: state.read_text().strip() == "FROZEN", "frozen")
    out: dict = {}
    t = _in_thread(lambda: node.create("task"), out, "create")
    t.join(20)
    assert not t.is_alive(), "create hung on a frozen pooled container"
    info = out["create"]
    assert not isinstance(info, BaseException), info
    assert not info.timing.pooled
    assert node.exec(info.id, ["python3", "hello.py"]).stdout == b"hello from the task\n"
    node.destroy(info.id)
    assert cid not in _containers(paths)


def test_a_pooled_environment_whose_overlay_was_unmounted_is_not_started(paths, shared_store, home):
    """Fixed (it failed before).  Scenario: the pooled environment's overlay rootfs is unmounted
    on the host (the container, created already, keeps its own copy in its
    mount namespace).  The next create starts it anyway: the environment runs,
    but its rootfs on the host is an empty directory, so node.files() reads
    and writes a different tree than the environment's processes see.
    Expected: like a pooled environment whose process died, it is removed and
    the environment created anew (the host's rootfs is its overlay)."""
    node = _start(home, paths, shared_store, pool_size=1)
    _warm_up(node)
    _wait_ready(node)
    (cid,) = _created(paths)
    rootfs = paths.environments / cid.removeprefix("weenv-") / "rootfs"
    r = subprocess.run(["umount", str(rootfs)], capture_output=True, text=True)
    if r.returncode != 0:
        subprocess.run(["umount", "-l", str(rootfs)], check=True)
    info = node.create("task")
    try:
        node.files(info.id).write_file("/workspace/from-host.txt", b"seen\n")
        inside = node.exec(info.id, "cat /workspace/from-host.txt").stdout
        host_view = _overlay_lowers(Path(info.rootfs))
    finally:
        node.destroy(info.id)
    assert host_view is not None and inside == b"seen\n", (
        f"pooled={info.timing.pooled}: host rootfs overlay {host_view}, file written on the host read inside: {inside!r}"
    )


# --- templates that move -----------------------------------------------------------------
@pytest.fixture
def own_store(tmp_path, shared_store):
    """The shared store's files, hard-linked into a store of the test's own
    (templates made, moved or deleted here stay out of the session's store)."""
    from weenv.store.file import FileStore

    root = tmp_path / "own-store"
    subprocess.run(["cp", "-al", str(shared_store.root), str(root)], check=True)
    return FileStore(root)


def test_a_moved_template_name_does_not_keep_its_old_digest_warm(paths, own_store, home, tmp_path):
    """Fixed (it failed before).  Scenario: template ``moving`` is warm (pooled); its name is
    then moved to a new digest (a new version published).  The next create of
    the name starts the old digest's pooled environment (the name's last
    digest, started while the store is asked), finds the name moved and
    undoes it; the failed create of the old key makes the pool fill the OLD
    digest again, and two creates of the new version fill that one too: the
    node keeps an environment of an outdated version ready (group mounts,
    runc init, cgroup) until idle_s (5 minutes).  Expected: once the name
    moved and was created twice, only its current digest is kept ready."""
    name = f"moving-{tmp_path.name[-12:]}"
    create_template(own_store, name, ["base", "task"], runtime=RuntimeConfig(working_dir="/workspace"))
    node = _start(home, paths, own_store, pool_size=1)
    _warm_up(node, name)
    _wait_ready(node)
    create_template(own_store, name, ["base", "task"], runtime=RuntimeConfig(working_dir="/tmp"))  # moves it
    new_digest = load_template(own_store, name)[0]
    for _ in range(2):
        info = node.create(name)
        assert info.template_digest == new_digest
        node.destroy(info.id)
    time.sleep(1.5)  # the fill thread does what it does
    cwds = []
    for cid in _created(paths):
        cfg = json.loads((paths.environments / cid.removeprefix("weenv-") / "bundle" / "config.json").read_text())
        cwds.append(cfg["process"]["cwd"])
    assert cwds == ["/tmp"], f"pooled environments by working dir (old: /workspace, new: /tmp): {cwds}"


def test_a_deleted_template_is_not_created_ahead_again(paths, own_store, home, tmp_path):
    """Fixed (it failed before).  Scenario: template ``deleted-*`` is warm (pooled), then deleted
    from the store (its ref and manifest, as gc would remove them).  The next
    create of the name starts the pooled environment of the deleted template
    (its last digest, started while the store is asked), then raises
    NotFoundError; that failed create of the key makes the pool build a NEW
    environment of the deleted template (its manifest is still in the node's
    memory) and keep it ready until idle_s.  Expected: no environment of a
    template the store no longer has is created ahead."""
    name = f"deleted-{tmp_path.name[-12:]}"
    create_template(own_store, name, ["base", "task"], runtime=RuntimeConfig(working_dir="/srv"))
    digest = load_template(own_store, name)[0]
    node = _start(home, paths, own_store, pool_size=1)
    _warm_up(node, name)
    _wait_ready(node)
    (first,) = _created(paths)
    own_store.delete_ref("templates", name)
    own_store.delete_manifest(digest)
    with pytest.raises(NotFoundError):
        node.create(name)
    time.sleep(1.5)  # the fill thread does what it does
    again = [c for c in _created(paths) if c != first]
    stats = node.pool.stats()
    assert not again, f"created ahead again for deleted template {digest[:19]}: {again} ({stats})"


def test_a_pooled_container_deleted_from_outside_is_created_anew(paths, shared_store, home):
    """Scenario: an operator deletes the pooled container with runc
    (its overlay and directory stay).  The next create must not fail: the
    leftover is removed and the environment created anew under that id."""
    node = _start(home, paths, shared_store, pool_size=1)
    _warm_up(node)
    _wait_ready(node)
    (cid,) = _created(paths)
    subprocess.run(
        [REAL_RUNC, "--root", str(paths.runc_root), "delete", "--force", cid],
        check=True,
        capture_output=True,
        timeout=60,
    )
    info = node.create("task")
    assert not info.timing.pooled
    assert node.exec(info.id, ["python3", "hello.py"]).stdout == b"hello from the task\n"
    node.destroy(info.id)
    node.pool.drain()
    assert not _containers(paths) and not [m for m in _mounts(paths) if m.startswith(str(paths.environments) + "/")]


def test_close_during_a_slow_fill_waits_for_it_and_leaves_nothing(paths, shared_store, home, tmp_path):
    """Scenario: node.close() while the fill thread is inside a slow
    ``runc create`` (1 s).  close must wait for the fill, remove what it made,
    and return without leaving a container, mount or cgroup."""
    node = _start(home, paths, shared_store, pool_size=0)
    _warm_up(node)
    node.runc.binary = _slow_runc(tmp_path, create=1.0)
    node.pool.configure(size=1)
    _wait_for(lambda: any(paths.environments.iterdir()), "the fill began")
    t = time.monotonic()
    node.close()
    took = time.monotonic() - t
    leaks = _leaks(paths, home[1])
    assert not any(leaks.values()), leaks
    assert took < 15, took


def test_configure_size_zero_during_a_burst_leaves_nothing(paths, shared_store, home):
    """Scenario: creates and destroys from 4 threads (two keys) while
    another thread flips the pool's size between 0, 1 and 2 and drains it,
    fills starting and being discarded throughout.  Expected: every create
    works, nothing hangs, and after close nothing of the home remains."""
    node = _start(home, paths, shared_store, pool_size=1)
    _warm_up(node)
    _warm_up(node, resources=Resources(cpus=0.5, memory_bytes=256 << 20))
    stop = time.monotonic() + 5.0
    errors: list[BaseException] = []

    def creator(i: int) -> None:
        kwargs = {"resources": Resources(cpus=0.5, memory_bytes=256 << 20)} if i % 2 else {}
        while time.monotonic() < stop:
            try:
                info = node.create("task", **kwargs)
                assert node.exec(info.id, ["true"]).exit_code == 0
                node.destroy(info.id)
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)
                return

    def flipper() -> None:
        sizes = [0, 2, 1, 0, 1]
        i = 0
        while time.monotonic() < stop:
            node.pool.configure(size=sizes[i % len(sizes)])
            if i % 3 == 2:
                node.pool.drain()
            i += 1
            time.sleep(0.15)

    threads = [threading.Thread(target=creator, args=(i,), daemon=True) for i in range(4)]
    threads.append(threading.Thread(target=flipper, daemon=True))
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "hung"
    assert not errors, errors
    node.pool.configure(size=1)
    stats = node.pool.stats()
    node.close()
    leaks = _leaks(paths, home[1])
    assert not any(leaks.values()), (stats, leaks)


def test_a_killed_node_and_fuse_holder_leave_their_pooled_environments_to_the_next(paths, shared_store, home, tmp_path):
    """Scenario: a node process with a pooled environment is SIGKILLed
    and so is its FUSE holder (no take-over: the next node clears the home as
    after a crash).  Expected: the next node (with a pool) starts, removes the
    pooled container, its overlay and cgroups, and works (and pools) again."""
    hold = kill_a_node_holding_a_pooled_environment(paths, shared_store, tmp_path)
    assert hold is not None
    os.kill(hold, signal.SIGKILL)
    _wait_for(lambda: holder.pid_of(paths.run) is None, "the holder gone")
    (pooled,) = _created(paths)
    node = _start(home, paths, shared_store, pool_size=1)
    assert not _containers(paths) and not [m for m in _mounts(paths) if m.startswith(str(paths.environments) + "/")]
    assert not [c for c in _weenv_cgroups() if c.endswith(pooled)]
    _warm_up(node)
    _wait_ready(node)
    node.create("task")
    node.close()
    leaks = _leaks(paths, home[1])
    assert not any(leaks.values()), leaks
