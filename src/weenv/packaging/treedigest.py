"""The digest of a file tree: what a copy of it would put in a group.

:func:`tree_digest` hashes, for every entry in sorted path order, its relative
path, type, permission bits, owner, xattrs and, by type, the sha256 of a regular
file's content, a symbolic link's target or a device's number; a hardlink is
recorded as a link to the first path of its inode.  Modification times are left
out (as Docker's build cache leaves them out): a fresh checkout of the same
files has the same digest.  Used for the build cache keys of ``from_dir`` and
``copy`` steps.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

from weenv.errors import InvalidInputError

_BUF = 1 << 20


def file_sha256(path: str | os.PathLike[str]) -> str:
    """Hex sha256 of a regular file's content, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while block := f.read(_BUF):
            h.update(block)
    return h.hexdigest()


def _xattrs(path: str) -> list[tuple[str, str]]:
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:
        return []
    return sorted((n, os.getxattr(path, n, follow_symlinks=False).hex()) for n in names)


def _entry(path: str, rel: str, st: os.stat_result, links: dict[tuple[int, int], str]) -> str:
    mode = st.st_mode
    head = f"{rel}\0{stat.S_IFMT(mode):o}\0{stat.S_IMODE(mode):o}\0{st.st_uid}:{st.st_gid}\0{_xattrs(path)}\0"
    if stat.S_ISREG(mode):
        key = (st.st_dev, st.st_ino)
        if st.st_nlink > 1:
            if key in links:
                return head + "link=" + links[key]
            links[key] = rel
        return head + f"{st.st_size}:{file_sha256(path)}"
    if stat.S_ISLNK(mode):
        return head + "target=" + os.readlink(path)
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return head + f"rdev={os.major(st.st_rdev)},{os.minor(st.st_rdev)}"
    return head


def tree_digest(path: str | os.PathLike[str]) -> str:
    """``sha256:`` digest of the tree at ``path`` (a directory, or a single file).

    Raises :class:`InvalidInputError` if ``path`` does not exist.
    """
    root = Path(path)
    try:
        st = os.lstat(root)
    except OSError as exc:
        raise InvalidInputError(f"{root}: {exc.strerror}") from exc
    h = hashlib.sha256()
    links: dict[tuple[int, int], str] = {}
    h.update(_entry(os.fspath(root), ".", st, links).encode(errors="surrogateescape") + b"\n")
    if not stat.S_ISDIR(st.st_mode):
        return "sha256:" + h.hexdigest()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(dirnames + filenames):
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, root)
            line = _entry(full, rel, os.lstat(full), links)
            h.update(line.encode(errors="surrogateescape") + b"\n")
    return "sha256:" + h.hexdigest()
