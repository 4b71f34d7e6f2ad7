"""Idmapped mounts for environments in a user namespace (Linux >= 5.12; overlayfs
takes idmapped lower layers since 5.19).

An environment with ``sudo`` (:func:`weenv.node.runtime.bundle.build_config`'s
``userns=``) runs in a user namespace mapping its uids and gids ``0..size-1`` to
the host's ``host_id..host_id+size-1``, an unprivileged range.  Its lower layers
are owned by host root, so inside they would show as 65534 (unmapped) and root
inside could not write ``/etc``.  :func:`idmapped_clone` makes, for each lower
mount, an idmapped copy (``open_tree(2)`` with ``OPEN_TREE_CLONE``, then
``mount_setattr(2)`` with ``MOUNT_ATTR_IDMAP``, then ``move_mount(2)``;
Documentation/filesystems/idmappings.rst, ``mount_setattr(2)``): through it a
file of host uid ``u`` shows as ``host_id + u``, so inside, after the
namespace's own mapping, it is ``u`` again.  Nothing is copied or chowned
(measured 0.13 ms per group).  The overlay over such lowers writes its upper
dir with the caller's view, i.e. ``host_id + u`` for a file of uid ``u``
inside: the upper dir, and its root, belong to the range (:func:`own_upper`).

The mapping needs a user namespace to name, held by a file descriptor: one
:class:`UserNamespace` is a short-lived child process that unshares one, whose
``uid_map``/``gid_map`` this (root) process writes, and whose
``/proc/PID/ns/user`` is opened before it exits.

System call numbers are the generic table's (x86_64 and arm64 alike):
``open_tree`` 428, ``move_mount`` 429, ``mount_setattr`` 442.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import stat
import struct
import subprocess
from pathlib import Path

from weenv.config import settings
from weenv.errors import CapacityError, InvalidInputError, MountError

SYS_OPEN_TREE, SYS_MOVE_MOUNT, SYS_MOUNT_SETATTR = 428, 429, 442
OPEN_TREE_CLONE, OPEN_TREE_CLOEXEC = 1, os.O_CLOEXEC
AT_FDCWD, AT_EMPTY_PATH, AT_RECURSIVE = -100, 0x1000, 0x8000
MOVE_MOUNT_F_EMPTY_PATH = 0x4
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV, MOUNT_ATTR_IDMAP = 0x1, 0x2, 0x4, 0x100000
UNSHARE = "/usr/bin/unshare"
"""util-linux's ``unshare(1)``, which makes the helper of :class:`UserNamespace`."""

ID_RANGE = 65536
"""Ids an environment's namespace maps (0..65535: every id Debian gives out)."""
RANGE_BASE = 1 << 30
"""The first host id of the first environment's range: far above the ranges
``/etc/subuid`` hands out (100000 + 65536 n) and every account of the host."""
RANGE_SLOTS = 4096
"""Ranges the host holds at once (every node on it together): ids up to
``RANGE_BASE + RANGE_SLOTS * ID_RANGE`` = 2^30 + 2^28, below 2^32 - 1."""
REGISTRY = Path("/run/weenv-userns")
"""Host-wide record of the ranges in use: file ``SLOT`` holds the directory of
the environment that has it (so nodes with different homes never share one)."""
RANGE_FILE = "userns"
"""In an environment's directory: its range's first host id (decimal); the
environment runs in a user namespace exactly when it exists."""

USERNS_ENV = "WEENV_USERNS"
"""The node setting giving every environment a user namespace of its own
(``on``, the default) or only those of templates with ``runtime.sudo`` (``off``)."""

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _MountAttr(ctypes.Structure):
    """``struct mount_attr`` (``linux/mount.h``, ``MOUNT_ATTR_SIZE_VER0`` = 32 bytes)."""

    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def _check(ret: int, what: str) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise MountError(f"{what}: {os.strerror(err)}")
    return ret


def userns_from_env() -> bool:
    """Whether :data:`USERNS_ENV` puts every environment in a user namespace of
    its own; raises :class:`InvalidInputError` naming the variable for a value not on/off."""
    return settings().runtime.userns


def check_range(host_id: int, size: int = ID_RANGE) -> None:
    """Refuse a host range that includes host root or overflows 32-bit ids
    (:class:`InvalidInputError`)."""
    if not 0 < host_id or size <= 0 or host_id + size > 2**32 - 1:
        raise InvalidInputError(f"bad host id range {host_id}+{size}: want 1 <= start, end < 2^32-1")


