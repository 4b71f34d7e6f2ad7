"""Robustness of resets that start a container made ahead (review findings on
:mod:`weenv.node.state.reset`), with real mounts, btrfs subvolumes and runc."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from test_fork import EXPECTED, SETUP, TREE, _containers_of, node, sh, store  # noqa: F401  (fixtures)
from weenv.config import Paths
from weenv.host import mounts
from weenv.node.node import Node
from weenv.node.runtime.agent.client import spawn


def test_a_command_of_a_stale_container_id_goes_in_the_cgroup_of_the_agent_answering(node):  # noqa: F811
    """A launcher reads the environment's container id, then connects to the
    agent's socket: a reset in between (a container made ahead started) gives
    it the new agent with the old id.  The command's own cgroup goes below the
    cgroup the agent's handler is in, not below the id read (review finding:
    it landed in the other container's cgroup, which the reset's background
    deletes, or a pause does not freeze)."""
    e = node.create("task")
    node.snapshot(e.id, "cg-snap")
    node.resets.close()  # weenv-ID.1 waits created: its cgroup exists
    env = node.table.get(e.id)
    spawned = spawn(env.agent_socket, ["sleep", "30"], env={}, cwd="/", cgroup=f"/weenv-{e.id}.1")
    try:
        assert spawned.group is not None
        assert spawned.group.path.startswith(f"/weenv-{e.id}/cmd-"), spawned.group.path
    finally:
        spawned.kill_tree()
        spawned.close()
    node.destroy(e.id)
    node.delete_snapshot("cg-snap")


def test_stuck_leftovers_of_an_earlier_reset_do_not_break_the_next(node):  # noqa: F811
    """A replaced container's bundle that cannot be deleted (``bundle.old``) and
    an old upper dir left as a plain directory (``disk.old``) stay apart: resets
    made ahead go on (review finding: the fixed names made the next reset fail
    midway, the environment left stopped); the start is the in-process exec
    FIFO one on this machine's runc 1.1."""
    e = node.create("task")
    sh(node, e.id, SETUP)
    node.snapshot(e.id, "stuck-snap")
    node.resets.close()
    d = node.snapshotter.dir(e.id)
    (d / "bundle.old").mkdir()
    (d / "bundle.old" / "container").write_text("not a valid id!")  # runc delete refuses it
    (d / "disk.old").mkdir()
    (d / "disk.old" / "kept").write_text("x")  # not a subvolume: its deletion fails
    runtime = node.runc.chosen  # the runtime that makes this node's containers (crun or runc)
    if runtime.name == "runc":
        assert runtime.version()[:2] == (1, 1)
    starts = runtime.fifo_starts
    for n in (1, 2):
        sh(node, e.id, "echo episode > /workspace/episode.txt")
        t = node.resets.reset(node.table.get(e.id), node.captures.named("stuck-snap").path)
        assert t.ahead, t
        assert node.get(e.id).state == "running"
        assert sh(node, e.id, TREE) == EXPECTED
        assert runtime.fifo_starts == starts + n  # started through its exec FIFO in the node's process
        node.resets.close()
        assert _containers_of(node, e.id) == {f"weenv-{e.id}.{n}": "running", f"weenv-{e.id}.{n + 1}": "created"}
        assert not [p for p in d.iterdir() if p.name.startswith("rootfs.old")]  # the old rootfs went
        assert not [p for p in d.iterdir() if p.name.startswith("bundle.old.")]  # the replaced one went
    assert (d / "bundle.old").is_dir() and (d / "disk.old" / "kept").exists()  # the stuck ones stayed
    subprocess.run(["rm", "-rf", str(d / "bundle.old")], check=True)
    node.destroy(e.id)
    assert not d.exists()
    node.delete_snapshot("stuck-snap")


def test_a_failed_preparation_leaves_no_stale_spare(node, tmp_path):  # noqa: F811
    """A preparation whose spare cannot be made (its source is no subvolume)
    after one of another source was made: the next reset to that other source
    does not count on the spare it replaced (review finding: ``_spares`` still
    named it, the reset swapped in a missing upper dir and failed)."""
    e = node.create("task")
    sh(node, e.id, SETUP)
    node.snapshot(e.id, "spare-snap")
    node.resets.close()
    plain = tmp_path / "not-a-subvolume"
    plain.mkdir()
    node.resets.prepare(node.table.get(e.id), plain)
    node.resets.close()
    t = node.resets.reset(node.table.get(e.id), node.captures.named("spare-snap").path)
    assert not t.spare and not t.ahead
    assert node.get(e.id).state == "running"
    assert sh(node, e.id, TREE) == EXPECTED
    node.destroy(e.id)
    node.delete_snapshot("spare-snap")


