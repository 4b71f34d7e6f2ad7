"""The old import path, kept to compare against (``weenv bench import --systems``,
system ``weenv-old``): each group's layers extracted to a directory tree
(:class:`GroupTree`, Linux only: mknod, lchown, xattrs), then that tree built
into a group like any directory (:func:`weenv.packaging.group.build_group`).
The product streams layers into the image writer instead
(:mod:`weenv.packaging.importer.tartree`); the rules both follow are
:mod:`weenv.packaging.importer.layers`'s."""

from __future__ import annotations

import errno
import os
import shutil
import stat
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from weenv.errors import InvalidInputError
from weenv.formats.manifest import DEFAULT_CHUNK_SIZE, RuntimeConfig, check_name
from weenv.packaging.group import build_group
from weenv.packaging.importer.image_import import (
    ImportResult,
    _finish,
    _rmtree,
    default_name,
    plan_image,
)
from weenv.packaging.importer.layers import (
    _CORRUPT_STREAM_ERRORS,
    BLOCK,
    OPAQUE_XATTR,
    READ_SIZE,
    LayerStats,
    View,
    _Dir,
    _is_opaque,
    _is_whiteout,
    _mtime_ns,
    _xattrs,
    apply_marker,
    open_layer,
)
from weenv.packaging.importer.runtime import runtime_from_config
from weenv.packaging.importer.source import Image, ImageSource, open_source
from weenv.store.base import Store
from weenv.store.lease import Lease, LeasedStore

_ZERO_BLOCK = bytes(BLOCK)
_ZERO_READ = bytes(READ_SIZE)
_DEFAULT_DIR_MODE = 0o755


def import_extracting(
    source: str,
    store: Store,
    *,
    name: str | None = None,
    merge_small: int | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    workdir: str | os.PathLike[str] | None = None,
    progress: Callable[[str], None] | None = None,
) -> ImportResult:
    """:func:`weenv.packaging.importer.image_import.import_image` by the old path
    (the only image of ``source``, a loopback or TLS registry): each group's
    layers extracted to a directory under ``workdir`` (about the image's
    unpacked size), then built from there."""
    started = time.monotonic()
    say = progress or (lambda _msg: None)
    name = check_name(name or default_name(source))
    with open_source(source) as src:
        image = src.read_image(None)
        plan, names = plan_image(src, image, name, merge_small)
        tmp = Path(tempfile.mkdtemp(dir=workdir, prefix="weenv-import-"))
        with Lease(store, what=f"import {name}") as lease:
            leased = LeasedStore(store, lease)
            try:
                trees, stats, runtime = _unpack(src, image, plan, tmp, say)
                results = []
                for k, (tree, group_name) in enumerate(zip(trees, names)):
                    layers = plan[k]
                    say(f"group {group_name}: layers {layers[0]}..{layers[-1]}, EROFS image + publish")
                    results.append(
                        build_group(
                            tree,
                            leased,
                            name=group_name,
                            chunk_size=chunk_size,
                            workdir=tmp,
                            ref=False,
                            source={
                                "type": "image",
                                "image": image.reference,
                                "config": image.config_digest,
                                "layers": ",".join(image.layers[i].diff_id for i in layers),
                            },
                        )
                    )
                    shutil.rmtree(tree, ignore_errors=True)
            finally:
                _rmtree(tmp)
            return _finish(leased, name, names, results, runtime, plan, stats, started)


def _unpack(
    src: ImageSource, image: Image, plan: list[list[int]], tmp: Path, say: Callable[[str], None]
) -> tuple[list[Path], list[LayerStats], RuntimeConfig]:
    """Apply every layer to its group's tree under ``tmp``; return the trees,
    per-layer stats and the runtime config (read while the trees exist)."""
    view = View()
    trees: list[Path] = []
    stats: list[LayerStats] = []
    for k, layer_indexes in enumerate(plan):
        tree = GroupTree(tmp / f"group-{k}", k, view, trees)
        for i in layer_indexes:
            layer = image.layers[i]
            what = f"{image.reference}: layer {i} ({layer.digest or layer.diff_id})"
            with open_layer(src, layer, what) as tar:
                stats.append(tree.apply_layer(tar, what))
            say(
                f"layer {i}: {stats[-1].entries} entries, {stats[-1].whiteouts} whiteouts, "
                f"{stats[-1].opaque_dirs} opaque dirs"
            )
        tree.finish()
        view.apply_group(tree.root, k)
        trees.append(tree.root)

    def read_file(path: str) -> bytes | None:
        parts = tuple(p for p in path.split("/") if p)
        group = view.lookup(parts)
        if not isinstance(group, int):
            return None
        f = trees[group].joinpath(*parts)
        st = os.lstat(f)
        return f.read_bytes() if stat.S_ISREG(st.st_mode) else None

    return trees, stats, runtime_from_config(image.config, read_file)


