"""Snapshot, fork, reset and pause/resume of running environments (issue 16),
with real mounts, btrfs snapshots, runc and the cgroup freezer."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from test_network_lists import _reach, far_hosts, no_leak  # noqa: F401  (fixtures)
from weenv.config import Paths
from weenv.errors import InvalidInputError, NotFoundError, StateError
from weenv.node.node import Node
from weenv.node.state.snapshot import CAPTURES
from weenv.store.file import FileStore

# the parent's changes to the template: a new file, a changed one, a deleted base
# file (a whiteout), a lower directory replaced by a new one (an opaque dir)
SETUP = (
    "set -e; mkdir -p /workspace/new && echo one > /workspace/new/a.txt"
    " && echo changed > /workspace/hello.py && rm /etc/hostname"
    " && rm -rf /usr/share/doc && mkdir /usr/share/doc && echo mine > /usr/share/doc/only.txt"
)
TREE = "cat /workspace/new/a.txt /workspace/hello.py /usr/share/doc/only.txt; ls /usr/share/doc; test -e /etc/hostname && echo hostname || echo no-hostname"
EXPECTED = b"one\nchanged\nmine\nonly.txt\nno-hostname\n"


@pytest.fixture
def store(tmp_path, shared_store) -> FileStore:
    """A private copy of the shared store (hard links; writes replace files by rename)."""
    root = tmp_path / "store"
    subprocess.run(["cp", "-al", str(shared_store.root), str(root)], check=True)
    return FileStore(root)


@pytest.fixture
def node(paths, store, leak_check):
    n = Node(paths, store=store, pool_size=0).start()
    try:
        yield n
    finally:
        n.close()


def sh(node: Node, env_id: str, script: str) -> bytes:
    r = node.exec(env_id, ["sh", "-c", script])
    assert r.exit_code == 0, r.stderr
    return r.stdout


def captures(paths: Paths) -> list[str]:
    """The node's captures (its directory is there only while one is)."""
    root = paths.environments / CAPTURES
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def test_snapshot_starts_on_a_fresh_home_lazily_with_the_same_tree(node, paths, store, tmp_path):
    parent = node.create("task")
    sh(node, parent.id, SETUP)
    assert sh(node, parent.id, TREE) == EXPECTED
    snap = node.snapshot(parent.id, "snap-one")
    assert snap.name == "snap-one" and snap.capture_s < 1.0
    assert [s.name for s in node.snapshots()] == ["snap-one"]
    # the parent runs on, unchanged, and keeps writing
    assert sh(node, parent.id, TREE) == EXPECTED
    sh(node, parent.id, "echo later > /workspace/later.txt")

    other = Paths(tmp_path / "home2", paths.cache, store.url)
    with Node(other, store=store, pool_size=0) as second:
        info = second.create("snap-one")
        assert info.timing.bytes_fetched < info.timing.template_bytes  # lazy: not the whole template
        assert sh(second, info.id, TREE) == EXPECTED
        assert sh(second, info.id, "test -e /workspace/later.txt && echo yes || echo no") == b"no\n"
        second.destroy(info.id)
    node.delete_snapshot("snap-one")
    assert node.snapshots() == []
    with pytest.raises(NotFoundError):
        node.delete_snapshot("snap-one")
    with pytest.raises(InvalidInputError):
        node.delete_snapshot("task")  # a template, not a snapshot
    node.destroy(parent.id)
    with pytest.raises(NotFoundError):
        node.snapshot(parent.id)


def test_fork_children_see_the_parent_and_diverge_apart(node, paths):
    parent = node.create("task")
    sh(node, parent.id, SETUP)
    result = node.fork(parent.id, 4)
    assert result.pause_s < 1.0
    children = result.children
    assert all(not isinstance(c, Exception) for c in children), children
    assert len({c.id for c in children}) == 4 and parent.id not in {c.id for c in children}
    for i, c in enumerate(children):
        assert c.template == "task" and c.template_digest == parent.template_digest
        assert sh(node, c.id, TREE) == EXPECTED
        sh(node, c.id, f"echo {i} > /workspace/mine.txt && rm /workspace/new/a.txt")
    sh(node, parent.id, "echo parent > /workspace/mine.txt")
    for i, c in enumerate(children):
        assert sh(node, c.id, "cat /workspace/mine.txt; ls /workspace/new") == f"{i}\n".encode()
    assert sh(node, parent.id, "cat /workspace/mine.txt /workspace/new/a.txt") == b"parent\none\n"
    assert captures(paths) == []  # the capture went once the children had their upper dirs
    for c in children:
        node.destroy(c.id)
    node.destroy(parent.id)


