"""SWE-ReX's runtime server (``swerex-remote``) as a layer group of its own.

The group holds, below :data:`PREFIX`, everything the server needs and
nothing of the environment's image: this machine's Python interpreter and
standard library (the one running weenv), the installed ``swe-rex`` with every
distribution it requires (copied from this interpreter's ``site-packages``,
byte-compiled), and the shared libraries all of them link against, the C
library and its dynamic loader included.  The server runs through that loader
(``LOADER --library-path PREFIX/lib PYTHON -I -B -m swerex.server``), so it
needs neither Python nor a compatible C library in the task's image; the
commands it starts (``bash`` for a session) are the image's own and use the
image's libraries (``--library-path`` is not inherited, and nothing is put in
the environment's variables).

The group's name carries a key of what went into it (the interpreter's
version and path, each distribution's name and version, this layout's
version): a store that holds it already is not written again.
"""

from __future__ import annotations

import compileall
import hashlib
import importlib.metadata as md
import py_compile
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import Requirement

from weenv.errors import NotFoundError
from weenv.packaging.group import build_group
from weenv.store.base import Store

PREFIX = "/opt/weenv-swerex"
"""Where the group's files appear inside an environment."""
LAYOUT = "1"
"""Version of the group's layout: bumped when what is built below changes."""
ROOT_DIST = "swe-rex"
STDLIB_SKIP = {"site-packages", "test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "__phello__"}
"""Parts of the standard library the server never imports (their size only)."""
_LDD_LINE = re.compile(r"^\s*(?:\S+\s+=>\s+)?(/\S+)\s+\(0x")


@dataclass(frozen=True)
class ServerGroup:
    """What an environment needs to run the server from the group."""

    name: str
    """The group's ref name in the store."""
    argv: list[str]
    """The server's command line without its ``--port``/``--auth-token`` (absolute paths inside the environment)."""


def _stdlib_skip(stdlib: Path):
    """copytree's ``ignore``: :data:`STDLIB_SKIP` and the build's ``config-*`` at the top,
    Tk anywhere, and the optimized byte code (``-O``/``-OO``, never used by the server)."""

    def ignore(where: str, names: list[str]) -> list[str]:
        top = Path(where) == stdlib
        return [
            n
            for n in names
            if (top and (n in STDLIB_SKIP or n.startswith("config-"))) or n.startswith("_tkinter") or ".opt-" in n
        ]

    return ignore


def _python() -> tuple[Path, Path, str]:
    """This interpreter's installation: its binary, its standard library, ``X.Y``."""
    ver = f"{sys.version_info.major}.{sys.version_info.minor}"
    base = Path(sys.base_prefix).resolve()
    binary = base / "bin" / f"python{ver}"
    stdlib = Path(sysconfig.get_paths(vars={"installed_base": str(base), "base": str(base)})["stdlib"])
    if not binary.is_file() or not (stdlib / "os.py").is_file():
        raise NotFoundError(
            f"this Python's installation ({base}) has no {binary.name} or standard library: "
            "the SWE-ReX server group is built from a CPython installed under a prefix"
        )
    return binary, stdlib, ver


def _closure(root: str = ROOT_DIST) -> list[md.Distribution]:
    """``root`` and every distribution it requires (markers evaluated for this
    interpreter; no extras: swe-rex's server needs none), installed here."""
    seen: dict[str, md.Distribution] = {}
    todo = [root]
    while todo:
        name = todo.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in seen:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            raise NotFoundError(
                f"{name!r} is not installed (needed by SWE-ReX's server; pip install 'weenv[swerex]')"
            ) from None
        seen[key] = dist
        for spec in dist.requires or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return sorted(seen.values(), key=lambda d: d.metadata["Name"].lower())


def group_key() -> str:
    """What goes into the group, hashed: its name's suffix."""
    binary, _stdlib, _ver = _python()
    parts = [LAYOUT, PREFIX, sys.version, str(binary)]
    parts += [f"{d.metadata['Name']}=={d.version}" for d in _closure()]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _libraries(files: list[Path]) -> tuple[set[Path], Path]:
    """The shared libraries ``files`` link against (as this machine resolves them) and the dynamic loader."""
    libs: set[Path] = set()
    loader: Path | None = None
    for f in files:
        out = subprocess.run(["ldd", str(f)], capture_output=True, text=True, check=False).stdout
        for line in out.splitlines():
            m = _LDD_LINE.match(line)
            if not m:
                continue
            path = Path(m.group(1))
            if "=>" not in line:
                loader = path
            else:
                libs.add(path)
    if loader is None:
        raise NotFoundError(f"no dynamic loader found for {files[0]} (ldd): a static Python cannot be packed")
    return libs, loader


def stage(dest: Path) -> list[str]:
    """Write the group's tree into ``dest`` (``dest`` + :data:`PREFIX`); return the server's argv."""
    binary, stdlib, ver = _python()
    top = dest / PREFIX.lstrip("/")
    pyroot = top / "python"
    (pyroot / "bin").mkdir(parents=True)
    shutil.copy2(binary, pyroot / "bin" / binary.name)
    lib_py = pyroot / "lib" / f"python{ver}"
    shutil.copytree(stdlib, lib_py, symlinks=True, ignore=_stdlib_skip(stdlib))
    site = lib_py / "site-packages"
    site.mkdir()
    for dist in _closure():
        for rel in dist.files or []:
            src = Path(dist.locate_file(rel))
            if rel.parts[0] == ".." or not src.is_file():
                continue  # scripts outside site-packages (bin/): the server is run as a module
            out = site / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, out)
    # compiled once here: the group is read-only and a start compiling fastapi and pydantic would take seconds
    compileall.compile_dir(site, quiet=1, workers=0, invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
    objects = [binary, *sorted(lib_py.glob("lib-dynload/*.so")), *sorted(site.rglob("*.so"))]
    libs, loader = _libraries(objects)
    libdir = top / "lib"
    libdir.mkdir()
    for lib in libs:
        if not str(lib).startswith(str(site)):  # a wheel's own bundled libraries came with it
            shutil.copy2(lib, libdir / lib.name)
    shutil.copy2(loader, libdir / loader.name)
    return [
        f"{PREFIX}/lib/{loader.name}",
        "--library-path",
        f"{PREFIX}/lib",
        f"{PREFIX}/python/bin/{binary.name}",
        "-I",
        "-B",
        "-m",
        "swerex.server",
    ]


def ensure_group(store: Store, *, workdir: str | Path | None = None) -> ServerGroup:
    """The server group in ``store``, built and published if it is not there
    yet.  Raises :class:`NotFoundError` if ``swe-rex`` (or a distribution it
    needs) is not installed, or this Python cannot be packed."""
    name = f"swerex-server-{group_key()}"
    with tempfile.TemporaryDirectory(dir=workdir, prefix=".weenv-swerex-") as tmp:
        argv = stage(Path(tmp) / "tree") if not _published(store, name) else None
        if argv is not None:
            build_group(
                Path(tmp) / "tree",
                store,
                name=name,
                workdir=tmp,
                source={"type": "swerex-server", "swe-rex": md.version(ROOT_DIST)},
            )
    return ServerGroup(name=name, argv=argv or server_argv())


def server_argv() -> list[str]:
    """The server's argv for a group built from this interpreter (without building it)."""
    binary, _stdlib, _ver = _python()
    _libs, loader = _libraries([binary])
    return [
        f"{PREFIX}/lib/{loader.name}",
        "--library-path",
        f"{PREFIX}/lib",
        f"{PREFIX}/python/bin/{binary.name}",
        "-I",
        "-B",
        "-m",
        "swerex.server",
    ]


def _published(store: Store, name: str) -> bool:
    try:
        store.resolve("groups", name)
    except NotFoundError:
        return False
    return True
