"""File access inside an environment's root from the host, confined to it (Linux >= 5.6).

Every path is resolved by openat2(2) with ``RESOLVE_IN_ROOT |
RESOLVE_NO_MAGICLINKS`` against a descriptor of the root: the kernel treats the
root as ``/`` for ``..`` and for absolute and relative symbolic links alike, and
refuses ``/proc/PID/fd``-style magic links, so no path, however crafted by the
environment's processes, reaches a host file.  Operations that name an entry
rather than open it (create, mkdir, unlink, rename) open the entry's *parent*
that way and then act on one plain name with the ``*at`` calls, which never
follow a final symbolic link.  Reads and writes open the target with
``O_PATH``, check it is a regular file, and reopen that very inode, so a FIFO
or device node never blocks or touches a host device.  Writing through a
symbolic link that points nowhere creates its target, inside the root, as a
process inside would (E2B and SWE-ReX file writes follow links the same way).

Paths are strings as seen inside the environment; relative ones are taken from
``/`` (callers join the working directory first).  Errors: a missing path ->
:class:`NotFoundError`; a path of the wrong kind (a directory where a file is
expected, a file as a parent, an existing entry, a magic link, too many links)
-> :class:`InvalidInputError`; the environment's disk limit reached
(``EDQUOT``, or ``ENOSPC`` of the node's disk, :mod:`weenv.node.disk`), on any
call or on a write to a file :meth:`RootFS.open_write` returned ->
:class:`DiskFullError`.  Other ``OSError`` (``EIO``) propagate unchanged.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import io
import os
import shutil
import stat as st
from pathlib import Path
from typing import BinaryIO, Literal

from pydantic import BaseModel, ConfigDict

from weenv.errors import DiskFullError, InvalidInputError, NotFoundError

SYS_OPENAT2 = 437  # the same number on every architecture (include/uapi/asm-generic/unistd.h)
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_IN_ROOT = 0x10
_RESOLVE = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS
_DIR = os.O_PATH | os.O_DIRECTORY

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


EntryType = Literal["file", "dir", "symlink", "other"]


class EntryInfo(BaseModel):
    """One directory entry: ``name``, ``type``, ``size`` in bytes, ``mode`` (permission
    bits, ``st_mode & 0o7777``)."""

    model_config = ConfigDict(frozen=True)
    name: str
    type: EntryType
    size: int
    mode: int

    @classmethod
    def of(cls, name: str, s: os.stat_result) -> EntryInfo:
        m = s.st_mode
        kind: EntryType = (
            "file" if st.S_ISREG(m) else "dir" if st.S_ISDIR(m) else "symlink" if st.S_ISLNK(m) else "other"
        )
        return cls(name=name, type=kind, size=s.st_size, mode=st.S_IMODE(m))


_INVALID = {
    errno.ENOTDIR: "a path component is not a directory",
    errno.EISDIR: "is a directory",
    errno.ELOOP: "too many symbolic links, or a magic link",
    errno.EEXIST: "already exists",
    errno.ENOTEMPTY: "directory not empty",
    errno.EXDEV: "cannot move across file systems (overlayfs cannot rename a directory of a lower layer)",
    errno.EINVAL: "invalid argument",
    errno.ENAMETOOLONG: "name too long",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EROFS: "read-only file system",
    errno.ENXIO: "not a regular file",
    errno.ETXTBSY: "a running program's file (text file busy)",
}


def _mapped(exc: OSError, path: str) -> Exception:
    if exc.errno == errno.EDQUOT:
        return DiskFullError(
            exc.errno,
            f"{path}: the environment's disk is full ({os.strerror(exc.errno)}): "
            "its disk limit (resources.disk_bytes) is reached",
        )
    if exc.errno == errno.ENOSPC:  # not its limit: the disk it shares with the node's other environments
        return DiskFullError(
            exc.errno,
            f"{path}: no space left on the node's disk ({os.strerror(exc.errno)}), "
            "below the environment's own disk limit",
        )
    if exc.errno == errno.ENOENT:
        return NotFoundError(f"{path}: no such file or directory")
    if exc.errno in _INVALID:
        return InvalidInputError(f"{path}: {_INVALID[exc.errno]}")
    return exc


def _clean(path: str) -> str:
    if not isinstance(path, str) or not path or "\0" in path:
        raise InvalidInputError(f"bad path {path!r}")
    return path if path.startswith("/") else "/" + path


def _split(path: str) -> tuple[str, str]:
    """``(parent, name)`` of a path naming an entry; refuses ``/``, ``.`` and ``..`` as the name."""
    parts = [p for p in _clean(path).split("/") if p]
    if not parts or parts[-1] in (".", ".."):
        raise InvalidInputError(f"{path!r} does not name an entry")
    return "/" + "/".join(parts[:-1]), parts[-1]


class _Writer(io.FileIO):
    """A file open for writing, unbuffered: :meth:`write` writes all of its
    bytes or raises (mapped like :class:`RootFS`'s errors: a write short of
    the disk limit is followed by the one that says why)."""

    def __init__(self, fd: int, path: str):
        super().__init__(fd, "wb")
        self.path = path

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        done = 0
        try:
            while done < len(view):
                done += super().write(view[done:])
        except OSError as exc:
            raise _mapped(exc, self.path) from exc
        return done


class RootFS:
    """Confined access to the tree at ``root`` (a host directory, e.g. the overlay mount).

    No descriptor is kept between calls (an open one would keep the mount busy),
    so an instance is cheap and safe to share between threads.

    ``shift``: the host id of id 0 inside (an environment in a user namespace,
    :mod:`weenv.node.runtime.idmap`; default 0, none): what a call creates is owned by
    ``shift + uid`` on the host, root's by ``shift``, so that inside it shows
    as ``uid`` (:meth:`inside_id` maps a ``stat`` owner back).
    """

    def __init__(self, root: Path, shift: int = 0):
        self.root = Path(root)
        self.shift = shift

    def inside_id(self, host_id: int) -> int:
        """A host ``st_uid``/``st_gid`` of a file here as processes inside see it
        (65534, the overflow id, for one outside the range)."""
        inside = host_id - self.shift
        return inside if 0 <= inside < (1 << 16 if self.shift else 1 << 32) else 65534

    def _owned(self, owner: tuple[int, int] | None) -> tuple[int, int] | None:
        """The host owner to give what a call creates for ``owner`` (None: as created, root's)."""
        if not self.shift:
            return owner
        uid, gid = owner or (0, 0)
        return self.shift + uid, self.shift + gid

    # --- reading -------------------------------------------------------------------------
    def read_file(self, path: str) -> bytes:
        """The whole content of the regular file at ``path`` (symbolic links followed inside the root)."""
        with self.open_read(path) as f:
            return f.read()

    def open_read(self, path: str) -> BinaryIO:
        """The regular file at ``path`` opened for reading (a binary file object
        the caller closes), to stream a big file; errors as :meth:`read_file`."""
        with self._open(path, os.O_PATH) as fd:
            self._require_file(fd, path)
            try:
                return open(f"/proc/self/fd/{fd}", "rb")
            except OSError as exc:
                raise _mapped(exc, path) from exc

    def list_dir(self, path: str) -> list[EntryInfo]:
        """The entries of the directory at ``path``, by name; symbolic links are not followed."""
        with self._open(path, os.O_RDONLY | os.O_DIRECTORY) as fd:
            try:
                with os.scandir(fd) as it:
                    return sorted(
                        (EntryInfo.of(e.name, e.stat(follow_symlinks=False)) for e in it),
                        key=lambda e: e.name,
                    )
            except OSError as exc:
                raise _mapped(exc, path) from exc

    def stat(self, path: str, *, follow_symlinks: bool = True) -> EntryInfo:
        """The entry at ``path``; with ``follow_symlinks=False`` a final link itself."""
        flags = os.O_PATH | (0 if follow_symlinks else os.O_NOFOLLOW)
        with self._open(path, flags) as fd:
            name = [p for p in _clean(path).split("/") if p][-1:] or ["/"]
            return EntryInfo.of(name[0], os.fstat(fd))

    def exists(self, path: str) -> bool:
        """Whether ``path`` resolves (links followed) to an entry inside the root."""
        try:
            self.stat(path)
        except (NotFoundError, InvalidInputError):
            return False
        return True

    def open_dir(self, path: str) -> int:
        """An ``O_PATH`` descriptor of the directory ``path``, resolved inside the
        root; the caller closes it.  ``/proc/self/fd/N`` of it names that very
        directory for tools run on the host (``cp`` into an environment)."""
        return int(self._open(path, _DIR))

    # --- writing -------------------------------------------------------------------------
    def write_file(
        self,
        path: str,
        data: bytes,
        mode: int = 0o644,
        *,
        make_parents: bool = True,
        owner: tuple[int, int] | None = None,
        own_existing: bool = False,
    ) -> None:
        """Replace the content of the regular file at ``path``, or create it.

        ``mode``: permission bits of a file this call creates (exactly, no umask);
        an existing file keeps its mode, and its owner unless ``own_existing``.
        ``make_parents``: create missing parent directories (0o755).  ``owner``:
        ``(uid, gid)`` for what this call creates (default: root); with
        ``own_existing`` an existing file replaced becomes ``owner``'s too (E2B's
        envd gives the file it writes to the writer, created or not).  Symbolic
        links are followed inside the root, a final one that points nowhere too:
        the file is created where it points, as a process inside would create it.
        """
        with self.open_write(path, mode, make_parents=make_parents, owner=owner, own_existing=own_existing) as f:
            f.write(data)

    def open_write(
        self,
        path: str,
        mode: int = 0o644,
        *,
        make_parents: bool = True,
        owner: tuple[int, int] | None = None,
        own_existing: bool = False,
    ) -> BinaryIO:
        """The regular file at ``path`` truncated (or created) and opened for
        writing: a binary file object the caller writes and closes, to stream a
        big file.  Arguments and errors as :meth:`write_file`."""
        target = path
        for _hop in range(40):  # the kernel's limit on symbolic links (ELOOP)
            parent, name = _split(target)
            if make_parents:
                self.make_dir(parent, owner=owner)
            try:
                with self._open(target, os.O_PATH) as fd:
                    self._require_file(fd, target)
                    try:
                        wfd = os.open(f"/proc/self/fd/{fd}", os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC)
                    except OSError as exc:
                        raise _mapped(exc, target) from exc
                created = False
            except NotFoundError:
                try:
                    wfd = self._create(target, mode, owner)
                except FileExistsError:
                    # A dangling symbolic link (or an entry created meanwhile): go where it points.
                    link = self._readlink(parent, name)
                    if link is not None:
                        target = link if link.startswith("/") else f"{parent.rstrip('/')}/{link}"
                    continue
                except OSError as exc:
                    raise _mapped(exc, target) from exc
                created = True
            try:
                if created:
                    os.fchmod(wfd, mode)
                    if (host_owner := self._owned(owner)) is not None:
                        os.fchown(wfd, *host_owner)
                elif own_existing:
                    host_owner = self._owned(owner) or (0, 0)
                    s = os.fstat(wfd)
                    if (s.st_uid, s.st_gid) != host_owner:
                        os.fchown(wfd, *host_owner)
            except BaseException:
                os.close(wfd)
                raise
            return _Writer(wfd, target)
        raise InvalidInputError(f"{path}: too many symbolic links")

    def make_dir(
        self,
        path: str,
        mode: int = 0o755,
        *,
        parents: bool = True,
        exist_ok: bool = True,
        owner: tuple[int, int] | None = None,
    ) -> None:
        """Create the directory ``path`` (and, with ``parents``, missing parents).

        ``mode`` is masked by the umask as mkdir(2) does; ``owner``: ``(uid, gid)``
        of the directories this call creates.  A symbolic link on the way that
        points nowhere is followed inside the root (its target is created).
        """
        self._make_dir(path, mode, parents, exist_ok, owner, 0)

    def _make_dir(self, path: str, mode: int, parents: bool, exist_ok: bool, owner, hops: int) -> None:
        if not parents:
            self._mkdir_one(path, mode, exist_ok, owner, hops)
            return
        try:  # the common case: it exists already
            with self._open(path, _DIR):
                if not exist_ok:
                    raise InvalidInputError(f"{path}: already exists")
                return
        except NotFoundError:
            pass
        parts = [p for p in _clean(path).split("/") if p not in ("", ".")]
        for i in range(1, len(parts) + 1):
            prefix = "/" + "/".join(parts[:i])
            if parts[i - 1] == "..":
                continue
            try:
                with self._open(prefix, _DIR):
                    continue
            except NotFoundError:
                self._mkdir_one(prefix, mode, True, owner, hops)

    def remove(self, path: str) -> None:
        """Remove the file, link or directory tree at ``path`` (a final link itself, not its target)."""
        parent, name = _split(path)
        with self._open(parent, _DIR) as pfd:
            try:
                s = os.stat(name, dir_fd=pfd, follow_symlinks=False)
                if st.S_ISDIR(s.st_mode):
                    shutil.rmtree(name, dir_fd=pfd)
                else:
                    os.unlink(name, dir_fd=pfd)
            except OSError as exc:
                raise _mapped(exc, path) from exc

    def rename(self, src: str, dst: str) -> None:
        """Move ``src`` to ``dst`` (rename(2): replaces a file or an empty directory)."""
        sparent, sname = _split(src)
        dparent, dname = _split(dst)
        with self._open(sparent, _DIR) as sfd, self._open(dparent, _DIR) as dfd:
            try:
                os.rename(sname, dname, src_dir_fd=sfd, dst_dir_fd=dfd)
            except OSError as exc:
                raise _mapped(exc, f"{src} -> {dst}") from exc

    # --- helpers -------------------------------------------------------------------------
    def _mkdir_one(self, path: str, mode: int, exist_ok: bool, owner, hops: int) -> None:
        parent, name = _split(path)
        with self._open(parent, _DIR) as pfd:
            try:
                os.mkdir(name, mode, dir_fd=pfd)
            except FileExistsError:
                s = os.stat(name, dir_fd=pfd, follow_symlinks=False)
                if st.S_ISDIR(s.st_mode) and exist_ok:
                    return
                if not st.S_ISLNK(s.st_mode) or not exist_ok:
                    raise InvalidInputError(f"{path}: already exists") from None
            except OSError as exc:
                raise _mapped(exc, path) from exc
            else:
                if (host_owner := self._owned(owner)) is not None:
                    os.chown(name, *host_owner, dir_fd=pfd, follow_symlinks=False)
                return
        # A dangling symbolic link: make the directory it points to.
        if hops >= 40:
            raise InvalidInputError(f"{path}: too many symbolic links")
        link = self._readlink(parent, name) or ""
        target = link if link.startswith("/") else f"{parent.rstrip('/')}/{link}"
        self._make_dir(target, mode, True, True, owner, hops + 1)

    def _readlink(self, parent: str, name: str) -> str | None:
        """The target of the symbolic link ``name`` in ``parent``, None if it is not one."""
        with self._open(parent, _DIR) as pfd:
            try:
                return os.readlink(name, dir_fd=pfd)
            except OSError as exc:
                if exc.errno == errno.EINVAL:
                    return None
                raise _mapped(exc, f"{parent}/{name}") from exc

    def _require_file(self, fd: int, path: str) -> None:
        m = os.fstat(fd).st_mode
        if st.S_ISDIR(m):
            raise InvalidInputError(f"{path}: is a directory")
        if not st.S_ISREG(m):
            raise InvalidInputError(f"{path}: not a regular file")

    def _create(self, path: str, mode: int, owner: tuple[int, int] | None) -> int:
        """A new regular file at ``path``, open for writing.  A file system
        mounted inside an environment's user namespace (its ``/dev/shm``, a
        tmpfs) refuses an inode whose owner is not mapped there (EOVERFLOW), and
        host root is not: there it is created with this thread's file-system ids
        set to its owner's host ids (setfsuid/setfsgid act on one thread)."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        try:
            return self._openat2(path, flags, mode)
        except OSError as exc:
            if exc.errno != errno.EOVERFLOW or not self.shift:
                raise
        uid, gid = self._owned(owner)
        old_gid, old_uid = _libc.setfsgid(gid), _libc.setfsuid(uid)
        try:
            return self._openat2(path, flags, mode)
        finally:
            _libc.setfsuid(old_uid)
            _libc.setfsgid(old_gid)

    def _openat2(self, path: str, flags: int, mode: int = 0) -> int:
        """openat2(root, path, flags) confined to the root; raises ``OSError``."""
        root = self._root_fd()
        try:
            how = _OpenHow(flags | os.O_CLOEXEC, mode, _RESOLVE)
            raw = os.fsencode(_clean(path))
            for _attempt in range(64):  # EAGAIN: a concurrent rename raced a ".." lookup
                fd = _libc.syscall(
                    ctypes.c_long(SYS_OPENAT2),
                    ctypes.c_long(root),
                    ctypes.c_char_p(raw),
                    ctypes.byref(how),
                    ctypes.c_size_t(ctypes.sizeof(how)),
                )
                if fd >= 0:
                    return fd
                err = ctypes.get_errno()
                if err not in (errno.EAGAIN, errno.EINTR):
                    break
            raise OSError(err, os.strerror(err), path)
        finally:
            os.close(root)

    def _root_fd(self) -> int:
        """A new ``O_PATH`` descriptor of the root (the caller closes it)."""
        return os.open(self.root, _DIR | os.O_CLOEXEC)

    def _open(self, path: str, flags: int) -> _Fd:
        try:
            return _Fd(self._openat2(path, flags))
        except OSError as exc:
            raise _mapped(exc, path) from exc


class _Fd(int):
    """A file descriptor that closes itself at the end of a ``with`` block."""

    def __enter__(self) -> int:
        return int(self)

    def __exit__(self, *exc) -> None:
        os.close(self)
