"""envd's filesystem service (``filesystem.Filesystem``) and its ``/files`` endpoint,
over a sandbox's confined root with its mounts, as its processes see them
(:meth:`weenv.node.node.Node.mounted_files`: ``/proc``, ``/dev``, ``/dev/shm``).

Every call is made as the user it names (:class:`~weenv.node.runtime.users.Identity`:
the RPC's basic-auth user, ``/files``' ``username``, default the template's).
Behaviour follows E2B's envd: ``~`` is the user's home; relative paths start
at the template's working directory when it names one (not ``/``), else at
the user's home (envd: always the home); files and parent directories an
upload or ``MakeDir`` creates belong to the user (envd writes as root and
chowns them: mode bits do not limit what a user's file calls reach, as
anyone who may call envd may also name ``root``); ``Stat`` reports a symbolic link with its
target's type and ``symlink_target`` (no ``is_symlink``, as envd); ``ListDir`` walks ``depth``
levels without following links; ``MakeDir`` answers ``already_exists`` for an
existing directory; ``Move`` creates the destination's parents; ``Remove``
removes a tree and succeeds when nothing is there (``os.RemoveAll``).
A name that is not UTF-8 is listed with U+FFFD for its bad bytes (protobuf
strings are UTF-8), so such a file never makes its directory unlistable; it
cannot be named through this face (weenv's own API can, losslessly).
All calls block (run them in a worker thread).
"""

from __future__ import annotations

import errno
import io
import os
import posixpath
import re
import stat as st
from typing import BinaryIO

from google.protobuf.message import Message

from weenv.errors import CommandTimeoutError, InvalidInputError, NotFoundError, PseudoFileError
from weenv.host.rootfs import RootFS
from weenv.node.runtime.users import Identity
from weenv.server.e2b.connect import RpcError
from weenv.server.e2b.proto import filesystem_pb
from weenv.server.e2b.sandboxes import Sandbox

FT = filesystem_pb.FileType
XATTR_PREFIX = "user.e2b."
"""Extended attributes holding a file's E2B metadata (``user.e2b.KEY``: envd's)."""
METADATA_HEADER = "x-metadata-"
"""An upload's metadata headers: ``X-Metadata-KEY: VALUE`` (the SDK's)."""
MAX_METADATA_KEYS = 64
MAX_METADATA_BYTES = 16 << 10
"""Most keys, and bytes of keys and values, of one upload's metadata (checked
before anything is written)."""
_METADATA_KEY = re.compile(r"\A[A-Za-z0-9!#$%&'*+\-.^_`|~]{1,200}\Z")
_METADATA_VALUE = re.compile(r"\A[\x20-\x7e]*\Z")
MAX_ENTRIES = 100_000
"""Most entries one ``ListDir`` returns."""


class SandboxFS:
    """A sandbox's files as its processes see them (``fs``: the node's
    :meth:`~weenv.node.node.Node.mounted_files`), plus the full ``stat(2)``
    results and the resolved link targets E2B's entries carry; every other
    :class:`RootFS` call goes to ``fs``."""

    def __init__(self, fs: RootFS):
        self.fs = fs

    def __getattr__(self, name: str):
        return getattr(self.fs, name)

    def lstat(self, path: str) -> os.stat_result:
        with self.fs._open(path, os.O_PATH | os.O_NOFOLLOW) as fd:
            return os.fstat(fd)

    def stat_target(self, path: str) -> os.stat_result:
        with self.fs._open(path, os.O_PATH) as fd:
            return os.fstat(fd)

    def readlink(self, path: str) -> str | None:
        parent, name = posixpath.split(path.rstrip("/") or "/")
        if not name:
            return None
        return self.fs._readlink(parent or "/", name)

    def realpath(self, path: str) -> str:
        """The absolute path ``path`` (absolute, normalized) resolves to inside the
        sandbox, every symbolic link on the way followed (as Go's
        ``filepath.EvalSymlinks``, which envd reports as ``symlink_target``); a
        link that points nowhere resolves to where it points.  Raises
        :class:`InvalidInputError` after 40 links (ELOOP)."""
        done, todo, hops = "/", [p for p in path.split("/") if p], 0
        while todo:
            part = todo.pop(0)
            if part == ".":
                continue
            if part == "..":
                done = posixpath.dirname(done)
                continue
            here = posixpath.join(done, part)
            try:
                target = self.readlink(here)
            except (NotFoundError, InvalidInputError):
                target = None  # missing or not a directory: the rest is taken as written
            if target is None:
                done = here
                continue
            hops += 1
            if hops > 40:
                raise InvalidInputError(f"{path}: too many symbolic links")
            if target.startswith("/"):
                done = "/"
            todo[:0] = [p for p in target.split("/") if p]
        return done

    def scan(self, path: str) -> list[tuple[str, os.stat_result]]:
        """``(name, lstat)`` of each entry of the directory ``path``."""
        with self.fs._open(path, os.O_RDONLY | os.O_DIRECTORY) as fd, os.scandir(fd) as it:
            return sorted(((e.name, e.stat(follow_symlinks=False)) for e in it), key=lambda x: x[0])