def test_fork_counts_outside_the_bounds_are_refused(node, paths):
    parent = node.create("task")
    for count in (0, -1, node.forks.maximum + 1, True, 1.5):
        with pytest.raises(InvalidInputError):
            node.fork(parent.id, count)
    for timeout in (0, -1, float("nan")):  # before: the parent captured, then every child failed
        with pytest.raises(InvalidInputError, match="timeout"):
            node.fork(parent.id, 1, timeout=timeout)
    assert captures(paths) == []
    with pytest.raises(NotFoundError):
        node.fork("nope", 1)
    assert node.count() == 1
    node.destroy(parent.id)


def test_reset_restores_the_template_or_the_snapshot_in_place(node, paths):
    e = node.create("task")
    sh(node, e.id, SETUP)
    node.snapshot(e.id, "after-setup")
    sh(node, e.id, "echo episode > /workspace/episode.txt && rm /workspace/new/a.txt")
    pid1 = sh(node, e.id, "sleep 1000 & echo $!")
    info = node.reset(e.id, "after-setup")
    assert info.id == e.id and info.state == "running" and info.resources == e.resources
    assert sh(node, e.id, TREE) == EXPECTED
    assert sh(node, e.id, "test -e /workspace/episode.txt && echo yes || echo no") == b"no\n"
    assert sh(node, e.id, "pgrep -x sleep || echo none") == b"none\n", pid1
    info = node.reset(e.id)  # the template's state
    assert (
        sh(node, e.id, "cat /workspace/hello.py; test -e /etc/hostname && echo hostname")
        == b"print('hello from the task')\nhostname\n"
    )
    print(f"\nreset: {info.timing.total_s * 1000:.1f} ms")
    with pytest.raises(NotFoundError):
        node.reset(e.id, "no-such-snapshot")
    node.destroy(e.id)
    node.delete_snapshot("after-setup")


def test_a_reset_to_a_snapshot_deleted_meanwhile_keeps_the_environment(node, paths):
    """A reset to snapshot N racing ``delete_snapshot(N)``: the reset either
    takes N's files (the capture stays until it is done) or finds no N
    (NotFoundError, the environment untouched); never a stopped environment
    (before: FileNotFoundError from the capture deleted under the reset, and
    the environment left without a container).  No capture is left after."""
    e = node.create("task")
    sh(node, e.id, "echo setup > /workspace/mark")
    with ThreadPoolExecutor(2) as pool:
        for i in range(3):
            node.snapshot(e.id, f"race{i}")
            node.reset(e.id)  # the container made ahead no longer matches race{i}
            reset = pool.submit(node.reset, e.id, f"race{i}")
            pool.submit(node.delete_snapshot, f"race{i}").result()
            try:
                reset.result()
                assert sh(node, e.id, "cat /workspace/mark") == b"setup\n"
            except NotFoundError:
                assert sh(node, e.id, "test -e /workspace/mark && echo yes || echo no") == b"no\n"
            assert node.table.get(e.id).info.state == "running"
    node.destroy(e.id)
    assert captures(paths) == []


def _containers_of(node: Node, env_id: str) -> dict[str, str]:
    """Container id -> runc status of every container of ``env_id`` (its own, made ahead, replaced)."""
    return {
        c["id"]: c["status"]
        for c in node.runc.list()
        if c["id"] == f"weenv-{env_id}" or c["id"].startswith(f"weenv-{env_id}.")
    }


def _cgroups_of(env_id: str) -> set[str]:
    return {p.name for p in Path("/sys/fs/cgroup").glob(f"*/weenv-{env_id}*") if p.is_dir()}


