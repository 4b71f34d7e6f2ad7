"""The environments' disk: a btrfs file system of the node's own, with a quota per environment (Linux only).

Every environment's writable layer (its overlay upper and work dirs) lives in a
btrfs subvolume of its own, ``ENV_DIR/disk`` (``upper/`` and ``work/`` in it),
with a simple-quota (squota, Linux >= 6.7) limit on the bytes it references:
its declared ``Resources.disk_bytes``.  Data and metadata both count (a million
empty files reach the limit too).  A write past the limit fails with
``EDQUOT`` ("Disk quota exceeded") inside the environment and through the files
API alike; the node, its other environments and the host's file system are
unaffected.

The file system is one sparse image file per node home (``node/disk.img``),
attached to a loop device (``LOOP_CONFIGURE``, direct I/O: no second copy of
the data in the host's page cache; autoclear: the device goes with the last
unmount) and mounted ``nosuid,nodev,discard=async`` on the environments'
directory (``node/envs``), so every environment directory is on it and
:meth:`Node.destroy`'s removal of a directory frees its blocks in the image
(discards punch holes in the file).  Its size: ``size=`` or
``WEENV_DISK_BYTES``, else :data:`DEFAULT_SHARE` of the free space of the file
system holding the home when it is made; grown (never shrunk) when a node
adopts it with a larger size asked.  Made at :meth:`NodeDisk.open` if not
mounted, unmounted and deleted at :meth:`NodeDisk.close`; a node process that
was killed leaves it mounted, and the next one adopts it with its environments.

Why btrfs and not XFS project quotas: this kernel is built without
``CONFIG_XFS_QUOTA`` ("XFS: quota support not available in this kernel").
btrfs gives what the fork/snapshot work needs as well: reflink copies
(``cp --reflink``) across subvolumes and subvolume snapshots.  Why ``EDQUOT``
and not ``ENOSPC``: a quota limit is reported so by btrfs (ext4's project
quotas do the same); only a file system per environment would say
``ENOSPC``, at the price of a mkfs and a loop device per create.

Every btrfs operation is an ioctl made here from Python (``BTRFS_IOC_*``,
include/uapi/linux/btrfs.h): no ``btrfs`` program runs after ``mkfs.btrfs``.
That one runs in a mount namespace of its own holding only the mounts it needs
(:mod:`weenv.host.mountns`): before it formats, it stat(2)s the source of every
mount in its table, and another home's FUSE mount whose daemon was killed
(``ENOTCONN``) would stop this node from starting.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import secrets
import shutil
import struct
import subprocess
import uuid
from pathlib import Path

from weenv.config import settings
from weenv.errors import CapacityError, MountError, ToolMissingError
from weenv.host import mountns, mounts

log = logging.getLogger(__name__)

DEFAULT_SHARE = 0.8
"""Share of the home file system's free space a new image gets by default (it
is sparse: the host's space is used only as environments write)."""
MIN_IMAGE_BYTES = 256 << 20
"""Smallest image (``mkfs.btrfs`` wants ~114 MiB; below this few environments fit)."""
SUBVOLUME = "disk"
"""The environment's subvolume, in its directory: ``upper/`` and ``work/`` inside."""
SPARE = "disk.next"
"""A subvolume made ahead for the environment's next reset (:meth:`NodeDisk.swap_in`), in its directory."""
RETIRED = "disk.old"
"""The subvolumes a reset swapped out, until they are deleted, in its directory:
``disk.old.<token>`` (a name of their own each: one whose deletion failed does
not stand in the next reset's way), or ``disk.old`` (left by an older weenv)."""
MOUNT_OPTIONS = "discard=async"
MKFS_TIMEOUT_S = 120.0
"""Seconds ``mkfs.btrfs`` of a new image may take (without discards it writes a few MiB)."""