class Names:
    """User and group names of the sandbox (its ``/etc/passwd`` and ``/etc/group``)."""

    def __init__(self, fs: RootFS):
        self.users = _id_names(fs, "/etc/passwd")
        self.groups = _id_names(fs, "/etc/group")

    def user(self, uid: int) -> str:
        return self.users.get(uid, str(uid))

    def group(self, gid: int) -> str:
        return self.groups.get(gid, str(gid))


def _id_names(fs: RootFS, path: str) -> dict[int, str]:
    try:
        text = fs.read_file(path).decode(errors="replace")
    except (NotFoundError, InvalidInputError):
        return {}
    out: dict[int, str] = {}
    for line in text.splitlines():
        parts = line.split(":")
        if len(parts) >= 3 and parts[2].isdigit():
            out.setdefault(int(parts[2]), parts[0])
    return out


def resolve(sb: Sandbox, path: str, who: Identity) -> str:
    """The absolute, normalized path ``path`` names inside ``sb`` for the user ``who``."""
    if not isinstance(path, str) or "\0" in path:
        raise RpcError("invalid_argument", f"bad path {path!r}")
    if path == "~" or path.startswith("~/"):
        path = who.home + path[1:]
    elif not path.startswith("/"):
        path = posixpath.join(sb.start_dir(who), path)
    return posixpath.normpath(path).replace("//", "/") or "/"


def owner(who: Identity) -> tuple[int, int] | None:
    """``(uid, gid)`` of what a call as ``who`` creates (None: root's, as written)."""
    return None if (who.uid, who.gid) == (0, 0) else (who.uid, who.gid)


def fs_of(node, sb: Sandbox) -> SandboxFS:
    """``sb``'s files with its mounts (raises :class:`NotFoundError` once it is gone)."""
    return SandboxFS(node.mounted_files(sb.id))


def _file_type(mode: int) -> int:
    if st.S_ISREG(mode):
        return FT.Value("FILE_TYPE_FILE")
    if st.S_ISDIR(mode):
        return FT.Value("FILE_TYPE_DIRECTORY")
    if st.S_ISLNK(mode):
        return FT.Value("FILE_TYPE_SYMLINK")
    return FT.Value("FILE_TYPE_UNSPECIFIED")


