"""The environments' disk (issue 13, finding 5): every environment has a disk
limit (``Resources.disk_bytes``) enforced by the kernel on a btrfs file system
of the node's own (:mod:`weenv.node.disk`); writes past it fail, from inside
and through the files API, while the node and its other environments go on;
admission bounds the sum of declared limits; nothing is left after close."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from weenv.errors import CapacityError, DiskFullError
from weenv.formats.manifest import Resources
from weenv.host import mounts
from weenv.node.node import Node

MiB = 1 << 20
SMALL = Resources(cpus=0.5, memory_bytes=256 * MiB, pids=256, disk_bytes=64 * MiB)


def _loops_of(image: Path) -> list[str]:
    out = subprocess.run(["losetup", "-a"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if str(image) in line]


def test_write_past_the_limit_fails_inside_and_the_node_goes_on(node, paths):
    info = node.create("task", resources=SMALL)
    image = paths.node / "disk.img"
    allocated0 = image.stat().st_blocks * 512
    t0 = time.monotonic()
    r = node.exec(info.id, ["dd", "if=/dev/zero", "of=/tmp/big", "bs=1M", "count=200", "conv=fsync"])
    took = time.monotonic() - t0
    assert r.exit_code != 0
    assert b"Disk quota exceeded" in r.stderr, r.stderr
    assert took < 10
    used, limit = node.disk_usage(info.id)
    assert limit == 64 * MiB and 48 * MiB < used <= limit, (used, limit)
    print(f"\ndd of 200 MiB into a 64 MiB disk: refused after {took:.2f} s; usage {used / MiB:.1f} MiB")
    # the host's file system got at most the limit: the image (sparse) grew by what the quota allowed
    assert image.stat().st_blocks * 512 - allocated0 < 64 * MiB + 16 * MiB
    # the environment itself goes on: it runs commands, and has room again once it deletes
    assert node.exec(info.id, ["echo", "ok"]).stdout == b"ok\n"
    assert node.exec(info.id, ["rm", "/tmp/big"]).exit_code == 0
    assert node.exec(info.id, ["sh", "-c", "head -c 8M /dev/zero > /tmp/small && sync"]).exit_code == 0
    # another environment on the node creates, writes and runs
    other = node.create("task", resources=SMALL)
    assert node.exec(other.id, ["sh", "-c", "head -c 32M /dev/zero > /tmp/f && sync && echo ok"]).stdout == b"ok\n"
    node.destroy(info.id)
    node.destroy(other.id)


def test_many_small_files_reach_the_limit_too(node):
    """Metadata counts: empty files cannot exhaust the node's disk either."""
    info = node.create("task", resources=Resources(cpus=0.5, memory_bytes=256 * MiB, pids=256, disk_bytes=16 * MiB))
    r = node.exec(
        info.id,
        [
            "python3",
            "-c",
            "import os\nos.mkdir('/tmp/d')\n"
            "try:\n  [open(f'/tmp/d/{i}', 'w').close() for i in range(200000)]\n"
            "except OSError as e: print(e.errno)",
        ],
        timeout=120,
    )
    assert r.stdout.strip() == str(errno.EDQUOT).encode(), (r.stdout, r.stderr)
    node.destroy(info.id)


def test_files_api_write_past_the_limit_is_refused(node):
    info = node.create("task", resources=SMALL)
    fs = node.files(info.id)
    with pytest.raises(DiskFullError, match="disk limit") as exc:
        fs.write_file("/tmp/big", b"x" * (100 * MiB))
    assert exc.value.errno == errno.EDQUOT
    fs.remove("/tmp/big")
    with pytest.raises(DiskFullError):  # a streamed write (PUT /files) too
        with fs.open_write("/tmp/big2") as f:
            for _ in range(100):
                f.write(b"y" * MiB)
    fs.remove("/tmp/big2")
    fs.write_file("/tmp/fits", b"z" * MiB)
    assert node.exec(info.id, ["stat", "-c", "%s", "/tmp/fits"]).stdout == b"1048576\n"
    node.destroy(info.id)