def test_reset_starts_the_container_made_ahead_and_leaves_none_behind(node, paths):
    """After a snapshot (and after each reset) the next reset's container waits
    created (``runc create``) over the spare upper dir: the reset starts it
    (its id moves on, ``weenv-<id>.N``), the killed one and its cgroup go, the
    environment keeps its address, files, agent and commands; a reset to
    another source runs its container again; destroy removes the one made
    ahead too (runc, cgroups, mounts: and the leak check)."""
    e = node.create("task")
    sh(node, e.id, SETUP)
    node.snapshot(e.id, "ahead-snap")
    node.resets.close()  # the background work (spare, container made ahead) is done
    assert _containers_of(node, e.id) == {f"weenv-{e.id}": "running", f"weenv-{e.id}.1": "created"}
    for n in (1, 2, 3):
        sh(node, e.id, "echo episode > /workspace/episode.txt; sleep 1000 >/dev/null 2>&1 &")
        t = node.resets.reset(node.table.get(e.id), node.captures.named("ahead-snap").path)
        assert t.ahead and t.spare, t
        print(
            f"\nreset {n} (made ahead): {t.total_s * 1000:.1f} ms: stop {t.stop_s * 1000:.1f}, "
            f"overlay {t.overlay_s * 1000:.1f}, runc start {t.runtime_s * 1000:.1f}"
        )
        assert node.table.get(e.id).container_id == f"weenv-{e.id}.{n}"
        assert node.get(e.id).state == "running"
        assert sh(node, e.id, TREE) == EXPECTED
        assert (
            sh(node, e.id, "test -e /workspace/episode.txt && echo yes || echo no; pgrep -x sleep || echo none")
            == b"no\nnone\n"
        )
        assert Path(node.get(e.id).rootfs, "workspace/new/a.txt").read_bytes() == b"one\n"  # the host's view follows
        node.resets.close()
        assert _containers_of(node, e.id) == {f"weenv-{e.id}.{n}": "running", f"weenv-{e.id}.{n + 1}": "created"}
        assert not (node.snapshotter.dir(e.id) / "rootfs.old").is_mount()  # the old rootfs, moved aside, went
        assert (
            _cgroups_of(e.id) >= {f"weenv-{e.id}.{n}"}
            and f"weenv-{e.id}.{n - 1}" not in _cgroups_of(e.id)
            and f"weenv-{e.id}" not in _cgroups_of(e.id)
        )
        used, _limit = node.disk_usage(e.id)
        assert used > 0  # the upper dir the kernel counts is the new one
    # to the template's state: its spare is not of that source, so the container runs again
    sh(node, e.id, "echo x > /workspace/x.txt")
    t = node.resets.reset(node.table.get(e.id), None)
    assert not t.ahead and node.table.get(e.id).container_id == f"weenv-{e.id}.3"
    assert (
        sh(node, e.id, "cat /workspace/hello.py; test -e /workspace/x.txt && echo yes || echo no")
        == b"print('hello from the task')\nno\n"
    )
    node.resets.close()
    assert _containers_of(node, e.id) == {f"weenv-{e.id}.3": "running", f"weenv-{e.id}.4": "created"}
    node.destroy(e.id)
    assert _containers_of(node, e.id) == {} and _cgroups_of(e.id) == set()
    assert [p for p in open("/proc/mounts").read().split() if e.id in p] == []
    node.delete_snapshot("ahead-snap")


