"""The node: every environment on one machine, and the shared data path under them.

A :class:`Node` owns, for one ``WEENV_HOME``:

- the node chunk cache (:class:`~weenv.node.cache.ChunkCache`), filled from the store;
- the lazy FUSE file system (:class:`~weenv.node.lazyfs.LazyFS`) that shows each
  group image as one file whose reads fetch missing chunks on demand;
- one shared read-only EROFS mount per group (:class:`~weenv.node.groups.GroupMounts`);
- the environments' disk (:mod:`weenv.node.disk`): a btrfs file system of its
  own holding every environment's directory, each upper dir a subvolume with
  a quota (its declared ``disk_bytes``);
- per environment: an overlay rootfs with a private upper dir, an OCI bundle,
  a runc container in its own namespaces and cgroup, and an exec agent inside
  it (:mod:`weenv.node.agent`) that starts commands without a ``runc exec`` each;
- the warm pool (:mod:`weenv.node.pool`): environments of recently repeated
  creates made ahead up to ``runc create``, which a matching create only starts.

State needed after a restart lives on disk and in the kernel: ``env.json``,
runc's state, the overlay and group mounts, the cgroups; the lazy file
system's connection is kept by the FUSE holder (:mod:`weenv.node.fuse.holder`).
A node started on a home whose previous node process was killed adopts its
running environments (:meth:`Node.start`).

Methods are blocking and thread-safe; the daemon calls them from worker threads.
Create and destroy undo every step on failure: no mount, cgroup, process or
directory of a failed environment remains.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import secrets
import shutil
import subprocess
import threading
import time
from concurrent.futures import Future, TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from weenv.config import PRIVATE_MODE, Paths, private_dir
from weenv.errors import (
    BrokenError,
    BusyError,
    CapacityError,
    ClosedError,
    CommandTimeoutError,
    InvalidInputError,
    MountError,
    NotFoundError,
    OutputLimitError,
    RuntimeFailedError,
    StoreUnavailableError,
)
from weenv.node.agent import AgentBinary, AgentUnavailable, listen as agent_listen, spawn as agent_spawn
from weenv.node import mounts, network
from weenv.node.bundle import RUNC_DEFAULT_CAPS, write_bundle
from weenv.node.cache import ChunkCache
from weenv.node.cgroups import open_cgroups
from weenv.node.disk import NodeDisk
from weenv.node.groups import GroupMounts, clear_stale
from weenv.node.lazyfs import LazyFS
from weenv.node.manifests import KnownNames, NodeManifests
from weenv.node.pool import PoolKey, Pooled, WarmPool, pool_size_from_env
from weenv.node.prefetch import PACK_BYTES, Prefetcher
from weenv.node.models import (
    DEFAULT_TIMEOUT_S,
    MAX_TIMEOUT_S,
    CreateTiming,
    EnvironmentInfo,
    ExecResult,
    NodeStats,
    ProcessInfo,
    TemplateInfo,
)
from weenv.node.process import DEFAULT_RETAIN, PipeSink, Process, Spawned
from weenv.node.rootfs import RootFS
from weenv.node.runc import Runc, exec_args
from weenv.node.provision import ProvisionConfig, Provisioner, ProvisionStats  # issue 5
from weenv.packaging.buildcache import store_lock
from weenv.packaging.group import load_group
from weenv.packaging.manifest import GroupManifest, Resources, TemplateManifest
from weenv.packaging.template import load_template
from weenv.store import Store, open_store

log = logging.getLogger(__name__)

CONTAINER_PREFIX = "weenv-"
AGENT_SOCKET = "agent.sock"
"""The exec agent's listening socket, in the environment's directory (outside its rootfs)."""
UNDELIVERED = "undelivered"
"""A file in an environment's directory while the answer naming it has not
reached its client (:meth:`Node.create` ``undelivered``); recovery removes such
an environment."""
INIT = Path("/usr/bin/tini-static")
"""The environment's pid 1 (Debian's ``tini``): it reaps orphans, so killed and
backgrounded processes do not pile up as zombies against the pids limit."""


POOLED_START_TIMEOUT_S = 2.0
"""Seconds a create gives ``runc start`` of a pooled environment before making its own."""

RESOLVE_WAIT_S = 1.0
"""Seconds from the start of a store's lookup of a template name after which a
create that is otherwise ready starts the name's last known digest (see :meth:`Node._resolve`)."""


class _Environment:
    """What the node keeps of one running environment."""

    def __init__(self, info: EnvironmentInfo, template: TemplateManifest, dir: Path):
        self.info = info
        self.template = template
        self.dir = dir
        self.lock = threading.Lock()
        self.processes: dict[int, Process] = {}
        """Streamed and background commands by pid inside the environment."""
        self.lowers: list[Path] = []
        """The group mount points its overlay uses (lazy or direct), as the template lists its groups."""

    def env_for(self, env: dict[str, str] | None) -> dict[str, str]:
        """A command's variables: the template's, then the create's, then its own."""
        return {**self.template.runtime.env, **self.info.envs, **(env or {})}

    @property
    def container_id(self) -> str:
        return CONTAINER_PREFIX + self.info.id

    @property
    def rootfs(self) -> Path:
        return self.dir / "rootfs"

    @property
    def upper(self) -> Path:
        """Its overlay upper dir (its own changes), on the node's disk."""
        return NodeDisk.upper(self.dir)

    @property
    def agent_socket(self) -> Path:
        """The exec agent's listening socket (on the host, outside the rootfs)."""
        return self.dir / AGENT_SOCKET