def test_no_preparation_after_a_destroy_that_failed_midway(node, monkeypatch):  # noqa: F811
    """A destroy that fails before the environment's directory is gone: a
    preparation queued for it (a reset's, a snapshot's) makes no container,
    mount or upper dir there (review finding: it made them for an environment
    no table holds any more)."""
    e = node.create("task")
    node.snapshot(e.id, "gone-snap")
    node.resets.close()
    env = node.table.get(e.id)
    d = env.dir
    remove_dir = node.snapshotter.remove_dir

    def failing(env_dir: Path) -> None:
        raise OSError("stuck")

    monkeypatch.setattr(node.snapshotter, "remove_dir", failing)
    try:
        node.destroy(e.id)
    except OSError:
        pass
    monkeypatch.setattr(node.snapshotter, "remove_dir", remove_dir)
    assert d.exists()
    node.resets.prepare(env, node.captures.named("gone-snap").path)
    node.resets.close()
    assert _containers_of(node, e.id) == {}
    assert not (d / "rootfs.next").is_mount()
    remove_dir(d)
    node.delete_snapshot("gone-snap")


def test_a_shared_environments_mount_is_found_at_start_and_resets_run_their_container(paths, store, leak_check):  # noqa: F811
    """Where the environments' mount is shared (mount(2) ``MS_MOVE`` refuses
    it), the node finds so at its start: no container is made ahead, resets run
    their container again and work (review finding: each node learnt it from
    a failed reset, then turned reset-ahead off node-wide).  The home lies below
    a directory others may search, so the environments' directory is its own
    ``node/envs`` (not an alias under /run, outside the shared mount)."""
    base = Path(tempfile.mkdtemp(prefix="weenv-shared-"))
    os.chmod(base, 0o711)
    paths = Paths(base / "home", paths.cache, paths.store_url)
    home = paths.home
    home.mkdir()
    subprocess.run(["mount", "--bind", str(home), str(home)], check=True)
    try:
        subprocess.run(["mount", "--make-shared", str(home)], check=True)
        with Node(paths, store=store, pool_size=0) as n:
            assert mounts.is_shared(paths.environments)
            assert not n.resets.moves
            e = n.create("task")
            n.snapshot(e.id, "shared-snap")
            n.resets.close()
            assert _containers_of(n, e.id) == {f"weenv-{e.id}": "running"}
            sh(n, e.id, "echo episode > /workspace/episode.txt")
            t = n.resets.reset(n.table.get(e.id), n.captures.named("shared-snap").path)
            assert t.spare and not t.ahead
            assert sh(n, e.id, "test -e /workspace/episode.txt && echo yes || echo no") == b"no\n"
            n.destroy(e.id)
            n.delete_snapshot("shared-snap")
    finally:
        subprocess.run(["umount", "-l", str(home)], check=False)
    assert not mounts.is_shared(paths.environments)
    shutil.rmtree(base, ignore_errors=True)


def test_a_refused_move_turns_reset_ahead_off_for_that_environment_only(node, monkeypatch):  # noqa: F811
    """One environment whose rootfs cannot move (mount(2) refuses it: here the
    refusal is injected for it alone) resets by running its container again,
    and gets none made ahead afterwards; another environment's resets still
    start theirs (review finding: one refusal turned it off node-wide)."""
    from weenv.errors import MountError

    a, b = node.create("task"), node.create("task")
    for e in (a, b):
        node.snapshot(e.id, f"move-{e.id}")
    node.resets.close()
    move_aside = node.snapshotter.move_aside

    def refusing(env_dir: Path):
        if env_dir.name == a.id:
            raise MountError(22, f"move mount {env_dir}/rootfs: Invalid argument")
        return move_aside(env_dir)

    monkeypatch.setattr(node.snapshotter, "move_aside", refusing)
    t = node.resets.reset(node.table.get(a.id), node.captures.named(f"move-{a.id}").path)
    assert not t.ahead and node.get(a.id).state == "running"
    assert sh(node, a.id, "echo a") == b"a\n"
    t = node.resets.reset(node.table.get(b.id), node.captures.named(f"move-{b.id}").path)
    assert t.ahead and node.get(b.id).state == "running"
    node.resets.close()
    assert _containers_of(node, a.id) == {f"weenv-{a.id}": "running"}  # none made ahead for it again
    assert _containers_of(node, b.id) == {f"weenv-{b.id}.1": "running", f"weenv-{b.id}.2": "created"}
    for e in (a, b):
        node.destroy(e.id)
        node.delete_snapshot(f"move-{e.id}")
