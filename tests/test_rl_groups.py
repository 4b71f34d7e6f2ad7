"""RL groups from one task state (:mod:`weenv.sdk.groups`) against a real
``weenv serve``: a task's setup run once and published as a snapshot, groups
forked from it, reused after a daemon restart; failed, timed-out and keyless
setups; a state gone from the store; the tree-search helper."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import weenv
from daemon_fixture import environ, start_daemon
from weenv.errors import InvalidInputError, SetupError
from weenv.formats.manifest import Resources, RuntimeConfig
from weenv.packaging.gc import collect
from weenv.packaging.group import load_group
from weenv.packaging.template import create_template, load_template
from weenv.sdk.groups import state_name
from weenv.store.file import FileStore

TEMPLATE = "grp"
MAX_FORK = 16
TOKEN = "head -c8 /dev/urandom | od -An -tx1 | tr -d ' \\n' > /workspace/token"
"""A setup command whose output differs at each run: the same token means the same build."""


class Node:
    """One daemon over a private copy of the shared store; :meth:`restart` replaces it."""

    def __init__(self, root, store_url: str):
        self.root = root
        self.store_url = store_url
        self.daemon = self._start()

    def _start(self):
        with environ(WEENV_MAX_FORK=str(MAX_FORK)):
            return start_daemon(self.root / "home", self.store_url)

    def restart(self) -> None:
        self.daemon.stop()
        self.daemon = self._start()

    @property
    def where(self) -> dict[str, str]:
        return {"api_url": self.daemon.url, "api_key": self.daemon.key}

    def environments(self) -> set[str]:
        with self.daemon.http() as c:
            return {e["id"] for e in c.get("/environments").json()}

    def snapshots(self) -> set[str]:
        with self.daemon.http() as c:
            return {s["name"] for s in c.get("/snapshots").json()}

    def state_of(self, task: weenv.Task) -> str:
        """The name ``task``'s state has in the store."""
        with self.daemon.http() as c:
            digest = c.get(f"/templates/{task.template}").json()["digest"]
        return state_name(task.template, digest, task.setup_key)


@pytest.fixture(scope="module")
def node(shared_store, tmp_path_factory):
    root = tmp_path_factory.mktemp("rl-groups")
    store = root / "store"
    subprocess.run(["cp", "-al", str(shared_store.root), str(store)], check=True)
    small = Resources(cpus=0.05, memory_bytes=96 << 20, pids=128)  # a group of 16, its root and a setup
    create_template(
        FileStore(store), TEMPLATE, ["base", "task"], runtime=RuntimeConfig(working_dir="/workspace", resources=small)
    )
    n = Node(root, FileStore(store).url)
    try:
        yield n
    finally:
        n.daemon.stop()


@pytest.fixture(scope="module")
def task():
    return weenv.Task(TEMPLATE, ["echo ready > /workspace/setup.txt", TOKEN])


@pytest.fixture(scope="module")
def first(node, task):
    """The task's first group of 16: the setup ran for it."""
    with weenv.rollout_group(task, 16, **node.where) as group:
        for i, sb in enumerate(group):
            sb.files.write("/workspace/mine", f"rollout {i}")
        seen = [
            (sb.files.read("/workspace/setup.txt"), sb.files.read("/workspace/token"), sb.files.read("/workspace/mine"))
            for sb in group
        ]
    return group, seen


def test_a_group_of_16_sees_the_setup_and_not_each_others_writes(node, first):
    group, seen = first
    assert len(group) == 16 and len({sb.id for sb in group}) == 16
    assert group.state.built and group.state.name.startswith(f"{TEMPLATE}-state-")
    assert {s[0] for s in seen} == {"ready\n"} and len({s[1] for s in seen}) == 1
    assert [s[2] for s in seen] == [f"rollout {i}" for i in range(16)]
    assert group.state.name in node.snapshots()
    assert not {sb.id for sb in group} & node.environments(), "the group's sandboxes outlived it"
    assert group.tally.wall_s > 0 and group.tally.phases["files"] > 0 and group.tally.rollout_s > 0


def test_the_state_is_built_once_for_many_groups(node, task, first):
    token = first[1][0][1]
    for _ in range(2):
        t = time.monotonic()
        with weenv.rollout_group(task, 2, **node.where) as group:
            made_s = time.monotonic() - t
            assert not group.state.built and group.state.name == first[0].state.name
            assert group.root == first[0].root  # forked from the same root on this node
            assert [sb.files.read("/workspace/token") for sb in group] == [token, token]
            assert not group[0].files.exists("/workspace/mine")
    print(f"\nstate built in {first[0].state.build_s:.2f} s; a later group of 2 made in {made_s:.2f} s")


def test_the_async_face_forks_the_same_state(node, task, first):
    async def run():
        async with await weenv.async_rollout_group(task, 2, **node.where) as group:
            return group.state, [await sb.files.read("/workspace/token") for sb in group]

    state, tokens = asyncio.run(run())
    assert not state.built and tokens == [first[1][0][1]] * 2


def test_a_failed_setup_leaves_nothing_and_says_why(node):
    before = node.environments()
    bad = weenv.Task(TEMPLATE, ["echo partial > /workspace/x", "echo 'no such package' >&2; exit 3"])
    with pytest.raises(SetupError, match=r"(?s)exited 3.*no such package"):
        weenv.rollout_group(bad, 2, **node.where)
    assert node.environments() == before
    assert node.state_of(bad) not in node.snapshots()