def entry_size(lst: os.stat_result) -> int:
    """The ``size`` of an entry whose ``lstat`` is ``lst``: its ``st_size``,
    but a directory's as ext4 (E2B's sandboxes' root file system) reports it:
    the whole blocks it takes, at least one (4096 for a new one).  The
    environments' disk is btrfs, which counts a directory's names' bytes
    instead (0 for an empty one); E2B's SDK tests read a directory's size as
    more than 0."""
    if not st.S_ISDIR(lst.st_mode):
        return lst.st_size
    block = lst.st_blksize or 4096
    return max(block, -(-lst.st_size // block) * block)


def entry_info(fs: SandboxFS, path: str, lst: os.stat_result, names: Names) -> Message:
    """The ``EntryInfo`` of the entry at ``path`` whose ``lstat`` is ``lst``.
    A symbolic link is reported as envd reports it: its target's type and
    permission bits, its own size, ``Lrwxrwxrwx`` (Go's form) as permissions,
    and ``symlink_target``: the absolute path it resolves to, not the link's
    text.  ``is_symlink`` is left unset, as envd leaves it (its protocol has no
    such field): the SDK then gives a link to a file the type ``file`` and its
    ``symlink_target``, as E2B's SDK tests expect.  A link that points nowhere
    is ``FILE_TYPE_SYMLINK`` (envd: unspecified, which the SDK drops from a
    listing): weenv keeps it listed, with where it points."""
    e = filesystem_pb.EntryInfo(
        name=_text(posixpath.basename(path) or "/"),
        path=_text(path),
        size=entry_size(lst),
        mode=st.S_IMODE(lst.st_mode),
        permissions=st.filemode(lst.st_mode),
        owner=names.user(fs.inside_id(lst.st_uid)),
        group=names.group(fs.inside_id(lst.st_gid)),
    )
    e.modified_time.FromNanoseconds(lst.st_mtime_ns)
    e.type = _file_type(lst.st_mode)
    if st.S_ISREG(lst.st_mode) or st.S_ISDIR(lst.st_mode):
        e.metadata.update(read_metadata(fs, path))
    if st.S_ISLNK(lst.st_mode):
        e.symlink_target = _text(fs.realpath(path))
        e.permissions = "L" + e.permissions[1:]
        try:
            target = fs.stat_target(path).st_mode
        except (NotFoundError, InvalidInputError):
            e.type = FT.Value("FILE_TYPE_SYMLINK")
        else:  # followed to the end: never a link itself
            e.type, e.mode = _file_type(target), st.S_IMODE(target)
    return e


def upload_metadata(headers) -> dict[str, str]:
    """The metadata an upload asks for (``X-Metadata-KEY`` headers, keys
    lowercased as envd does), checked: HTTP token keys, printable US-ASCII
    values, at most :data:`MAX_METADATA_KEYS` keys and
    :data:`MAX_METADATA_BYTES` bytes.  Raises :class:`InvalidInputError`."""
    out: dict[str, str] = {}
    size = 0
    for name, value in headers.items():
        if not name.lower().startswith(METADATA_HEADER):
            continue
        key = name[len(METADATA_HEADER) :].lower()
        if not _METADATA_KEY.match(key) or not _METADATA_VALUE.match(value):
            raise InvalidInputError(
                f"bad metadata header {name!r}: token characters in the key, printable ASCII in the value"
            )
        out[key] = value
        size += len(key) + len(value)
        if len(out) > MAX_METADATA_KEYS or size > MAX_METADATA_BYTES:
            raise InvalidInputError(f"metadata over {MAX_METADATA_KEYS} keys or {MAX_METADATA_BYTES} bytes")
    return out


def set_metadata(f: BinaryIO, path: str, metadata: dict[str, str]) -> None:
    """Make ``metadata`` the whole metadata of the open file ``f`` (at
    ``path``), as ``user.e2b.*`` extended attributes: as envd, a file written
    again keeps none of an earlier upload's keys (truncating a file keeps its
    extended attributes, so they are removed here).  Raises
    :class:`InvalidInputError` where the file system keeps none and
    ``metadata`` has some."""
    try:
        stale = [
            n for n in os.listxattr(f.fileno()) if n.startswith(XATTR_PREFIX) and n[len(XATTR_PREFIX) :] not in metadata
        ]
        for name in stale:
            os.removexattr(f.fileno(), name)
    except OSError as exc:
        if metadata or exc.errno not in (errno.ENOTSUP, errno.EOPNOTSUPP):
            raise InvalidInputError(f"{path}: cannot replace its metadata: {exc.strerror}") from exc
    for key, value in metadata.items():
        try:
            os.setxattr(f.fileno(), XATTR_PREFIX + key, value.encode())
        except OSError as exc:
            raise InvalidInputError(f"{path}: cannot store metadata: {exc.strerror}") from exc


def read_metadata(fs: SandboxFS, path: str) -> dict[str, str]:
    """The ``user.e2b.*`` extended attributes of the entry at ``path`` (a link
    itself, not followed); {} where there are none or none can be read."""
    try:
        with fs.fs._open(path, os.O_PATH | os.O_NOFOLLOW) as fd:
            where = f"/proc/self/fd/{fd}"
            names = [n for n in os.listxattr(where) if n.startswith(XATTR_PREFIX)]
            return {n[len(XATTR_PREFIX) :]: os.getxattr(where, n).decode(errors="replace") for n in names}
    except (OSError, NotFoundError, InvalidInputError):
        return {}


def _text(name: str) -> str:
    """``name`` as valid UTF-8 for a protobuf string: each byte of a name that
    is not UTF-8 (a surrogate escape) becomes U+FFFD.  Lossy: E2B's protocol
    has only UTF-8 strings for names; weenv's own API keeps such names whole."""
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def _mapped(exc: Exception) -> RpcError:
    if isinstance(exc, RpcError):
        return exc
    if isinstance(exc, NotFoundError):
        return RpcError("not_found", str(exc))
    if isinstance(exc, InvalidInputError):
        return RpcError("invalid_argument", str(exc))
    if isinstance(exc, OSError):
        return RpcError("internal", f"{exc.strerror or exc}")
    raise exc


# --- filesystem.Filesystem --------------------------------------------------------------
def stat(node, sb: Sandbox, req, who: Identity) -> Message:
    path = resolve(sb, req.path, who)
    fs = fs_of(node, sb)
    try:
        lst = fs.lstat(path)
        if st.S_ISLNK(lst.st_mode):
            fs.stat_target(path)  # a link that points nowhere: not found, as stat(2)
        return filesystem_pb.StatResponse(entry=entry_info(fs, path, lst, Names(fs)))
    except Exception as exc:
        raise _mapped(exc) from exc


def list_dir(node, sb: Sandbox, req, who: Identity) -> Message:
    depth = req.depth or 1
    path = resolve(sb, req.path, who)
    fs = fs_of(node, sb)
    try:
        if not st.S_ISDIR(fs.stat_target(path).st_mode):
            raise RpcError("invalid_argument", f"path is not a directory: {path}")
        names = Names(fs)
        entries: list[Message] = []

        def walk(d: str, level: int) -> None:
            for name, lst in fs.scan(d):
                child = posixpath.join(d, name)
                entries.append(entry_info(fs, child, lst, names))
                if len(entries) > MAX_ENTRIES:
                    raise RpcError("resource_exhausted", f"more than {MAX_ENTRIES} entries under {path}")
                if level < depth and st.S_ISDIR(lst.st_mode):
                    walk(child, level + 1)

        walk(path, 1)
        return filesystem_pb.ListDirResponse(entries=entries)
    except Exception as exc:
        raise _mapped(exc) from exc


def make_dir(node, sb: Sandbox, req, who: Identity) -> Message:
    path = resolve(sb, req.path, who)
    fs = fs_of(node, sb)
    try:
        try:
            mode = fs.stat_target(path).st_mode
        except NotFoundError:
            mode = None
        if mode is not None:
            if st.S_ISDIR(mode):
                raise RpcError("already_exists", f"directory already exists: {path}")
            raise RpcError("invalid_argument", f"path already exists but it is not a directory: {path}")
        fs.make_dir(path, owner=owner(who))
        e = filesystem_pb.EntryInfo(name=posixpath.basename(path), type=FT.Value("FILE_TYPE_DIRECTORY"), path=path)
        return filesystem_pb.MakeDirResponse(entry=e)
    except Exception as exc:
        raise _mapped(exc) from exc


def move(node, sb: Sandbox, req, who: Identity) -> Message:
    src, dst = resolve(sb, req.source, who), resolve(sb, req.destination, who)
    fs = fs_of(node, sb)
    try:
        fs.make_dir(posixpath.dirname(dst) or "/", owner=owner(who))
        fs.rename(src, dst)
        return filesystem_pb.MoveResponse(entry=entry_info(fs, dst, fs.lstat(dst), Names(fs)))
    except Exception as exc:
        raise _mapped(exc) from exc


def remove(node, sb: Sandbox, req, who: Identity) -> Message:
    path = resolve(sb, req.path, who)
    fs = fs_of(node, sb)
    try:
        fs.remove(path)
    except NotFoundError:
        pass  # as os.RemoveAll: nothing there is success
    except Exception as exc:
        raise _mapped(exc) from exc
    return filesystem_pb.RemoveResponse()


# --- the /files endpoint ------------------------------------------------------------------
def open_read(node, sb: Sandbox, path: str, who: Identity) -> BinaryIO:
    """The file ``path`` open for reading; NotFoundError / InvalidInputError /
    RpcError.  A file of a kernel pseudo file system (``/proc``, ``/sys``,
    directly or through links) is read by a process inside the sandbox, as
    ``who`` (:func:`read_inside`), never by the daemon from outside."""
    full = resolve(sb, path, who)
    fs = fs_of(node, sb)
    try:
        return fs.open_read(full)
    except PseudoFileError:
        pass
    except NotFoundError:
        on_pseudo_fs = getattr(fs.fs, "on_pseudo_fs", None)  # a ProcessRootFS: the sandbox runs
        if on_pseudo_fs is None or not on_pseudo_fs(full):  # not under /proc/self and the like
            raise
    return io.BytesIO(read_inside(node, sb, full, who))


PSEUDO_READ_TIMEOUT_S = 10.0
"""Seconds a read of a pseudo file inside a sandbox may take (some block: a pipe of the kernel's)."""
MAX_PSEUDO_READ = 64 << 20
"""Most bytes one read of a pseudo file inside a sandbox returns."""
_READ_SCRIPT = 'if [ -d "$1" ]; then exit 3; fi; exec cat -- "$1"'
"""Run by ``/bin/sh`` inside: the file's bytes on stdout, ``cat``'s complaint on stderr, 3 for a directory."""


def read_inside(node, sb: Sandbox, path: str, who: Identity) -> bytes:
    """The content of ``path`` (absolute) as a process of the sandbox running
    as ``who`` reads it: in the sandbox's namespaces, cgroup and user, with
    its capabilities and nothing more, so it sees only what that user sees
    there (E2B's envd reads inside the sandbox too).  Raises NotFoundError
    (missing), InvalidInputError (a directory), OSError EACCES (refused to
    that user), CommandTimeoutError (past :data:`PSEUDO_READ_TIMEOUT_S`)."""
    p = node.spawn(
        sb.id,
        ["/bin/sh", "-c", _READ_SCRIPT, "sh", path],
        user=who,
        cwd="/",
        timeout=PSEUDO_READ_TIMEOUT_S,
        primary_reader=True,
    )
    r = node.collect(p, MAX_PSEUDO_READ)
    if r.timed_out:
        raise CommandTimeoutError(f"reading {path} inside the sandbox took more than {PSEUDO_READ_TIMEOUT_S:g} s")
    if r.exit_code == 0:
        return r.stdout
    if r.exit_code == 3:
        raise InvalidInputError(f"path '{path}' is a directory")
    why = r.stderr.decode(errors="replace").strip().rpartition(": ")[2] or f"exit status {r.exit_code}"
    if "No such file" in why:
        raise NotFoundError(f"path '{path}' does not exist")
    raise OSError(
        errno.EACCES if "denied" in why or "not permitted" in why else errno.EIO, f"error opening file '{path}': {why}"
    )


def open_write(
    node, sb: Sandbox, path: str, who: Identity, metadata: dict[str, str] | None = None
) -> tuple[BinaryIO, dict]:
    """The file ``path`` truncated or created (it and the parents made for it
    owned by ``who``, as envd chowns them) and open for writing, with ``metadata`` (:func:`upload_metadata`) as its
    whole metadata (an earlier upload's keys removed), and the ``/files``
    answer entry for it."""
    full = resolve(sb, path, who)
    f = fs_of(node, sb).open_write(full, owner=owner(who), own_existing=True)  # envd chowns a replaced file too
    entry: dict = {"name": posixpath.basename(full), "type": "file", "path": full}
    try:
        set_metadata(f, full, metadata or {})
    except BaseException:
        f.close()
        raise
    if metadata:
        entry["metadata"] = metadata
    return f, entry