class Node:
    """All environments of one machine.  Use as a context manager or call
    :meth:`start` then :meth:`close`."""

    KEEP_FINISHED = 64
    """Ended processes kept per environment (for their exit code and output)."""

    def __init__(
        self,
        paths: Paths | None = None,
        store: Store | None = None,
        *,
        max_environments: int | None = None,
        output_retain_bytes: int = DEFAULT_RETAIN,
        provisioning: ProvisionConfig | None = None,
        cache_bytes: int | None = None,
        prefetch_workers: int = 4,
        prefetch_record_s: float = 10.0,
        prefetch_pack_bytes: int = PACK_BYTES,
        exec_agent: bool = True,
        pool_size: int | None = None,
        disk_bytes: int | None = None,
    ):
        """``max_environments``: creates past it raise :class:`CapacityError`
        (None: no limit).  ``output_retain_bytes``: output kept per background
        command that nobody reads (older output is dropped).  ``cache_bytes``:
        the node chunk cache's bound (default ``WEENV_CACHE_BYTES``, else 20% of
        its file system, at most 10 GiB).  ``prefetch_workers``,
        ``prefetch_record_s``, ``prefetch_pack_bytes``: see :mod:`weenv.node.prefetch`.  ``exec_agent``:
        run commands through an agent inside each environment (built into
        ``WEENV_CACHE`` on first use; False: always ``runc exec``).  ``pool_size``:
        environments the warm pool keeps created ahead per template (with the
        same resources and capabilities) created twice recently
        (:mod:`weenv.node.pool`; default ``WEENV_POOL_SIZE``, else 1; 0: no pool).
        ``disk_bytes``: the size of the environments' disk, which bounds the sum
        of their declared disk limits (:mod:`weenv.node.disk`; default
        ``WEENV_DISK_BYTES``, else 80% of the home file system's free space)."""
        self.paths = paths or Paths.from_env()
        self.max_environments = max_environments
        self.output_retain_bytes = output_retain_bytes
        self.sink = PipeSink()
        self._pending = 0
        self.store = store or open_store(self.paths.store_url, check=False)  # starts while the store is down
        self.cache = ChunkCache(self.paths.chunk_cache, self.store, max_bytes=cache_bytes)
        self.lazyfs = LazyFS(self.paths.lazy_mountpoint, self.cache, run_dir=self.paths.run)  # + the FUSE holder
        self.groups = GroupMounts(self.paths.group_mounts, self.lazyfs, images=self.paths.node / "images")
        self.prefetch = Prefetcher(self.cache, self.store, self.lazyfs, workers=prefetch_workers,
                                   record_s=prefetch_record_s, pack_bytes=prefetch_pack_bytes,
                                   publish_lock=lambda: store_lock(self.paths, exclusive=False),
                                   on_group_complete=self.groups.assemble_if_complete)
        self.runc = Runc(self.paths.runc_root)
        self.net_cidr = network.cidr_from_env()
        """Where environments with network get their /30 (``WEENV_NET_CIDR``, :mod:`weenv.node.network`)."""
        self.disk = NodeDisk(self.paths.node / "disk.img", self.paths.environments, size=disk_bytes)
        self.agent = AgentBinary(self.paths.cache, enabled=exec_agent)
        self.exec_counts = {"agent": 0, "runc": 0}
        """Commands started through each launcher (``runc``: the fallback)."""
        self.provisioner = Provisioner(provisioning or ProvisionConfig.from_env())  # quotas follow usage
        self._envs: dict[str, _Environment] = {}
        self._lock = threading.Lock()
        self.manifests = NodeManifests(self.paths.node / "known", self.store)
        """Template and group manifests, in memory and in the node's home (:mod:`weenv.node.manifests`)."""
        self.names = KnownNames(self.paths.node / "known", self.store.url)
        """The digest each template name last resolved to, in the node's home."""
        self._asking: dict[str, Future] = {}  # template name -> the store lookup under way
        self._started = False
        self._closing = False  # close() runs: creates are refused, those under way are waited for
        self._home_lock: int | None = None
        self.pool = WarmPool(self._prepare_pooled, may_fill=self._may_pool,
                             size=pool_size_from_env() if pool_size is None else pool_size)
        """Environments created ahead (:mod:`weenv.node.pool`)."""

    # --- lifetime -------------------------------------------------------------------
    def start(self) -> "Node":
        """Take the home, start the FUSE daemon, and either recover what an
        earlier node process of this home left running (it was killed) or
        clear it.  Idempotent.

        Recovery: if the home's FUSE holder (:mod:`weenv.node.fuse.holder`)
        still keeps the lazy file system's connection, this node takes it over
        (reads that were waiting are served again), adopts the group mounts and
        every environment whose container still runs (its pid 1, overlay,
        cgroup and files stay as they are; exec, files and destroy work on it),
        and removes the rest (environments half created or whose container
        died).  Without a holder (both processes were killed, or none ran),
        the lazy file system's connection is gone: environments reading any
        group through it are removed with the lazy mounts, and those whose
        every group is mounted directly from its assembled image (no FUSE on
        their read path) are adopted as above.

        One node per ``WEENV_HOME``: it holds an flock(2) on ``run/weenv.lock``
        until :meth:`close` (the daemon's node is that one).  Raises
        :class:`BusyError` if another node (a daemon, or a program using
        :class:`Node` directly) runs on this home, before touching anything of it."""
        if self._started:
            return self
        for d in (self.paths.node, self.paths.run):  # closed to other users: see weenv.config
            private_dir(d)
        for d in (self.paths.environments, self.paths.group_mounts):
            d.mkdir(parents=True, exist_ok=True)
        self._take_home()
        self._closing = False
        try:
            self.disk.open()  # adopted with the environments on it, or made
        except BaseException:
            self._release_home()
            raise
        self.provisioner.disk_capacity = self.disk.size
        self.pool.open()
        try:
            if self.lazyfs.take_over():
                self._recover()
            else:
                self._recover_direct()
            try:
                self.provisioner.start()
            except BaseException:
                self.lazyfs.stop()
                raise
        except BaseException:
            with _logged("closing the node's disk after a failed start"):
                self.disk.close()
            self._release_home()
            raise
        self._started = True
        return self

    def _take_home(self) -> None:
        fd = os.open(self.paths.run / "weenv.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise BusyError(
                f"a weenv node already serves WEENV_HOME={self.paths.home}; use its daemon "
                "(NodeClient / weenv.Sandbox) or another WEENV_HOME"
            ) from None
        self._home_lock = fd

    def _release_home(self) -> None:
        if self._home_lock is not None:
            os.close(self._home_lock)  # releases the flock
            self._home_lock = None

    def close(self) -> None:
        """Destroy every environment, unmount every group, stop the FUSE daemon,
        release the home.  Idempotent."""
        if not self._started:
            return
        with self._lock:
            self._closing = True
        self.pool.close()  # its fills use the groups and runc; a create waiting for one goes on without
        while self._pending:  # creates under way end (their environments are destroyed below)
            time.sleep(0.01)
        errors = []
        for env_id in list(self._envs):
            try:
                self.destroy(env_id)
            except Exception as exc:  # keep going: close must release everything it can
                log.exception("destroying %s on close", env_id)
                errors.append(exc)
        self.provisioner.close()
        self.prefetch.close()
        try:
            self.groups.unmount_all()
        finally:
            try:
                self.lazyfs.stop()
                self.sink.close()
                self.sink = PipeSink()
                self.disk.close()  # every environment is gone: its directory, subvolume and overlay
            finally:
                self._started = False
                self._release_home()
        if errors:
            raise errors[0]

    def __enter__(self) -> "Node":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def _recover(self) -> None:
        """Adopt the group mounts and running environments of a killed node
        process whose FUSE connection :meth:`LazyFS.take_over` took (see :meth:`start`)."""
        try:
            self.groups.recover(self.manifests.group)
        finally:
            self.lazyfs.start()  # serve the taken connection in any case: readers wait on it
        self._adopt_all()

    def _recover_direct(self) -> None:
        """After a crash without the FUSE holder (or on a clean home): remove
        every environment with a lower dir that is not a direct group mount
        (its lazy reads can no longer be served), detach the dead lazy mounts,
        then adopt the direct group mounts and the environments on them only
        (see :meth:`start`)."""
        for env_dir in self._env_dirs():
            lowers = _overlay_lowers(env_dir / "rootfs")
            if not lowers or not all(self.groups.is_direct_point(p) for p in lowers):
                log.warning("removing environment %s: %s", env_dir.name,
                            "it read through the lost FUSE connection" if lowers else "it has no overlay")
                self._remove_leftover(env_dir)
        clear_stale(self.paths.group_mounts, self.paths.lazy_mountpoint, keep_direct=True)
        self.groups.recover(self.manifests.group)  # the node's copies: recovery needs no store
        self.lazyfs.start()
        self._adopt_all()

    def _env_dirs(self) -> list[Path]:
        return sorted(p for p in self.paths.environments.iterdir() if p.is_dir())

    def _adopt_all(self) -> None:
        """Adopt every environment left in the home that can go on running;
        remove the others and every container left without its environment."""
        status = {s.get("id"): s.get("status") for s in self.runc.list()}
        kept: set[str] = set()
        for env_dir in self._env_dirs():
            env_id = env_dir.name
            try:
                e = self._adopt(env_dir, status.get(CONTAINER_PREFIX + env_id))
            except Exception as exc:
                log.warning("cannot recover environment %s (removing it): %s", env_id, exc)
                self._remove_leftover(env_dir)
                continue
            self._envs[env_id] = e
            kept.add(e.container_id)
            log.info("recovered environment %s (template %s)", env_id, e.info.template)
        for cid, st in status.items():
            if cid and cid.startswith(CONTAINER_PREFIX) and cid not in kept:
                log.warning("removing container %s (%s) left without its environment", cid, st)
                with _logged(f"removing container {cid}"):
                    self.runc.delete(cid, force=True)

    def _adopt(self, env_dir: Path, runc_status: str | None) -> _Environment:
        """The environment in ``env_dir`` as a killed node process left it, its
        references counted; raises if it cannot go on running (not fully
        created, its container gone or stopped, its overlay not mounted)."""
        info_path = env_dir / "env.json"
        if not info_path.exists():
            raise InvalidInputError("it was not fully created")
        info = EnvironmentInfo.model_validate_json(info_path.read_text())
        if info.id != env_dir.name:
            raise InvalidInputError(f"its env.json names {info.id!r}")
        if (env_dir / UNDELIVERED).exists():
            raise InvalidInputError("the answer of its create never reached its client")
        if runc_status not in ("running", "paused"):
            raise InvalidInputError(f"its container is {runc_status or 'gone'}")
        rootfs = env_dir / "rootfs"
        lowers = _overlay_lowers(rootfs)
        if lowers is None:
            raise InvalidInputError(f"{rootfs} is not an overlay mount")
        template = self.manifests.template(info.template_digest)
        if len(lowers) != len(template.groups):
            raise InvalidInputError(
                f"its overlay has {len(lowers)} lower dirs, its template {len(template.groups)} groups")
        adopted: list[tuple[str, Path]] = []
        try:
            for g_digest, lower in zip(template.groups, lowers):
                self.groups.adopt(g_digest, lower)
                adopted.append((g_digest, lower))
        except BaseException:
            for g_digest, lower in adopted:
                self.groups.release(g_digest, lower)
            raise
        e = _Environment(info, template, env_dir)
        e.lowers = list(lowers)
        e.info.state = "running"
        if runc_status == "paused":  # frozen by the dead node's provisioner (weenv pauses nothing else)
            try:
                open_cgroups(f"/{e.container_id}").thaw()
            except Exception as exc:
                log.warning("cannot thaw recovered environment %s: %s", info.id, exc)
        try:
            self.provisioner.reserve(info.id, info.resources, priority=info.priority)
            self.provisioner.attach(info.id, f"/{e.container_id}")
        except Exception as exc:  # it runs anyway, with the limits it had
            log.warning("provisioning of recovered environment %s failed: %s", info.id, exc)
            self.provisioner.detach(info.id)
        return e

    def _remove_leftover(self, env_dir: Path) -> None:
        """Remove an environment directory not recovered: its container, overlay and files."""
        self.provisioner.detach(env_dir.name)
        with _logged(f"removing the container of leftover environment {env_dir.name}"):
            self._delete_container(CONTAINER_PREFIX + env_dir.name, env_dir / "bundle")
        network.teardown(env_dir.name, env_dir)
        for _fstype, point in mounts.mounts_under(env_dir):
            _umount_quietly(Path(point))
        self._remove_env_dir(env_dir)

    def _remove_env_dir(self, env_dir: Path) -> None:
        """Remove an environment's directory, its disk's subvolume first (at once, however big)."""
        self.disk.remove(env_dir)
        _remove_tree(env_dir)

    # --- environments ---------------------------------------------------------------
    def create(
        self,
        template: str,
        *,
        resources: Resources | None = None,
        first_command: bool = True,
        capabilities: tuple[str, ...] = RUNC_DEFAULT_CAPS,
        timeout: float | None = None,
        envs: dict[str, str] | None = None,
        metadata: dict[str, str] | None = None,
        prefetch: bool = True,
        priority: int = 0,
        undelivered: bool = False,
    ) -> EnvironmentInfo:
        """Create and start an environment from ``template`` (name or digest).

        ``undelivered``: the caller hands the environment on (a server's
        answer) and calls :meth:`delivered` once it has; until then a node
        recovering after a crash removes it instead of adopting it (nobody
        would know its id).

        ``prefetch``: record the template's prefetch profile on its first start
        and replay it on later cold starts (off for transient build environments).

        ``timeout``: seconds from now after which :meth:`reap_expired` destroys
        it (default :data:`DEFAULT_TIMEOUT_S`).  ``envs``: variables of every
        command run inside.  ``metadata``: labels kept in its info.
        ``priority``: elastic provisioning's (higher grows first, is frozen last).  Raises
        :class:`CapacityError` when ``max_environments`` run or start.

        ``capabilities``: the processes' capability set (default runc's; build
        environments pass :data:`~weenv.node.bundle.DOCKER_DEFAULT_CAPS`).

        Returns its info with the create's phase timings (seconds) and bytes fetched.
        Raises :class:`NotFoundError` for an unknown template, :class:`MountError`
        or :class:`RuntimeFailedError` when a step fails; every step already done
        is undone first.
        """
        self._check_started()
        timeout = _check_timeout(DEFAULT_TIMEOUT_S if timeout is None else timeout)
        priority = _check_priority(priority)
        for key, value in (envs or {}).items():
            if not key or "=" in key or "\0" in key or "\0" in value:
                raise InvalidInputError(f"bad environment variable {key!r}")
        with self._lock:
            if self._closing:  # checked with the count close() waits on
                raise ClosedError("node is closing")
            if self.max_environments is not None and len(self._envs) + self._pending >= self.max_environments:
                raise CapacityError(
                    f"the node runs {len(self._envs)} environments (+{self._pending} starting) "
                    f"of at most {self.max_environments}"
                )
            self._pending += 1
        try:
            t0 = time.perf_counter()
            req = _Request(template, resources, first_command, tuple(capabilities), timeout, envs or {},
                           metadata or {}, prefetch, priority, undelivered)  # fmt: skip
            resolved = self._resolve(template)
            try:
                return self._create(t0, resolved, req)
            except Exception:
                current = self._moved(template, resolved)
                if current is None:
                    raise
                self.pool.forget(_pool_key(resolved.digest, req))  # its name means another template now
            # it started the digest the name had before; the name moved meanwhile (undone): start the new one
            return self._create(t0, _Resolved(current), req)
        finally:
            with self._lock:
                self._pending -= 1

    def _create(self, t0: float, resolved: _Resolved, req: _Request) -> EnvironmentInfo:
        if not req.prefetch:  # transient (build) environments: never from the warm pool, never filling it
            return self._create_env(t0, resolved, req, None)
        key = _pool_key(resolved.digest, req)
        created = False
        try:
            pooled = self.pool.take(key)  # a container of this request created ahead, or None
            info = self._create_env(t0, resolved, req, pooled)
            created = True
            return info
        except NotFoundError:  # the template (or its name) is gone: make no more of it
            self.pool.forget(key)
            raise
        finally:
            self.pool.done(key, created)

    def _create_env(self, t0: float, resolved: _Resolved, req: _Request, pooled: Pooled | None) -> EnvironmentInfo:
        """:meth:`create` of ``resolved.digest``, starting ``pooled`` (taken from the
        warm pool, owned now) if given, else creating the environment anew."""
        digest = resolved.digest
        fetched0, chunks0 = self.cache.bytes_fetched, self.cache.chunks_fetched
        timing: dict[str, float | None] = {}

        pooled_tried = False  # once its start was tried, a pooled environment is removed, not given back
        with contextlib.ExitStack() as undo:
            if pooled is not None:  # a create refused before it (e.g. CapacityError) returns it untouched
                undo.callback(lambda: pooled.undo.close() if pooled_tried else self.pool.give_back(pooled))
            env_id = pooled.env_id if pooled is not None else secrets.token_hex(6)
            # chunks flow while the manifests load (not on a node that refuses new environments)
            if req.prefetch and self.provisioner.admitting and self.prefetch.begin_early(env_id, digest):
                undo.callback(self.prefetch.cancel, env_id)
            manifest, group_manifests = self._manifests(digest)
            timing["manifest_s"] = time.perf_counter() - t0

            res = req.resources or manifest.runtime.resources
            self.provisioner.reserve(env_id, res, priority=req.priority)  # admission: CapacityError if the node is full
            undo.callback(self.provisioner.detach, env_id)
            if req.prefetch:
                self.prefetch.begin(env_id, digest, list(zip(manifest.groups, group_manifests)))
            undo.callback(self.prefetch.cancel, env_id)
            undo.callback(self.prefetch.end_recording, env_id, publish=False)  # runs first: a failed create records nothing

            env_dir = self.paths.environments / env_id
            container_id = CONTAINER_PREFIX + env_id
            lowers = None
            if pooled is not None:
                pooled_tried = True
                lowers = self._start_pooled(pooled, manifest, group_manifests, timing)
            if lowers is None:
                lowers = self._prepare(env_id, manifest, group_manifests, res, req.capabilities, undo, timing, start=True)
            self.provisioner.attach(env_id, f"/{container_id}")
            if resolved.asking is not None and self._resolved_now(req.template, resolved) != digest:
                raise _RefMoved(req.template)  # undone; create starts the new digest

            info = EnvironmentInfo(
                id=env_id,
                template=manifest.name,
                template_digest=digest,
                created_at=time.time(),
                state="running",
                rootfs=str(env_dir / "rootfs"),
                resources=res,
                timing=CreateTiming(),
                timeout_s=req.timeout,
                envs=req.envs,
                metadata=req.metadata,
                priority=req.priority,
            )
            env = _Environment(info, manifest, env_dir)
            env.lowers = lowers
            if req.undelivered:  # before env.json: recovery never adopts it without the mark
                (env_dir / UNDELIVERED).touch()
            if req.first_command:
                t = time.perf_counter()
                try:
                    result = self.collect(self._spawn(env, ["true"], timeout=60, primary_reader=True))
                except BrokenError as exc:  # the container ended under its first command: the runtime's failure
                    raise RuntimeFailedError(
                        f"template {req.template}: the environment stopped as it started (does its "
                        f"command {list(manifest.runtime.command)!r} exist and keep running?): {exc}"
                    ) from exc
                if result.exit_code != 0:
                    raise InvalidInputError(
                        f"template {req.template}: 'true' exited {result.exit_code} inside the "
                        f"environment: {result.stderr.decode(errors='replace').strip()}"
                    )
                timing["first_command_s"] = time.perf_counter() - t
            undo.pop_all()

        info.timing = CreateTiming(
            **timing,
            resolved_from=resolved.source,
            resolved_age_s=resolved.age_s,
            total_s=time.perf_counter() - t0,
            bytes_fetched=self.cache.bytes_fetched - fetched0,
            chunks_fetched=self.cache.chunks_fetched - chunks0,
            template_bytes=sum(g.image_size for g in group_manifests),
            template_stored_bytes=sum(g.stored_size for g in group_manifests),
        )
        info.expires_at = time.time() + req.timeout
        _save_info(env_dir, info)
        with self._lock:
            self._envs[env_id] = env
        return info

    def _start_pooled(self, pooled: Pooled, manifest: TemplateManifest, group_manifests: list[GroupManifest],
                      timing: dict) -> list[Path] | None:
        """Start the pooled environment (``runc start``) and return its overlay's
        lower dirs; or remove it and return None if it cannot serve: a group it
        reads through FUSE has an assembled image now (new environments mount
        that directly), its overlay is no longer mounted on the host (the
        node's file access goes through it), or its container does not start
        (e.g. its waiting process was killed)."""
        why = None
        for g, g_manifest, lower in zip(manifest.groups, group_manifests, pooled.lowers):
            if self.groups.superseded(g, lower, g_manifest):
                why = f"it reads group {g} through FUSE, which is mounted directly now"
        if why is None and not mounts.is_mounted(self.paths.environments / pooled.env_id / "rootfs"):
            why = "its overlay is not mounted"
        if why is not None:
            log.info("pooled environment %s not used (%s); creating it anew", pooled.env_id, why)
            self.pool.unusable()
            pooled.undo.close()
            return None
        t = time.perf_counter()
        try:  # ~7 ms; one that waits longer is stuck (e.g. its process stopped): made anew instead
            self.runc.start(CONTAINER_PREFIX + pooled.env_id, timeout=POOLED_START_TIMEOUT_S)
        except (RuntimeFailedError, NotFoundError) as exc:
            log.warning("pooled environment %s did not start (%s); creating it anew", pooled.env_id, exc)
            self.pool.unusable()
            pooled.undo.close()
            return None
        timing["runtime_s"] = time.perf_counter() - t
        timing["pooled"] = True
        return pooled.lowers

    def _prepare(self, env_id: str, manifest: TemplateManifest, group_manifests: list[GroupManifest],
                 res: Resources, capabilities: tuple[str, ...], undo: contextlib.ExitStack,
                 timing: dict, *, start: bool) -> list[Path]:
        """Make environment ``env_id``'s directory, group mounts, overlay rootfs,
        bundle and container (``start``: running, ``runc run --detach``; else
        created and waiting, ``runc create``), each step's undo pushed on
        ``undo``; the phases' seconds go to ``timing``.  Returns the overlay's
        lower dirs (group mount points, as the template lists its groups)."""
        env_dir = self.paths.environments / env_id
        env_dir.mkdir(mode=PRIVATE_MODE)
        undo.callback(self._remove_env_dir, env_dir)

        t = time.perf_counter()
        lowers = self.groups.acquire_all(list(zip(manifest.groups, group_manifests)))  # cold ones in parallel
        for g_digest, lower in zip(manifest.groups, lowers):
            undo.callback(self.groups.release, g_digest, lower)
        timing["groups_s"] = time.perf_counter() - t

        t = time.perf_counter()
        self.disk.make(env_dir, res.disk_bytes)  # upper and work dirs, with the disk limit
        upper, work, rootfs = NodeDisk.upper(env_dir), NodeDisk.work(env_dir), env_dir / "rootfs"
        rootfs.mkdir()
        mounts.mount(mounts.overlay_spec(lowers, upper, work, rootfs))
        undo.callback(_umount_quietly, rootfs)
        timing["overlay_s"] = time.perf_counter() - t

        t = time.perf_counter()
        netns = self._network(env_id, env_dir, manifest.runtime.network, undo)
        container_id = CONTAINER_PREFIX + env_id
        bundle = env_dir / "bundle"
        bundle.mkdir()
        agent = self.agent.get()
        write_bundle(
            bundle,
            rootfs,
            manifest.runtime,
            hostname=f"weenv-{env_id}",
            cgroups_path=f"/{container_id}",
            resources=res,
            init=INIT if INIT.exists() else None,
            capabilities=capabilities,
            agent=agent,
            netns=netns,
        )
        listener = agent_listen(env_dir / AGENT_SOCKET) if agent is not None else None
        undo.callback(self._delete_container, container_id, bundle)
        stdin = None if listener is None else listener.fileno()
        try:
            if start:  # create + start in one runc process
                self.runc.run_detached(container_id, bundle, stdin=stdin)
            else:
                self.runc.create(container_id, bundle, stdin=stdin)
        finally:
            if listener is not None:
                listener.close()  # the agent holds it now: when it dies, connects are refused
        timing["runtime_s"] = time.perf_counter() - t
        return lowers

    def _network(self, env_id: str, env_dir: Path, wanted: bool, undo: contextlib.ExitStack) -> Path | None:
        """With ``wanted`` (the template's ``runtime.network``): environment
        ``env_id``'s own network namespace and link (:mod:`weenv.node.network`),
        its teardown pushed on ``undo``; the namespace file, or None."""
        if not wanted:
            return None
        undo.callback(network.teardown, env_id, env_dir)
        return network.setup(env_id, env_dir, self.net_cidr).netns

    def _prepare_pooled(self, key: PoolKey) -> Pooled:
        """One environment of ``key`` for the warm pool: created, not started."""
        env_id = secrets.token_hex(6)
        manifest, group_manifests = self._manifests(key.digest)
        res = Resources.model_validate_json(key.resources) if key.resources else manifest.runtime.resources
        with contextlib.ExitStack() as undo:
            lowers = self._prepare(env_id, manifest, group_manifests, res, key.capabilities, undo, {}, start=False)
            return Pooled(key, env_id, lowers, undo.pop_all())

    def _may_pool(self, ready: int) -> bool:
        """Whether the warm pool may hold ``ready`` environments now: the node
        admits environments and, with ``max_environments``, they fit beside
        the running and starting ones (read without the node's lock: a hint)."""
        if not self._started or not self.provisioner.admitting:
            return False
        return self.max_environments is None or len(self._envs) + self._pending + ready <= self.max_environments

    def _resolve(self, template: str) -> _Resolved:
        """The digest to create ``template`` from: the one the store names now;
        or, for a name this node resolved before (also before a restart:
        :class:`~weenv.node.manifests.KnownNames`), that digest (started
        speculatively) with ``asking``, a Future of the store's answer, asked
        in a thread (one per name at a time): an ``oci://`` resolve is a
        registry request (~3 ms), which then overlaps the create instead of
        preceding it.  :meth:`_resolved_now` checks the guess before the create
        completes.

        Staleness rule: the store is asked on every create, and its answer wins
        whenever it gives one (a moved name restarts the create on the new
        digest; a deleted one fails it).  The node's last known digest is used
        *instead* only when the store fails with :class:`StoreUnavailableError`
        (unreachable, timed out, or known to be down) or has not answered
        :data:`RESOLVE_WAIT_S` after it was asked and the create is otherwise
        ready; the create then logs a warning naming the digest and when the
        store last named it, and its answer says so (``timing.resolved_from``
        ``"node"``, ``timing.resolved_age_s``).  A store outage so stops publishing, not
        starting, for templates whose manifests and chunks are on the node.  A
        name this node never resolved, or a digest whose manifest it lacks,
        fails with :class:`StoreUnavailableError`."""
        if template.startswith("sha256:"):
            try:
                return _Resolved(self.store.resolve("templates", template))
            except StoreUnavailableError as exc:
                if not self.manifests.has(template):
                    raise
                log.warning("template %s: the store did not answer (%s); its manifest is on the node", template, exc)
                return _Resolved(template, source="node")
        known = self.names.get(template)
        if known is None:
            try:
                digest = self.store.resolve("templates", template)
            except StoreUnavailableError as exc:
                raise StoreUnavailableError(
                    f"cannot resolve template {template!r}: {exc}; this node never started it, "
                    "so it cannot without the store"
                ) from exc
            self.names.remember(template, digest)
            return _Resolved(digest)
        return _Resolved(known[0], asking=self._ask(template))

    def _ask(self, template: str) -> Future:
        """The store's answer for name ``template``, asked in a thread unless a
        lookup of it is under way already (shared: a frozen store holds one
        thread per name, not one per create).  ``future.asked`` is its start (monotonic)."""
        with self._lock:
            future = self._asking.get(template)
            if future is not None:
                return future
            future = self._asking[template] = Future()
            future.asked = time.monotonic()

        def ask() -> None:
            try:
                future.set_result(self.store.resolve("templates", template))
            except BaseException as exc:
                future.set_exception(exc)
            finally:
                with self._lock:
                    if self._asking.get(template) is future:
                        del self._asking[template]

        threading.Thread(target=ask, name="weenv-resolve", daemon=True).start()
        return future

    def _resolved_now(self, template: str, resolved: _Resolved) -> str:
        """What the store named ``template`` during this create (remembered for
        the next one); raises the store's error (:class:`NotFoundError` if the
        ref is gone: forgotten), which undoes the create.  When the store is
        unavailable or slow (:meth:`_resolve`'s staleness rule): the name's
        last known digest, with a warning, and ``resolved`` says so (``source``, ``age_s``)."""
        asking = resolved.asking
        try:
            digest = asking.result(timeout=max(0.0, asking.asked + RESOLVE_WAIT_S - time.monotonic()))
        except NotFoundError:
            self.names.forget(template)
            raise
        except (StoreUnavailableError, FutureTimeout) as exc:
            known = self.names.get(template)
            if known is None:
                raise
            why = str(exc) or f"no answer within {RESOLVE_WAIT_S:g} s"
            resolved.source, resolved.age_s = "node", max(0.0, time.time() - known[1])
            log.warning("template %r: the store did not answer (%s); starting %s, which it named %.0f s ago",
                        template, why, known[0], resolved.age_s)  # fmt: skip
            return known[0]
        self.names.remember(template, digest)
        return digest

    def _moved(self, template: str, resolved: _Resolved) -> str | None:
        """After a failed create of ``resolved.digest`` guessed for ``template``: the
        digest the name has now if that is another (the failure may be the
        old one's, e.g. its manifests collected), else None."""
        if resolved.asking is None:
            return None
        try:
            current = self._resolved_now(template, resolved)
        except Exception:  # the store's own error: the create's says more
            return None
        return current if current != resolved.digest else None

    def _remember_resolved(self, template: str, digest: str) -> None:
        self.names.remember(template, digest)

    def _manifests(self, digest: str) -> tuple[TemplateManifest, list[GroupManifest]]:
        """The manifest and group manifests of the template ``digest`` (which the
        caller resolved from a name in the store on this create: a ref may
        move), from the node when it has them (:mod:`weenv.node.manifests`:
        content-addressed, so a warm start asks the store one question, the
        resolve, instead of 2 + 2 per group, and none when the store is down),
        else from the store.  Raises as :func:`load_template` and :func:`load_group` do."""
        manifest = self.manifests.template(digest)
        return manifest, self.manifests.groups(manifest.groups)

    def set_timeout(self, env_id: str, timeout: float) -> EnvironmentInfo:
        """Destroy the environment ``timeout`` seconds from now (instead of when
        it was due).  Raises :class:`NotFoundError`, or :class:`InvalidInputError`
        for a timeout not in (0, 7 days]."""
        timeout = _check_timeout(timeout)
        e = self._env(env_id)
        e.info.timeout_s = timeout
        e.info.expires_at = time.time() + timeout
        _save_info(e.dir, e.info)  # a restarted node must not reap it at the old time
        return e.info

    def set_priority(self, env_id: str, priority: int) -> EnvironmentInfo:
        """Set the environment's priority for elastic provisioning (higher: grows
        first, frozen last).  Raises :class:`NotFoundError`, or
        :class:`InvalidInputError` for a priority not an int in [-1000, 1000]."""
        priority = _check_priority(priority)
        e = self._env(env_id)
        self.provisioner.set_priority(env_id, priority)
        e.info.priority = priority
        _save_info(e.dir, e.info)  # kept across a restart
        return e.info

    def reap_expired(self, now: float | None = None) -> list[str]:
        """Destroy every environment whose ``expires_at`` has passed; their ids."""
        now = time.time() if now is None else now
        with self._lock:
            due = [i for i, e in self._envs.items() if e.info.expires_at <= now]
        reaped = []
        for env_id in due:
            try:
                self.destroy(env_id)
            except NotFoundError:  # destroyed meanwhile
                continue
            log.info("reaped environment %s (its timeout passed)", env_id)
            reaped.append(env_id)
        return reaped

    def get(self, env_id: str) -> EnvironmentInfo:
        """The environment's info; its ``state`` is runc's (``"stopped"`` once its
        first process died).  Raises :class:`NotFoundError`."""
        e = self._env(env_id)
        if e.info.state == "running":
            state = self.runc.state(e.container_id)
            self._follow(e, state["status"] if state else None)
        return e.info

    def list(self) -> list[EnvironmentInfo]:
        """Every environment's info, ``state`` from runc (one ``runc list``)."""
        with self._lock:
            envs = list(self._envs.values())
        if any(e.info.state == "running" for e in envs):
            status = {s.get("id"): s.get("status") for s in self.runc.list()}
            for e in envs:
                self._follow(e, status.get(e.container_id))
        return [e.info for e in envs]

    def count(self) -> int:
        """How many environments the node holds (no runc call)."""
        with self._lock:
            return len(self._envs)

    @staticmethod
    def _follow(e: _Environment, runc_status: str | None) -> None:
        """A running environment whose container stopped (its first process
        died) or vanished is ``"stopped"``: commands can no longer run in it."""
        if e.info.state == "running" and runc_status in (None, "stopped"):
            e.info.state = "stopped"

    def exec(
        self,
        env_id: str,
        command: list[str] | str,
        *,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        timeout: float | None = None,
        stdin: bytes | None = None,
        raise_on_timeout: bool = False,
        max_output: int = 64 << 20,
    ) -> ExecResult:
        """Run ``command`` (argv, or a ``/bin/sh -c`` string) in environment ``env_id``.

        ``env`` adds to the template's variables; ``cwd`` defaults to its working
        dir; ``timeout`` in seconds kills the command and its children, reported
        as ``timed_out`` (or raised as :class:`CommandTimeoutError`).

        The output comes through pipes (:meth:`run`): past ``max_output`` bytes
        the command is killed (:class:`OutputLimitError`), and what a background
        descendant (``cmd &``) writes after the command returned goes to the
        node's :class:`~weenv.node.process.PipeSink`, never to a file on the host.
        """
        r = self.run(env_id, command, env=env, cwd=cwd, timeout=timeout, stdin=stdin, max_output=max_output)
        if r.timed_out and raise_on_timeout:
            raise CommandTimeoutError(f"command timed out after {timeout} s in {env_id}")
        return r

    # --- streamed and background commands ------------------------------------------------
    def spawn(
        self,
        env_id: str,
        command: list[str] | str,
        *,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        timeout: float | None = None,
        stdin: bytes | None = None,
        stdin_open: bool = False,
        tag: str | None = None,
        primary_reader: bool = False,
    ) -> Process:
        """Start ``command`` in environment ``env_id`` and return once it runs
        (or could not start: then its pid is 0 and it has already ended with
        127/126 and the reason on stderr, as runc words it).

        Its output streams through ``process.log`` (see :mod:`weenv.node.process`);
        ``stdin_open`` makes stdin a pipe for :meth:`Process.write_stdin`;
        ``primary_reader`` attaches a reader that sees every event (a foreground
        stream; read it to the end or detach it).  The process is kept under
        its pid (:meth:`process`) while it runs and a while after.  Raises
        :class:`NotFoundError` for an unknown environment and
        :class:`InvalidInputError` for a bad command, variable or directory.
        """
        e = self._env(env_id)
        p = self._spawn(e, command, env=env, cwd=cwd, timeout=timeout, stdin=stdin, stdin_open=stdin_open,
                        tag=tag, primary_reader=primary_reader)  # fmt: skip
        self.prefetch.watch_command(env_id, p.wait)
        if p.pid:
            with self._lock:
                e.processes[p.pid] = p
                ended = [pid for pid, q in e.processes.items() if not q.running]
                for pid in ended[: max(0, len(ended) - self.KEEP_FINISHED)]:
                    del e.processes[pid]
        return p

    def _spawn(self, e: _Environment, command, *, env=None, cwd=None, timeout=None, stdin=None,
               stdin_open=False, tag=None, primary_reader=False) -> Process:
        """Start ``command`` in ``e`` (see :meth:`spawn`) and wait until it runs."""
        if isinstance(command, list) and not command:
            raise InvalidInputError("empty command")
        if timeout is not None:
            _check_timeout(timeout)
        wd = cwd or e.template.runtime.working_dir
        spawned = self._launch(e, command, e.env_for(env), wd, None if stdin_open else stdin, stdin_open)
        p = Process(
            spawned, command=command, tag=tag, cwd=wd, timeout=timeout,
            stdin=stdin if stdin_open else None, retain_bytes=self.output_retain_bytes, sink=self.sink,
            primary_reader=primary_reader,
        )  # fmt: skip
        p.wait_started(self.runc.command_timeout)
        return p

    def _launch(self, e: _Environment, command, env: dict[str, str], cwd: str, stdin: bytes | None,
                stdin_pipe: bool) -> Spawned:
        """Start a command through the environment's exec agent, or through
        ``runc exec`` when the agent is not there (logged once per environment)."""
        _flags, argv = exec_args(command, env, cwd, e.template.runtime.user)  # raises for bad input
        if e.agent_socket.exists():
            try:
                spawned = agent_spawn(e.agent_socket, argv, env=env, cwd=cwd, stdin=stdin, stdin_pipe=stdin_pipe,
                                      cgroup=f"/{e.container_id}")
            except AgentUnavailable as exc:
                if exc.gone:  # for good: later commands go straight to runc
                    log.warning("environment %s: %s; using runc exec from now on", e.info.id, exc)
                    with contextlib.suppress(FileNotFoundError):
                        e.agent_socket.unlink()
                else:
                    log.info("environment %s: %s; using runc exec for this command", e.info.id, exc)
            else:
                self._count_exec("agent")
                return spawned
        self._count_exec("runc")
        return self.runc.spawn(e.container_id, argv, env=env, cwd=cwd, user=e.template.runtime.user,
                               stdin=stdin, stdin_pipe=stdin_pipe)  # fmt: skip

    def _count_exec(self, launcher: str) -> None:
        with self._lock:
            self.exec_counts[launcher] += 1

    def process(self, env_id: str, pid: int) -> Process:
        """The streamed or background command ``pid`` of ``env_id``; :class:`NotFoundError` if unknown."""
        e = self._env(env_id)
        with self._lock:
            p = e.processes.get(pid)
        if p is None:
            raise NotFoundError(f"no command with pid {pid} in environment {env_id!r}")
        return p

    def processes(self, env_id: str) -> list[ProcessInfo]:
        e = self._env(env_id)
        with self._lock:
            procs = list(e.processes.values())
        return [p.info() for p in procs]

    def run(
        self,
        env_id: str,
        command: list[str] | str,
        *,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        timeout: float | None = None,
        stdin: bytes | None = None,
        max_output: int = 64 << 20,
    ) -> ExecResult:
        """Like :meth:`exec`, through a streamed process whose output is counted
        as it comes: past ``max_output`` bytes (stdout + stderr) the command tree
        is killed and :class:`OutputLimitError` raised, so a huge output never
        fills the daemon's memory or disk."""
        p = self.spawn(env_id, command, env=env, cwd=cwd, timeout=timeout, stdin=stdin, primary_reader=True)
        return self.collect(p, max_output)

    def collect(self, p: Process, max_output: int = 64 << 20) -> ExecResult:
        """Wait for ``p`` (spawned with ``primary_reader``) and return its result
        with its whole output, as :meth:`run` does (:class:`OutputLimitError`
        past ``max_output`` bytes)."""
        out, err = bytearray(), bytearray()
        end = None
        for ev in p.log.follow(p.primary):
            if ev.type in ("stdout", "stderr"):
                (out if ev.type == "stdout" else err).extend(ev.data or b"")
                if len(out) + len(err) > max_output:
                    p.kill()
                    p.wait(30)
                    raise OutputLimitError(
                        f"the command wrote more than {max_output} bytes of output and was killed "
                        "(stream its output instead, or redirect it to a file)"
                    )
            elif ev.type == "end":
                end = ev
        if p.error is not None:
            raise p.error
        assert end is not None and end.exit_code is not None
        return ExecResult(exit_code=end.exit_code, stdout=bytes(out), stderr=bytes(err),
                          duration_s=end.duration_s or 0.0, timed_out=bool(end.timed_out))

    # --- templates --------------------------------------------------------------------
    def templates(self) -> list[TemplateInfo]:
        """The store's templates by name (name and digest only)."""
        return [TemplateInfo(name=n, digest=d) for n, d in sorted(self.store.list_refs("templates").items())]

    def template(self, name: str) -> TemplateInfo:
        """One template (name or digest) with its groups, runtime and sizes; :class:`NotFoundError` if unknown."""
        digest, m = load_template(self.store, name)
        groups = [load_group(self.store, g) for g in m.groups]
        return TemplateInfo(
            name=m.name, digest=digest, version=m.version, groups=list(m.groups), runtime=m.runtime,
            image_bytes=sum(g.image_size for g in groups), stored_bytes=sum(g.stored_size for g in groups),
        )  # fmt: skip

    def files(self, env_id: str) -> RootFS:
        """File access inside the environment's root (paths cannot escape it)."""
        return RootFS(self._env(env_id).rootfs)

    def stop(self, env_id: str) -> Path:
        """Kill every process of environment ``env_id``, remove its container and
        unmount its rootfs; return its upper dir (the environment's own changes in
        overlayfs's upper-dir format: whiteouts, ``trusted.overlay.*`` xattrs),
        which stays on disk, no longer in use, until :meth:`destroy`.
        Idempotent.  Raises :class:`NotFoundError` if unknown."""
        e = self._env(env_id)
        with e.lock:
            self._delete_container(e.container_id, e.dir / "bundle")
            _umount_quietly(e.rootfs)
            network.teardown(env_id, e.dir)
            e.info.state = "stopped"
        return e.upper

    def delivered(self, env_id: str) -> None:
        """The environment created ``undelivered`` reached its client: a
        recovering node adopts it from now on.  A gone environment is fine."""
        with contextlib.suppress(FileNotFoundError):
            (self.paths.environments / env_id / UNDELIVERED).unlink()

    def destroy(self, env_id: str) -> None:
        """Kill the environment's processes and remove its container, cgroup,
        overlay and directory.  Raises :class:`NotFoundError` if unknown."""
        with self._lock:
            e = self._envs.pop(env_id, None)
        if e is None:
            raise NotFoundError(f"no environment {env_id!r}")
        with e.lock:
            procs = list(e.processes.values())
            for p in procs:
                p.log.abandon()
            try:
                self.provisioner.detach(env_id)  # before the cgroup goes
                self._delete_container(e.container_id, e.dir / "bundle")
                for p in procs:  # their helpers exit with the container's processes
                    p.wait(10)
                _umount_quietly(e.rootfs)
            finally:
                self.prefetch.cancel(env_id)
                for g, lower in zip(e.template.groups, e.lowers):
                    self.groups.release(g, lower)
                network.teardown(env_id, e.dir)
                self._remove_env_dir(e.dir)
                self.pool.wake()  # room for the pool, if max_environments held it back

    def disk_usage(self, env_id: str) -> tuple[int, int]:
        """``(used, total)`` bytes: what the environment wrote (its upper dir's
        quota usage: data and metadata, counted by the kernel) and its disk
        limit (``resources.disk_bytes``).  Raises :class:`NotFoundError`."""
        e = self._env(env_id)
        try:
            used, limit = self.disk.usage(e.dir)
        except FileNotFoundError:  # destroyed meanwhile
            raise NotFoundError(f"no environment {env_id!r}") from None
        return used, limit or e.info.resources.disk_bytes

    def provision_stats(self, env_id: str | None = None) -> ProvisionStats:
        """Quotas, usage history and events of elastic provisioning (:class:`NotFoundError` for an unknown id)."""
        return self.provisioner.stats(env_id)

    def stats(self) -> NodeStats:
        pool = self.pool.stats()
        return NodeStats(
            environments=len(self._envs),
            groups_mounted=self.groups.mounted(),
            cache_chunks_fetched=self.cache.chunks_fetched,
            cache_bytes_fetched=self.cache.bytes_fetched,
            exec_agent=self.exec_counts["agent"],
            exec_runc=self.exec_counts["runc"],
            exec_agent_error=self.agent.error,
            pool_ready=pool.ready,
            pool_hits=pool.hits,
            pool_misses=pool.misses,
        )

    def drop_caches(self) -> None:
        """Remove the warm pool's environments, unmount groups no environment
        uses, empty the node chunk cache, the kernel's page cache of the group
        images and the manifests and names the node knows (for cold-start measurements).  Raises :class:`InvalidInputError` while any
        environment runs."""
        self._check_idle()  # before the pool is drained for nothing
        self.pool.drain()  # its environments hold group mounts
        with self._lock:
            self._check_idle(locked=True)
            self.groups.unmount_unused()
            self.groups.remove_images()
            self.lazyfs.drop_page_cache()
            self.cache.clear()
            self.manifests.clear()
            self.names.clear()

    # --- helpers --------------------------------------------------------------------
    def _env(self, env_id: str) -> _Environment:
        with self._lock:
            e = self._envs.get(env_id)
        if e is None:
            raise NotFoundError(f"no environment {env_id!r}")
        return e

    def _delete_container(self, container_id: str, bundle: Path) -> None:
        self.runc.delete(container_id, force=True, bundle=bundle)

    def _check_idle(self, locked: bool = False) -> None:
        with contextlib.nullcontext() if locked else self._lock:
            if self._envs:
                raise InvalidInputError("cannot drop the node cache while environments run")

    def _check_started(self) -> None:
        if not self._started:
            raise ClosedError("node is not started")
        if self._closing:
            raise ClosedError("node is closing")


