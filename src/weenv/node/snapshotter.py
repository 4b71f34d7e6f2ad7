"""The snapshotter: an environment's root file system, as a plan and as mounts.

An environment's directory (``environments/<id>/``) holds its rootfs mount
point, its upper and work dirs (a subvolume of the node's disk with the
environment's disk limit, :mod:`weenv.node.disk`) and, beside them, the bundle
and the agent's socket (:mod:`weenv.node.runtime.container`).  Its rootfs is an
overlay of the template's group mounts (:class:`~weenv.node.data.groups.GroupMounts`,
shared read-only) under its private upper dir.

As containerd's snapshotter does, computing the mounts (:func:`rootfs_mounts`,
no system call) is apart from performing them (:meth:`Snapshotter.prepare`
through :mod:`weenv.host.mounts`, the mounter).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shutil
import subprocess
import threading
import time
from concurrent.futures import Future
from pathlib import Path

from weenv.api.models import CreateTiming
from weenv.config import PRIVATE_MODE
from weenv.errors import MountError
from weenv.formats.manifest import GroupManifest
from weenv.host import mounts
from weenv.host.mounts import MountSpec
from weenv.node.data.groups import GroupMounts
from weenv.node.disk import SPARE, SUBVOLUME, NodeDisk, leftovers
from weenv.node.runtime import idmap

log = logging.getLogger(__name__)

IDMAPPED = "idmapped"
"""In a user-namespace environment's directory: ``N/``, the idmapped clone of its
``N``-th lower (:func:`weenv.node.runtime.idmap.idmapped_clone`), the overlay's real lowers."""
LOWERS_FILE = "lowers.json"
"""In ``IDMAPPED/``: the group mount points the clones were made of (a list of paths), for recovery."""
RANGE_DIR_MODE = 0o710
"""The mode of a user-namespace environment's directory, group the range's root
(its first host id): only host root and the range's root get through it."""


AHEAD_ROOTFS = "rootfs.next"
"""In an environment's directory: the rootfs of the container made ahead for its
next reset (over its :data:`SPARE` upper dir), until the reset moves it to ``rootfs``."""
RETIRED_ROOTFS = "rootfs.old"
"""In an environment's directory: where a reset moves its old rootfs, until it
is unmounted in the background: ``rootfs.old.<token>`` (a name of its own each:
one whose unmount failed does not stand in the next reset's way), or
``rootfs.old`` (left by an older weenv)."""


