"""Build an EROFS image of a directory with Debian's ``mkfs.erofs`` (erofs-utils),
to compare weenv's own writer against (``weenv bench image-writer``).

The image is **uncompressed** (no ``-z``): the group's chunks are zstd-compressed
later, and an uncompressed image lets the lazy FUSE file system map a read of
image bytes to chunks one to one.

Determinism: identical input trees (names, contents, modes, owners, xattrs,
mtimes) give byte-identical images, so rebuilding an unchanged tree writes no new
chunks.  Two things in an image would otherwise vary from build to build:

- the file system UUID: fixed with ``-U`` (see :func:`mkfs_erofs`'s ``uuid``);
- the build time in the superblock.  ``-T`` would fix it but also overwrites every
  file's mtime (erofs-utils 1.5).  Instead ``SOURCE_DATE_EPOCH`` is set to one
  second after the newest mtime in the tree: mkfs.erofs then stores that as the
  build time, clamps only mtimes *newer* than it (there are none) and writes
  extended inodes, so every file keeps its mtime to the nanosecond.

mkfs.erofs sorts directory entries itself, so readdir order of the source does
not matter (checked: two trees created in opposite orders give the same bytes).

erofs-utils 1.5 fails ("Could not format the device: No such file or
directory") on a file name of exactly 255 bytes (NAME_MAX); such trees are
refused up front with :class:`InvalidInputError` naming the files.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import uuid as uuid_mod
from pathlib import Path

from weenv.errors import InvalidInputError, RuntimeFailedError, ToolMissingError
from weenv.packaging.erofs import NAME_MAX, TreeScan, check_source_dir, scan_tree

MKFS_EROFS = "mkfs.erofs"
DEFAULT_UUID = "3a5e0f3c-6b2d-5c1e-9f47-7765656e7601"
"""The file system UUID of images built without an explicit one (a constant, so builds repeat)."""
_SBIN = "/usr/local/sbin:/usr/sbin:/sbin"
_STDERR_TAIL_LINES = 12


def find_mkfs(mkfs: str = MKFS_EROFS) -> str:
    """Path of the ``mkfs`` program (PATH, then the sbin directories);
    :class:`ToolMissingError` if absent."""
    found = shutil.which(mkfs) or shutil.which(mkfs, path=_SBIN)
    if found is None:
        raise ToolMissingError(f"{mkfs} is not installed (apt-get install erofs-utils)")
    return found


@functools.lru_cache(maxsize=8)
def _version(program: str) -> str:
    # erofs-utils 1.5 has no -V, but prints "mkfs.erofs 1.5" before complaining
    # about the option; newer versions print the same line for -V.
    proc = subprocess.run([program, "-V"], capture_output=True, text=True)
    match = re.search(r"mkfs\.erofs\s+(\S+)", proc.stdout + proc.stderr)
    return match.group(1) if match else "unknown"


def mkfs_version(mkfs: str = MKFS_EROFS) -> str:
    """Version of mkfs.erofs, e.g. ``"1.5"`` (``"unknown"`` if it does not say).
    Raises :class:`ToolMissingError` if it is not installed."""
    return _version(find_mkfs(mkfs))


def mkfs_erofs(
    source_dir: str | os.PathLike[str],
    image: str | os.PathLike[str],
    *,
    uuid: str = DEFAULT_UUID,
    mkfs: str = MKFS_EROFS,
) -> TreeScan:
    """Write an uncompressed EROFS image of ``source_dir`` to the file ``image``.

    Owners, modes (setuid/setgid/sticky), mtimes (ns), xattrs (user, trusted,
    security, POSIX ACLs), symlinks, hardlinks, device nodes, fifos and sockets
    are kept.  ``uuid``: the file system UUID (a fixed default keeps builds
    repeatable).  ``mkfs``: the program name or path.  ``image`` is
    overwritten; on failure it is removed.  Returns the :class:`TreeScan` of
    the tree (one lstat walk, made first to find the build time).

    Raises :class:`ToolMissingError` if mkfs.erofs is missing,
    :class:`InvalidInputError` if ``source_dir`` is not a directory, ``uuid``
    is not a UUID or (erofs-utils <= 1.5, which fails on them) a name is 255
    bytes long, and :class:`RuntimeFailedError` (with the tail of the tool's
    stderr) if mkfs.erofs fails.
    """
    source = check_source_dir(source_dir)
    try:
        uuid = str(uuid_mod.UUID(uuid))
    except (ValueError, TypeError) as exc:
        raise InvalidInputError(f"not a UUID: {uuid!r}") from exc
    program = find_mkfs(mkfs)
    scan = scan_tree(source)
    if scan.longest_names and _older_than(_version(program), (1, 6)):
        shown = ", ".join(scan.longest_names[:3])
        raise InvalidInputError(
            f"mkfs.erofs {_version(program)} cannot store file names of {NAME_MAX} bytes "
            f"({len(scan.longest_names)} in {source}: {shown}); shorten them"
        )
    epoch = max(scan.max_mtime + 1, 1)
    env = dict(os.environ, SOURCE_DATE_EPOCH=str(epoch), LC_ALL="C")
    image = Path(image)
    argv = [program, "--quiet", f"-U{uuid}", os.fspath(image), os.fspath(source)]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, errors="replace", env=env)
    except OSError as exc:
        raise RuntimeFailedError(f"cannot run {program}: {exc}") from exc
    if proc.returncode != 0:
        image.unlink(missing_ok=True)
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-_STDERR_TAIL_LINES:])
        raise RuntimeFailedError(f"mkfs.erofs failed (exit {proc.returncode}) building {image} from {source}:\n{tail}")
    return scan


def _older_than(version: str, limit: tuple[int, ...]) -> bool:
    """Whether dotted ``version`` is older than ``limit`` (an unknown version is)."""
    try:
        return tuple(int(x) for x in version.split(".")[:2]) < limit
    except ValueError:
        return True
