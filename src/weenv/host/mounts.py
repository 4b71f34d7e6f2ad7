"""Mounts as data, and the two syscalls that act on them (Linux only).

A :class:`MountSpec` says what to mount (type, source, target, options); computing
a rootfs's plan (:func:`overlay_spec`, :func:`erofs_spec`) never touches the
system, :func:`mount` and :func:`umount` do.  (containerd's snapshotter returns
mounts the same way: ``core/mount/mount.go``.)

mount(2) is called directly through libc: util-linux ``mount`` would turn a
regular-file source into a loop device, while EROFS mounts a regular file
itself (file-backed mounts, Linux >= 6.12).

EROFS ``directio`` (Linux >= 6.13, file-backed mounts): the image file is
read with direct I/O (``IOCB_DIRECT``, fs/erofs/fileio.c), so a page fault on
a file in the mount allocates only its own page, not a second one in the image
file's page cache.  Issue 18: python3 run from a file-backed EROFS mount in a
cgroup-v1 memory cgroup at its limit with the OOM killer disabled (weenv's
provisioner holds environments so until it raises the limit) died of SIGBUS in
7 of 20 runs: that nested page-cache charge fails instead of waiting.  With
``directio``: none in 20.  It also stops the image's bytes being cached twice.
:func:`mount_erofs` asks for it and falls back, once per process, to a mount
without it when the kernel refuses the option.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path

from weenv.errors import MountError

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MNT_DETACH = 0x2
EROFS_DIRECTIO = "directio"

log = logging.getLogger(__name__)

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


@dataclass(frozen=True)
class MountSpec:
    """One mount: ``mount(source, target, fstype, flags, options)``."""

    fstype: str
    source: str
    target: str
    options: str = ""
    flags: int = 0


def erofs_spec(image: str | os.PathLike[str], target: str | os.PathLike[str], *, directio: bool = False) -> MountSpec:
    """A read-only, file-backed EROFS mount of the image file ``image`` at ``target``,
    ``nosuid,nodev``: a setuid file or a device node in a group is neither on the host.
    ``directio``: the kernel reads the image file with direct I/O (module docstring)."""
    return MountSpec(
        "erofs",
        os.fspath(image),
        os.fspath(target),
        EROFS_DIRECTIO if directio else "",
        MS_RDONLY | MS_NOSUID | MS_NODEV,
    )


class _DirectIO:
    """Whether this kernel takes EROFS's ``directio``: None until a mount tells."""

    lock = threading.Lock()
    supported: bool | None = None


def mount_erofs(image: str | os.PathLike[str], target: str | os.PathLike[str]) -> MountSpec:
    """Mount ``image`` at ``target`` as :func:`erofs_spec` says, with ``directio``
    when the kernel takes it; return the spec mounted.

    The kernel's answer is learnt from the first mount: ``EINVAL`` with
    ``directio`` and success without it means a kernel without the option
    (before 6.13, or built without ``CONFIG_EROFS_FS_BACKED_BY_FILE``'s
    direct I/O): logged once, every later mount goes without it.  ``EINVAL``
    both ways is the image's fault (a bad superblock) and teaches nothing.
    Raises :class:`MountError` (the error of the mount without ``directio``
    when both failed).
    """
    with _DirectIO.lock:
        supported = _DirectIO.supported
    if supported is False:
        spec = erofs_spec(image, target)
        mount(spec)
        return spec
    spec = erofs_spec(image, target, directio=True)
    try:
        mount(spec)
    except MountError as exc:
        if exc.errno != errno.EINVAL:
            raise
        plain = erofs_spec(image, target)
        mount(plain)
        with _DirectIO.lock:
            first, _DirectIO.supported = _DirectIO.supported is None, False
        if first:
            log.warning(
                "this kernel refuses EROFS's directio option (%s); group images are mounted "
                "without it, and commands at a memory limit may die of SIGBUS (issue 18)",
                exc,
            )
        return plain
    with _DirectIO.lock:
        _DirectIO.supported = True
    return spec


def overlay_spec(
    lowers_bottom_to_top: list[str | os.PathLike[str]],
    upper: str | os.PathLike[str],
    work: str | os.PathLike[str],
    target: str | os.PathLike[str],
    *,
    nosuid: bool = True,
) -> MountSpec:
    """An overlay of read-only group mounts with a private upper/work dir.

    ``lowers_bottom_to_top`` lists group mount points as a template lists its groups;
    overlayfs wants the top one first (Documentation/filesystems/overlayfs.rst).
    Paths are escaped (:func:`overlay_escape`), so a home holding ``,`` or ``:`` works.

    Mounted ``nosuid,nodev``: a setuid file or a device node the environment
    makes is neither when reached from the host through the mount point.  Inside
    nothing changes: runc's bind of the rootfs keeps the flags, and the
    environment's ``noNewPrivileges`` already ignores setuid bits, its device
    cgroup already refuses device nodes but runc's defaults (on its own ``/dev``).
    ``nosuid=False`` (a ``sudo`` environment in a user namespace, whose setuid
    files must count inside): ``nodev`` only; its files are then all owned by
    its unprivileged host id range (:mod:`weenv.node.runtime.idmap`).
    """
    if not lowers_bottom_to_top:
        raise MountError("an overlay needs at least one lower dir")
    lower = ":".join(overlay_escape(p) for p in reversed(lowers_bottom_to_top))
    options = f"lowerdir={lower},upperdir={overlay_escape(upper)},workdir={overlay_escape(work)}"
    return MountSpec("overlay", "overlay", os.fspath(target), options, (MS_NOSUID if nosuid else 0) | MS_NODEV)