@dataclass
class GroupTree:
    """The tree of group ``index`` under ``root`` (created empty), written over
    ``view`` (the groups below; their trees are ``lower_trees``, by index)."""

    root: Path
    index: int
    view: View
    lower_trees: list[Path]
    _dir_times: dict[tuple[str, ...], int] = field(default_factory=dict)
    _new: set[tuple[str, ...]] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.root.mkdir(mode=0o700)
        self._copy_dir_meta((), self.root)

    # --- layers ---------------------------------------------------------------------
    def apply_layer(self, tar: tarfile.TarFile, what: str) -> LayerStats:
        """Apply every entry of the layer ``tar`` (streamed); ``what`` names the
        layer in errors.  Raises :class:`InvalidInputError` for an unsafe or
        malformed entry."""
        self._new = set()
        stats = LayerStats()
        name = "(start)"
        try:
            for member in tar:
                name = member.name
                stats.entries += 1
                self._apply(tar, member, _parts(member.name, what), stats, what)
        except _CORRUPT_STREAM_ERRORS as exc:
            raise InvalidInputError(f"{what}: truncated or corrupt layer (at {name!r}): {exc}") from exc
        except OSError as exc:
            raise InvalidInputError(f"{what}: cannot apply {name!r}: {exc}") from exc
        return stats

    def finish(self) -> None:
        """Set directory mtimes (children first), now that nothing more is written."""
        for parts in sorted(self._dir_times, key=len, reverse=True):
            ns = self._dir_times[parts]
            st = _lstat(self._path(parts))
            if st is not None and stat.S_ISDIR(st.st_mode):  # a later layer may have removed it
                os.utime(self._path(parts), ns=(ns, ns), follow_symlinks=False)
        self._dir_times.clear()

    def _apply(
        self, tar: tarfile.TarFile, m: tarfile.TarInfo, parts: tuple[str, ...], stats: LayerStats, what: str
    ) -> None:
        if apply_marker(self, m, parts, stats, f"{what}: {m.name!r}"):
            return
        if not parts:
            if not m.isdir():
                raise InvalidInputError(f"{what}: the root entry {m.name!r} is not a directory")
            self._set_meta(self.root, m, (), is_dir=True)
            return
        self._ensure_dir(parts[:-1], what)
        path = self._path(parts)
        old = _lstat(path)
        replaced_non_dir = False
        if old is not None:
            if m.isdir() and stat.S_ISDIR(old.st_mode):
                self._set_meta(path, m, parts, is_dir=True, clear_xattrs=True)
                self._new.add(parts)
                return
            replaced_non_dir = not stat.S_ISDIR(old.st_mode)
            _remove(path, old)
        if m.isdir():
            os.mkdir(path, 0o700)
            self._set_meta(path, m, parts, is_dir=True)
            if replaced_non_dir:
                os.setxattr(path, OPAQUE_XATTR, b"y", follow_symlinks=False)
        elif m.isreg():
            stats.bytes += self._write_file(tar, m, path, what)
        elif m.issym():
            os.symlink(m.linkname, path)
            self._set_meta(path, m, parts, symlink=True)
        elif m.islnk():
            self._hardlink(m, path, what)
        elif m.ischr() or m.isblk():
            kind = stat.S_IFCHR if m.ischr() else stat.S_IFBLK
            os.mknod(path, kind | 0o600, os.makedev(m.devmajor, m.devminor))
            self._set_meta(path, m, parts)
        elif m.isfifo():
            os.mkfifo(path, 0o600)
            self._set_meta(path, m, parts)
        else:
            raise InvalidInputError(f"{what}: entry {m.name!r} has unsupported type {m.type!r}")
        self._new.add(parts)

    def _write_file(self, tar: tarfile.TarFile, m: tarfile.TarInfo, path: Path, what: str) -> int:
        src = tar.extractfile(m)
        if src is None:  # pragma: no cover - isreg() members always have data
            raise InvalidInputError(f"{what}: no data for {m.name!r}")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            written = _copy_sparse(src, fd)
            if written != m.size:
                raise InvalidInputError(f"{what}: {m.name!r} has {written} bytes of data, its header says {m.size}")
            self._set_meta_fd(fd, m)
        finally:
            os.close(fd)
        return written

    def _hardlink(self, m: tarfile.TarInfo, path: Path, what: str) -> None:
        target_parts = _parts(m.linkname, what)
        if not target_parts:
            raise InvalidInputError(f"{what}: hardlink {m.name!r} points at the root")
        self._check_parents(target_parts[:-1], what)
        target = self._path(target_parts)
        st = _lstat(target)
        if st is not None and not stat.S_ISDIR(st.st_mode) and not _is_whiteout(st):
            os.link(target, path, follow_symlinks=False)
            return
        below = self.view.lookup(target_parts)
        if st is None and isinstance(below, int):
            # A link to a file of a lower group: overlayfs cannot link across
            # layers, so the file is copied (data, owner, mode, xattrs, mtime).
            _copy_entry(self.lower_trees[below] / os.path.join(*target_parts), path)
            return
        raise InvalidInputError(f"{what}: hardlink {m.name!r} -> {m.linkname!r}: no such file in the image")

    def _whiteout(self, parts: tuple[str, ...], mtime_ns: int, what: str) -> None:
        if parts in self._new:
            return  # the same layer made it: a whiteout only hides lower layers
        if self._dirs_in_tree(parts[:-1]):
            old = _lstat(self._path(parts))
            if old is not None:
                _remove(self._path(parts), old)
        if self._visible_below(parts):
            self._ensure_dir(parts[:-1], what)
            path = self._path(parts)
            os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(0, 0))
            os.utime(path, ns=(mtime_ns, mtime_ns), follow_symlinks=False)  # repeatable images

    def _opaque(self, parts: tuple[str, ...], what: str) -> None:
        self._ensure_dir(parts, what)
        path = self._path(parts)
        with os.scandir(path) as it:
            entries = list(it)
        for entry in entries:
            if parts + (entry.name,) not in self._new:
                _remove(Path(entry.path), entry.stat(follow_symlinks=False))
        os.setxattr(path, OPAQUE_XATTR, b"y", follow_symlinks=False)

    def _visible_below(self, parts: tuple[str, ...]) -> bool:
        """Whether ``parts`` shows through this group from below: present in the
        view, and no parent in this tree is a non-directory (a whiteout or a
        file hides what is below it) or an opaque directory."""
        if self.view.lookup(parts) is None:
            return False
        for i in range(len(parts)):
            st = _lstat(self._path(parts[:i]))
            if st is None:
                continue
            if not stat.S_ISDIR(st.st_mode) or _is_opaque(self._path(parts[:i])):
                return False
        return True

    def _dirs_in_tree(self, parts: tuple[str, ...]) -> bool:
        """Whether every prefix of ``parts`` is a directory (not a symlink) in this tree."""
        for i in range(1, len(parts) + 1):
            st = _lstat(self._path(parts[:i]))
            if st is None or not stat.S_ISDIR(st.st_mode):
                return False
        return True

    # --- directories ------------------------------------------------------------------
    def _ensure_dir(self, parts: tuple[str, ...], what: str) -> None:
        """Make ``parts`` a directory of this tree, creating missing parents with
        the metadata the image shows for them below (or 0755 root)."""
        for i in range(1, len(parts) + 1):
            prefix = parts[:i]
            path = self._path(prefix)
            st = _lstat(path)
            if st is not None and stat.S_ISDIR(st.st_mode):
                continue
            replaced = False
            if st is not None:
                if prefix in self._new and not _is_whiteout(st):
                    raise InvalidInputError(
                        f"{what}: an entry lies under /{'/'.join(prefix)}, which this layer made "
                        f"a {'symlink' if stat.S_ISLNK(st.st_mode) else 'non-directory'}"
                    )
                _remove(path, st)
                replaced = True
            os.mkdir(path, 0o700)
            self._copy_dir_meta(prefix, path)
            if replaced:
                os.setxattr(path, OPAQUE_XATTR, b"y", follow_symlinks=False)

    def _check_parents(self, parts: tuple[str, ...], what: str) -> None:
        for i in range(1, len(parts) + 1):
            st = _lstat(self._path(parts[:i]))
            if st is not None and not stat.S_ISDIR(st.st_mode):
                raise InvalidInputError(f"{what}: path /{'/'.join(parts)} goes through a non-directory")

    def _copy_dir_meta(self, parts: tuple[str, ...], path: Path) -> None:
        below = self.view.lookup(parts)
        if isinstance(below, _Dir) and below.group >= 0:
            src = self.lower_trees[below.group] / os.path.join(*parts) if parts else self.lower_trees[below.group]
            st = os.lstat(src)
            os.chown(path, st.st_uid, st.st_gid, follow_symlinks=False)
            os.chmod(path, stat.S_IMODE(st.st_mode))
            for key in os.listxattr(src, follow_symlinks=False):
                if key != OPAQUE_XATTR:
                    os.setxattr(path, key, os.getxattr(src, key, follow_symlinks=False), follow_symlinks=False)
            self._dir_times[parts] = st.st_mtime_ns
        else:
            os.chown(path, 0, 0, follow_symlinks=False)
            os.chmod(path, _DEFAULT_DIR_MODE)
            self._dir_times[parts] = 0

    # --- metadata -----------------------------------------------------------------------
    def _set_meta(
        self,
        path: Path,
        m: tarfile.TarInfo,
        parts: tuple[str, ...],
        *,
        is_dir: bool = False,
        symlink: bool = False,
        clear_xattrs: bool = False,
    ) -> None:
        os.chown(path, m.uid, m.gid, follow_symlinks=False)
        if not symlink:
            os.chmod(path, m.mode & 0o7777)
        xattrs = _xattrs(m)
        if clear_xattrs:
            for key in os.listxattr(path, follow_symlinks=False):
                if key not in xattrs and key != OPAQUE_XATTR:
                    os.removexattr(path, key, follow_symlinks=False)
        for key, value in xattrs.items():
            _setxattr(path, key, value, symlink)
        ns = _mtime_ns(m)
        if is_dir:
            self._dir_times[parts] = ns
        else:
            os.utime(path, ns=(ns, ns), follow_symlinks=False)

    def _set_meta_fd(self, fd: int, m: tarfile.TarInfo) -> None:
        os.fchown(fd, m.uid, m.gid)
        os.fchmod(fd, m.mode & 0o7777)
        for key, value in _xattrs(m).items():
            os.setxattr(fd, key, value)
        ns = _mtime_ns(m)
        os.utime(fd, ns=(ns, ns))

    def _path(self, parts: tuple[str, ...]) -> Path:
        return self.root.joinpath(*parts) if parts else self.root


