"""Another home's mounts left disconnected, and a node started beside them.

:func:`disconnected_mounts` makes what a weenv home leaves when its FUSE daemon
is killed (SIGKILL): a FUSE mount serving one EROFS image file, that image
mounted by EROFS (file-backed, its source a path inside the FUSE mount), and
the daemon gone, so both stay mounted and every access through the FUSE mount
fails with ``ENOTCONN``.  Each is unmounted at the end (``umount -l`` of
exactly its path).

Run as a program:

- ``serve MOUNTPOINT IMAGE``: the FUSE daemon (mounts, prints ``ready``, serves
  until killed);
- ``start-node DIR STORE [killed|stopped]``: with :func:`disconnected_mounts` in ``DIR``, start
  a node on ``WEENV_HOME`` (a fresh home) over the file store ``STORE``, create
  two environments of template ``task`` (one with network), run a command in
  each, destroy them, and print one JSON line of what it saw.  Meant to run in a mount namespace of
  its own (``unshare --mount --propagation private``): the broken mounts then
  stand in no other process's way on the machine, while this node's
  processes see them as they would on the host.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from weenv.host.mounts import MountSpec, erofs_spec, is_mounted, mount, mounts_under, umount
from weenv.node.data.fuse import protocol as P
from weenv.node.data.fuse.session import Attr, FuseSession, Operations, mount_options, open_device

PR_SET_PDEATHSIG = 1
IMAGE_NAME = b"image"
IMAGE_INO = 2


class OneFile(Operations):
    """A root directory holding one read-only file, ``image``, of the bytes ``data``."""

    def __init__(self, data: bytes):
        self.data = data

    def lookup(self, parent: int, name: bytes) -> Attr:
        if parent == 1 and name == IMAGE_NAME:
            return self.getattr(IMAGE_INO)
        raise OSError(errno.ENOENT, "no such entry")

    def getattr(self, ino: int) -> Attr:
        if ino == 1:
            return Attr(1, stat.S_IFDIR | 0o755, nlink=2, timeout=0)
        if ino == IMAGE_INO:  # not cached: a stat(2) of it asks the daemon, as one of a lazy group image does
            return Attr(IMAGE_INO, stat.S_IFREG | 0o444, size=len(self.data), timeout=0)
        raise OSError(errno.ENOENT, "no such inode")

    def open(self, ino: int, flags: int) -> tuple[int, int]:
        if ino != IMAGE_INO:
            raise OSError(errno.ENOENT, "no such inode")
        return IMAGE_INO, P.FOPEN_KEEP_CACHE

    def read(self, fh: int, offset: int, size: int) -> bytes:
        return self.data[offset : offset + size]

    def opendir(self, ino: int) -> int:
        return 1

    def readdir(self, fh: int, offset: int) -> list[tuple[int, int, bytes, int]]:
        return [(1, IMAGE_INO, IMAGE_NAME, 8)][offset:]  # DT_REG


def serve(mountpoint: str, image: str) -> None:
    # killed with its parent however that ends (a stopped daemon too): nothing waits on its mount after
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    fd = open_device()
    mount(MountSpec("fuse", "foreign-home", mountpoint, mount_options(fd, "allow_other")))
    FuseSession(fd, OneFile(Path(image).read_bytes()), name="foreign").start()
    print("ready", flush=True)
    while True:
        time.sleep(3600)


def _enotconn(path: Path) -> bool:
    try:
        os.stat(path)
    except OSError as exc:
        return exc.errno == errno.ENOTCONN
    return False


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


@contextlib.contextmanager
def disconnected_mounts(directory: Path, how: str = "killed") -> Iterator[tuple[Path, Path]]:
    """``(FUSE mount point, EROFS mount point)`` of another home's group mount
    under ``directory`` whose FUSE daemon was killed (module docstring), or,
    ``how="stopped"``, stopped (SIGSTOP): alive, it answers nothing, and every
    access through the FUSE mount waits until it is killed at the end."""
    if how not in ("killed", "stopped"):
        raise ValueError(f"how: killed or stopped, not {how!r}")
    tree, image = directory / "tree", directory / "group.erofs"
    fuse_point, group_point = directory / "lazy", directory / "group"
    for d in (tree, fuse_point, group_point):
        d.mkdir(parents=True)
    (tree / "hello").write_text("hello\n")
    subprocess.run(["mkfs.erofs", "--quiet", str(image), str(tree)], check=True)
    daemon = subprocess.Popen(
        [sys.executable, __file__, "serve", str(fuse_point), str(image)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert daemon.stdout is not None and daemon.stdout.readline().strip() == "ready"
        mount(erofs_spec(fuse_point / IMAGE_NAME.decode(), group_point))
        assert (group_point / "hello").read_text() == "hello\n"
        if how == "killed":
            daemon.send_signal(signal.SIGKILL)
            daemon.wait()
        else:
            daemon.send_signal(signal.SIGSTOP)
            while not _stopped(daemon.pid):
                time.sleep(0.01)
        yield fuse_point, group_point
    finally:
        if daemon.poll() is None:
            daemon.kill()  # a stopped one too: its connection ends, and what waited on it fails
            daemon.wait()
        for point in (group_point, fuse_point):  # the EROFS mount first: it holds a file of the FUSE mount
            if is_mounted(point):
                umount(point, detach=True)


def start_node(directory: Path, store_root: Path, how: str = "killed") -> dict:
    from weenv.config import Paths
    from weenv.node.node import Node
    from weenv.store.file import FileStore

    with disconnected_mounts(directory, how) as (fuse_point, group_point):
        seen = {"mounted": [is_mounted(fuse_point), is_mounted(group_point)]}
        if how == "killed":  # (a stat(2) through a stopped daemon's mount would wait for ever)
            seen["enotconn"] = _enotconn(fuse_point / IMAGE_NAME.decode())  # the EROFS mount's source
        paths = Paths.from_env()
        with Node(paths, store=FileStore(store_root)) as node:
            env = node.create("task")
            r = node.exec(env.id, ["sh", "-c", "echo up; ls /workspace"])
            seen.update(exit_code=r.exit_code, stdout=r.stdout.decode(), stderr=r.stderr.decode())
            networked = node.create("task", network=True)  # its namespace, veth and rules too
            r = node.exec(networked.id, ["cat", "/sys/class/net/eth0/operstate"])
            seen.update(network_exit_code=r.exit_code, network_stdout=r.stdout.decode())
            node.destroy(env.id)
            node.destroy(networked.id)
            seen["ids"] = [env.id, networked.id]
        seen["mounts_left"] = [point for _fstype, point in mounts_under(paths.home)]  # in this namespace
    return seen


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "start-node":
        print(json.dumps(start_node(Path(sys.argv[2]), Path(sys.argv[3]), *sys.argv[4:5])))
    else:
        sys.exit(f"unknown command {sys.argv[1]!r}")
