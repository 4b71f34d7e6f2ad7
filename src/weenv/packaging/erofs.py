"""The source tree of a group image: checked, walked once (inodes, newest
mtime, names of NAME_MAX bytes).  weenv's own writer
(:mod:`weenv.packaging.erofs_writer`) writes the image; Debian's
``mkfs.erofs``, kept to compare against, is the benchmarks'
(``weenv_bench.mkfs_erofs``).
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from weenv.errors import InvalidInputError

NAME_MAX = 255


@dataclass(frozen=True)
class TreeScan:
    """What one walk of a source tree learns (no file contents are read)."""

    inodes: int
    """Distinct inodes, the root directory included; hardlinks count once."""
    max_mtime: int
    """Newest mtime in the tree, in whole seconds since the epoch (floor)."""
    longest_names: tuple[str, ...] = ()
    """Paths (relative) of entries whose name is NAME_MAX (255) bytes long."""


def check_source_dir(source_dir: str | os.PathLike[str]) -> Path:
    """``source_dir`` as an absolute, symlink-free :class:`Path`;
    :class:`InvalidInputError` if it is missing or not a directory."""
    path = Path(source_dir).resolve()
    if not path.exists():
        raise InvalidInputError(f"source directory {path} does not exist")
    if not path.is_dir():
        raise InvalidInputError(f"source {path} is not a directory")
    return path


def scan_tree(source_dir: str | os.PathLike[str]) -> TreeScan:
    """Walk ``source_dir`` with lstat(2): inode count and newest mtime.

    Raises :class:`InvalidInputError` if ``source_dir`` is not a directory, or
    holds an entry that cannot be read (no permission, or a path longer than
    PATH_MAX, which mkfs.erofs cannot open either).
    """
    root = check_source_dir(source_dir)
    st = os.stat(root)
    seen = {(st.st_dev, st.st_ino)}
    max_ns = st.st_mtime_ns
    longest: list[str] = []
    stack = [os.fspath(root)]
    while stack:
        top = stack.pop()
        try:
            with os.scandir(top) as it:
                for entry in it:
                    st = entry.stat(follow_symlinks=False)
                    seen.add((st.st_dev, st.st_ino))
                    max_ns = max(max_ns, st.st_mtime_ns)
                    if len(os.fsencode(entry.name)) >= NAME_MAX:
                        longest.append(os.path.relpath(entry.path, root))
                    if stat.S_ISDIR(st.st_mode):
                        stack.append(entry.path)
        except OSError as exc:
            rel = os.path.relpath(exc.filename or top, root)
            if len(rel) > 200:
                rel = rel[:80] + "..." + rel[-80:]
            if exc.errno == errno.ENAMETOOLONG:
                raise InvalidInputError(
                    f"{root}: a path is longer than PATH_MAX ({os.pathconf('/', 'PC_PATH_MAX')} bytes), "
                    f"which mkfs.erofs cannot read: {rel}"
                ) from None
            raise InvalidInputError(f"{root}: cannot read {rel}: {exc.strerror}") from exc
    return TreeScan(len(seen), max_ns // 1_000_000_000, tuple(sorted(longest)))


def count_inodes(source_dir: str | os.PathLike[str]) -> int:
    """Distinct inodes under ``source_dir`` (files, dirs, links, nodes; the root
    included; hardlinks once): what an EROFS image of it holds.

    Raises :class:`InvalidInputError` if ``source_dir`` is not a directory.
    """
    return scan_tree(source_dir).inodes
