"""The node's OCI runtime: crun or runc behind one interface (Linux only).

Both read the same OCI bundle and take the same command line (``--root``,
``create``/``run --detach --bundle --pid-file``, ``start``, ``state``, ``list
--format json``, ``kill --all``, ``delete --force``, ``exec --detach
--pid-file --process``): :class:`weenv.node.runtime.runc.Runc` drives runc and
:class:`Crun` is that class with crun's name, version line and messages.
crun is written in C: a ``crun run`` costs ~10 ms of CPU where ``runc run``
and the ``runc init`` it starts (two Go runtimes) cost ~29 ms.

Which one runs, setting ``WEENV_RUNTIME`` (:func:`runtime_setting`):

- ``auto`` (the default): crun where it runs (:func:`crun_refusal` says why
  not), else runc with a one-line warning at node start;
- ``crun``: crun, or the node refuses to start, in one line saying why;
- ``runc``: runc.

Each runtime keeps its containers' state in a root of its own
(``run/runc``, ``run/crun``), and each bundle records the runtime that made
its container (:data:`RUNTIME_FILE`): :class:`NodeRuntime` makes new
containers with the chosen runtime and sends every later command on a
container to the runtime that holds it, so a node restarted with another
runtime adopts the running containers through the one that made them.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import stat
import subprocess
import time
from pathlib import Path
from typing import Any

from weenv.config import settings
from weenv.errors import InvalidInputError, ToolMissingError
from weenv.node.cgroups import CGROUP_ROOT, detect
from weenv.node.runtime.runc import EXEC_FIFO, Runc

log = logging.getLogger(__name__)

RUNTIMES = ("auto", "crun", "runc")
"""The values of the runtime setting."""
DEFAULT_RUNTIME = "auto"
"""The runtime setting when ``WEENV_RUNTIME`` is not set."""
RUNTIME_FILE = "runtime"
"""In a bundle: the name of the runtime that made its container (``crun`` or ``runc``)."""


class Crun(Runc):
    """crun with its state in ``root`` (``crun --root``): :class:`Runc`'s
    commands, which crun takes as they are.  crun is started from its file
    (no sealed copy: that is runc's own start-up cost); a created container
    is started here through its exec FIFO as ``crun start`` does
    (:meth:`_start_through_fifo`), saving a process start."""

    name = "crun"
    fifo_version = (1, 8)
    sealed = False

    def _start_through_fifo(self, container_id: str, timeout: float) -> bool:
        """crun 1.8's start of a created container: its first process waits
        reading ``ROOT/ID/exec.fifo``; ``crun start`` writes one byte to it and
        removes it (crun then says ``running``; ``libcrun_container_start``,
        which also runs poststart hooks and waits on a notify socket: weenv's
        bundles have neither).  True if done so; False when no process reads
        the FIFO (then ``crun start`` answers)."""
        path = self.root / container_id / EXEC_FIFO
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # ENXIO: no reader
        except OSError:
            return False
        try:
            started = stat.S_ISFIFO(os.fstat(fd).st_mode) and os.write(fd, b"0") == 1
        except OSError:
            started = False
        os.close(fd)
        if started:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        return started

    def status_file(self, container_id: str) -> dict[str, Any]:
        """crun's record of a container (``ROOT/ID/status``: ``bundle``,
        ``cgroup-path``, ``pid``...), {} if there is none."""
        try:
            return json.loads((self.root / container_id / "status").read_text())
        except (OSError, ValueError):
            return {}

    def _exec_argv(
        self,
        container_id: str,
        argv,
        env: dict[str, str] | None,
        cwd: str | None,
        user: str | None,
        process: dict | None,
        tmp: Path,
    ) -> list[str]:
        """As :meth:`Runc._exec_argv`, but a command without its own
        ``process`` gets the container's first process (its bundle's
        ``config.json``) with ``env`` overriding its variables by name: crun
        1.8's ``exec`` flags do not start from it as runc's do (without
        ``--user`` it runs as uid 0, without ``--cwd`` in ``/``, with
        ``--env`` only those variables, and without ``noNewPrivileges``)."""
        if process is None:
            bundle = self.status_file(container_id).get("bundle")
            try:
                process = json.loads((Path(bundle) / "config.json").read_text())["process"] if bundle else None
            except (OSError, ValueError, KeyError):
                process = None
            if process is not None and env is not None:
                merged = dict(e.partition("=")[::2] for e in process.get("env", []))
                env = {**merged, **env}
        return super()._exec_argv(container_id, argv, env, cwd, user, process, tmp)

    def delete(self, container_id: str, force: bool = True, *, bundle: Path | None = None) -> None:
        """:meth:`Runc.delete`, then the container's cgroup directories crun
        left (crun 1.8 on v1 hierarchies gives up on a directory whose last
        process has not quite exited yet) are removed, waiting up to 2 s for
        them to empty."""
        cgroup = self.status_file(container_id).get("cgroup-path")
        super().delete(container_id, force, bundle=bundle)
        if cgroup:
            remove_cgroup_dirs(cgroup)

    @staticmethod
    def is_missing(msg: str) -> bool:
        # crun: "error opening file `ROOT/ID/status`: No such file or directory"
        return "/status`: No such file or directory" in msg or "does not exist" in msg


def remove_cgroup_dirs(path: str, *, wait_s: float = 2.0) -> None:
    """rmdir cgroup ``path`` (e.g. ``/weenv-ID``) in every hierarchy that has
    it, retrying while it is busy (its processes are still exiting) for up to
    ``wait_s`` seconds; a directory still busy then is left, with a warning."""
    layout = detect()
    dirs = [Path(f"{m}/{path.lstrip('/')}") for m in {*layout.v1.values(), *([layout.v2] if layout.v2 else [])}]
    dirs = [d for d in dirs if d.is_dir()]
    deadline = time.monotonic() + wait_s
    while dirs:
        busy = []
        for d in dirs:
            try:
                d.rmdir()
            except FileNotFoundError:
                pass
            except OSError as exc:
                if exc.errno != errno.EBUSY:
                    log.warning("cannot remove cgroup %s: %s", d, exc)
                    continue
                busy.append(d)
        dirs = busy
        if dirs and time.monotonic() >= deadline:
            log.warning("cgroup %s still busy after %s s: left", ", ".join(map(str, dirs)), wait_s)
            return
        if dirs:
            time.sleep(0.005)


KINDS: dict[str, type[Runc]] = {"runc": Runc, "crun": Crun}


def runtime_setting(value: str | None = None) -> str:
    """``value``, else ``WEENV_RUNTIME``, else :data:`DEFAULT_RUNTIME`; one of
    :data:`RUNTIMES`.  Raises :class:`InvalidInputError` for another value."""
    if value is None:
        value = settings().runtime.name
    if value not in RUNTIMES:
        raise InvalidInputError(f"WEENV_RUNTIME={value!r}: want one of {', '.join(RUNTIMES)}")
    return value


def hybrid_v2_controllers(mountinfo: Path = Path("/proc/self/mountinfo")) -> list[str]:
    """On a hybrid cgroup host (v1 hierarchies, and a cgroup2 hierarchy
    mounted elsewhere than ``/sys/fs/cgroup``), the controllers that cgroup2
    hierarchy holds; [] on a pure v1 or pure v2 host."""
    layout = detect(mountinfo)
    if layout.v2 is None or str(layout.v2) == CGROUP_ROOT or not layout.v1:
        return []
    try:
        return (layout.v2 / "cgroup.controllers").read_text().split()
    except OSError:
        return []


def crun_refusal(binary: str = "crun") -> str | None:
    """Why crun cannot run containers on this host (one line), None if it can:
    no such binary, a binary that does not answer ``--version`` as crun, or
    a hybrid cgroup layout whose v2 hierarchy holds controllers (crun 1.x:
    "cgroups in hybrid mode not supported, drop all controllers from
    cgroupv2")."""
    path = shutil.which(binary)
    if path is None:
        return f"no {binary!r} on PATH (Debian: apt-get install crun)"
    try:
        proc = subprocess.run([path, "--version"], stdin=subprocess.DEVNULL, capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{path} --version failed: {exc}"
    first = proc.stdout.decode(errors="replace").partition("\n")[0]
    if proc.returncode != 0 or not first.startswith("crun version"):
        return f"{path} --version did not answer as crun (exit status {proc.returncode}: {first[:100]!r})"
    held = hybrid_v2_controllers()
    if held:
        return (
            f"the cgroups are hybrid and the v2 hierarchy holds {', '.join(held)}, which crun refuses "
            f"(scripts/setup.sh binds them to v1 hierarchies)"
        )
    return None


def choose_runtime(setting: str, *, crun_binary: str = "crun") -> tuple[str, str | None]:
    """(the runtime to run, why crun does not run or None) for the runtime
    ``setting``.  Raises :class:`ToolMissingError` when the setting is
    ``crun`` and crun cannot run here."""
    setting = runtime_setting(setting)
    if setting == "runc":
        return "runc", None
    why = crun_refusal(crun_binary)
    if why is None:
        return "crun", None
    if setting == "crun":
        raise ToolMissingError(f"WEENV_RUNTIME=crun but crun cannot run here: {why}")
    return "runc", why


class NodeRuntime:
    """The node's OCI runtime: new containers are made by :attr:`chosen`, and
    a command on an existing container goes to the runtime whose root holds
    it (:meth:`of`).  ``roots``: runtime name -> its state root;
    ``binaries``: runtime name -> its executable (default: its name)."""

    def __init__(
        self,
        chosen: str,
        roots: dict[str, Path],
        binaries: dict[str, str] | None = None,
        *,
        command_timeout: float = 60.0,
    ):
        if chosen not in KINDS:
            raise InvalidInputError(f"unknown OCI runtime {chosen!r}: want one of {', '.join(KINDS)}")
        binaries = binaries or {}
        self.runtimes: dict[str, Runc] = {
            name: KINDS[name](roots[name], binaries.get(name), command_timeout=command_timeout) for name in KINDS
        }
        self.chosen = self.runtimes[chosen]

    @classmethod
    def for_setting(cls, setting: str | None, roots: dict[str, Path], *, crun_binary: str = "crun") -> NodeRuntime:
        """The node's runtime for ``setting`` (None: ``WEENV_RUNTIME``), chosen
        once (:func:`choose_runtime`) and said in the log: a warning when
        ``auto`` falls back to runc."""
        setting = runtime_setting(setting)
        name, why = choose_runtime(setting, crun_binary=crun_binary)
        if why is not None:
            log.warning("OCI runtime: runc (crun cannot run here: %s)", why)
        else:
            log.info("OCI runtime: %s (setting %s)", name, setting)
        return cls(name, roots, {"crun": crun_binary})

    @property
    def name(self) -> str:
        """The name of the runtime that makes new containers."""
        return self.chosen.name

    @property
    def command_timeout(self) -> float:
        """Seconds after which a control command of the chosen runtime counts as hung."""
        return self.chosen.command_timeout

    @command_timeout.setter
    def command_timeout(self, seconds: float) -> None:
        self.chosen.command_timeout = seconds

    @property
    def binary(self) -> str:
        """The chosen runtime's executable; setting it runs another from the next call on."""
        return self.chosen.binary

    @binary.setter
    def binary(self, binary: str) -> None:
        self.chosen.binary = binary

    def of(self, container_id: str) -> Runc:
        """The runtime holding container ``container_id`` (its state directory
        is in that runtime's root), else the chosen one."""
        for r in self.runtimes.values():
            if r is not self.chosen and (r.root / container_id).is_dir():
                return r
        return self.chosen

    # --- making containers: the chosen runtime, recorded in the bundle ------------------
    def create(self, container_id: str, bundle: Path, *, stdin: int | None = None) -> None:
        _record(bundle, self.chosen.name)
        self.chosen.create(container_id, bundle, stdin=stdin)

    def run_detached(self, container_id: str, bundle: Path, *, stdin: int | None = None) -> None:
        _record(bundle, self.chosen.name)
        self.chosen.run_detached(container_id, bundle, stdin=stdin)

    # --- commands on a container: the runtime that made it -------------------------------
    def start(self, container_id: str, *, timeout: float | None = None) -> None:
        self.of(container_id).start(container_id, timeout=timeout)

    def state(self, container_id: str) -> dict[str, Any] | None:
        return self.of(container_id).state(container_id)

    def kill(self, container_id: str, signal: str = "KILL", all: bool = True) -> None:
        self.of(container_id).kill(container_id, signal, all)

    def delete(self, container_id: str, force: bool = True, *, bundle: Path | None = None) -> None:
        self.of(container_id).delete(container_id, force, bundle=bundle)

    def stop(self, container_id: str, bundle: Path, *, timeout: float = 1.0) -> bool:
        return self.of(container_id).stop(container_id, bundle, timeout=timeout)

    def exec(self, container_id: str, argv, **kw):
        return self.of(container_id).exec(container_id, argv, **kw)

    def spawn(self, container_id: str, argv, **kw):
        return self.of(container_id).spawn(container_id, argv, **kw)

    def list(self) -> list[dict[str, Any]]:
        """Every container of every runtime (a runtime whose binary is missing
        holds none), each state with ``"runtime"``: the name of its runtime."""
        found = []
        for name, r in self.runtimes.items():
            if r is not self.chosen and not (r.root.is_dir() and any(r.root.iterdir())):
                continue  # nothing made by it: no process started to ask
            try:
                found += [{**s, "runtime": name} for s in r.list()]
            except ToolMissingError as exc:
                log.warning("cannot list the containers of %s: %s", name, exc)
        return found

    def close(self) -> None:
        for r in self.runtimes.values():
            r.close()


def _record(bundle: Path, name: str) -> None:
    """Record in ``bundle`` that runtime ``name`` makes its container; a bundle
    already recording it is not written again (a resume on a full disk then
    fails with the runtime's own words, not on this file)."""
    if recorded_runtime(bundle) != name:
        (Path(bundle) / RUNTIME_FILE).write_text(name)


def recorded_runtime(bundle: Path) -> str | None:
    """The runtime a bundle records having made its container, None if none."""
    try:
        return (Path(bundle) / RUNTIME_FILE).read_text().strip() or None
    except OSError:
        return None