def overlay_escape(path: str | os.PathLike[str]) -> str:
    """``path`` for an overlayfs option: ``\\``, ``,`` and ``:`` escaped by a
    backslash.  The kernel splits options at unescaped ``,`` (``ovl_next_opt``)
    and lowerdir at unescaped ``:``, then drops the escapes (``ovl_unescape``),
    for lowerdir, upperdir and workdir alike (fs/overlayfs/params.c)."""
    return os.fspath(path).replace("\\", "\\\\").replace(",", "\\,").replace(":", "\\:")


def mount(spec: MountSpec) -> None:
    """Perform ``spec``; raise :class:`MountError` with the errno on failure."""
    options = spec.options.encode() if spec.options else None
    rc = _libc.mount(spec.source.encode(), spec.target.encode(), spec.fstype.encode(), spec.flags, options)
    if rc != 0:
        err = ctypes.get_errno()
        raise MountError(err, f"mount {spec.fstype} {spec.source} on {spec.target}: {os.strerror(err)}")


MS_MOVE = 0x2000


def move(source: str | os.PathLike[str], target: str | os.PathLike[str]) -> None:
    """Move the mount at ``source`` to ``target`` (mount(2) ``MS_MOVE``; other
    mount namespaces' copies of it stay where they are).  Raise :class:`MountError`
    (``EINVAL`` when its parent mount is shared)."""
    rc = _libc.mount(os.fspath(source).encode(), os.fspath(target).encode(), None, MS_MOVE, None)
    if rc != 0:
        err = ctypes.get_errno()
        raise MountError(err, f"move mount {source} to {target}: {os.strerror(err)}")


def umount(target: str | os.PathLike[str], *, detach: bool = False) -> None:
    """Unmount ``target``; ``detach`` for MNT_DETACH.  Raise :class:`MountError`."""
    rc = _libc.umount2(os.fspath(target).encode(), MNT_DETACH if detach else 0)
    if rc != 0:
        err = ctypes.get_errno()
        raise MountError(err, f"umount {target}: {os.strerror(err)}")


def _unescape(field: str) -> str:
    # /proc/mounts escapes space, tab, newline and backslash as octal.
    return field.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def mounts_under(prefix: str | os.PathLike[str]) -> list[tuple[str, str]]:
    """``(fstype, mount point)`` of every mount at or below ``prefix``, from /proc/mounts.

    ``prefix`` is taken as written when anything is mounted at or below it by that
    name: resolving it would stat it, and a FUSE mount point whose server died
    (a killed daemon's lazy mount, before the next one serves it again) blocks
    every stat forever.  Else its symbolic links are resolved, as the kernel
    names mount points: a home's ``node/envs`` may be a link
    (:mod:`weenv.node.runtime.envs_dir`)."""
    with open("/proc/self/mounts") as f:
        table = [(fields[2], _unescape(fields[1])) for fields in map(str.split, f) if len(fields) > 2]
    literal = os.fspath(Path(prefix).absolute())
    found = _at_or_below(table, literal)
    if found:
        return found
    resolved = os.path.realpath(literal)
    return _at_or_below(table, resolved) if resolved != literal else []


def _at_or_below(table: list[tuple[str, str]], prefix: str) -> list[tuple[str, str]]:
    return [(fstype, point) for fstype, point in table if point == prefix or point.startswith(prefix.rstrip("/") + "/")]


def mount_info(target: str | os.PathLike[str]) -> tuple[str, str, str] | None:
    """``(fstype, source, super options)`` of the mount at ``target`` (the top
    one), from /proc/self/mountinfo; None if nothing is mounted there."""
    want = os.path.realpath(target)  # the kernel shows resolved paths
    found = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, rfields = left.split(), right.split()
            if len(fields) > 4 and len(rfields) > 2 and _unescape(fields[4]) == want:
                found = (rfields[0], _unescape(rfields[1]), rfields[2])
    return found


def is_shared(target: str | os.PathLike[str]) -> bool:
    """Whether the mount at ``target`` (the top one; else the one holding it)
    has shared propagation (``shared:N`` in /proc/self/mountinfo's optional
    fields): mount(2) ``MS_MOVE`` refuses to move a mount off or onto such a parent."""
    want = os.path.realpath(target)
    best, shared = "", False
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, _right = line.partition(" - ")
            fields = left.split()
            if len(fields) < 6:
                continue
            point = _unescape(fields[4])
            holds = want == point or want.startswith(point.rstrip("/") + "/")
            if holds and len(point) >= len(best):  # the deepest (and, at one point, the last: top) mount
                best, shared = point, any(o.startswith("shared:") for o in fields[6:])
    return shared


def is_mounted(target: str | os.PathLike[str]) -> bool:
    target = os.fspath(Path(target).absolute())
    return any(point == target for _t, point in mounts_under(target))


def overlay_lowers(target: Path) -> list[Path] | None:
    """The lower dirs of the overlay mounted at ``target``, bottom to top (as
    :func:`~weenv.host.mounts.overlay_spec` takes them), from
    /proc/self/mountinfo; None if no overlay is mounted there."""
    found = mount_info(target)
    if found is None or found[0] != "overlay":
        return None
    options = found[2]
    for option in options.split(","):  # the kernel shows a "," inside a value as \054
        if option.startswith("lowerdir="):
            value = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), option[len("lowerdir=") :])
            dirs, cur, chars = [], [], iter(value)
            for ch in chars:  # overlayfs escapes: "\x" is x; an unescaped ":" separates
                if ch == "\\":
                    cur.append(next(chars, ""))
                elif ch == ":":
                    dirs.append("".join(cur))
                    cur = []
                else:
                    cur.append(ch)
            dirs.append("".join(cur))
            return [Path(d) for d in reversed(dirs)]
    return None
