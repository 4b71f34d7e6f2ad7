"""E2B's build steps (``RUN``, ``COPY``, ``WORKDIR``, ``USER``, ``ENV``): their
model, the build context they carry, and what each does to a tree.

A build is a base (an image or a template) and an ordered list of steps, as the
``e2b`` SDK's ``Template`` sends them (``POST /v2/templates/{id}/builds/{buildID}``,
E2B's ``TemplateStep``: ``type``, ``args``, ``filesHash``, ``force``).  Their
meaning follows E2B's template builder (github.com/e2b-dev/infra,
``packages/orchestrator/pkg/template/build/commands``):

- ``RUN [command, user?]``: ``/bin/sh -c command`` as ``user`` (default: the
  context's), in the context's working dir (unset: the user's home), with the
  context's variables;
- ``COPY [src, dest, owner?, mode?]``: the files uploaded for ``filesHash`` (a tar,
  paths relative to the SDK's context directory); ``src`` up to its first glob
  is what is copied: a file to ``dest`` (into it if ``dest`` ends with ``/``), a
  directory's contents merged into ``dest``; ``dest`` relative to the working
  dir; owned by ``owner`` (``user[:group]``, default the context's user), ``mode``
  octal;
- ``WORKDIR [path]``: the working dir (relative: to the current one, else ``/``),
  created and given to the context's user if missing;
- ``USER [name, sudo?]``: the user, created if the tree lacks it (the next free
  uid from 1000, home ``/home/NAME``, a group of its own); ``sudo`` = ``"true"``
  adds a sudoers rule when the tree has ``/etc/sudoers.d``;
- ``ENV [k1, v1, k2, v2, ...]``: variables, ``$VAR`` / ``${VAR}`` expanded from
  the context's.

:class:`Context` is what the steps carry from one to the next; it depends on
the step list alone (:func:`advance`), so a build whose steps all come from
the cache needs no environment to know it.  Errors: :class:`InvalidInputError`
naming the step.
"""

from __future__ import annotations

import os
import posixpath
import re
import tarfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from weenv.errors import InvalidInputError, NotFoundError
from weenv.host.rootfs import RootFS
from weenv.packaging.fileshash import files_hash
from weenv.packaging.tarscan import scan_file

StepType = Literal["RUN", "COPY", "WORKDIR", "USER", "ENV"]
MAX_STEPS = 1000
"""Steps in one build."""
MAX_ARG_CHARS = 1 << 20
"""Characters of one step's arguments together."""
DEFAULT_USER = "user"
"""E2B's account in every template it builds (uid 1000, home ``/home/user``)."""
FIRST_UID = 1000
MAX_ENV_VALUE_BYTES = 128 << 10
"""UTF-8 bytes of one variable's value once expanded (Linux's ``MAX_ARG_STRLEN``
is 128 KiB per ``KEY=value`` string: a longer one could not reach a command anyway)."""
MAX_ENV_BYTES = 1 << 20
"""UTF-8 bytes of all the context's variables together (``KEY=value`` strings),
bounded as they are expanded: ``ENV A=$A$A`` repeated doubled them per step,
and one step of 250,000 ``$A`` made 125 GB in the daemon."""
MAX_COPY_ENTRIES = 200_000
"""Entries of one COPY's upload."""
MAX_COPY_BYTES = 16 << 30
"""Bytes of one COPY's upload once unpacked (a gzip bomb stops here)."""
_GLOB = re.compile(r"[*?\[{]")
_VAR = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")


