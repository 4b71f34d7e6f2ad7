"""An overlayfs upper dir turned into a clean group tree, in place.

After a build environment's commands ran, its upper dir holds exactly what
they changed, already in the form a group needs (DESIGN.md, "Whiteouts"): a
deleted file or directory is a character device 0/0 (a *whiteout*), a directory
that was removed and made again is marked ``trusted.overlay.opaque=y``.  What
overlayfs adds for its own bookkeeping must go (seen on Linux 6.18 with the
module's defaults, redirect_dir/metacopy/index off):

- ``trusted.overlay.origin`` on every copied-up file and directory (a file
  handle of the lower inode: it would point into the build's lower layers);
- ``trusted.overlay.impure`` on directories holding copied-up entries;
- ``trusted.overlay.uuid`` on the upper root (Linux >= 6.6);
- whiteouts made by linking one shared whiteout inode (``nlink`` > 1): each is
  re-made as its own device node, so the group holds no hardlinks between them.

Two features would make an upper dir that is *not* self-contained, and are
refused with :class:`InvalidInputError`: ``redirect_dir`` (a renamed directory
records where its contents live in a lower layer, ``trusted.overlay.redirect``)
and ``metacopy`` (a chmod/chown copies up metadata only, ``trusted.overlay.metacopy``,
the data stays below).  Both are off by default and in build environments'
mounts here; the check guards hosts where a module parameter turned them on.

Escaped xattrs (``trusted.overlay.overlay.*``, a user's own ``trusted.overlay.*``
as seen through the overlay) are kept: the group, as a lower layer, shows them
the same way.  (Source: Documentation/filesystems/overlayfs.rst, "whiteouts and
opaque directories", "Redirect dir", "Metadata only copy up", "Nesting overlayfs".)
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from weenv.errors import InvalidInputError

OVERLAY_PREFIX = "trusted.overlay."
OPAQUE = "trusted.overlay.opaque"
_ESCAPED = "trusted.overlay.overlay."
_NOT_SELF_CONTAINED = ("trusted.overlay.redirect", "trusted.overlay.metacopy")


@dataclass(frozen=True)
class UpperStats:
    """What :func:`clean_upper` found."""

    entries: int
    whiteouts: int
    opaque_dirs: int
    xattrs_removed: int


def is_whiteout(st: os.stat_result) -> bool:
    """Whether ``st`` is an overlay whiteout: a character device 0/0."""
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def clean_upper(upper: str | os.PathLike[str]) -> UpperStats:
    """Strip overlayfs's bookkeeping from the unmounted upper dir ``upper`` (see
    the module docstring), keeping whiteouts and opaque markers.

    Raises :class:`InvalidInputError` if the dir uses redirects or metacopy.
    """
    root = Path(upper)
    entries = whiteouts = opaque = removed = 0
    paths = [os.fspath(root)]
    for dirpath, dirnames, filenames in os.walk(root):
        paths.extend(os.path.join(dirpath, n) for n in dirnames + filenames)
    for path in paths:
        entries += 1
        st = os.lstat(path)
        if is_whiteout(st):
            whiteouts += 1
            if st.st_nlink > 1:
                os.unlink(path)
                os.mknod(path, stat.S_IFCHR | stat.S_IMODE(st.st_mode), 0)
                os.chown(path, st.st_uid, st.st_gid, follow_symlinks=False)
            continue
        if stat.S_ISLNK(st.st_mode):
            continue  # overlayfs sets no xattrs on symlinks; lsetxattr on one is refused anyway
        for name in os.listxattr(path, follow_symlinks=False):
            if not name.startswith(OVERLAY_PREFIX) or name.startswith(_ESCAPED):
                continue
            if name in _NOT_SELF_CONTAINED:
                raise InvalidInputError(
                    f"{path} carries {name}: the build overlay used redirect_dir or metacopy "
                    f"(check /sys/module/overlay/parameters); its upper dir is not a group"
                )
            if name == OPAQUE and os.getxattr(path, name, follow_symlinks=False) == b"y":
                opaque += 1
                continue
            os.removexattr(path, name, follow_symlinks=False)
            removed += 1
    return UpperStats(entries, whiteouts, opaque, removed)
