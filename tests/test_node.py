"""Environments end to end on one node: real overlay, EROFS over lazy FUSE, runc."""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest
import zstandard

from conftest import store_copy_without_profiles  # at import: in a run with tests/unit, "conftest" is that one later
from weenv.errors import (
    InvalidInputError,
    MountError,
    NotFoundError,
    RuntimeFailedError,
)
from weenv.formats.manifest import RuntimeConfig
from weenv.host import mounts
from weenv.node.node import Node
from weenv.packaging.group import assemble_image, build_group, load_group
from weenv.packaging.template import create_template, load_template
from weenv.store.file import FileStore


def _erofs_mounts(paths):
    return [p for t, p in mounts.mounts_under(paths.group_mounts) if t == "erofs"]


def _runc_ids(node):
    return [s["id"] for s in node.runc.list()]


def test_lifecycle_exec_files_and_destroy(node, paths):
    info = node.create("task")
    t = info.timing
    assert t.groups_s > 0 and t.runtime_s > 0 and t.first_command_s is not None
    assert t.total_s >= t.manifest_s + t.reserve_s + t.groups_s + t.overlay_s + t.runtime_s and t.reserve_s > 0
    # a cold start of a 200 MB template fetches a small part of it
    assert 0 < t.bytes_fetched < 0.5 * t.template_stored_bytes
    assert [e.id for e in node.list()] == [info.id]

    r = node.exec(info.id, ["python3", "hello.py"])
    assert (r.exit_code, r.stdout, r.timed_out) == (0, b"hello from the task\n", False)
    r = node.exec(info.id, "echo $FOO; pwd; echo oops >&2; exit 3", env={"FOO": "bar"}, cwd="/tmp")
    assert (r.exit_code, r.stdout, r.stderr) == (3, b"bar\n/tmp\n", b"oops\n")
    r = node.exec(info.id, ["cat"], stdin=b"piped")
    assert r.stdout == b"piped"

    files = node.files(info.id)
    files.write_file("/workspace/new/data.bin", b"\x00\x01binary")
    r = node.exec(info.id, ["cat", "/workspace/new/data.bin"])
    assert r.stdout == b"\x00\x01binary"
    node.exec(info.id, "echo written-inside > /root/out.txt")
    assert files.read_file("/root/out.txt") == b"written-inside\n"

    # the environment's writes stay in its private upper dir
    other = node.create("task")
    assert node.exec(other.id, ["test", "-e", "/root/out.txt"]).exit_code == 1
    node.destroy(other.id)

    node.destroy(info.id)
    assert node.list() == []
    assert not (paths.environments / info.id).exists()
    node.pool.drain()  # "task" was created twice: the warm pool holds one (tests/test_pool.py)
    assert _runc_ids(node) == []
    with pytest.raises(NotFoundError):
        node.exec(info.id, ["true"])
    with pytest.raises(NotFoundError):
        node.destroy(info.id)


def test_timeout_kills_command_and_children(node):
    info = node.create("task")
    r = node.exec(info.id, "sleep 100 & sleep 100; echo never", timeout=1)
    assert r.timed_out and r.exit_code == 137 and b"never" not in r.stdout
    assert r.duration_s < 10
    ps = node.exec(info.id, ["sh", "-c", "ls /proc | grep -c '^[0-9]'"])
    # left: pid 1 (the exec agent holding the environment), the agent's server and the
    # handler of this command, the sh and its ls/grep children
    assert int(ps.stdout) <= 7, ps.stdout
    assert node.exec(info.id, ["true"]).exit_code == 0  # still usable
    node.destroy(info.id)


def test_paths_cannot_escape_the_root(node, tmp_path):
    info = node.create("task")
    files = node.files(info.id)
    host_target = tmp_path / "host-secret"
    host_target.write_text("host")
    node.exec(
        info.id, f"ln -s {host_target} /workspace/abs-link; ln -s ../../../../../../{host_target} /workspace/rel-link"
    )
    for link in ("/workspace/abs-link", "/workspace/rel-link"):
        with pytest.raises(NotFoundError):
            files.read_file(link)  # resolves inside the root, where no such file exists
    # writing through the link creates its target inside the root, as a process inside would
    files.write_file("/workspace/abs-link", b"pwned")
    assert files.read_file("/workspace/rel-link") == b"pwned"
    assert files.read_file(str(host_target)) == b"pwned"
    assert node.exec(info.id, ["cat", str(host_target)]).stdout == b"pwned"
    assert host_target.read_text() == "host"
    assert files.read_file("../../../../etc/debian_version") == files.read_file("/etc/debian_version")
    assert (tmp_path / "host-secret").read_text() == "host"
    node.destroy(info.id)