class Step(BaseModel):
    """One build step, as E2B's ``TemplateStep``."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True, frozen=True)
    type: StepType
    args: list[str] = Field(default_factory=list)
    files_hash: str | None = Field(default=None, alias="filesHash", pattern=r"^[0-9a-f]{64}$")
    """Lowercase hex sha256 the SDK computed over a COPY's files (their upload's name)."""
    force: bool = False
    """Run this step and every later one even if the cache has them."""

    @field_validator("type", mode="before")
    @classmethod
    def _upper(cls, v):
        return v.upper() if isinstance(v, str) else v

    @field_validator("args")
    @classmethod
    def _bounded(cls, v: list[str]) -> list[str]:
        if sum(len(a) for a in v) > MAX_ARG_CHARS or any("\0" in a for a in v):
            raise ValueError(f"arguments hold NUL bytes or more than {MAX_ARG_CHARS} characters")
        return v

    def check(self) -> Step:
        """``self`` if its arguments fit its type; else :class:`InvalidInputError`."""
        n = len(self.args)
        ok = {
            "RUN": 1 <= n <= 2 and bool(self.args[0].strip()),
            "COPY": 2 <= n <= 4,
            "WORKDIR": n == 1 and bool(self.args[0]),
            "USER": 1 <= n <= 2 and bool(self.args[0]),
            "ENV": n >= 2 and n % 2 == 0,
        }[self.type]
        if not ok:
            raise InvalidInputError(f"{self.type} with arguments {self.args!r}: see E2B's TemplateStep"[:1000])
        if self.type == "ENV":
            bad = next((k for k in self.args[::2] if not k or "=" in k), None)
            if bad is not None:
                raise InvalidInputError(f"ENV variable name {bad[:200]!r}: empty or holding '='")
        if self.type == "COPY":
            if not self.files_hash:
                raise InvalidInputError("COPY needs filesHash (the upload of its files)")
            if len(self.args) == 4 and self.args[3]:
                _mode(self.args[3])
        return self

    def describe(self) -> str:
        """The step as a Dockerfile line (``RUN make``), for logs and errors."""
        if self.type == "ENV":
            pairs = zip(self.args[::2], self.args[1::2])
            return "ENV " + " ".join(f"{k}={v}" for k, v in pairs)
        shown = [a for a in self.args if a]
        return f"{self.type} {' '.join(shown)}"


@dataclass(frozen=True)
class Context:
    """What steps carry: the user name, the working dir (None: the user's
    home, as E2B's), the variables."""

    user: str = "root"
    workdir: str | None = None
    env: dict[str, str] = field(default_factory=dict)


def advance(ctx: Context, step: Step) -> Context:
    """The context after ``step`` (a pure function of the two)."""
    if step.type == "USER":
        return replace(ctx, user=step.args[0])
    if step.type == "WORKDIR":
        return replace(ctx, workdir=workdir_path(ctx, step.args[0]))
    if step.type == "ENV":
        env = dict(ctx.env)
        for k, v in zip(step.args[::2], step.args[1::2]):
            env[k] = expand(v, env)
            if env_bytes(env) > MAX_ENV_BYTES:
                raise InvalidInputError(f"ENV {k[:200]}: the variables would hold more than {MAX_ENV_BYTES} bytes")
        return replace(ctx, env=env)
    return ctx


def check_steps(steps: list[Step], ctx: Context = Context()) -> Context:
    """The context after ``steps`` from ``ctx``, each step's arguments checked
    (:meth:`Step.check`) and its variables expanded within their bounds: a step
    list refused before any build starts.  Raises :class:`InvalidInputError`
    naming the step (1-based)."""
    for i, step in enumerate(steps, 1):
        try:
            ctx = advance(ctx, step.check())
        except InvalidInputError as exc:
            raise InvalidInputError(f"step {i}: {exc}") from None
    return ctx


def env_bytes(env: dict[str, str]) -> int:
    """UTF-8 bytes of ``env`` as ``KEY=value`` strings with their NULs."""
    return sum(
        len(k.encode(errors="surrogateescape")) + len(v.encode(errors="surrogateescape")) + 2 for k, v in env.items()
    )


def workdir_path(ctx: Context, path: str) -> str:
    return posixpath.normpath(posixpath.join(ctx.workdir or "/", path))


def expand(value: str, env: dict[str, str], limit: int = MAX_ENV_VALUE_BYTES) -> str:
    """``$VAR`` and ``${VAR}`` of ``value`` replaced from ``env`` (unset: empty).
    Raises :class:`InvalidInputError` once the result passes ``limit`` UTF-8
    bytes, counted as it is made (never allocated past it)."""
    sizes: dict[str, int] = {}
    pieces: list[str] = []
    size, at = 0, 0
    for m in _VAR.finditer(value):
        name = m.group(1) or m.group(2)
        sub = env.get(name, "")
        if name not in sizes:
            sizes[name] = len(sub.encode(errors="surrogateescape"))
        size += len(value[at : m.start()].encode(errors="surrogateescape")) + sizes[name]
        if size > limit:
            raise InvalidInputError(f"a variable's value would pass {limit} bytes once expanded")
        pieces += [value[at : m.start()], sub]
        at = m.end()
    size += len(value[at:].encode(errors="surrogateescape"))
    if size > limit:
        raise InvalidInputError(f"a variable's value would pass {limit} bytes once expanded")
    return "".join([*pieces, value[at:]])


def _mode(text: str) -> int:
    try:
        mode = int(text, 8)
    except ValueError:
        mode = -1
    if not 0 <= mode <= 0o7777:
        raise InvalidInputError(f"COPY mode {text!r} is not octal permission bits")
    return mode


# --- users ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Account:
    name: str
    uid: int
    gid: int
    home: str

    @property
    def ids(self) -> str:
        return f"{self.uid}:{self.gid}"


ROOT = Account("root", 0, 0, "/root")


def _rows(fs: RootFS, path: str) -> list[list[str]]:
    try:
        text = fs.read_file(path).decode(errors="replace")
    except (NotFoundError, InvalidInputError):
        return []
    return [line.split(":") for line in text.splitlines() if line and not line.startswith("#")]


def find_account(fs: RootFS, user: str) -> Account | None:
    """``user`` (``name``, ``uid``, ``name:group``, ``uid:gid``) looked up in the
    tree's ``/etc/passwd`` and ``/etc/group``; None if the name is unknown (a
    numeric uid is always found, as Docker takes it)."""
    name, _, group = user.partition(":")
    rows = [r for r in _rows(fs, "/etc/passwd") if len(r) >= 7 and r[2].isdigit() and r[3].isdigit()]
    entry = next((r for r in rows if (r[2] if name.isdigit() else r[0]) == name), None)
    if entry is None and not name.isdigit():
        return None
    uid = int(entry[2]) if entry else int(name)
    gid = int(entry[3]) if entry else uid
    home = entry[5] if entry and entry[5] else "/"
    if group:
        if group.isdigit():
            gid = int(group)
        else:
            g = next((r for r in _rows(fs, "/etc/group") if len(r) >= 3 and r[0] == group and r[2].isdigit()), None)
            if g is None:
                raise InvalidInputError(f"group {group!r} is not in the tree's /etc/group")
            gid = int(g[2])
    return Account(entry[0] if entry else name, uid, gid, home)


def create_account(fs: RootFS, name: str, *, sudo: bool = False) -> Account:
    """Add user ``name`` to the tree as ``useradd --create-home`` would: the
    first uid from 1000 that no user holds, a group of the same name and id
    (the next free one if that is taken), home ``/home/NAME`` (0755, with
    ``/etc/skel``), shell bash (sh without it), a locked password.  Raises
    :class:`InvalidInputError` for a name passwd cannot hold."""
    if not re.fullmatch(r"[a-z_][a-z0-9_-]{0,31}\$?", name):
        raise InvalidInputError(f"cannot create user {name!r}: not a valid user name")
    users = _rows(fs, "/etc/passwd")
    groups = _rows(fs, "/etc/group")
    taken_uids = {int(r[2]) for r in users if len(r) > 2 and r[2].isdigit()}
    taken_gids = {int(r[2]) for r in groups if len(r) > 2 and r[2].isdigit()}
    uid = next(i for i in range(FIRST_UID, 1 << 31) if i not in taken_uids)
    gid = uid if uid not in taken_gids else next(i for i in range(FIRST_UID, 1 << 31) if i not in taken_gids)
    home = f"/home/{name}"
    shell = "/bin/bash" if fs.exists("/bin/bash") else "/bin/sh"
    _append(fs, "/etc/passwd", f"{name}:x:{uid}:{gid}::{home}:{shell}\n", 0o644)
    _append(fs, "/etc/group", f"{name}:x:{gid}:\n", 0o644)
    if fs.exists("/etc/shadow"):
        _append(fs, "/etc/shadow", f"{name}:!:19000:0:99999:7:::\n", 0o640)
    fs.make_dir("/home", 0o755)
    fs.make_dir(home, 0o755, owner=(uid, gid))
    fd = fs.open_dir(home)
    try:
        os.chmod(f"/proc/self/fd/{fd}", 0o755)
        os.chown(f"/proc/self/fd/{fd}", uid, gid)
    finally:
        os.close(fd)
    if fs.exists("/etc/skel"):
        _copy_skel(fs, home, uid, gid)
    if sudo and fs.exists("/etc/sudoers.d"):
        fs.write_file(f"/etc/sudoers.d/{name}", f"{name} ALL=(ALL:ALL) NOPASSWD: ALL\n".encode(), 0o440)
    return Account(name, uid, gid, home)


def _append(fs: RootFS, path: str, line: str, mode: int) -> None:
    try:
        data = fs.read_file(path)
    except NotFoundError:
        data = b""
    if data and not data.endswith(b"\n"):
        data += b"\n"
    fs.write_file(path, data + line.encode(), mode)


def _copy_skel(fs: RootFS, home: str, uid: int, gid: int) -> None:
    for entry in fs.list_dir("/etc/skel"):
        if entry.type == "file" and not fs.exists(f"{home}/{entry.name}"):
            fs.write_file(f"{home}/{entry.name}", fs.read_file(f"/etc/skel/{entry.name}"), 0o644, owner=(uid, gid))


def make_workdir(fs: RootFS, path: str, owner: Account) -> bool:
    """Create directory ``path`` (and missing parents) owned by ``owner``, as
    E2B's WORKDIR does; False if it already existed (the tree is unchanged)."""
    if fs.exists(path):
        return False
    fs.make_dir(path, 0o755, owner=(owner.uid, owner.gid))
    return True


# --- COPY ---------------------------------------------------------------------------------
def copy_source(src: str) -> str:
    """The part of a COPY source before its first glob (E2B copies that whole
    path; the SDK uploaded only the matching files), relative, normalized."""
    parts = []
    for part in src.strip("/").split("/"):
        if _GLOB.search(part):
            break
        parts.append(part)
    path = posixpath.normpath("/".join(parts) or ".")
    if path.startswith(".."):
        raise InvalidInputError(f"COPY source {src!r} leaves the build context")
    return path


def unpack_upload(upload: Path, dest: Path, step: Step | None = None) -> None:
    """Extract the COPY upload ``upload`` (a tar, gzip-compressed or not) into the
    empty directory ``dest``, refusing absolute or ``..`` paths, links out of
    it, devices, more than :data:`MAX_COPY_ENTRIES` entries or
    :data:`MAX_COPY_BYTES` bytes, and the headers :mod:`~weenv.packaging.tarscan`
    refuses (checked before :mod:`tarfile` reads any).  With ``step`` (a COPY),
    the upload must also be the files whose ``filesHash`` the step carries
    (:func:`~weenv.packaging.fileshash.files_hash`).  Raises
    :class:`InvalidInputError` (:class:`UploadMismatchError` for the hash)."""
    gzip = scan_file(upload, max_entries=MAX_COPY_ENTRIES, max_bytes=MAX_COPY_BYTES)
    try:
        with tarfile.open(upload, "r:gz" if gzip else "r:") as tar:
            members = tar.getmembers()
            if step is not None:
                got = files_hash(tar, members, step.args[0], step.args[1], max_bytes=MAX_COPY_BYTES)
                if got != step.files_hash:
                    raise UploadMismatchError(
                        f"the upload of filesHash {step.files_hash} is not the files of COPY {step.args[0]} "
                        f"{step.args[1]} (they hash to {got}; it was removed: build again to upload it anew)"
                    )
            tar.extractall(dest, members=members, filter=_upload_filter)
    except tarfile.FilterError as exc:
        raise InvalidInputError(f"the COPY upload leaves its directory: {exc}") from exc
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise InvalidInputError(f"the COPY upload is not a readable tar: {exc}") from exc


class UploadMismatchError(InvalidInputError):
    """A COPY upload is not the files its ``filesHash`` names."""


def _upload_filter(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo:
    """PEP 706's ``data`` checks (no absolute or ``..`` names, nor names that
    resolve out of ``dest`` through a link already extracted; no hard link to
    an absolute path or out of ``dest``; no devices; it raises
    :class:`tarfile.FilterError`), symbolic links kept whatever their target
    (they are resolved inside the environment), with members' own permission bits kept:
    a COPY keeps modes, and owners are set by :func:`copy_archive`.  The
    ``tar`` filter alone let a hard link to ``/etc/shadow`` be linked into the
    stage and written through as root."""
    if member.issym():  # its target is resolved by the environment's root (copy_archive), any target is fine;
        return tarfile.tar_filter(member, dest)  # its own name (realpath: through links too) stays inside
    checked = tarfile.data_filter(member, dest)
    if member.isreg() or member.isdir():
        checked = checked.replace(mode=member.mode & 0o7777, deep=False)
    return checked


def _inside(stage: Path, entry: Path, what: str) -> None:
    """Refuse ``entry`` unless it, every symbolic link on the way resolved,
    stays inside ``stage`` (:class:`InvalidInputError`)."""
    real_stage, real = os.path.realpath(stage), os.path.realpath(entry)
    if real != real_stage and not real.startswith(real_stage + os.sep):
        raise InvalidInputError(f"COPY {what}: the path goes through a symbolic link out of the upload")


def copy_archive(stage: Path, step: Step, ctx: Context, owner: Account, home: str, out: Path) -> str:
    """Write to ``out`` the tar that places the unpacked upload ``stage`` as
    ``step`` (a COPY) says (entries owned by ``owner``, ``mode`` applied);
    return the directory of the tree it is to be extracted into.  Extracting
    it *inside* the environment, with ``--no-overwrite-dir``, keeps the
    metadata of directories already there, and a symbolic link in the tree is
    resolved by the environment's own root, never the host's."""
    src_rel = copy_source(step.args[0])
    dest = step.args[1]
    mode = _mode(step.args[3]) if len(step.args) > 3 and step.args[3] else None
    target = dest if dest.startswith("/") else posixpath.join(ctx.workdir or home or "/", dest)
    entry = stage / src_rel
    _inside(stage, entry.parent, step.args[0])  # a link on the way (``l -> /``, then ``l/etc/shadow``)
    if not (entry.exists() or entry.is_symlink()):
        raise InvalidInputError(f"COPY {step.args[0]}: the upload holds no {src_rel!r}")

    def owned(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid, info.gid, info.uname, info.gname = owner.uid, owner.gid, "", ""
        if mode is not None and not info.issym():
            info.mode = mode
        return info

    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
        if entry.is_dir() and not entry.is_symlink():
            for path in sorted(_walk(entry)):
                tar.add(path, arcname=str(path.relative_to(entry)), recursive=False, filter=owned)
            return posixpath.normpath(target)
        into = target.endswith("/")
        norm = posixpath.normpath(target)
        tar.add(entry, arcname=entry.name if into else posixpath.basename(norm), recursive=False, filter=owned)
        return norm if into else (posixpath.dirname(norm) or "/")


def _walk(top: Path):
    for dirpath, dirnames, filenames in os.walk(top):  # followlinks=False: links inside are added as links
        for n in dirnames + filenames:
            yield Path(dirpath) / n
