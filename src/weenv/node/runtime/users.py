"""The users of an environment: names, uids, groups and homes from its own
``/etc/passwd`` and ``/etc/group``.

A command or file call names a user (``"root"``, ``"user"``, or numeric
``"UID"`` / ``"UID:GID"``); :func:`lookup` turns it into an :class:`Identity`
(uid, primary gid, supplementary groups, home, name) as ``getpwnam(3)`` and
``initgroups(3)`` would inside the environment:

- a name must be in ``/etc/passwd`` (else :class:`UnknownUserError`);
- ``UID`` takes its name, home and gid from the first passwd entry with that
  uid, if any (else gid = uid, as weenv's ``RuntimeConfig.user`` does, home
  ``/``); ``UID:GID`` keeps its gid;
- supplementary groups: the primary gid, then every group of ``/etc/group``
  whose member list names the user (file order, no repeats).

The files are read through the environment's confined root
(:class:`weenv.host.rootfs.RootFS`: symbolic links resolve inside it, never to
the host's files), each at most :data:`MAX_FILE_BYTES` (a bigger one is
:class:`InvalidInputError` before it is read whole); lines past
:data:`MAX_LINE` bytes and malformed lines are skipped, as glibc's ``files``
backend skips what it cannot parse.  A missing file counts as empty.
:class:`Users` keeps the parsed files per environment until either changes
(size, mtime, inode).
"""

from __future__ import annotations

import os
import re
import threading
from dataclasses import dataclass

from weenv.errors import InvalidInputError, NotFoundError, UnknownUserError
from weenv.host.rootfs import RootFS

PASSWD, GROUP = "/etc/passwd", "/etc/group"
MAX_FILE_BYTES = 8 << 20
"""Largest ``/etc/passwd`` or ``/etc/group`` read (bytes)."""
MAX_LINE = 64 << 10
"""Longest line kept (bytes); longer ones are skipped."""
MAX_GROUPS = 1024
"""Most supplementary groups of one user (Linux allows 65536; ``setgroups(2)`` of more is refused here)."""
MAX_ID = 2**32 - 2
"""Largest uid or gid (``(uid_t) -1`` is "no change" to the kernel)."""
MAX_NAME = 256
"""Longest user name accepted in a request (bytes)."""
_NUMERIC = re.compile(r"(\d{1,10})(?::(\d{1,10}))?\Z")


@dataclass(frozen=True)
class Identity:
    """Who a command runs as, or who owns what a file call writes."""

    uid: int
    gid: int
    groups: tuple[int, ...]
    """Supplementary groups (the primary gid first)."""
    home: str
    """Absolute home directory (``/`` when the user has no passwd entry)."""
    name: str | None
    """The passwd name; None for a numeric uid without an entry."""

    @property
    def spec(self) -> str:
        """``"UID:GID"`` (runc's ``--user``)."""
        return f"{self.uid}:{self.gid}"

    def env(self) -> dict[str, str]:
        """``HOME``, ``USER`` and ``LOGNAME`` for its commands (as envd sets them)."""
        out = {"HOME": self.home}
        if self.name:
            out["USER"] = out["LOGNAME"] = self.name
        return out


@dataclass(frozen=True)
class _Db:
    by_name: dict[str, tuple[int, int, str]]
    """name -> (uid, gid, home), first entry wins."""
    by_uid: dict[int, tuple[str, int, str]]
    """uid -> (name, gid, home), first entry wins."""
    members: dict[str, tuple[int, ...]]
    """user name -> gids of the groups listing it, in file order."""


def check_name(user: str) -> str:
    """``user`` if it can name a user (non-empty, at most :data:`MAX_NAME`
    bytes, no ``:``, NUL, newline or ``/``); else :class:`InvalidInputError`."""
    if not isinstance(user, str) or not user or len(user.encode(errors="surrogateescape")) > MAX_NAME:
        raise InvalidInputError(f"bad user {str(user)[:80]!r}: want a name of 1 to {MAX_NAME} bytes or 'UID[:GID]'")
    if any(c in user for c in ":\0\n/") and not _NUMERIC.match(user):
        raise InvalidInputError(
            f"bad user {user[:80]!r}: want a name without ':', '/' or control bytes, or 'UID[:GID]'"
        )
    return user


def _read(fs: RootFS, path: str) -> str:
    try:
        f = fs.open_read(path)
    except NotFoundError:
        return ""
    with f:
        size = os.fstat(f.fileno()).st_size
        if size > MAX_FILE_BYTES:
            raise InvalidInputError(f"the environment's {path} is {size} bytes (at most {MAX_FILE_BYTES} are read)")
        data = f.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:  # grew meanwhile
        raise InvalidInputError(f"the environment's {path} is larger than {MAX_FILE_BYTES} bytes")
    return data.decode("utf-8", "surrogateescape")