def test_admission_counts_declared_disks(paths, shared_store, leak_check, monkeypatch):
    half = Resources(cpus=0.5, memory_bytes=256 * MiB, pids=256, disk_bytes=600 * MiB)
    with Node(paths, store=shared_store, disk_bytes=1 << 30, pool_size=0) as node:  # default: thin, 4x the disk
        both = [node.create("task", resources=half) for _ in range(2)]
        with pytest.raises(CapacityError, match="disk limits would reach"):
            node.create("task", resources=Resources(disk_bytes=3 << 30))
        for info in both:
            node.destroy(info.id)
    monkeypatch.setenv("WEENV_DISK_OVERCOMMIT", "1")  # every environment gets what it declared
    with Node(paths, store=shared_store, disk_bytes=1 << 30, pool_size=0) as node:
        assert 900 * MiB < node.disk.size <= 1 << 30
        first = node.create("task", resources=half)
        with pytest.raises(CapacityError, match="disk limits would reach"):
            node.create("task", resources=half)
        with pytest.raises(CapacityError, match="disk limits"):
            node.create("task", resources=Resources(disk_bytes=2 << 30))
        node.destroy(first.id)
        second = node.create("task", resources=half)  # room again
        node.destroy(second.id)


def test_nothing_left_after_destroy_and_close(paths, shared_store, leak_check):
    image = paths.node / "disk.img"
    with Node(paths, store=shared_store) as node:
        envs = node.envs  # node/envs, or its /run alias when a directory above the home is closed to others
        assert mounts.is_mounted(envs)
        assert len(_loops_of(image)) == 1
        assert os.stat(image).st_blocks * 512 < 64 * MiB  # sparse
        info = node.create("task", resources=SMALL)
        node.exec(info.id, ["sh", "-c", "head -c 16M /dev/urandom > /tmp/f"])
        sub = node._env(info.id).dir / "disk"
        assert sub.stat().st_ino == 256  # a subvolume's root
        node.destroy(info.id)
        assert not sub.exists() and list(envs.iterdir()) == []
    assert not mounts.mounts_under(paths.home) and not mounts.mounts_under(envs)
    assert _loops_of(image) == [] and not image.exists()


FOREIGN_MOUNTS = Path(__file__).parent / "foreign_mounts.py"


@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_a_fresh_home_starts_beside_another_homes_broken_fuse_mount(tmp_path, paths, shared_store, leak_check, how):
    """Another home's FUSE daemon killed leaves its FUSE mount and the EROFS group
    mount reading a file in it disconnected (ENOTCONN); one stopped (SIGSTOP)
    leaves them answering nothing.  A node with a fresh home still makes its
    disk, starts, and creates and runs environments (one with network).  The
    node runs in a mount namespace of its own holding the broken mounts
    (``foreign_mounts.py``), so that they stand in no other process's way."""
    proc = subprocess.Popen(
        [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            sys.executable,
            str(FOREIGN_MOUNTS),
            "start-node",
            str(tmp_path / "foreign"),
            str(shared_store.root),
            how,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # its clean-up runs: the daemon killed, the broken mounts unmounted
        out, err = proc.communicate(timeout=120)
        pytest.fail(f"no node started in 300 s:\n{err[-4000:]}")
    assert proc.returncode == 0, err[-4000:]
    seen = json.loads(out.splitlines()[-1])
    assert seen["mounted"] == [True, True], seen
    if how == "killed":
        assert seen["enotconn"], seen  # the EROFS mount's source fails as it did for mkfs.btrfs
    assert seen["exit_code"] == 0 and seen["stdout"].split("\n")[0] == "up", seen
    assert "hello.py" in seen["stdout"], seen
    assert seen["network_exit_code"] == 0 and seen["network_stdout"].strip() in ("up", "unknown"), seen
    left = [str(p) for i in seen["ids"] for p in Path("/sys/fs/cgroup").glob(f"*/weenv-{i}")]
    assert not left and not seen["mounts_left"], (left, seen["mounts_left"])  # the node left nothing