def test_eight_at_once_share_one_mount_per_group(node, paths):
    # without prefetch: a profile another test published to the shared store may
    # name every chunk of the task group, which then completes and is mounted
    # directly for the later creates (a second mount of it, by design)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        infos = list(pool.map(lambda _: node.create("task", prefetch=False), range(8)))
    node.pool.drain()  # its environments hold the group mounts too
    groups = load_template(node.store, "task")[1].groups
    assert len(_erofs_mounts(paths)) == len(groups)
    assert node.groups.mounted() == {g: 8 for g in groups}
    overlays = [p for t, p in mounts.mounts_under(paths.environments) if t == "overlay"]
    assert len(overlays) == 8
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda i: node.exec(i.id, ["python3", "hello.py"]).stdout, infos))
    assert outs == [b"hello from the task\n"] * 8
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: node.destroy(i.id), infos))
    assert [p for t, p in mounts.mounts_under(paths.environments) if t != "btrfs"] == []  # the disk stays
    assert _runc_ids(node) == []


def _corrupt(store: FileStore, digest: str) -> None:
    """Replace a stored chunk with a valid zstd frame of other content."""
    store._put("chunks", digest, zstandard.ZstdCompressor().compress(b"not the chunk" * 1000))


@pytest.fixture
def private_store(paths, debian_root, tmp_path):
    """A store of its own (so corrupting it spares the shared one)."""
    store = FileStore(tmp_path / "private-store")
    task = tmp_path / "task"
    (task / "workspace").mkdir(parents=True)
    (task / "workspace" / "big.bin").write_bytes(os.urandom(6 << 20))
    build_group(debian_root, store, name="base")
    build_group(task, store, name="task")
    create_template(store, "task", ["base", "task"], runtime=RuntimeConfig(working_dir="/workspace"))
    return store


def test_corrupted_chunk_is_an_io_error_inside(private_store, paths, tmp_path, leak_check):
    task = load_group(private_store, private_store.get_ref("groups", "task"))
    image = tmp_path / "task.img"
    assemble_image(private_store, task, image)
    data = (tmp_path / "task" / "workspace" / "big.bin").read_bytes()
    offset = image.read_bytes().find(data[:4096])
    assert offset > 0
    victim = offset // task.chunk_size + 2  # a chunk wholly inside big.bin
    _corrupt(private_store, task.chunks[victim].digest)

    with Node(paths, store=private_store) as node:
        info = node.create("task")
        r = node.exec(info.id, ["sha256sum", "/workspace/big.bin"])
        assert r.exit_code != 0
        assert b"Input/output error" in r.stderr
        assert r.stdout == b""  # never a hash of wrong bytes
        # the rest of the environment still works
        assert node.exec(info.id, ["python3", "-c", "print(2+2)"]).stdout == b"4\n"


def test_failed_creates_leave_nothing(private_store, paths, leak_check):
    create_template(private_store, "broken", ["base"], runtime=RuntimeConfig(command=["/no/such/program"]))
    with Node(paths, store=private_store) as node:
        with pytest.raises(NotFoundError):
            node.create("no-such-template")
        with pytest.raises(InvalidInputError):
            node.create("sha256:xyz")
        for _ in range(10):  # never a create that answers for a command that did not run (a race once)
            with pytest.raises(RuntimeFailedError):
                node.create("broken")
        assert node.list() == [] and _runc_ids(node) == []
        assert list(paths.environments.iterdir()) == []
        base_hex = private_store.get_ref("groups", "base").split(":")[1]
        assert [p for t, p in mounts.mounts_under(paths.environments) if t != "btrfs"] == []  # the disk stays

        # a group whose first chunk (the EROFS superblock) is corrupt cannot mount
        task = load_group(private_store, private_store.get_ref("groups", "task"))
        _corrupt(private_store, task.chunks[0].digest)
        with pytest.raises(MountError):
            node.create("task")
        assert list(paths.environments.iterdir()) == []
        # the base group stays mounted for later starts, used by nobody; the task group is not
        assert [Path(p).name for p in _erofs_mounts(paths)] == [base_hex]
        assert not any(node.groups.mounted().values())
        assert _runc_ids(node) == []