def leftovers(directory: Path, name: str) -> list[Path]:
    """The entries of ``directory`` named ``name`` or ``name.<suffix>``, sorted
    (what resets replaced and left for the background to delete, each under a
    name of its own: :data:`RETIRED` here, rootfs and bundles beside it); ``[]``
    when ``directory`` is gone."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return [directory / n for n in sorted(names) if n == name or n.startswith(name + ".")]


# --- ioctls ----------------------------------------------------------------------------


def _ioc(direction: int, kind: int, nr: int, size: int) -> int:
    return (direction << 30) | (size << 16) | (kind << 8) | nr


_W, _R = 1, 2
_BTRFS = 0x94
SUBVOL_CREATE = _ioc(_W, _BTRFS, 14, 4096)  # struct btrfs_ioctl_vol_args {s64 fd; char name[4088]}
SNAP_DESTROY = _ioc(_W, _BTRFS, 15, 4096)
SNAP_CREATE_V2 = _ioc(_W, _BTRFS, 23, 4096)  # {s64 fd; u64 transid; u64 flags; u64 unused[4]; char name[4040]}
SUBVOL_RDONLY = 1 << 1
RESIZE = _ioc(_W, _BTRFS, 3, 4096)
INO_LOOKUP = _ioc(_W | _R, _BTRFS, 18, 4096)  # {u64 treeid; u64 objectid; char name[4080]}
FS_INFO = _ioc(_R, _BTRFS, 31, 1024)  # fsid at offset 16
QUOTA_CTL = _ioc(_W | _R, _BTRFS, 40, 16)  # {u64 cmd; u64 status}
QGROUP_LIMIT = _ioc(_R, _BTRFS, 43, 48)  # {u64 qgroupid; {u64 flags, max_rfer, max_excl, rsv_rfer, rsv_excl}}
QUOTA_CTL_ENABLE_SIMPLE_QUOTA = 4
QGROUP_LIMIT_MAX_RFER = 1
FIRST_FREE_OBJECTID = 256  # the root directory inode of every subvolume

LOOP_CTL_GET_FREE = 0x4C82
LOOP_CONFIGURE = 0x4C0A
LOOP_SET_CAPACITY = 0x4C07
LO_FLAGS_AUTOCLEAR = 4
LO_FLAGS_DIRECT_IO = 16


def _vol_args(name: str) -> bytearray:
    args = bytearray(4096)
    raw = name.encode()
    args[8 : 8 + len(raw)] = raw
    return args


def _snap_args(source_fd: int, name: str, flags: int) -> bytearray:
    args = bytearray(4096)
    struct.pack_into("=qQQ", args, 0, source_fd, 0, flags)
    raw = name.encode()
    args[56 : 56 + len(raw)] = raw
    return args


def _loop_config(fd: int, flags: int, name: str) -> bytes:
    """struct loop_config (include/uapi/linux/loop.h): fd, block_size, loop_info64, reserved."""
    return struct.pack(
        "=II5Q4I64s64s32s2Q64x", fd, 4096, 0, 0, 0, 0, 0, 0, 0, 0, flags, name.encode()[:63], b"", b"", 0, 0
    )


def attach_loop(image: Path) -> tuple[int, str]:
    """Attach ``image`` to a free loop device with autoclear and direct I/O;
    return ``(fd, device)``: the device goes when ``fd`` and every mount of it
    are closed.  Raises :class:`MountError`."""
    backing = os.open(image, os.O_RDWR | os.O_CLOEXEC)
    try:
        ctl = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
        try:
            for _try in range(20):  # another process may take the free device first
                n = fcntl.ioctl(ctl, LOOP_CTL_GET_FREE)
                dev = f"/dev/loop{n}"
                fd = os.open(dev, os.O_RDWR | os.O_CLOEXEC)
                try:
                    fcntl.ioctl(
                        fd, LOOP_CONFIGURE, _loop_config(backing, LO_FLAGS_AUTOCLEAR | LO_FLAGS_DIRECT_IO, str(image))
                    )
                except OSError as exc:
                    os.close(fd)
                    if exc.errno == errno.EBUSY:
                        continue
                    raise MountError(exc.errno, f"loop device for {image}: {exc.strerror}") from exc
                return fd, dev
            raise MountError(errno.EBUSY, f"no free loop device for {image}")
        finally:
            os.close(ctl)
    except OSError as exc:
        if isinstance(exc, MountError):
            raise
        raise MountError(exc.errno, f"loop device for {image}: {exc.strerror}") from exc
    finally:
        os.close(backing)


class NodeDisk:
    """The btrfs file system at ``mountpoint`` in the image ``image`` (see the module doc).

    ``size``: the image's bytes (default ``WEENV_DISK_BYTES``, else
    :data:`DEFAULT_SHARE` of the free space).  Thread-safe: every method is
    one or a few ioctls on paths of one environment."""

    def __init__(self, image: Path, mountpoint: Path, size: int | None = None):
        self.image = Path(image)
        self.mountpoint = Path(mountpoint)
        if size is None:
            size = settings().disk.size_bytes
        if size is not None and size < MIN_IMAGE_BYTES:
            raise CapacityError(f"a node disk of {size} bytes is too small (at least {MIN_IMAGE_BYTES >> 20} MiB)")
        self.asked = size
        self.size = 0
        """Bytes of the file system once open (what admission counts disk limits against)."""
        self._qgroups: Path | None = None

    # --- lifetime ----------------------------------------------------------------------
    def open(self) -> None:
        """Adopt the file system mounted at the mount point (grown to the size
        asked, if larger), or make and mount a new one.  Raises
        :class:`MountError`, :class:`ToolMissingError` (no ``mkfs.btrfs``), or
        :class:`CapacityError` (the home's file system has too little room)."""
        found = mounts.mount_info(self.mountpoint)
        if found is not None:
            if found[0] != "btrfs":
                raise MountError(errno.EINVAL, f"{self.mountpoint} is a {found[0]} mount, not weenv's disk")
            if self.asked is not None and self.asked > self.image.stat().st_size:
                self._grow(found[1], self.asked)
        else:
            self._make()
        self._read_fs()

    def close(self) -> None:
        """Unmount the file system (its loop device goes with it) and delete
        the image.  Idempotent.  Raises :class:`MountError` if it stays busy
        (the image is kept then)."""
        if mounts.mount_info(self.mountpoint) is not None:
            try:
                mounts.umount(self.mountpoint)
            except MountError as exc:
                if exc.errno != errno.EBUSY:
                    raise
                mounts.umount(self.mountpoint, detach=True)  # gone once its last user is
                raise MountError(errno.EBUSY, f"{self.mountpoint} was busy: detached, image kept") from exc
        self.image.unlink(missing_ok=True)
        self._qgroups = None

    def _make(self) -> None:
        if self.mountpoint.is_dir() and any(self.mountpoint.iterdir()):
            log.warning("removing %s: left on the host file system by a node without its disk", self.mountpoint)
            for _fstype, point in reversed(mounts.mounts_under(self.mountpoint)):
                mounts.umount(point, detach=True)
            shutil.rmtree(self.mountpoint, ignore_errors=True)
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        size = self.asked if self.asked is not None else self.default_size()
        mkfs = shutil.which("mkfs.btrfs")
        if mkfs is None:
            raise ToolMissingError("mkfs.btrfs is not installed (Debian: apt-get install btrfs-progs)")
        self.image.unlink(missing_ok=True)  # an image not mounted: what it held is gone with its node
        with open(self.image, "wb") as f:
            f.truncate(size)
        try:
            self._format(mkfs)
            fd, dev = attach_loop(self.image)
            try:
                mounts.mount(
                    mounts.MountSpec(
                        "btrfs", dev, str(self.mountpoint), MOUNT_OPTIONS, mounts.MS_NOSUID | mounts.MS_NODEV
                    )
                )
            finally:
                os.close(fd)  # the mount holds the device now (autoclear once unmounted)
        except BaseException:
            self.image.unlink(missing_ok=True)
            raise
        try:
            root = os.open(self.mountpoint, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                fcntl.ioctl(root, QUOTA_CTL, bytearray(struct.pack("=QQ", QUOTA_CTL_ENABLE_SIMPLE_QUOTA, 0)))
            finally:
                os.close(root)
            os.chmod(self.mountpoint, 0o700)
        except OSError as exc:
            self.close()
            raise MountError(exc.errno, f"enabling quotas on {self.mountpoint}: {exc.strerror}") from exc

    def _format(self, mkfs: str) -> None:
        """``mkfs.btrfs`` of the image, in a mount namespace holding only the
        mounts it needs (:func:`weenv.host.mountns.run_isolated`): it stat(2)s the
        source of every mount it sees first, so another home's disconnected FUSE
        mount (``ENOTCONN``) or stuck one must not be among them.  Raises :class:`MountError`."""
        argv = [mkfs, "-q", "-f", "-K", "-m", "single", "-d", "single", str(self.image)]
        try:
            r = mountns.run_isolated(argv, keep=[self.image], timeout=MKFS_TIMEOUT_S)
        except subprocess.TimeoutExpired as exc:
            raise MountError(errno.ETIMEDOUT, f"mkfs.btrfs {self.image}: no end after {MKFS_TIMEOUT_S:.0f} s") from exc
        if r.returncode != 0:
            raise MountError(errno.EIO, f"mkfs.btrfs {self.image} (exit {r.returncode}): {r.stderr.strip()}")

    def default_size(self) -> int:
        """:data:`DEFAULT_SHARE` of the free bytes of the file system holding the
        image, in whole MiB; :class:`CapacityError` if below :data:`MIN_IMAGE_BYTES`."""
        st = os.statvfs(self.image.parent)
        size = int(st.f_bavail * st.f_frsize * DEFAULT_SHARE) >> 20 << 20
        if size < MIN_IMAGE_BYTES:
            raise CapacityError(
                f"{self.image.parent} has {st.f_bavail * st.f_frsize >> 20} MiB free: "
                f"too little for the environments' disk (WEENV_DISK_BYTES)"
            )
        return size

    def _grow(self, device: str, size: int) -> None:
        with open(self.image, "r+b") as f:
            f.truncate(size)
        fd = os.open(device, os.O_RDONLY | os.O_CLOEXEC)
        try:
            fcntl.ioctl(fd, LOOP_SET_CAPACITY, 0)
        finally:
            os.close(fd)
        root = os.open(self.mountpoint, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.ioctl(root, RESIZE, _vol_args("max"))
        finally:
            os.close(root)
        log.info("grew the environments' disk %s to %d MiB", self.image, size >> 20)

    def _read_fs(self) -> None:
        st = os.statvfs(self.mountpoint)
        self.size = st.f_blocks * st.f_frsize
        root = os.open(self.mountpoint, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            info = bytearray(1024)
            fcntl.ioctl(root, FS_INFO, info)
        finally:
            os.close(root)
        self._qgroups = Path("/sys/fs/btrfs") / str(uuid.UUID(bytes=bytes(info[16:32]))) / "qgroups"

    # --- environments ------------------------------------------------------------------
    @staticmethod
    def upper(env_dir: Path) -> Path:
        """The environment's overlay upper dir (its own changes)."""
        return env_dir / SUBVOLUME / "upper"

    @staticmethod
    def work(env_dir: Path) -> Path:
        """The overlay work dir (on the same subvolume: copy-up renames from it into ``upper``)."""
        return env_dir / SUBVOLUME / "work"

    def make(self, env_dir: Path, limit: int, name: str = SUBVOLUME) -> None:
        """Make the environment's subvolume ``name`` in ``env_dir`` (on this disk) with
        ``upper/`` and ``work/``, its quota ``limit`` bytes.  Raises :class:`MountError`."""
        parent = os.open(env_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            try:
                fcntl.ioctl(parent, SUBVOL_CREATE, _vol_args(name))
            except OSError as exc:
                raise MountError(exc.errno, f"subvolume {env_dir / name}: {exc.strerror}") from exc
        finally:
            os.close(parent)
        try:
            self._limit(env_dir, limit, name)
            (env_dir / name / "upper").mkdir()
            (env_dir / name / "work").mkdir()
        except BaseException:
            self.remove(env_dir, name)
            raise

    def swap_in(self, env_dir: Path, name: str = SPARE) -> None:
        """Make the subvolume ``env_dir/name`` (made by :meth:`make` or
        :meth:`clone` with that name, its quota set) the environment's own,
        the old one renamed ``disk.old.<token>`` (:data:`RETIRED`, for
        :meth:`remove_retired` to delete): two renames, no transaction of the
        file system waited for.  The overlay must be unmounted.  Raises :class:`MountError`."""
        try:
            os.rename(env_dir / SUBVOLUME, env_dir / f"{RETIRED}.{secrets.token_hex(4)}")
            os.rename(env_dir / name, env_dir / SUBVOLUME)
        except OSError as exc:
            raise MountError(exc.errno, f"swapping in {env_dir / name}: {exc.strerror}") from exc

    def clone(self, source: Path, env_dir: Path, limit: int, name: str = SUBVOLUME) -> None:
        """Make the environment's subvolume in ``env_dir`` as a snapshot of the
        subvolume ``source`` (a capture, :meth:`snapshot`): its ``upper/`` as
        the capture holds it, sharing every data extent (no data is copied), a
        fresh empty ``work/``, its quota ``limit`` bytes (simple quotas count the
        extents a subvolume writes itself: the shared ones are the capture's
        owner's).  ``name``: the subvolume's name in ``env_dir`` (default the
        environment's own).  Raises :class:`MountError`."""
        self.snapshot(source, env_dir, name, readonly=False)
        try:
            self._limit(env_dir, limit, name)
            work = env_dir / name / "work"
            shutil.rmtree(work, ignore_errors=True)  # overlayfs's scratch of the parent: copy-ups under way
            work.mkdir()
        except BaseException:
            self.remove(env_dir, name)
            raise

    @staticmethod
    def snapshot(source: Path, parent: Path, name: str, *, readonly: bool) -> None:
        """Snapshot the subvolume ``source`` as ``parent/name`` (a subvolume on
        the same disk; ``readonly``: a read-only one).  The kernel writes back
        the source's dirty data first and the snapshot is atomic: it holds the
        source as it was at one instant.  O(metadata), however much the source
        holds.  Raises :class:`MountError` (``ENOSPC``/``EDQUOT`` when the disk
        or quota is full, ``EEXIST``)."""
        src = os.open(source, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            dest = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                fcntl.ioctl(dest, SNAP_CREATE_V2, _snap_args(src, name, SUBVOL_RDONLY if readonly else 0))
            except OSError as exc:
                raise MountError(exc.errno, f"snapshot of {source} as {parent / name}: {exc.strerror}") from exc
            finally:
                os.close(dest)
        finally:
            os.close(src)

    @staticmethod
    def tree_bytes(root: Path) -> int:
        """Bytes the tree at ``root`` references on disk, as ``du`` counts them:
        allocated blocks (``st_blocks``) of every file, directory and link,
        each inode once (hard links), symlinks not followed.  A read-only
        capture's data extents are shared with the environment it was taken of
        (and simple quotas charge them to it), so the subvolume's own quota
        group says nothing of what it pins; this is what deleting everything
        else would leave held.  Raises :class:`FileNotFoundError` if ``root`` is gone."""
        seen: set[int] = set()
        total = os.lstat(root).st_blocks * 512
        stack = [os.fspath(root)]
        while stack:
            with os.scandir(stack.pop()) as it:
                for entry in it:
                    st = entry.stat(follow_symlinks=False)
                    if st.st_nlink > 1 and not entry.is_dir(follow_symlinks=False):
                        if st.st_ino in seen:
                            continue
                        seen.add(st.st_ino)
                    total += st.st_blocks * 512
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(entry.path)
        return total

    @staticmethod
    def delete_subvolume(parent: Path, name: str) -> None:
        """Delete the subvolume ``parent/name`` (read-only or not); fine if it is gone."""
        try:
            fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            return
        try:
            fcntl.ioctl(fd, SNAP_DESTROY, _vol_args(name))
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                raise MountError(exc.errno, f"deleting subvolume {parent / name}: {exc.strerror}") from exc
        finally:
            os.close(fd)

    def _subvolume_id(self, env_dir: Path, name: str = SUBVOLUME) -> int:
        fd = os.open(env_dir / name, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            args = bytearray(struct.pack("=QQ", 0, FIRST_FREE_OBJECTID) + bytes(4080))
            fcntl.ioctl(fd, INO_LOOKUP, args)
            return struct.unpack_from("=Q", args)[0]
        finally:
            os.close(fd)

    def _limit(self, env_dir: Path, limit: int, name: str = SUBVOLUME) -> None:
        try:
            sid = self._subvolume_id(env_dir, name)
            fd = os.open(env_dir / name, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                fcntl.ioctl(fd, QGROUP_LIMIT, bytearray(struct.pack("=6Q", sid, QGROUP_LIMIT_MAX_RFER, limit, 0, 0, 0)))
            finally:
                os.close(fd)
        except OSError as exc:
            raise MountError(exc.errno, f"quota of {env_dir / name}: {exc.strerror}") from exc

    def set_limit(self, env_dir: Path, limit: int, name: str = SUBVOLUME) -> None:
        """Set the quota of the environment's subvolume ``name`` (default its upper
        dir's) to ``limit`` bytes (live: writes past it fail with ``EDQUOT``).
        Raises :class:`MountError`."""
        self._limit(env_dir, limit, name)

    def remove(self, env_dir: Path, name: str = SUBVOLUME) -> None:
        """Delete the environment's subvolume ``name`` (default its own) and all
        in it (its blocks and its quota group are freed by the kernel's cleaner
        shortly after).  Fine if there is none; errors are logged (the
        directory's removal then takes it)."""
        try:
            self.delete_subvolume(env_dir, name)
        except MountError as exc:
            if exc.errno != errno.EINVAL:  # EINVAL: a plain directory, not a subvolume
                log.warning("cannot delete subvolume %s: %s", env_dir / name, exc)

    @staticmethod
    def retired(env_dir: Path) -> list[str]:
        """Names of the subvolumes :meth:`swap_in` swapped out of ``env_dir``, not deleted yet."""
        return [p.name for p in leftovers(env_dir, RETIRED)]

    def remove_retired(self, env_dir: Path) -> None:
        """Delete every subvolume :meth:`swap_in` swapped out of ``env_dir`` (one
        that cannot be deleted now is logged and tried again next time)."""
        for name in self.retired(env_dir):
            self.remove(env_dir, name)

    def usage(self, env_dir: Path) -> tuple[int, int]:
        """``(used, limit)`` bytes of the environment's quota: what it references
        (data and metadata as of the last commit, btrfs commits every 30 s or on
        sync, plus data reserved for dirty pages) and its limit (0: none).  Raises :class:`FileNotFoundError` if it has no subvolume."""
        assert self._qgroups is not None, "the disk is not open"
        q = self._qgroups / f"0_{self._subvolume_id(env_dir)}"

        def read(name: str) -> int:
            with contextlib.suppress(FileNotFoundError):
                return int((q / name).read_text())
            return 0

        return read("referenced") + read("rsv_data"), read("max_referenced")
