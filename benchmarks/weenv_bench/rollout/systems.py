"""The two systems a rollout runs on, behind one small interface: create an
environment for a task, exec a command in it, destroy it; bytes fetched so
far; the daemon-side processes (for their memory).

- :class:`WeenvSystem`: a weenv daemon (``weenv serve``, started here with its
  own home: empty node cache, an ``oci://`` store on the loopback registry,
  provisioning off so quotas stay what was asked, as Docker's) reached through
  the SDK (:class:`weenv.Sandbox`) over its TCP API with its key, as a trainer
  on another host would.  ``Sandbox.create``, ``commands.run``, ``kill``.
- :class:`DockerSystem`: a private dockerd (:mod:`weenv_bench.services.dockerd`) with
  no image present; ``docker run -d --network none`` with the same CPU, memory
  and pids limits (pulling the image from the same registry when missing),
  ``docker exec`` per command, ``docker rm -f``.

**Exec overhead.**  Every command runs as ``bash -c`` of a wrapper
(:func:`wrap`) that reads bash's ``$EPOCHREALTIME`` just before the command
and, from an ``EXIT`` trap (so an ``exit`` in the command is timed too), just
after it, and prints both on stderr's last line; :func:`unwrap` strips
them.  The command's own run time is their difference; the exec's wall time
(the client's request to its result) minus it is the system's overhead for
that command (the wrapper's own bash start included, the same on both).

**Daemon memory.**  :class:`MemorySampler` sums the resident memory (VmRSS)
of a system's daemon-side processes every ``interval`` seconds and keeps the
peak: weenv's daemon (its FUSE server is a thread of it) and the processes
below it; dockerd, its containerd, the containerd shims and the processes below
them.  Processes inside environments or containers (in a mount namespace of
their own: the commands, their ``runc init``) are left out on both sides;
``runc`` calls of either side count while they run.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from weenv.errors import RuntimeFailedError

MARK = "__weenv_bench_t"


@dataclass(frozen=True)
class ExecResult:
    """One command: exit code, output, wall seconds seen by the client and
    seconds the command itself ran (inside the environment)."""

    exit_code: int
    stdout: str
    stderr: str
    wall_s: float
    inner_s: float

    @property
    def overhead_s(self) -> float:
        return max(0.0, self.wall_s - self.inner_s)


class System(Protocol):
    """What :mod:`weenv_bench.rollout.iteration` needs from a system.

    A system with a task setup (:mod:`weenv_bench.rollout.setup_systems`) also
    has ``setup(env) -> (after, inside)``, called right after ``create``: it
    runs the setup and returns the seconds that took (``after``) and the
    seconds of the create that were setup already (``inside``: a shared state
    built while the create waited), which move from the rollout's create time
    to its setup time."""

    name: str

    def create(self, task: str) -> str:
        """Start an environment of ``task``; return its id."""

    def exec(self, env: str, command: str, timeout: float) -> ExecResult:
        """Run shell ``command`` in ``env``."""

    def destroy(self, env: str) -> None: ...

    def bytes_fetched(self) -> int:
        """Bytes fetched from the registry since the system started."""

    def daemon_pids(self) -> list[int]: ...


def wrap(command: str) -> list[str]:
    """argv running ``command`` in bash with its own run time measured inside."""
    script = (
        f'__t0=$EPOCHREALTIME\ntrap \'printf "\\\\n{MARK} %s %s\\\\n" "$__t0" "$EPOCHREALTIME" >&2\' EXIT\n'
        f"{{ {command}\n}}\n"
    )
    return ["bash", "-c", script]


def unwrap(exit_code: int, stdout: str, stderr: str, wall_s: float) -> ExecResult:
    """The :class:`ExecResult` of a :func:`wrap`-ped command.  Raises
    :class:`RuntimeFailedError` if the timing line is missing (the wrapper did not
    run to its end: the exec itself failed)."""
    head, _sep, last = stderr.rstrip("\n").rpartition("\n")  # the wrapper adds a newline + its line
    parts = last.split()
    if len(parts) != 3 or parts[0] != MARK:
        raise RuntimeFailedError(f"exec failed (exit {exit_code}), no timing line: {stderr[-400:]!r}")
    inner = float(parts[2].replace(",", ".")) - float(parts[1].replace(",", "."))
    return ExecResult(exit_code, stdout, head, wall_s, inner)


def host_side(pids) -> list[int]:
    """The PIDs of ``pids`` in this process's mount namespace (not inside an
    environment or container, which have their own)."""
    own = os.readlink("/proc/self/ns/mnt")
    out = []
    for pid in pids:
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/ns/mnt") == own:
                out.append(pid)
    return out


def descendants(*pids: int) -> list[int]:
    """``pids`` and every process below them (from ``/proc/*/stat`` parent ids)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry))
    out, todo, seen = [], list(pids), set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        out.append(p)
        todo.extend(children.get(p, ()))
    return out


def rss_bytes(pid: int) -> int:
    """Resident bytes of ``pid`` (VmRSS); 0 if it is gone."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class MemorySampler:
    """Peak of the summed VmRSS of ``pids()`` sampled every ``interval`` seconds
    in a thread, between ``__enter__`` and ``__exit__``; ``peak_bytes`` after."""

    def __init__(self, pids, interval: float = 0.5):
        self.pids, self.interval = pids, interval
        self.peak_bytes = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-memory", daemon=True)

    def _sample(self) -> None:
        total = sum(rss_bytes(p) for p in self.pids())
        self.peak_bytes = max(self.peak_bytes, total)
        self.samples += 1

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> MemorySampler:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


# --- weenv -----------------------------------------------------------------------------------
class WeenvSystem:
    """A weenv daemon of its own (home ``home``, store ``store_url``), used through
    the SDK.  ``templates``: task name -> template name.  ``resources``: the limits
    of every environment.  Use as a context manager: the daemon is stopped (by
    its PID) and every environment destroyed on exit."""

    name = "weenv"

    def __init__(
        self,
        home: Path,
        cache: Path,
        store_url: str,
        templates: dict[str, str],
        resources,
        *,
        cache_bytes: int = 8 << 30,
    ):
        from weenv.config import Paths

        self.paths = Paths(home=Path(home), cache=Path(cache), store_url=store_url)
        self.templates, self.resources, self.cache_bytes = templates, resources, cache_bytes
        self._proc: subprocess.Popen | None = None
        self._sandboxes: dict = {}
        self._lock = threading.Lock()
        self._fetched0 = 0

    def __enter__(self) -> WeenvSystem:
        from weenv.server import daemon
        from weenv_bench.services import process

        self.paths.run.mkdir(parents=True, exist_ok=True)
        env = dict(
            os.environ,
            WEENV_HOME=str(self.paths.home),
            WEENV_CACHE=str(self.paths.cache),
            WEENV_STORE=self.paths.store_url,
            WEENV_PROVISION_MODE="off",
            WEENV_CACHE_BYTES=str(self.cache_bytes),
        )
        env.pop("WEENV_API_URL", None)
        env.pop("WEENV_API_KEY", None)
        self._proc = process.spawn(
            [sys.executable, "-m", "weenv", "serve", "--port", "0"], self.paths.daemon_log, env=env
        )
        try:
            process.wait_ready(
                self._proc,
                lambda: self.paths.api_url.exists() and daemon.is_running(self.paths),
                what="weenv daemon",
                log=self.paths.daemon_log,
                timeout=60,
            )
            self.api_url = self.paths.api_url.read_text().strip()
            self.api_key = self.paths.api_key.read_text().strip()
            self._fetched0 = self._stats().cache_bytes_fetched
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        from weenv.server import daemon
        from weenv_bench.services import process

        for env_id in list(self._sandboxes):
            with contextlib.suppress(Exception):
                self.destroy(env_id)
        if self._proc is not None:
            with contextlib.suppress(Exception):
                daemon.stop(self.paths, timeout=60)
            process.stop_process(self._proc, grace=30)
            self._proc = None

    def _stats(self):
        from weenv.server import daemon

        with daemon.connect(self.paths, autostart=False) as client:
            return client.stats()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def create(self, task: str) -> str:
        from weenv.sdk import Sandbox

        sb = Sandbox.create(
            self.templates[task], timeout=3600, resources=self.resources, api_url=self.api_url, api_key=self.api_key
        )
        with self._lock:
            self._sandboxes[sb.id] = sb
        return sb.id

    def exec(self, env: str, command: str, timeout: float) -> ExecResult:
        sb = self._sandboxes[env]
        t0 = time.perf_counter()
        r = sb.commands.run(wrap(command), timeout=timeout)
        wall = time.perf_counter() - t0
        return unwrap(r.exit_code, r.stdout, r.stderr, wall)

    def destroy(self, env: str) -> None:
        with self._lock:
            sb = self._sandboxes.pop(env)
        try:
            sb.kill()
        finally:
            sb.close()

    def bytes_fetched(self) -> int:
        return self._stats().cache_bytes_fetched - self._fetched0

    def daemon_pids(self) -> list[int]:
        return host_side(descendants(self.pid)) if self.pid else []


# --- Docker ----------------------------------------------------------------------------------
class DockerSystem:
    """A started :class:`~weenv_bench.services.dockerd.Dockerd`; ``images``: task name ->
    image reference in the registry; ``image_layers``: reference -> (bytes of the
    manifest + config, {layer digest: compressed bytes}), what a pull downloads."""

    name = "docker"

    def __init__(self, dockerd, images: dict[str, str], image_layers: dict[str, tuple[int, dict[str, int]]], resources):
        self.dockerd, self.images, self.image_layers, self.resources = dockerd, images, image_layers, resources
        self._pulled: set[str] = set()
        self._lock = threading.Lock()

    def _docker(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        from weenv.errors import CommandTimeoutError
        from weenv_bench.services.dockerd import DOCKER

        try:
            return subprocess.run(
                [DOCKER, *args], capture_output=True, text=True, timeout=timeout, env=self.dockerd.env(), check=False
            )
        except subprocess.TimeoutExpired as exc:
            raise CommandTimeoutError(f"docker {args[0]} ran past {timeout} s") from exc

    def create(self, task: str) -> str:
        ref = self.images[task]
        r = self.resources
        p = self._docker(
            "run",
            "-d",
            "--network",
            "none",
            "--cpus",
            f"{r.cpus:g}",
            "--memory",
            str(r.memory_bytes),
            "--pids-limit",
            str(r.pids),
            ref,
            "sleep",
            "infinity",
        )
        if p.returncode != 0:
            raise RuntimeFailedError(f"docker run {ref} failed: {p.stderr[-600:]}")
        with self._lock:
            self._pulled.add(ref)
        return p.stdout.strip()

    def exec(self, env: str, command: str, timeout: float) -> ExecResult:
        t0 = time.perf_counter()
        p = self._docker("exec", env, *wrap(command), timeout=timeout)
        wall = time.perf_counter() - t0
        return unwrap(p.returncode, p.stdout, p.stderr, wall)

    def destroy(self, env: str) -> None:
        p = self._docker("rm", "-f", env, timeout=120)
        if p.returncode != 0:
            raise RuntimeFailedError(f"docker rm -f {env} failed: {p.stderr[-400:]}")

    def bytes_fetched(self) -> int:
        """Manifests + configs of the images pulled, plus each distinct layer once
        (the daemon pulls a layer shared by images once; none was present)."""
        with self._lock:
            pulled = sorted(self._pulled)
        layers: dict[str, int] = {}
        total = 0
        for ref in pulled:
            meta, ly = self.image_layers[ref]
            total += meta
            layers.update(ly)
        return total + sum(layers.values())

    def daemon_pids(self) -> list[int]:
        from weenv_bench.services import process

        roots = {self.dockerd.pid} | set(process.pids_mentioning(str(self.dockerd.root) + "/"))
        return host_side(descendants(*sorted(p for p in roots if p)))