@contextlib.contextmanager
def mapped_child(host_id: int, size: int = ID_RANGE, *, net: bool = False):
    """A short-lived child in a new user namespace mapping ids ``0..size-1`` to
    host ``host_id..`` (and, with ``net``, in a new network namespace that
    user namespace owns); yields its pid while it waits, then lets it exit.
    Raises :class:`MountError` when the kernel refuses."""
    check_range(host_id, size)
    try:
        child = subprocess.Popen(
            [UNSHARE, "--user", *(["--net"] if net else []), "--", "/bin/sh", "-c", "echo; read _"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            close_fds=True,
            env={},
        )
    except OSError as exc:
        raise MountError(f"cannot run {UNSHARE} to make a user namespace: {exc}") from exc
    try:
        if child.stdout.read(1) != b"\n":
            raise MountError(
                f"unshare(CLONE_NEWUSER) failed in the helper process: "
                f"{child.stderr.read().decode(errors='replace').strip()}"
            )
        line = f"0 {host_id} {size}\n".encode()
        for name in ("uid_map", "gid_map"):
            with open(f"/proc/{child.pid}/{name}", "wb", buffering=0) as f:
                f.write(line)
        yield child.pid
    finally:
        child.stdin.close()  # the child exits
        child.stdout.close()
        child.stderr.close()
        child.wait()


class UserNamespace:
    """A user namespace mapping ids ``0..size-1`` to host ``host_id..``, held by
    :attr:`fd` (``O_RDONLY`` of its ``/proc/PID/ns/user``); :meth:`close` it.

    Made by a child spawned (``vfork``: its cost does not grow with this
    process's memory, as a ``fork`` copying the node's page tables does,
    measured 19-25 ms for a 300 MB process against 2-5 ms) running
    :data:`UNSHARE` ``--user`` of a shell that says when it is in the new
    namespace and waits for its input to close.  Raises :class:`MountError`
    when the kernel refuses (e.g. ``user.max_user_namespaces`` is 0).
    """

    def __init__(self, host_id: int, size: int = ID_RANGE):
        with mapped_child(host_id, size) as pid:
            self.fd = os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
        self.host_id, self.size = host_id, size

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> UserNamespace:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def idmapped_clone(
    source: str | os.PathLike[str], target: str | os.PathLike[str], userns: UserNamespace, *, readonly: bool = True
) -> None:
    """Mount at ``target`` (an existing directory) an idmapped copy of the mount
    tree at ``source`` (with its submounts), through ``userns``'s mapping,
    read-only by default; undo it with ``umount(target)``.  Raises
    :class:`MountError` (e.g. ``EINVAL`` for a file system that cannot be
    idmapped)."""
    src, dst = os.fsencode(os.fspath(source)), os.fsencode(os.fspath(target))
    fd = _check(
        _libc.syscall(SYS_OPEN_TREE, AT_FDCWD, src, OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_RECURSIVE),
        f"open_tree({source!r})",
    )
    try:
        attr = _MountAttr(MOUNT_ATTR_IDMAP | (MOUNT_ATTR_RDONLY if readonly else 0) | MOUNT_ATTR_NODEV, 0, 0, userns.fd)
        _check(
            _libc.syscall(
                SYS_MOUNT_SETATTR, fd, b"", AT_EMPTY_PATH | AT_RECURSIVE, ctypes.byref(attr), ctypes.sizeof(attr)
            ),
            f"mount_setattr(MOUNT_ATTR_IDMAP) of {source!r}",
        )
        _check(
            _libc.syscall(SYS_MOVE_MOUNT, fd, b"", AT_FDCWD, dst, MOVE_MOUNT_F_EMPTY_PATH), f"move_mount to {target!r}"
        )
    finally:
        os.close(fd)


def own_upper(upper: Path, work: Path, host_id: int) -> None:
    """Give the overlay's upper and work dirs to the range's root (host ``host_id``),
    so root inside owns ``/`` of the environment."""
    for d in (upper, work):
        os.chown(d, host_id, host_id)


@contextlib.contextmanager
def _locked(registry: Path):
    registry.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(registry / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def range_of(env_dir: Path) -> int | None:
    """The first host id of the environment in ``env_dir``'s range, None if it has none."""
    try:
        return int((Path(env_dir) / RANGE_FILE).read_text())
    except (FileNotFoundError, ValueError):
        return None


def _holder(registry: Path, slot: int) -> Path | None:
    """The environment directory that still holds ``slot``, None if free or
    stale (its directory gone or naming another range: a node killed before
    it released it)."""
    try:
        env_dir = Path((registry / str(slot)).read_text())
    except FileNotFoundError:
        return None
    return env_dir if range_of(env_dir) == RANGE_BASE + slot * ID_RANGE else None


def allocate(env_dir: Path, registry: Path = REGISTRY) -> int:
    """Give the environment in ``env_dir`` (existing, absolute) the lowest free
    range of :data:`ID_RANGE` host ids; write its first id to
    ``env_dir/RANGE_FILE`` and return it.  Ranges are disjoint host-wide (the
    record in ``registry``, under a lock) and survive a node restart (the
    file in the environment's directory is the claim; :func:`release`, or
    the directory's removal, gives it back).  Raises :class:`CapacityError`
    when all :data:`RANGE_SLOTS` are taken."""
    env_dir = Path(env_dir).absolute()
    with _locked(registry):
        for slot in range(RANGE_SLOTS):
            if _holder(registry, slot) is not None:
                continue
            host_id = RANGE_BASE + slot * ID_RANGE
            tmp = env_dir / f".{RANGE_FILE}.tmp"
            tmp.write_text(str(host_id))
            os.replace(tmp, env_dir / RANGE_FILE)
            tmp = registry / f".{slot}.tmp"
            tmp.write_text(str(env_dir))
            os.replace(tmp, registry / str(slot))
            return host_id
    raise CapacityError(f"every one of the host's {RANGE_SLOTS} user-namespace id ranges is in use")


def release(env_dir: Path, registry: Path = REGISTRY) -> None:
    """Give back the range of the environment in ``env_dir``, if it has one; idempotent."""
    env_dir = Path(env_dir).absolute()
    host_id = range_of(env_dir)
    if host_id is None:
        return
    slot = (host_id - RANGE_BASE) // ID_RANGE
    with _locked(registry):
        with contextlib.suppress(FileNotFoundError):
            if Path((registry / str(slot)).read_text()) == env_dir:
                os.unlink(registry / str(slot))
        with contextlib.suppress(FileNotFoundError):
            os.unlink(env_dir / RANGE_FILE)


def in_use(registry: Path = REGISTRY) -> dict[int, Path]:
    """First host id -> environment directory of every range held now (stale records left out)."""
    if not registry.is_dir():
        return {}
    with _locked(registry):
        held = {}
        for p in registry.iterdir():
            if p.name.isdigit() and (d := _holder(registry, int(p.name))) is not None:
                held[RANGE_BASE + int(p.name) * ID_RANGE] = d
        return held


SEARCHABLE_MODE = 0o711
"""The mode of the node's directories above a user-namespace environment's
directory (``node/``, ``node/envs/``): others may search them (runc's init, as
the range's root, opens the rootfs by its path), never list them."""


def open_parents(env_dir: Path, levels: int = 2) -> None:
    """Make the ``levels`` directories above ``env_dir`` (the node's own) searchable
    (:data:`SEARCHABLE_MODE`) where they are private (0700: the node's start
    closes ``node/`` again), then :func:`check_traversable`."""
    for d in list(Path(env_dir).absolute().parents)[:levels]:
        if os.stat(d).st_mode & 0o777 == 0o700:
            os.chmod(d, SEARCHABLE_MODE)
    check_traversable(env_dir)


def check_traversable(path: Path) -> None:
    """Refuse (:class:`InvalidInputError`) when a directory above ``path`` does
    not let others search it (``o+x``): runc's init, already in the
    environment's user namespace as an unmapped host id, opens the rootfs by
    its path."""
    for parent in Path(path).absolute().parents:
        if not os.stat(parent).st_mode & 0o001:
            raise InvalidInputError(
                f"environments in a user namespace (sudo, WEENV_USERNS) need every directory above their "
                f"rootfs searchable by others (o+x): {parent} is mode {os.stat(parent).st_mode & 0o777:o}; "
                "chmod o+x it or move the home"
            )


# --- owners of captures: an upper dir written in one range, started in another ----------
XATTR_CAPS = "security.capability"
_VFS_CAP_V2, _VFS_CAP_V3 = 0x02000000, 0x03000000
"""``VFS_CAP_REVISION_2`` and ``_3`` (``linux/capability.h``): a version-3
value carries the host uid of the user namespace's root it holds for (``rootid``)."""


def range_of_subvolume(subvolume: Path) -> int:
    """The first host id of the range whose view the upper dir in ``subvolume``
    (an environment's disk subvolume or a capture of it) holds: the owner of
    its ``work`` dir, which :func:`own_upper` gives to the range's root and
    which nothing inside the environment can reach; 0 for one written without
    a user namespace (host ids as they are inside)."""
    uid = os.lstat(Path(subvolume) / "work").st_uid
    return uid if uid >= RANGE_BASE and (uid - RANGE_BASE) % ID_RANGE == 0 else 0


def _shifted(i: int, src: int, dst: int) -> int:
    return dst + (i - src) if src <= i < src + ID_RANGE else i


def shift_owners(upper: Path, src: int, dst: int) -> int:
    """Move the owners in the upper dir ``upper`` (every entry, hard links
    once) from range ``src``'s host ids to range ``dst``'s (0: the ids as
    they are inside, as in an environment without a user namespace), so that
    inside the environment over range ``dst`` every file has the owner and
    group it had inside the one over ``src``.  Modes stay exactly
    (``chown(2)`` clears set-user-ID and set-group-ID: put back), and so do
    file capabilities (``chown(2)`` drops them: put back, a version-3 one's
    ``rootid`` shifted like an owner).  Ids outside ``src``'s range are left.
    Returns the number of entries changed; nothing when ``src == dst``.
    POSIX ACL entries naming users are not shifted."""
    if src == dst:
        return 0
    changed, seen = 0, set()
    top = os.fspath(upper)
    for dirpath, dirnames, filenames in os.walk(top):
        names = [dirpath] if dirpath == top else []
        names += [os.path.join(dirpath, n) for n in dirnames + filenames]
        for path in names:
            st = os.lstat(path)
            if st.st_nlink > 1 and not stat.S_ISDIR(st.st_mode):
                if (st.st_dev, st.st_ino) in seen:
                    continue
                seen.add((st.st_dev, st.st_ino))
            uid, gid = _shifted(st.st_uid, src, dst), _shifted(st.st_gid, src, dst)
            if (uid, gid) == (st.st_uid, st.st_gid):
                continue
            _chown_keeping(path, st, uid, gid, src, dst)
            changed += 1
    return changed


def _chown_keeping(path: str, st: os.stat_result, uid: int, gid: int, src: int, dst: int) -> None:
    """``lchown`` ``path`` keeping its mode and file capabilities (see :func:`shift_owners`)."""
    if stat.S_ISLNK(st.st_mode):
        os.chown(path, uid, gid, follow_symlinks=False)
        return
    caps = None
    if stat.S_ISREG(st.st_mode):
        try:
            caps = os.getxattr(path, XATTR_CAPS, follow_symlinks=False)
        except OSError:
            caps = None
    os.chown(path, uid, gid, follow_symlinks=False)
    if st.st_mode & (stat.S_ISUID | stat.S_ISGID):
        os.chmod(path, stat.S_IMODE(st.st_mode))  # not a symlink (Linux has no lchmod)
    if caps is not None:
        os.setxattr(path, XATTR_CAPS, _shifted_caps(caps, src, dst), follow_symlinks=False)


def _shifted_caps(caps: bytes, src: int, dst: int) -> bytes:
    """A ``security.capability`` value for the file's new range: a version-3
    one's ``rootid`` shifted like an owner; a version-2 one (no ``rootid``:
    host root's) gets ``rootid`` ``dst`` (capabilities for the range's root,
    as if set inside it); one whose ``rootid`` becomes 0 is written as
    version 2, as the kernel itself stores host root's."""
    if len(caps) < 20:
        return caps
    magic = struct.unpack_from("<I", caps)[0]
    revision, flags = magic & 0xFF000000, magic & 0x00FFFFFF
    if revision == _VFS_CAP_V3 and len(caps) >= 24:
        rootid = _shifted(struct.unpack_from("<I", caps, 20)[0], src, dst)
    elif revision == _VFS_CAP_V2 and src == 0:
        rootid = dst
    else:
        return caps
    if rootid == 0:
        return struct.pack("<I", _VFS_CAP_V2 | flags) + caps[4:20]
    return struct.pack("<I", _VFS_CAP_V3 | flags) + caps[4:20] + struct.pack("<I", rootid)
