"""The snapshotter: an environment's root file system, as a plan and as mounts.

An environment's directory (``environments/<id>/``) holds its rootfs mount
point, its upper and work dirs (a subvolume of the node's disk with the
environment's disk limit, :mod:`weenv.node.disk`) and, beside them, the bundle
and the agent's socket (:mod:`weenv.node.container`).  Its rootfs is an
overlay of the template's group mounts (:class:`~weenv.node.groups.GroupMounts`,
shared read-only) under its private upper dir.

As containerd's snapshotter does, computing the mounts (:func:`rootfs_mounts`,
no system call) is apart from performing them (:meth:`Snapshotter.prepare`
through :mod:`weenv.host.mounts`, the mounter).
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from pathlib import Path

from weenv.config import PRIVATE_MODE
from weenv.errors import MountError
from weenv.formats.manifest import GroupManifest
from weenv.host import mounts
from weenv.host.mounts import MountSpec
from weenv.node.disk import RETIRED, SPARE, SUBVOLUME, NodeDisk
from weenv.node.groups import GroupMounts


def rootfs_mounts(env_dir: Path, lowers: list[Path]) -> list[MountSpec]:
    """The mounts making the rootfs of the environment in ``env_dir`` over the
    group mount points ``lowers`` (bottom to top, as the template lists its
    groups): one overlay at ``env_dir/rootfs``.  Touches nothing."""
    return [mounts.overlay_spec(lowers, NodeDisk.upper(env_dir), NodeDisk.work(env_dir), env_dir / "rootfs")]


class Snapshotter:
    """Environments' directories and rootfs mounts under ``environments``."""

    def __init__(self, environments: Path, groups: GroupMounts, disk: NodeDisk):
        self.environments = environments
        self.groups = groups
        self.disk = disk

    def dir(self, env_id: str) -> Path:
        return self.environments / env_id

    def dirs(self) -> list[Path]:
        """Every environment directory on the node, by id (not the captures' ``.captures``)."""
        return sorted(p for p in self.environments.iterdir() if p.is_dir() and not p.name.startswith("."))

    def prepare(self, env_id: str, groups: list[str], group_manifests: list[GroupManifest], disk_bytes: int,
                undo: contextlib.ExitStack, timing: dict, *, upper_from: Path | None = None) -> list[Path]:
        """Make environment ``env_id``'s directory, take its group mounts (cold
        ones in parallel), make its upper dir with ``disk_bytes`` as its limit
        (empty, or with ``upper_from`` a capture's subvolume,
        :mod:`weenv.node.snapshot`: a snapshot of it) and mount its overlay rootfs; each step's undo pushed on ``undo``; the
        seconds of ``groups_s`` and ``overlay_s`` go to ``timing``.  Returns the
        overlay's lower dirs (group mount points, as ``groups`` lists them).
        Raises :class:`MountError` (and what the group mounts raise)."""
        env_dir = self.dir(env_id)
        env_dir.mkdir(mode=PRIVATE_MODE)
        undo.callback(self.remove_dir, env_dir)

        t = time.perf_counter()
        lowers = self.groups.acquire_all(list(zip(groups, group_manifests)))
        undo.callback(self.release, groups, lowers)
        timing["groups_s"] = time.perf_counter() - t

        t = time.perf_counter()
        if upper_from is None:
            self.disk.make(env_dir, disk_bytes)  # upper and work dirs, with the disk limit
        else:
            self.disk.clone(upper_from, env_dir, disk_bytes)
        (env_dir / "rootfs").mkdir()
        self.mount(env_dir, lowers, undo)
        timing["overlay_s"] = time.perf_counter() - t
        return lowers

    def mount(self, env_dir: Path, lowers: list[Path], undo: contextlib.ExitStack | None = None) -> None:
        """Mount the overlay rootfs of the environment in ``env_dir`` over ``lowers``
        (its undo pushed on ``undo``).  Raises :class:`MountError`."""
        for spec in rootfs_mounts(env_dir, lowers):
            mounts.mount(spec)
            if undo is not None:
                undo.callback(umount_quietly, Path(spec.target))

    def replace_upper(self, env_dir: Path, disk_bytes: int, upper_from: Path | None, *, spare: bool = False) -> None:
        """Give the unmounted environment in ``env_dir`` a new upper dir: empty,
        or a snapshot of the capture subvolume ``upper_from``.  ``spare``: the
        one :meth:`make_spare` made of that source is swapped in (two renames);
        else it is made now.  The old one is kept as :data:`RETIRED` until
        :meth:`drop_retired` (the disk's :meth:`~NodeDisk.remove` of it can wait
        for the file system).  Raises :class:`MountError`."""
        if not spare:
            self.disk.remove(env_dir, SPARE)
            self.make_upper(env_dir, disk_bytes, upper_from, SPARE)
        self.disk.swap_in(env_dir, SPARE)

    def make_upper(self, env_dir: Path, disk_bytes: int, upper_from: Path | None, name: str) -> None:
        """Make subvolume ``name`` in ``env_dir``: an empty upper dir, or a snapshot
        of the capture subvolume ``upper_from``, its quota ``disk_bytes``.  Raises :class:`MountError`."""
        if upper_from is None:
            self.disk.make(env_dir, disk_bytes, name)
        else:
            self.disk.clone(upper_from, env_dir, disk_bytes, name)

    def make_spare(self, env_dir: Path, disk_bytes: int, upper_from: Path | None) -> None:
        """Make, ahead of a reset, the upper dir :meth:`replace_upper` would make
        (:data:`SPARE`, replacing one there).  Raises :class:`MountError`."""
        self.disk.remove(env_dir, SPARE)
        self.make_upper(env_dir, disk_bytes, upper_from, SPARE)

    def drop_retired(self, env_dir: Path) -> None:
        """Delete the upper dir a reset swapped out (:data:`RETIRED`), if any."""
        self.disk.remove(env_dir, RETIRED)

    def release(self, groups: list[str], lowers: list[Path]) -> None:
        """Give back the group mounts an environment's overlay used."""
        for g_digest, lower in zip(groups, lowers):
            self.groups.release(g_digest, lower)

    def is_mounted(self, env_id: str) -> bool:
        """Whether environment ``env_id``'s rootfs is mounted."""
        return mounts.is_mounted(self.dir(env_id) / "rootfs")

    def unmount(self, env_dir: Path) -> None:
        """Unmount the rootfs of the environment in ``env_dir`` (lazily if busy); idempotent."""
        umount_quietly(env_dir / "rootfs")

    def unmount_all(self, env_dir: Path) -> None:
        """Unmount whatever is mounted under ``env_dir`` (a leftover's)."""
        for _fstype, point in mounts.mounts_under(env_dir):
            umount_quietly(Path(point))

    def remove_dir(self, env_dir: Path) -> None:
        """Remove an environment's directory, its disk's subvolumes first (at once, however big)."""
        for name in (SUBVOLUME, SPARE, RETIRED):
            self.disk.remove(env_dir, name)
        remove_tree(env_dir)

    def usage(self, env_dir: Path) -> tuple[int, int]:
        """``(used, limit)`` bytes of the environment's upper dir (:meth:`NodeDisk.usage`)."""
        return self.disk.usage(env_dir)


def remove_tree(path: Path) -> None:
    """Remove the directory tree ``path``, ignoring errors, however deep an
    environment made it (shutil.rmtree recurses once per level until Python 3.12)."""
    try:
        shutil.rmtree(path, ignore_errors=True)
    except RecursionError:
        subprocess.run(["rm", "-rf", "--one-file-system", "--", str(path)], check=False,
                       stdin=subprocess.DEVNULL, capture_output=True)  # fmt: skip


def umount_quietly(target: Path) -> None:
    """Unmount ``target`` if mounted, lazily if it is busy."""
    if not mounts.is_mounted(target):
        return
    try:
        mounts.umount(target)
    except MountError:
        mounts.umount(target, detach=True)