def test_reset_whose_container_made_ahead_died_runs_it_anew(node):
    """A container made ahead whose waiting ``runc init`` was killed (OOM, an
    operator) does not fail the reset: it is deleted and run anew over the
    prepared rootfs, the environment runs with the snapshot's files, and what
    remains is its container and the next one made ahead (review finding: the
    reset raised RuntimeFailedError and left the environment stopped)."""
    e = node.create("task")
    sh(node, e.id, SETUP)
    node.snapshot(e.id, "dead-snap")
    node.resets.close()
    waiting = node.runc.state(f"weenv-{e.id}.1")
    assert waiting and waiting["status"] == "created"
    os.kill(waiting["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 5
    while os.path.exists(f"/proc/{waiting['pid']}") and time.monotonic() < deadline:
        time.sleep(0.01)
    sh(node, e.id, "echo episode > /workspace/episode.txt")
    t = node.resets.reset(node.table.get(e.id), node.captures.named("dead-snap").path)
    assert t.ahead and node.get(e.id).state == "running"
    assert sh(node, e.id, TREE) == EXPECTED
    assert sh(node, e.id, "test -e /workspace/episode.txt && echo yes || echo no") == b"no\n"
    node.resets.close()
    assert _containers_of(node, e.id) == {f"weenv-{e.id}.1": "running", f"weenv-{e.id}.2": "created"}
    node.destroy(e.id)
    assert _containers_of(node, e.id) == {} and _cgroups_of(e.id) == set()
    node.delete_snapshot("dead-snap")


def test_reset_made_ahead_of_a_memory_released_environment_and_destroy_before_the_background(node):
    """A memory-releasing pause and its resume keep the container made ahead
    (it runs nothing); a reset of it starts that one; a destroy right after a
    reset (its replaced container not deleted yet) leaves nothing."""
    e = node.create("task")
    node.snapshot(e.id, "rel-snap")
    node.resets.close()
    node.pause(e.id, release_memory=True)
    assert _containers_of(node, e.id) == {f"weenv-{e.id}.1": "created"}
    node.resume(e.id)
    assert sh(node, e.id, "echo back") == b"back\n"
    t = node.resets.reset(node.table.get(e.id), node.captures.named("rel-snap").path)
    assert t.ahead
    assert sh(node, e.id, "echo reset") == b"reset\n"
    node.destroy(e.id)  # the background's deletion of weenv-ID may not have run
    node.resets.close()
    assert _containers_of(node, e.id) == {} and _cgroups_of(e.id) == set()
    node.delete_snapshot("rel-snap")


def _counter(path: Path) -> int:
    """The number a running ``echo $i > path`` loop wrote last (read again when
    the read fell between the shell's truncate and its write)."""
    deadline = time.monotonic() + 5
    while not (text := path.read_text()) and time.monotonic() < deadline:
        time.sleep(0.005)
    return int(text)


def test_pause_stops_cpu_and_resume_keeps_pid_and_memory(node):
    e = node.create("task")
    # a counter in memory (a shell variable) printed to a file every 10 ms
    p = node.spawn(e.id, ["sh", "-c", "i=0; while true; do i=$((i+1)); echo $i > /tmp/n; sleep 0.01; done"])
    time.sleep(0.3)
    root = Path(node.get(e.id).rootfs)
    info = node.pause(e.id)
    assert info.state == "paused" and node.get(e.id).state == "paused"
    assert [i.state for i in node.list()] == ["paused"]
    # frozen maybe between the shell's truncate and its write: compare the text
    t0 = (root / "tmp/n").read_text()
    time.sleep(0.3)
    assert (root / "tmp/n").read_text() == t0  # no progress while frozen
    n0 = int(t0 or 0)
    with pytest.raises(StateError):
        node.exec(e.id, ["true"])
    with pytest.raises(StateError):
        node.pause(e.id)
    assert node.reap_expired(now=time.time() + 10**7) == []  # its timeout stands still
    node.resume(e.id)
    time.sleep(0.3)
    n1 = _counter(root / "tmp/n")
    assert n1 > n0 and p.running  # the same process went on counting from where it was (its memory)
    assert sh(node, e.id, f"cat /proc/{p.pid}/cmdline | tr '\\0' ' '").startswith(b"sh -c i=0")  # same pid
    with pytest.raises(StateError):
        node.resume(e.id)
    node.pause(e.id)
    node.destroy(e.id)  # a paused environment is destroyed at once
    assert node.count() == 0


def test_a_fork_past_capacity_lists_each_failed_child_and_leaves_nothing(paths, store, leak_check):
    """Two of four children do not fit (``max_environments``): the others run,
    the result names each failure, and the failed ones left nothing (the
    leak check: mounts, cgroups, subvolumes, processes)."""
    from weenv.errors import CapacityError

    with Node(paths, store=store, pool_size=0, max_environments=3) as node:
        parent = node.create("task")
        sh(node, parent.id, "echo p > /workspace/p.txt")
        result = node.fork(parent.id, 4)
        ok = [c for c in result.children if not isinstance(c, Exception)]
        failed = [c for c in result.children if isinstance(c, Exception)]
        assert len(ok) == 2 and len(failed) == 2 and all(isinstance(f, CapacityError) for f in failed), result
        for c in ok:
            assert sh(node, c.id, "cat /workspace/p.txt") == b"p\n"
        assert sorted(node.snapshotter.dirs()) == sorted(
            node.snapshotter.dir(i) for i in [parent.id, *(c.id for c in ok)]
        )
        assert captures(paths) == []
        for c in ok:
            node.destroy(c.id)
        node.destroy(parent.id)
        assert node.snapshotter.dirs() == []


def test_a_fork_while_the_parent_writes_gives_every_child_one_state(node):
    """The parent rewrites two files in turn as fast as it can; the freeze
    makes one instant of its file system the state of every child."""
    parent = node.create("task")
    node.spawn(parent.id, ["sh", "-c", "i=0; while true; do i=$((i+1)); echo $i > /tmp/a; echo $i > /tmp/b; done"])
    time.sleep(0.3)
    result = node.fork(parent.id, 4)
    states = set()
    for c in result.children:
        assert not isinstance(c, Exception), c
        states.add(sh(node, c.id, "cat /tmp/a /tmp/b"))
        node.destroy(c.id)
    assert len(states) == 1, states  # one instant for all (frozen maybe between a write's truncate and data)
    values = [int(x) for x in states.pop().split()]
    assert values and max(values) - min(values) <= 1, values
    a = max(values)
    assert node.get(parent.id).state == "running"  # thawed: it goes on
    deadline = time.monotonic() + 10
    while True:  # a read can meet the writer between its truncate and its write: empty
        now = sh(node, parent.id, "cat /tmp/a").strip()
        if now and int(now) > a:
            break
        assert time.monotonic() < deadline, (now, a)
        time.sleep(0.01)
    node.destroy(parent.id)


def test_fork_and_snapshot_of_a_paused_environment_keep_it_paused(node):
    e = node.create("task")
    sh(node, e.id, "echo x > /workspace/x.txt")
    node.pause(e.id)
    result = node.fork(e.id, 1)
    (child,) = result.children
    assert result.pause_s == 0.0 and node.get(e.id).state == "paused"
    assert sh(node, child.id, "cat /workspace/x.txt") == b"x\n"
    node.snapshot(e.id, "paused-snap")
    assert node.get(e.id).state == "paused"
    node.resume(e.id)
    node.destroy(child.id)
    node.destroy(e.id)
    node.delete_snapshot("paused-snap")


def test_a_paused_environment_stays_paused_across_a_node_restart(paths, store, leak_check):
    """A node process killed while an environment is paused: the next adopts it
    paused (its processes kept), and resume goes on."""
    script = f"""
import os, sys, time
sys.path.insert(0, {str(Path(__file__).parents[1] / "src")!r})
from weenv.node.node import Node
from weenv.store.file import FileStore
from weenv.config import Paths
n = Node(Paths.from_env(), store=FileStore({str(store.root)!r}), pool_size=0).start()
e = n.create("task")
started = n.exec(e.id, ["cut", "-d ", "-f22", "/proc/1/stat"]).stdout.decode().strip()  # pid 1's start time
n.pause(e.id)
print(e.id, started, flush=True)
os._exit(0)  # killed: no close
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    env_id, started = r.stdout.split()
    with Node(paths, store=store, pool_size=0) as node:
        assert node.get(env_id).state == "paused"
        node.resume(env_id)
        assert sh(node, env_id, "cut -d' ' -f22 /proc/1/stat").decode().strip() == started  # the same first process
        node.destroy(env_id)


def test_a_memory_released_environment_stays_paused_across_a_node_restart(paths, store, leak_check):
    """A node process killed while an environment is paused with its memory
    released (no container): the next adopts it paused, its disk counted, and
    resume runs its first process over its files."""
    script = f"""
import os, sys
sys.path.insert(0, {str(Path(__file__).parents[1] / "src")!r})
from weenv.node.node import Node
from weenv.store.file import FileStore
from weenv.config import Paths
n = Node(Paths.from_env(), store=FileStore({str(store.root)!r}), pool_size=0).start()
e = n.create("task")
n.exec(e.id, ["sh", "-c", "echo kept > /workspace/kept.txt"])
n.pause(e.id, release_memory=True)
print(e.id, flush=True)
os._exit(0)  # killed: no close
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    env_id = r.stdout.strip()
    with Node(paths, store=store, pool_size=0) as node:
        info = node.get(env_id)
        assert info.state == "paused" and info.memory_released
        assert node.provision_stats().totals.disk_held == info.resources.disk_bytes
        node.resume(env_id)
        assert sh(node, env_id, "cat /workspace/kept.txt") == b"kept\n"
        node.destroy(env_id)
        assert node.provision_stats().totals.disk_held == 0


def test_a_fork_of_100_leaves_nothing_after_its_children_go(paths, store, leak_check):
    """100 children answer; once destroyed, no mount, cgroup, container,
    subvolume or capture of theirs is left (the leak check and the disk)."""
    from weenv.formats.manifest import Resources

    tiny = Resources(cpus=0.02, memory_bytes=64 << 20, pids=64, disk_bytes=64 << 20)
    with Node(paths, store=store, pool_size=0) as node:
        parent = node.create("task", resources=tiny)
        sh(node, parent.id, "echo p > /workspace/p.txt")
        result = node.fork(parent.id, 100)
        kids = [c for c in result.children if not isinstance(c, Exception)]
        assert len(kids) == 100, [c for c in result.children if isinstance(c, Exception)][:3]
        print(f"\nfork 100: {result.total_s:.2f} s, parent paused {result.pause_s * 1000:.1f} ms")
        assert sh(node, kids[-1].id, "cat /workspace/p.txt") == b"p\n"
        for c in kids:
            node.destroy(c.id)
        assert node.snapshotter.dirs() == [node.snapshotter.dir(parent.id)] and captures(paths) == []
        assert [i.id for i in node.list()] == [parent.id]
        node.destroy(parent.id)


def test_children_failing_after_their_upper_dir_was_made_are_undone(node, paths, monkeypatch):
    """Every other child's container fails to start (after its group mounts,
    cloned upper dir and overlay were made): those are undone, subvolume and
    mounts included, and the others run."""
    from weenv.errors import RuntimeFailedError

    real = node.containers.make
    calls = []
    lock = threading.Lock()

    def make(env_id, env_dir, *args, **kw):
        with lock:  # children start in threads: each call's number is its own
            calls.append(env_id)
            n = len(calls)
        assert (env_dir / "disk" / "upper" / "workspace" / "p.txt").exists()  # the clone is there
        if n % 2 == 0:
            raise RuntimeFailedError(f"injected: container of {env_id} does not start")
        return real(env_id, env_dir, *args, **kw)

    parent = node.create("task")
    sh(node, parent.id, "echo p > /workspace/p.txt")
    monkeypatch.setattr(node.containers, "make", make)
    result = node.fork(parent.id, 4)
    monkeypatch.setattr(node.containers, "make", real)
    ok = [c for c in result.children if not isinstance(c, Exception)]
    failed = [c for c in result.children if isinstance(c, Exception)]
    assert len(ok) == 2 and len(failed) == 2 and all("injected" in str(f) for f in failed), failed
    assert sorted(d.name for d in node.snapshotter.dirs()) == sorted([parent.id, *(c.id for c in ok)])
    assert captures(paths) == []
    for c in ok:
        assert sh(node, c.id, "cat /workspace/p.txt") == b"p\n"
        node.destroy(c.id)
    node.destroy(parent.id)


def test_fork_children_keep_the_parents_network_policy(node, store, far_hosts, no_leak):  # noqa: F811
    """Parents of a template with network, each created with less: none, a
    ``deny_out`` list, an ``allow_out`` list alone.  Each child reaches what its
    parent reaches and nothing more (not the template's network), and a snapshot
    of a limited parent starts without network by default."""
    from weenv.formats.manifest import canonical_json
    from weenv.packaging.template import load_template

    _digest, m = load_template(store, "task")  # "task" with network: true (by digest, no ref)
    net_template = store.put_manifest(
        canonical_json(m.model_copy(update={"runtime": m.runtime.model_copy(update={"network": True})}))
    )
    one, two = far_hosts["one"], far_hosts["two"]
    cases = {
        "off": ({"network": False}, {"one": False, "two": False}),
        "denied": ({"deny_out": [f"{two}/32"]}, {"one": True, "two": False}),
        "only": ({"network": False, "allow_out": [one]}, {"one": True, "two": False}),
    }
    made = []
    for name, (fields, reach) in cases.items():
        parent = node.create(net_template, **fields)
        made.append(parent.id)
        assert _reach(node, parent.id, far_hosts) == reach, name
        (child,) = node.fork(parent.id, 1).children
        assert not isinstance(child, Exception), child
        made.append(child.id)
        assert _reach(node, child.id, far_hosts) == reach, name
        assert (child.network, child.allow_out, child.deny_out) == (
            parent.network,
            parent.allow_out,
            parent.deny_out,
        ), name
    node.snapshot(made[2], "limited-net")  # the "denied" parent
    assert node.template("limited-net").runtime.network is False
    node.delete_snapshot("limited-net")
    for env_id in made:
        node.destroy(env_id)


def test_paused_environments_keep_their_memory_counted_in_admission(paths, store, leak_check):
    """A node with memory for three environments: with two of them paused (frozen,
    their memory still resident) a fourth is refused as it is when all run; a
    resume admits nothing new, and a destroy of a paused one makes room."""
    from weenv.errors import CapacityError
    from weenv.node.provision import ProvisionConfig

    res = {"cpus": 0.05, "memory_bytes": 256 << 20, "pids": 128}
    cfg = ProvisionConfig(mode="static", memory_capacity=3 * (256 << 20), memory_overcommit=1.0)
    with Node(paths, store=store, pool_size=0, provisioning=cfg) as node:
        envs = [node.create("task", resources=res).id for _ in range(3)]
        with pytest.raises(CapacityError, match="memory limits would reach 1024 MiB of 768 MiB") as running:
            node.create("task", resources=res)
        node.pause(envs[0])
        node.pause(envs[1])
        with pytest.raises(CapacityError) as paused:
            node.create("task", resources=res)
        assert str(paused.value) == str(running.value)  # refused as if they ran
        assert node.provision_stats().totals.paused == 2
        node.resume(envs[0])  # counted all along: nothing to admit again
        assert sh(node, envs[0], "echo up") == b"up\n"
        node.destroy(envs[1])  # paused: its memory goes with it
        envs[1] = node.create("task", resources=res).id
        assert node.count() == 3
        for env_id in envs:
            node.destroy(env_id)


def test_kept_snapshot_captures_count_against_the_nodes_disk(paths, store, leak_check):
    """A node disk of 2 GiB at overcommit 0.25 (512 MiB of limits) holding one
    environment of 300 MiB: a snapshot of the 128 MiB it wrote is kept (428 MiB
    counted), then a new create of 100 MiB and a second snapshot (the file
    rewritten: a capture pinning other extents) do not fit and are refused
    before anything is published; deleting the first snapshot frees its count."""
    from weenv.errors import CapacityError
    from weenv.node.provision import ProvisionConfig

    res = {"cpus": 0.05, "memory_bytes": 64 << 20, "pids": 128, "disk_bytes": 300 << 20}
    cfg = ProvisionConfig(mode="static", disk_overcommit=0.25)
    with Node(paths, store=store, pool_size=0, disk_bytes=2 << 30, provisioning=cfg) as node:
        e = node.create("task", resources=res)
        write = "head -c 128M /dev/zero > /workspace/fill && sync"
        sh(node, e.id, write)
        first = node.snapshot(e.id, "disk-one")
        with pytest.raises(CapacityError, match="disk limits would reach"):
            node.create("task", resources={**res, "disk_bytes": 100 << 20})
        sh(node, e.id, write)
        with pytest.raises(CapacityError, match="snapshot 'disk-two'.s capture holds"):
            node.snapshot(e.id, "disk-two")
        assert [s.name for s in node.snapshots()] == ["disk-one"] and len(captures(paths)) == 1
        assert 128 << 20 <= first.capture_bytes < 150 << 20, first
        assert node.provision_stats().totals.disk_held == first.capture_bytes
        node.delete_snapshot("disk-one")
        assert node.provision_stats().totals.disk_held == 0 and captures(paths) == []
        second = node.snapshot(e.id, "disk-two")
        assert node.provision_stats().totals.disk_held == second.capture_bytes
        node.delete_snapshot("disk-two")
        node.destroy(e.id)


def test_two_concurrent_snapshots_of_one_name_have_one_winner(paths, store, tmp_path, leak_check):
    """Two environments on two nodes of one store snapshot under one name at
    once: one snapshot is published, the other is refused (BusyError: the
    store's compare-and-swap of the ref), keeps nothing on its node, and its
    environment runs on with its files."""
    from weenv.errors import BusyError

    other = Paths(tmp_path / "home2", paths.cache, store.url)
    with Node(paths, store=store, pool_size=0) as one, Node(other, store=store, pool_size=0) as two:
        for round_ in range(3):
            name = f"contested-{round_}"
            envs = [(one, one.create("task")), (two, two.create("task"))]
            for i, (n, e) in enumerate(envs):
                sh(n, e.id, f"echo {i} > /workspace/who.txt")
            barrier = threading.Barrier(2)

            def take(i: int):
                n, e = envs[i]
                barrier.wait()
                try:
                    return n.snapshot(e.id, name)
                except BusyError as exc:
                    return exc

            with ThreadPoolExecutor(2) as pool:
                outcome = list(pool.map(take, range(2)))
            won = [not isinstance(o, Exception) for o in outcome]
            assert sum(won) == 1, outcome
            winner = won.index(True)
            assert [s.environment for s in one.snapshots() if s.name == name] == [envs[winner][1].id]
            loser_node, loser = envs[1 - winner]
            assert loser_node.captures._named == {} or name not in loser_node.captures._named
            assert sh(loser_node, loser.id, "cat /workspace/who.txt") == f"{1 - winner}\n".encode()
            fresh = one.create(name)  # the published snapshot is the winner's
            assert sh(one, fresh.id, "cat /workspace/who.txt") == f"{winner}\n".encode()
            one.destroy(fresh.id)
            for n, e in envs:
                n.destroy(e.id)
            envs[winner][0].delete_snapshot(name)


def _cgroup_gone(e) -> bool:
    """Whether environment ``e``'s container cgroup is gone (its processes and their memory with it)."""
    return not Path(f"/sys/fs/cgroup/memory/weenv-{e.id}").exists()


def test_a_memory_releasing_pause_ends_processes_keeps_files_and_resume_restarts(node):
    """pause(release_memory=True): every process ends (its cgroup goes), the
    files stay (readable and writable through the host while paused), it
    counts against disk and not memory; resume runs its first process anew
    over the same files; a second release or a resume of a running one is refused."""
    e = node.create("task")
    sh(node, e.id, "echo kept > /workspace/kept.txt && rm /etc/hostname")
    p = node.spawn(e.id, ["sleep", "1000"])
    held = node.provision_stats().totals
    info = node.pause(e.id, release_memory=True)
    assert info.state == "paused" and info.memory_released and info.paused_at is not None
    assert _cgroup_gone(e) and not p.running
    assert [i.state for i in node.list()] == ["paused"] and node.get(e.id).memory_released
    stats = node.provision_stats().totals
    assert stats.disk_held == e.resources.disk_bytes, (held, stats)
    root = Path(info.rootfs)
    assert (root / "workspace/kept.txt").read_text() == "kept\n"
    (root / "workspace/while-paused.txt").write_text("host\n")
    with pytest.raises(StateError):
        node.exec(e.id, ["true"])
    with pytest.raises(StateError):
        node.pause(e.id, release_memory=True)
    assert node.reap_expired(now=time.time() + 10**7) == []  # its timeout stands still
    info = node.resume(e.id)
    assert info.state == "running" and not info.memory_released and info.paused_at is None
    assert node.provision_stats().totals.disk_held == 0
    assert (
        sh(node, e.id, "cat /workspace/kept.txt /workspace/while-paused.txt; test -e /etc/hostname || echo gone")
        == b"kept\nhost\ngone\n"
    )
    assert sh(node, e.id, "pgrep -x sleep || echo none") == b"none\n"  # processes did not survive
    with pytest.raises(StateError):
        node.resume(e.id)
    # a freezer pause can release its memory later (the idle release does so)
    node.pause(e.id)
    node.pauses.release_after = 60.0
    node.reap_expired(now=time.time() + 30)
    assert not node.get(e.id).memory_released
    node.reap_expired(now=time.time() + 61)
    assert node.get(e.id).memory_released and _cgroup_gone(e)
    node.resume(e.id)
    assert sh(node, e.id, "cat /workspace/kept.txt") == b"kept\n"
    node.pause(e.id, release_memory=True)
    node.destroy(e.id)  # a memory-released environment is destroyed at once; its disk count goes
    assert node.count() == 0 and node.provision_stats().totals.disk_held == 0


def test_on_timeout_pause_pauses_at_the_timeout_and_a_reset_runs_it_again(node):
    """Created with ``on_timeout="pause"``: the reaper pauses it (memory released)
    instead of destroying it; reset of a memory-released one runs it again."""
    e = node.create("task", timeout=30, on_timeout="pause")
    assert e.on_timeout == "pause"
    sh(node, e.id, "echo mine > /workspace/mine.txt")
    assert node.reap_expired(now=time.time() + 60) == [e.id]
    info = node.get(e.id)
    assert info.state == "paused" and info.memory_released and node.count() == 1
    node.resume(e.id, timeout=30)
    assert sh(node, e.id, "cat /workspace/mine.txt") == b"mine\n"
    node.pause(e.id, release_memory=True)
    info = node.reset(e.id)
    assert info.state == "running" and not info.memory_released
    assert node.provision_stats().totals.disk_held == 0
    assert sh(node, e.id, "test -e /workspace/mine.txt && echo yes || echo no") == b"no\n"
    node.destroy(e.id)