def test_a_name_that_moves_or_goes_between_creates(private_store, paths, tmp_path, leak_check):
    """A node starts a name's last digest while it asks the store what the name
    is now: a create after the name moved runs the new template (the
    speculative start is undone), also when the old one's manifests are gone;
    after the name is deleted, create raises NotFoundError and leaves nothing."""
    (tmp_path / "v2" / "workspace").mkdir(parents=True)
    (tmp_path / "v2" / "workspace" / "which").write_text("two\n")
    build_group(tmp_path / "v2", private_store, name="v2")
    one, _ = create_template(private_store, "moving", ["base", "task"], runtime=RuntimeConfig(working_dir="/workspace"))
    with Node(paths, store=private_store) as node:
        env = node.create("moving")  # the node learns moving -> one
        assert env.template_digest == one
        node.destroy(env.id)

        two, _ = create_template(
            private_store, "moving", ["base", "v2"], runtime=RuntimeConfig(working_dir="/workspace")
        )
        env = node.create("moving")
        assert env.template_digest == two
        assert node.exec(env.id, ["cat", "which"]).stdout == b"two\n"
        node.destroy(env.id)

        node.drop_caches()  # the manifests of two out of the node, and out of the store:
        private_store.delete_manifest(two)
        private_store.set_ref("templates", "moving", one)
        node._remember_resolved("moving", two)  # the node still believes moving -> two
        env = node.create("moving")
        assert env.template_digest == one
        assert node.exec(env.id, ["test", "-f", "big.bin"]).exit_code == 0
        node.destroy(env.id)

        private_store.delete_ref("templates", "moving")
        with pytest.raises(NotFoundError):
            node.create("moving")
        assert node.list() == [] and _runc_ids(node) == []
        assert list(paths.environments.iterdir()) == []


def test_close_destroys_running_environments(paths, shared_store, leak_check):
    node = Node(paths, store=shared_store).start()
    ids = [node.create("task").id for _ in range(2)]
    node.close()
    node.close()  # idempotent
    assert mounts.mounts_under(paths.home) == []
    assert not any((paths.environments / i).exists() for i in ids)
    cgroups = [p for p in Path("/sys/fs/cgroup").glob("*/weenv-*") if any(i in p.name for i in ids)]
    assert cgroups == []


class _HeldSuperblockStore(FileStore):
    """A real FileStore whose reads of chunk ``held`` (a group's first: its
    EROFS superblock) wait until :attr:`gate` is set; :attr:`waiting` is set
    while one does."""

    def __init__(self, root):
        super().__init__(root)
        self.held: str | None = None
        self.gate = threading.Event()
        self.waiting = threading.Event()

    def _get(self, space: str, digest: str, max_bytes: int | None = None) -> bytes:
        if space == "chunks" and digest == self.held:
            self.waiting.set()
            self.gate.wait(60)
        return super()._get(space, digest, max_bytes)


def test_upper_dir_is_made_while_groups_mount(shared_store, paths, tmp_path, leak_check):
    """A cold create makes its upper dir (the disk subvolume with its quota)
    while its group mounts wait for their superblocks, not after them."""
    root = tmp_path / "store"
    subprocess.run(["cp", "-al", str(shared_store.root), str(root)], check=True)
    store = _HeldSuperblockStore(root)
    task = load_group(store, store.get_ref("groups", "task"))
    store.held = task.chunks[0].digest
    with Node(paths, store=store) as node:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            creating = pool.submit(node.create, "task", prefetch=False)
            try:
                assert store.waiting.wait(60), "the task group's mount never read its superblock"
                deadline = time.monotonic() + 10
                uppers = []
                while not uppers and time.monotonic() < deadline:  # the mount still waits meanwhile
                    uppers = [p for p in paths.environments.glob("*/disk/upper") if p.is_dir()]
                    time.sleep(0.01)
                assert uppers, "the upper dir was not made while the group mount waited"
                assert not creating.done()
            finally:
                store.gate.set()
            info = creating.result(60)
        assert info.timing.groups_s >= info.timing.upper_s > 0
        assert node.exec(info.id, ["cat", "/workspace/hello.py"]).stdout == b"print('hello from the task')\n"