def _id(text: str) -> int | None:
    if not text.isdigit() or len(text) > 10:
        return None
    value = int(text)
    return value if value <= MAX_ID else None


def parse(passwd: str, group: str) -> _Db:
    """The lookup tables of the texts of ``/etc/passwd`` and ``/etc/group``."""
    by_name: dict[str, tuple[int, int, str]] = {}
    by_uid: dict[int, tuple[str, int, str]] = {}
    for line in passwd.splitlines():
        if len(line) > MAX_LINE or line.startswith(("#", "+", "-")):
            continue
        parts = line.split(":")
        if len(parts) < 7 or not parts[0]:
            continue
        uid, gid = _id(parts[2]), _id(parts[3])
        if uid is None or gid is None:
            continue
        home = parts[5] if parts[5].startswith("/") else "/"
        by_name.setdefault(parts[0], (uid, gid, home))
        by_uid.setdefault(uid, (parts[0], gid, home))
    members: dict[str, list[int]] = {}
    for line in group.splitlines():
        if len(line) > MAX_LINE or line.startswith(("#", "+", "-")):
            continue
        parts = line.split(":")
        if len(parts) < 4 or (gid := _id(parts[2])) is None:
            continue
        for member in filter(None, parts[3].split(",")):
            gids = members.setdefault(member.strip(), [])
            if gid not in gids:
                gids.append(gid)
    return _Db(by_name, by_uid, {k: tuple(v) for k, v in members.items()})


def resolve(db: _Db, user: str) -> Identity:
    """``user`` (a name or ``UID[:GID]``) in ``db``; :class:`UnknownUserError`
    for a name it lacks, :class:`InvalidInputError` for a bad one."""
    check_name(user)
    m = _NUMERIC.match(user)
    if m:
        uid = int(m.group(1))
        gid = int(m.group(2)) if m.group(2) is not None else None
        if uid > MAX_ID or (gid is not None and gid > MAX_ID):
            raise InvalidInputError(f"bad user {user!r}: ids are at most {MAX_ID}")
        name, entry_gid, home = db.by_uid.get(uid, (None, uid, "/"))
        gid = entry_gid if gid is None else gid
    else:
        if user not in db.by_name:
            raise UnknownUserError(f"unknown user {user!r}: the environment's /etc/passwd has no such user")
        name = user
        uid, gid, home = db.by_name[user]
    groups = [gid]
    for g in db.members.get(name, ()) if name else ():
        if g not in groups:
            groups.append(g)
    if len(groups) > MAX_GROUPS:
        raise InvalidInputError(f"user {user!r} is in {len(groups)} groups (at most {MAX_GROUPS})")
    return Identity(uid=uid, gid=gid, groups=tuple(groups), home=home, name=name)


def _stamp(fs: RootFS, path: str) -> tuple[int, int, int, int] | None:
    """What tells a change of the file at ``path``: (device, inode, size, mtime ns)."""
    try:
        with fs._open(path, os.O_PATH) as fd:  # noqa: SLF001 - one stat, resolved inside the root
            s = os.fstat(fd)
    except (NotFoundError, InvalidInputError):
        return None
    return (s.st_dev, s.st_ino, s.st_size, s.st_mtime_ns)


class Users:
    """:func:`lookup` with the parsed files kept per root until they change.  Thread-safe."""

    MAX_ROOTS = 4096

    def __init__(self) -> None:
        self._dbs: dict[str, tuple[tuple, _Db]] = {}
        self._lock = threading.Lock()

    def lookup(self, fs: RootFS, user: str) -> Identity:
        """``user`` inside the tree of ``fs`` (see the module docstring)."""
        check_name(user)
        stamp = (_stamp(fs, PASSWD), _stamp(fs, GROUP))
        key = os.fspath(fs.root)
        with self._lock:
            cached = self._dbs.get(key)
        if cached is None or cached[0] != stamp:
            db = parse(_read(fs, PASSWD), _read(fs, GROUP))
            with self._lock:
                if len(self._dbs) >= self.MAX_ROOTS:
                    self._dbs.clear()
                self._dbs[key] = (stamp, db)
        else:
            db = cached[1]
        return resolve(db, user)

    def forget(self, fs: RootFS) -> None:
        """Drop what is kept for the tree of ``fs`` (its environment is gone)."""
        with self._lock:
            self._dbs.pop(os.fspath(fs.root), None)


def lookup(fs: RootFS, user: str) -> Identity:
    """``user`` inside the tree of ``fs``, read now (see the module docstring)."""
    return resolve(parse(_read(fs, PASSWD), _read(fs, GROUP)), user)