def rootfs_mounts(env_dir: Path, lowers: list[Path], *, userns: bool = False, ahead: bool = False) -> list[MountSpec]:
    """The mounts making the rootfs of the environment in ``env_dir`` over the
    lower dirs ``lowers`` (bottom to top, as the template lists its groups):
    one overlay at ``env_dir/rootfs``, ``nosuid`` unless ``userns`` (its lowers
    are then idmapped clones, every file of it its range's); ``ahead``: at
    ``env_dir/``:data:`AHEAD_ROOTFS` over the :data:`SPARE` subvolume.  Touches nothing."""
    if ahead:
        sub = env_dir / SPARE
        return [mounts.overlay_spec(lowers, sub / "upper", sub / "work", env_dir / AHEAD_ROOTFS, nosuid=not userns)]
    return [
        mounts.overlay_spec(
            lowers, NodeDisk.upper(env_dir), NodeDisk.work(env_dir), env_dir / "rootfs", nosuid=not userns
        )
    ]


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

    def prepare(
        self,
        env_id: str,
        groups: list[str],
        group_manifests: list[GroupManifest],
        disk_bytes: int,
        undo: contextlib.ExitStack,
        timing: CreateTiming,
        *,
        upper_from: Path | None = None,
        userns: bool = False,
    ) -> list[Path]:
        """Make environment ``env_id``'s directory, take its group mounts (cold
        ones in parallel), make its upper dir with ``disk_bytes`` as its limit
        (empty, or with ``upper_from`` a capture's subvolume,
        :mod:`weenv.node.state.snapshot`: a snapshot of it) and mount its overlay rootfs; each step's undo pushed on ``undo``.
        The upper dir is made while the group mounts are taken (in a thread of
        their own): ``timing`` gets ``groups_s``, seconds until both are done,
        ``upper_s``, the upper dir's part of them, and ``overlay_s``, the overlay mount's after.  Returns the
        overlay's lower dirs (group mount points, as ``groups`` lists them).
        ``userns``: the environment gets a host id range of its own
        (:func:`weenv.node.runtime.idmap.allocate`), its upper dir is the range's
        root's and its overlay lies over idmapped clones of the group mounts.
        A capture's files keep their owners inside whatever range (or none)
        either environment has (:meth:`make_upper`).
        Raises :class:`MountError` (and what the group mounts raise),
        :class:`InvalidInputError` where the range cannot reach its rootfs,
        :class:`CapacityError` when no range is free."""
        env_dir = self.dir(env_id)
        if userns:
            idmap.open_parents(env_dir)
        env_dir.mkdir(mode=PRIVATE_MODE)
        undo.callback(self.remove_dir, env_dir)
        if userns:  # searchable by the range's root group only (runc's init, in the namespace, opens the rootfs)
            os.chown(env_dir, 0, idmap.allocate(env_dir))
            os.chmod(env_dir, RANGE_DIR_MODE)

        # the group mounts (a cold one waits for its superblock's fetch) run in a thread while this
        # one makes the upper dir (btrfs ioctls): neither needs the other until the overlay mount
        t = time.perf_counter()
        acquiring: Future = Future()

        def acquire() -> None:
            try:
                acquiring.set_result(self.groups.acquire_all(list(zip(groups, group_manifests))))
            except BaseException as exc:  # raised in the create's thread, below
                acquiring.set_exception(exc)

        threading.Thread(target=acquire, name=f"weenv-groups-{env_id}", daemon=True).start()
        try:
            self.make_upper(env_dir, disk_bytes, upper_from, SUBVOLUME)  # with the disk limit
            (env_dir / "rootfs").mkdir()
        finally:
            upper_s = time.perf_counter() - t
            lowers = acquiring.result()  # the mounts' error first: the upper dir's goes with remove_dir
            undo.callback(self.release, groups, lowers)
        joined = time.perf_counter()
        timing.groups_s = joined - t
        self.mount(env_dir, lowers, undo)
        timing.upper_s = upper_s
        timing.overlay_s = time.perf_counter() - joined
        return lowers

    def mount(
        self, env_dir: Path, lowers: list[Path], undo: contextlib.ExitStack | None = None, *, ahead: bool = False
    ) -> None:
        """Mount the overlay rootfs of the environment in ``env_dir`` over ``lowers``
        (its undo pushed on ``undo``); for an environment with a host id
        range, over idmapped clones of them (made if not mounted yet, left for
        :meth:`unmount`).  ``ahead``: the rootfs of a container made ahead
        (:data:`AHEAD_ROOTFS`, over the :data:`SPARE` upper dir, for
        :meth:`promote_ahead`).  Raises :class:`MountError`."""
        host_id = idmap.range_of(env_dir)
        if host_id is not None:  # again after a restart: the node's start closed node/ (0700)
            idmap.open_parents(env_dir)
            lowers = self._idmapped(env_dir, lowers, host_id, undo)
        if ahead:
            (env_dir / AHEAD_ROOTFS).mkdir(exist_ok=True)
        for spec in rootfs_mounts(env_dir, lowers, userns=host_id is not None, ahead=ahead):
            mounts.mount(spec)
            if undo is not None:
                undo.callback(umount_quietly, Path(spec.target))

    def _idmapped(
        self, env_dir: Path, lowers: list[Path], host_id: int, undo: contextlib.ExitStack | None
    ) -> list[Path]:
        """The idmapped clones (``env_dir/IDMAPPED/N``) of ``lowers`` through range
        ``host_id``'s mapping, mounting those not mounted yet."""
        clones = [env_dir / IDMAPPED / str(i) for i in range(len(lowers))]
        (env_dir / IDMAPPED).mkdir(exist_ok=True)
        (env_dir / IDMAPPED / LOWERS_FILE).write_text(json.dumps([os.fspath(p) for p in lowers]))
        missing = [(lower, c) for lower, c in zip(lowers, clones) if not mounts.is_mounted(c)]
        if missing:
            with idmap.UserNamespace(host_id) as ns:
                for lower, clone in missing:
                    clone.mkdir(parents=True, exist_ok=True)
                    idmap.idmapped_clone(lower, clone, ns)
                    if undo is not None:
                        undo.callback(umount_quietly, clone)
        return clones

    def overlay_lowers(self, env_dir: Path) -> list[Path] | None:
        """The group mount points under the mounted rootfs of the environment in
        ``env_dir`` (through its idmapped clones, if it has a range), None if
        its rootfs is not an overlay mount (:func:`weenv.host.mounts.overlay_lowers`)."""
        lowers = mounts.overlay_lowers(env_dir / "rootfs")
        if lowers is None or idmap.range_of(env_dir) is None:
            return lowers
        try:
            points = [Path(p) for p in json.loads((env_dir / IDMAPPED / LOWERS_FILE).read_text())]
        except (OSError, ValueError):
            return None
        return points if len(points) == len(lowers) else None

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
        of the capture subvolume ``upper_from``, its quota ``disk_bytes``.
        Its owners are the environment's range's (:func:`weenv.node.runtime.idmap.range_of`,
        0 without one): an empty one's root is the range's root; a snapshot's
        files are moved from the range the capture was taken in
        (:func:`~weenv.node.runtime.idmap.range_of_subvolume`) to it
        (:func:`~weenv.node.runtime.idmap.shift_owners`), so owners and modes inside
        are the captured environment's.  Raises :class:`MountError`."""
        host_id = idmap.range_of(env_dir)
        sub = env_dir / name
        if upper_from is None:
            self.disk.make(env_dir, disk_bytes, name)
            if host_id is not None:
                idmap.own_upper(sub / "upper", sub / "work", host_id)
        else:
            self.disk.clone(upper_from, env_dir, disk_bytes, name)
            idmap.shift_owners(sub / "upper", idmap.range_of_subvolume(upper_from), host_id or 0)
            if host_id is not None:  # the clone's work dir is a new one
                os.chown(sub / "work", host_id, host_id)

    def make_spare(self, env_dir: Path, disk_bytes: int, upper_from: Path | None) -> None:
        """Make, ahead of a reset, the upper dir :meth:`replace_upper` would make
        (:data:`SPARE`, replacing one there).  Raises :class:`MountError`."""
        self.disk.remove(env_dir, SPARE)
        self.make_upper(env_dir, disk_bytes, upper_from, SPARE)

    def move_aside(self, env_dir: Path) -> Path:
        """Move the environment's rootfs mount to a new ``rootfs.old.<token>``
        (:data:`RETIRED_ROOTFS`, for :meth:`unmount_retired`: an overlay's
        unmount may wait for its upper file system); that path.  Raises :class:`MountError`."""
        aside = env_dir / f"{RETIRED_ROOTFS}.{secrets.token_hex(4)}"
        aside.mkdir()
        try:
            mounts.move(env_dir / "rootfs", aside)
        except BaseException:
            with contextlib.suppress(OSError):
                aside.rmdir()
            raise
        return aside

    @staticmethod
    def retired_rootfs(env_dir: Path) -> list[Path]:
        """The rootfs mount points resets moved aside in ``env_dir`` (mounted or left empty)."""
        return leftovers(env_dir, RETIRED_ROOTFS)

    def unmount_retired(self, env_dir: Path) -> None:
        """Unmount every rootfs a reset moved aside (:data:`RETIRED_ROOTFS`) and
        remove its mount point; idempotent (one that cannot go stays for the next call)."""
        for aside in self.retired_rootfs(env_dir):
            try:
                umount_quietly(aside)
                aside.rmdir()
            except (MountError, OSError) as exc:
                log.warning("cannot remove the rootfs moved aside at %s: %s", aside, exc)

    def move_ahead(self, env_dir: Path) -> None:
        """With the environment's rootfs moved aside or unmounted: move the overlay at
        :data:`AHEAD_ROOTFS` (over :data:`SPARE`) to ``env_dir/rootfs``
        (then :meth:`swap_in_spare`).  The mount keeps naming ``SPARE`` in
        ``/proc/mounts``.  Raises :class:`MountError` (nothing moved)."""
        mounts.move(env_dir / AHEAD_ROOTFS, env_dir / "rootfs")

    def swap_in_spare(self, env_dir: Path) -> None:
        """Make the :data:`SPARE` upper dir (mounted or not) the environment's own
        (:meth:`NodeDisk.swap_in`: the old one becomes :data:`RETIRED`).  Raises :class:`MountError`."""
        self.disk.swap_in(env_dir, SPARE)

    def is_mounted_ahead(self, env_dir: Path) -> bool:
        """Whether the rootfs of a container made ahead (:data:`AHEAD_ROOTFS`) is mounted."""
        return mounts.is_mounted(env_dir / AHEAD_ROOTFS)

    def move_back(self, env_dir: Path, aside: Path) -> None:
        """Undo :meth:`move_aside` (which returned ``aside``; the rootfs made ahead
        could not take its place).  Raises :class:`MountError`."""
        mounts.move(aside, env_dir / "rootfs")
        with contextlib.suppress(OSError):
            aside.rmdir()

    def unmount_ahead(self, env_dir: Path) -> None:
        """Unmount the rootfs of a container made ahead (:data:`AHEAD_ROOTFS`), if mounted; idempotent."""
        umount_quietly(env_dir / AHEAD_ROOTFS)

    def drop_retired(self, env_dir: Path) -> None:
        """Delete the upper dirs resets swapped out (:data:`RETIRED`), if any."""
        self.disk.remove_retired(env_dir)

    def release(self, groups: list[str], lowers: list[Path]) -> None:
        """Give back the group mounts an environment's overlay used."""
        for g_digest, lower in zip(groups, lowers):
            self.groups.release(g_digest, lower)

    def is_mounted(self, env_id: str) -> bool:
        """Whether environment ``env_id``'s rootfs is mounted."""
        return mounts.is_mounted(self.dir(env_id) / "rootfs")

    def unmount(self, env_dir: Path) -> None:
        """Unmount the rootfs of the environment in ``env_dir`` (lazily if busy),
        and the rootfs of a container made ahead (:data:`AHEAD_ROOTFS`) and one
        moved aside by a reset (:data:`RETIRED_ROOTFS`), then
        its idmapped lowers if any; idempotent."""
        umount_quietly(env_dir / "rootfs")
        umount_quietly(env_dir / AHEAD_ROOTFS)
        for aside in self.retired_rootfs(env_dir):
            umount_quietly(aside)
        clones = env_dir / IDMAPPED
        if clones.is_dir():
            for c in sorted(clones.iterdir()):
                umount_quietly(c)

    def unmount_all(self, env_dir: Path) -> None:
        """Unmount whatever is mounted under ``env_dir`` (a leftover's)."""
        for _fstype, point in mounts.mounts_under(env_dir):
            umount_quietly(Path(point))

    def remove_dir(self, env_dir: Path) -> None:
        """Remove an environment's directory, its disk's subvolumes first (at once, however big)."""
        for name in (SUBVOLUME, SPARE, *self.disk.retired(env_dir)):
            self.disk.remove(env_dir, name)
        idmap.release(env_dir)
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
        subprocess.run(
            ["rm", "-rf", "--one-file-system", "--", str(path)],
            check=False,
            stdin=subprocess.DEVNULL,
            capture_output=True,
        )


def umount_quietly(target: Path) -> None:
    """Unmount ``target`` if mounted, lazily if it is busy."""
    if not mounts.is_mounted(target):
        return
    try:
        mounts.umount(target)
    except MountError:
        mounts.umount(target, detach=True)