def _store_with_other(shared_store, tmp_path) -> tuple[FileStore, str]:
    """A copy of the shared store without profiles, with template ``other``
    (base + a group holding ``/other/note.txt``); it and the base group's digest."""
    store = store_copy_without_profiles(shared_store, tmp_path / "store")
    other = tmp_path / "other"
    (other / "other").mkdir(parents=True)
    (other / "other" / "note.txt").write_text("another task\n")
    build_group(other, store, name="other")
    create_template(store, "other", ["base", "other"])
    return store, store.get_ref("groups", "base")


def test_profile_holds_the_mount_of_a_group_mounted_before(shared_store, paths, tmp_path, leak_check):
    """A template recorded while one of its groups is already mounted (by
    another template) still gets that group's mount reads (its superblock
    first) in its prefetch profile: a cold start mounting it finds them in
    the pack instead of fetching them on demand."""
    from weenv.packaging.profile import load_profile

    store, base = _store_with_other(shared_store, tmp_path)
    with Node(paths, store=store) as node:
        first = node.create("task")  # mounts base: its mount reads are before the next template's window
        node.destroy(first.id)
        node.prefetch.wait_published()
        mount = node.lazyfs.mount_reads(base)
        assert mount and mount[0] == 0  # the superblock's chunk
        second = node.create("other")
        assert node.exec(second.id, ["cat", "/other/note.txt"]).stdout == b"another task\n"
        node.destroy(second.id)
        node.prefetch.wait_published()
        digest, _m = load_template(store, "other")
        profile = load_profile(store, digest)
        assert profile is not None
        gi = profile.groups.index(base)
        assert [c for g, c in profile.chunks if g == gi][: len(mount)] == mount


def test_profile_holds_reads_of_a_group_read_before(shared_store, paths, tmp_path, leak_check):
    """A template recorded while one of its groups is already mounted and read
    (by another template's start: the page cache serves those reads, LazyFS
    never sees them) still gets, in its prefetch profile and pack, the chunks
    and ranges of that group the other template's profile names: a cold start
    of the new template then finds them in the pack instead of fetching them on
    demand (``weenv update`` republishing one group over a shared base made
    the bench's cold start fetch its command's 4 chunks on demand)."""
    from weenv.packaging.profile import load_profile

    store, base = _store_with_other(shared_store, tmp_path)
    read = ["sh", "-c", "cat /usr/bin/python3.11 /other/note.txt 2>/dev/null | wc -c"]
    with Node(paths, store=store) as node:
        first = node.create("task")
        assert node.exec(first.id, read).exit_code == 0  # its first command reads python3.11 from base
        node.destroy(first.id)
        node.prefetch.wait_published()
        p1 = load_profile(store, load_template(store, "task")[0])
        b1 = [c for g, c in p1.chunks if p1.groups[g] == base]
        spans1 = {(off, n) for g, off, n in p1.ranges if p1.groups[g] == base}
        assert len(b1) > len(node.lazyfs.mount_reads(base)), "the first command read no chunk of base"
        second = node.create("other")
        assert node.exec(second.id, read).exit_code == 0  # the same reads: served by the page cache
        node.destroy(second.id)
        node.prefetch.wait_published()
    p2 = load_profile(store, load_template(store, "other")[0])
    gi = p2.groups.index(base)
    b2 = [c for g, c in p2.chunks if g == gi]
    assert set(b1) <= set(b2)
    assert spans1 <= {(off, n) for g, off, n in p2.ranges if g == gi}
    assert p2.pack is not None and len(p2.pack.frames) == len(p2.chunks)  # all of them in its pack