def _pool_key(digest: str, req: _Request) -> PoolKey:
    return PoolKey(digest, None if req.resources is None else req.resources.model_dump_json(), req.capabilities)


@dataclass(frozen=True)
class _Request:
    """What :meth:`Node.create` was asked (its arguments, checked)."""

    template: str
    resources: Resources | None
    first_command: bool
    capabilities: tuple[str, ...]
    timeout: float
    envs: dict[str, str]
    metadata: dict[str, str]
    prefetch: bool
    priority: int
    undelivered: bool = False


@dataclass
class _Resolved:
    """The digest a create starts and who named it (:meth:`Node._resolve`)."""

    digest: str
    asking: Future | None = None
    """The store's answer for the name, under way (checked by :meth:`Node._resolved_now`); None: the store named it."""
    source: Literal["store", "node"] = "store"
    """``node``: the store did not answer; the node's last known digest (or manifest) is started."""
    age_s: float | None = None
    """With ``node`` for a name: seconds since the store last named ``digest``."""


class _RefMoved(Exception):
    """A create started a template name's previous digest; the name moved."""


def _check_timeout(timeout: float) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not (0 < timeout <= MAX_TIMEOUT_S):
        raise InvalidInputError(f"bad timeout {timeout!r}: want seconds in (0, {MAX_TIMEOUT_S:.0f}]")
    return float(timeout)