def _parts(name: str, what: str) -> tuple[str, ...]:
    """A tar entry name as path components below the root; ``..`` is refused."""
    parts = []
    for part in name.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            raise InvalidInputError(f"{what}: entry {name!r} climbs out of the root ('..')")
        parts.append(part)
    return tuple(parts)


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def _remove(path: Path, st: os.stat_result) -> None:
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _setxattr(path: Path, key: str, value: bytes, symlink: bool) -> None:
    try:
        os.setxattr(path, key, value, follow_symlinks=False)
    except OSError as exc:
        # Linux allows only trusted.* and security.* xattrs on symlinks.
        if not (symlink and exc.errno in (errno.EPERM, errno.ENOTSUP)):
            raise


def _copy_sparse(src: IO[bytes], fd: int) -> int:
    """Copy ``src`` to ``fd``, skipping (lseek) 4 KiB blocks of zeros; return bytes."""
    pos = 0
    while True:
        buf = src.read(READ_SIZE)
        if not buf:
            break
        n = len(buf)
        if buf == _ZERO_READ[:n]:
            pos += n
            continue
        view = memoryview(buf)
        start = 0  # first byte of the current run of data blocks
        for off in range(0, n, BLOCK):
            if buf[off : off + BLOCK] == _ZERO_BLOCK[: min(BLOCK, n - off)]:
                if start < off:
                    os.pwrite(fd, view[start:off], pos + start)
                start = off + BLOCK
        if start < n:
            os.pwrite(fd, view[start:n], pos + start)
        pos += n
    os.ftruncate(fd, pos)
    return pos


def _copy_entry(src: Path, dest: Path) -> None:
    """Copy one non-directory ``src`` to ``dest`` with owner, mode, xattrs, mtime."""
    st = os.lstat(src)
    if stat.S_ISLNK(st.st_mode):
        os.symlink(os.readlink(src), dest)
    elif stat.S_ISREG(st.st_mode):
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            with open(src, "rb") as f:
                _copy_sparse(f, fd)
        finally:
            os.close(fd)
    else:
        os.mknod(dest, stat.S_IFMT(st.st_mode) | 0o600, st.st_rdev)
    os.chown(dest, st.st_uid, st.st_gid, follow_symlinks=False)
    if not stat.S_ISLNK(st.st_mode):
        os.chmod(dest, stat.S_IMODE(st.st_mode))
    for key in os.listxattr(src, follow_symlinks=False):
        _setxattr(dest, key, os.getxattr(src, key, follow_symlinks=False), stat.S_ISLNK(st.st_mode))
    os.utime(dest, ns=(st.st_mtime_ns, st.st_mtime_ns), follow_symlinks=False)