def test_a_setup_that_never_finishes_times_out_and_leaves_nothing(node):
    before = node.environments()
    stuck = weenv.Task(TEMPLATE, ["sleep 600"], timeout=1)
    with pytest.raises(SetupError, match=r"did not finish within its timeout of 1 s \(at 'sleep 600'\)"):
        weenv.rollout_group(stuck, 2, **node.where)
    assert node.environments() == before
    assert node.state_of(stuck) not in node.snapshots()


def test_a_callable_setup_is_rebuilt_when_its_key_changes_and_not_otherwise(node):
    calls = []

    def setup(sb):
        calls.append(sb.id)
        sb.commands.run(TOKEN)

    def group_of(key):
        with weenv.rollout_group(weenv.Task(TEMPLATE, setup, key=key), 1, **node.where) as g:
            return g.state, g[0].files.read("/workspace/token")

    v1, token1 = group_of("deps-v1")
    again, token_again = group_of("deps-v1")  # a new Task object: the next iteration
    v2, token2 = group_of("deps-v2")
    assert len(calls) == 2 and v1.built and not again.built and v2.built
    assert token_again == token1 != token2 and v1.name == again.name != v2.name
    with pytest.raises(InvalidInputError, match="callable setup needs key="):
        weenv.Task(TEMPLATE, setup)


def test_a_state_gone_from_the_store_is_rebuilt_and_said_so(node, caplog):
    gone = weenv.Task(TEMPLATE, ["echo gone-test > /workspace/g", TOKEN])
    with weenv.rollout_group(gone, 1, **node.where) as g:
        token = g[0].files.read("/workspace/token")
    assert weenv.Sandbox.delete_snapshot(g.state.name, **node.where)
    with (
        caplog.at_level(logging.WARNING, logger="weenv.sdk.groups"),
        weenv.rollout_group(gone, 1, **node.where) as again,
    ):
        assert again[0].files.read("/workspace/token") != token
    assert again.state.built and "gone from the store" in again.state.rebuilt
    assert again.root != g.root and g.root not in node.environments()  # the old state's root went with it
    assert "gone from the store" in caplog.text


def test_bad_group_sizes_are_refused(node, task, first):
    before = node.environments()
    for n in (0, -1, True, 2.0):
        with pytest.raises(InvalidInputError, match="bad group size"):
            weenv.rollout_group(task, n, **node.where)
    with pytest.raises(InvalidInputError, match=f"want 1 to {MAX_FORK} children"):
        weenv.rollout_group(task, MAX_FORK + 1, **node.where)
    assert node.environments() == before


def test_the_tree_helper_branches_and_resets(node):
    with weenv.Tree("search") as tree:
        root = weenv.Sandbox.create(TEMPLATE, timeout=300, **node.where)
        root.files.write("/workspace/f", "root")
        saved = tree.save(root)
        branches = tree.branch(root, 3)
        for i, b in enumerate(branches):
            b.files.write("/workspace/f", f"branch {i}")
        assert [b.files.read("/workspace/f") for b in branches] == [f"branch {i}" for i in range(3)]
        assert root.files.read("/workspace/f") == "root"
        deeper = tree.branch(branches[1], 2)
        assert {b.files.read("/workspace/f") for b in deeper} == {"branch 1"}
        tree.reset(branches[0], saved)
        assert branches[0].files.read("/workspace/f") == "root"
        with pytest.raises(InvalidInputError, match="bad branch count"):
            tree.branch(root, 0)
        root.kill()
    ids = {b.id for b in tree.branches}
    assert len(ids) == 5 and not ids & node.environments() and saved not in node.snapshots()
    assert tree.tally.phases["files"] > 0


def test_two_groups_at_once_share_one_state_and_one_root(node):
    before = node.environments()
    fresh = weenv.Task(TEMPLATE, ["echo concurrent > /workspace/c", TOKEN])
    with ThreadPoolExecutor(2) as pool:
        groups = list(pool.map(lambda _: weenv.rollout_group(fresh, 2, **node.where), range(2)))
    try:
        tokens = {sb.files.read("/workspace/token") for g in groups for sb in g}
        assert len(tokens) == 1 and groups[0].state.digest == groups[1].state.digest
    finally:
        for g in groups:
            g.kill()
    assert weenv.release_task(fresh, **node.where) == 1
    assert node.environments() == before, "a second root of the same state outlived the task"


def test_the_state_is_kept_by_gc_and_reused_after_a_daemon_restart(node, task, first):
    state = first[0].state
    node.daemon.stop()
    store = FileStore(node.store_url.removeprefix("file://"))
    swept = collect(store, node.daemon.paths, in_use=[], grace=0)  # no daemon, no environment: refs only
    assert swept.manifests_removed, "gc found nothing to remove: the deleted states' groups should go"
    assert state.digest not in swept.manifests_removed
    assert all(
        store.has_chunk(c.digest) for c in load_group(store, load_template(store, state.name)[1].groups[-1]).chunks
    )
    node.daemon = node._start()
    with weenv.rollout_group(task, 2, **node.where) as group:
        assert not group.state.built and group.state.digest == first[0].state.digest
        assert [sb.files.read("/workspace/token") for sb in group] == [first[1][0][1]] * 2
    assert weenv.release_task(task, **node.where) == 1
    assert node.environments() == set()