def _check_priority(priority: int) -> int:
    if isinstance(priority, bool) or not isinstance(priority, int) or not -1000 <= priority <= 1000:
        raise InvalidInputError(f"bad priority {priority!r}: want an integer in [-1000, 1000]")
    return priority


def _save_info(env_dir: Path, info: EnvironmentInfo) -> None:
    """Write ``env_dir/env.json`` whole or not at all (a node killed mid-write
    must not leave a file recovery cannot read)."""
    tmp = env_dir / "env.json.tmp"
    try:
        tmp.write_text(info.model_dump_json(indent=2))
        os.replace(tmp, env_dir / "env.json")
    except FileNotFoundError:  # destroyed meanwhile
        raise NotFoundError(f"no environment {info.id!r}") from None


@contextlib.contextmanager
def _logged(what: str):
    """Go on past any failure of ``what`` (crash cleanup must release all it
    can), but say so in the log, with the traceback: never swallow silently."""
    try:
        yield
    except Exception:
        log.warning("%s failed; going on", what, exc_info=True)


def _remove_tree(path: Path) -> None:
    """Remove the directory tree ``path``, ignoring errors, however deep an
    environment made it (shutil.rmtree recurses once per level until Python 3.12)."""
    try:
        shutil.rmtree(path, ignore_errors=True)
    except RecursionError:
        subprocess.run(["rm", "-rf", "--one-file-system", "--", str(path)], check=False,
                       stdin=subprocess.DEVNULL, capture_output=True)  # fmt: skip


def _umount_quietly(target: Path) -> None:
    if not mounts.is_mounted(target):
        return
    try:
        mounts.umount(target)
    except MountError:
        mounts.umount(target, detach=True)


def _overlay_lowers(target: Path) -> list[Path] | None:
    """The lower dirs of the overlay mounted at ``target``, bottom to top (as
    :func:`~weenv.node.mounts.overlay_spec` takes them), from
    /proc/self/mountinfo; None if no overlay is mounted there."""
    found = mounts.mount_info(target)
    if found is None or found[0] != "overlay":
        return None
    options = found[2]
    for option in options.split(","):  # the kernel shows a "," inside a value as \054
        if option.startswith("lowerdir="):
            value = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), option[len("lowerdir="):])
            dirs, cur, chars = [], [], iter(value)
            for ch in chars:  # overlayfs escapes: "\x" is x; an unescaped ":" separates
                if ch == "\\":
                    cur.append(next(chars, ""))
                elif ch == ":":
                    dirs.append("".join(cur))
                    cur = []
                else:
                    cur.append(ch)
            dirs.append("".join(cur))
            return [Path(d) for d in reversed(dirs)]
    return None
