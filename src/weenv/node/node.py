"""The node: every environment on one machine, and the shared data path under them.

A :class:`Node` owns, for one ``WEENV_HOME`` (:mod:`weenv.node.home`), the parts
below and runs each operation as a short script over them:

- the node chunk cache (:class:`~weenv.node.data.cache.ChunkCache`), filled from the store;
- the lazy FUSE file system (:class:`~weenv.node.data.lazyfs.LazyFS`) that shows each
  group image as one file whose reads fetch missing chunks on demand;
- one shared read-only EROFS mount per group (:class:`~weenv.node.data.groups.GroupMounts`);
- the resolver (:mod:`weenv.node.resolver`): template name -> digest, manifests;
- admission (:mod:`weenv.node.admission`, and the provisioner's reservations);
- the snapshotter (:mod:`weenv.node.snapshotter`): each environment's directory,
  its upper dir (a subvolume with a quota on the node's disk, :mod:`weenv.node.disk`)
  and its overlay rootfs, planned apart from mounted (:mod:`weenv.host.mounts`);
- the container service (:mod:`weenv.node.runtime.container`): bundle, network
  namespace, runc container with an exec agent inside (:mod:`weenv.node.runtime.agent`);
- commands (:mod:`weenv.node.runtime.commands`) started through a launcher
  (:mod:`weenv.node.runtime.launcher`: the exec agent, or ``runc exec``);
- the environment table with timeouts and the reaper (:mod:`weenv.node.table`);
- the warm pool (:mod:`weenv.node.state.pool`, :mod:`weenv.node.state.warm`): environments of
  recently repeated creates made ahead up to ``runc create``, which a matching
  create only starts;
- crash recovery (:mod:`weenv.node.state.recovery`);
- state: captures of an environment's file system and snapshots published
  from them (:mod:`weenv.node.state.snapshot`), forks (:mod:`weenv.node.state.fork`),
  resets in place (:mod:`weenv.node.state.reset`), pause and resume with the cgroup
  freezer (:mod:`weenv.node.state.pause`).

State needed after a restart lives on disk and in the kernel: ``env.json``,
runc's state, the overlay and group mounts, the cgroups; the lazy file
system's connection is kept by the FUSE holder (:mod:`weenv.node.data.fuse.holder`).
A node started on a home whose previous node process was killed adopts its
running environments (:meth:`Node.start`).

Methods are blocking and thread-safe; the daemon calls them from worker threads.
Create and destroy undo every step on failure: no mount, cgroup, process or
directory of a failed environment remains.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from pydantic import ValidationError

from weenv.api.models import (
    DEFAULT_TIMEOUT_S,
    CreateRequest,
    CreateTiming,
    EnvironmentInfo,
    ExecResult,
    NodeStats,
    ProcessInfo,
    TemplateInfo,
)
from weenv.config import Paths, private_dir
from weenv.errors import (
    FULL_ERRNOS,
    BrokenError,
    CommandTimeoutError,
    DiskFullError,
    InvalidInputError,
    NotFoundError,
    RuntimeFailedError,
    StateError,
    disk_full,
)
from weenv.formats.manifest import Resources, RuntimeConfig, TemplateManifest, check_name
from weenv.host.mounts import overlay_lowers as _overlay_lowers  # noqa: F401  (where it always was)
from weenv.host.procroot import ProcessRootFS, pin_process
from weenv.host.rootfs import RootFS
from weenv.node.admission import Admission
from weenv.node.data.cache import ChunkCache
from weenv.node.data.groups import GroupMounts
from weenv.node.data.lazyfs import LazyFS
from weenv.node.data.peers import PEERS_HINT, PeerChunks
from weenv.node.data.prefetch import PACK_BYTES, Prefetcher
from weenv.node.disk import NodeDisk
from weenv.node.home import HomeLock
from weenv.node.manifests import KnownNames, NodeManifests
from weenv.node.provision import ProvisionConfig, Provisioner, ProvisionStats  # issue 5
from weenv.node.provision.profiles import TemplateProfiles  # issue 19
from weenv.node.resolver import Resolved, Resolver
from weenv.node.runtime import envs_dir, idmap, network
from weenv.node.runtime.agent import AgentBinary
from weenv.node.runtime.agent.client import AgentUnavailable
from weenv.node.runtime.bundle import AGENT_PATH
from weenv.node.runtime.commands import KEEP_FINISHED, Commands, collect
from weenv.node.runtime.container import Containers, check_capabilities
from weenv.node.runtime.launcher import Launchers
from weenv.node.runtime.process import DEFAULT_RETAIN, Process
from weenv.node.runtime.runtime import NodeRuntime
from weenv.node.runtime.spec import CommandSpec
from weenv.node.runtime.users import Identity
from weenv.node.snapshotter import Snapshotter
from weenv.node.state.fork import ForkResult, Forks
from weenv.node.state.pause import Pauses, check_running, release_after_from_env
from weenv.node.state.pool import pool_size_from_env
from weenv.node.state.recovery import Recovery, logged
from weenv.node.state.reset import Resets
from weenv.node.state.snapshot import (
    Capture,
    Captures,
    SnapshotInfo,
    check_snapshot_name,
    delete_snapshot,
    list_snapshots,
    new_snapshot_name,
)
from weenv.node.state.warm import WarmStarts, pool_key
from weenv.node.table import (  # noqa: F401  (CONTAINER_PREFIX: where it always was)
    CONTAINER_PREFIX,
    UNDELIVERED,
    Environment,
    EnvironmentTable,
    check_priority,
    container_id,
    save_info,
    staged_info,
)
from weenv.node.table import (
    follow as _follow,
)
from weenv.packaging.buildcache import store_lock
from weenv.store import Store, open_store

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Create:
    """One create: the shared request and what only in-process callers ask."""

    request: CreateRequest
    capabilities: tuple[str, ...]
    prefetch: bool
    undelivered: bool
    upper_from: Path | None = None
    """A capture's subvolume its upper dir starts from (a fork child), else empty."""
    sudo: bool = True
    """Whether a template with ``runtime.sudo`` gets it (build environments: no,
    their upper dir becomes a group and must hold unshifted owners)."""
    peer_hint: tuple[str, ...] = ()
    """The peers the cluster's placement says hold or fetch the template (:data:`PEERS_HINT`)."""


class Node:
    """All environments of one machine.  Use as a context manager or call
    :meth:`start` then :meth:`close`."""

    KEEP_FINISHED = KEEP_FINISHED
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
        runtime: str | None = None,
    ):
        """``max_environments``: creates past it raise :class:`CapacityError`
        (None: no limit).  ``output_retain_bytes``: output kept per background
        command that nobody reads (older output is dropped).  ``cache_bytes``:
        the node chunk cache's bound (default ``WEENV_CACHE_BYTES``, else 20% of
        its file system, at most 10 GiB).  ``prefetch_workers``,
        ``prefetch_record_s``, ``prefetch_pack_bytes``: see :mod:`weenv.node.data.prefetch`.  ``exec_agent``:
        run commands through an agent inside each environment (built into
        ``WEENV_CACHE`` on first use; False: always ``runc exec``).  ``pool_size``:
        environments the warm pool keeps created ahead per template (with the
        same resources and capabilities) created twice recently
        (:mod:`weenv.node.state.pool`; default ``WEENV_POOL_SIZE``, else 1; 0: no pool).
        ``disk_bytes``: the size of the environments' disk, which bounds the sum
        of their declared disk limits (:mod:`weenv.node.disk`; default
        ``WEENV_DISK_BYTES``, else 80% of the home file system's free space).
        ``runtime``: the OCI runtime setting, ``auto``, ``crun`` or ``runc``
        (:mod:`weenv.node.runtime.runtime`; default ``WEENV_RUNTIME``); chosen here,
        and :class:`ToolMissingError` when ``crun`` is asked for and cannot run."""
        self.paths = paths = paths or Paths.from_env()
        self.home = HomeLock(paths)
        self.store = store or open_store(paths.store_url, check=False)  # starts while the store is down
        self.peers = PeerChunks(self.store, groups=lambda: self.lazyfs.manifests())
        """Chunks from peer nodes before the store, once the node is in a cluster (:mod:`weenv.node.data.peers`)."""
        self.cache = ChunkCache(paths.chunk_cache, self.peers, max_bytes=cache_bytes)
        self.peers.held = self._held_for_peer
        self.lazyfs = LazyFS(paths.lazy_mountpoint, self.cache, run_dir=paths.run)  # + the FUSE holder
        self.groups = GroupMounts(paths.group_mounts, self.lazyfs, images=paths.node / "images")
        self.prefetch = Prefetcher(
            self.cache,
            self.store,
            self.lazyfs,
            workers=prefetch_workers,
            record_s=prefetch_record_s,
            pack_bytes=prefetch_pack_bytes,
            publish_lock=lambda: store_lock(self.paths, exclusive=False),
            on_group_complete=self.groups.assemble_if_complete,
            peers=self.peers,
        )
        self.manifests = NodeManifests(paths.node / "known", self.store)
        """Template and group manifests, in memory and in the node's home (:mod:`weenv.node.manifests`)."""
        self.names = KnownNames(paths.node / "known", self.store.url)
        """The digest each template name last resolved to, in the node's home."""
        self.resolver = Resolver(self.store, self.manifests, self.names)
        self.table = EnvironmentTable()
        self.admission = Admission(max_environments, count=lambda: len(self.table))
        self.provisioner = Provisioner(
            provisioning or ProvisionConfig.from_env(),  # quotas follow usage
            profiles=TemplateProfiles(paths.node / "usage", self.store),
        )
        self.envs = envs_dir.environments_dir(paths)
        """The environments' directories: ``node/envs``, or one reached through searchable directories
        only when a directory above the home is closed to others (:mod:`weenv.node.runtime.envs_dir`)."""
        self.disk = NodeDisk(paths.node / "disk.img", self.envs, size=disk_bytes)
        self.snapshotter = Snapshotter(self.envs, self.groups, self.disk)
        self.runtime = NodeRuntime.for_setting(runtime, paths.runtime_roots)
        """The OCI runtime: crun or runc (:mod:`weenv.node.runtime.runtime`)."""
        self.runc = self.runtime  # the name earlier code knows it by
        self.agent = AgentBinary(paths.cache, enabled=exec_agent)
        self.containers = Containers(self.runc, self.agent)
        self.launchers = Launchers(self.runc)
        self.commands = Commands(
            self.table, self.launchers, retain_bytes=output_retain_bytes, start_timeout=self.runc.command_timeout
        )
        self.warm = WarmStarts(
            self.resolver,
            self.snapshotter,
            self.containers,
            self.groups,
            size=pool_size_from_env() if pool_size is None else pool_size,
            may_fill=lambda ready: self.admission.may_pool(ready, self.provisioner.admitting),
        )
        self.pool = self.warm.pool
        """Environments created ahead (:mod:`weenv.node.state.pool`)."""
        self.recovery = Recovery(
            table=self.table,
            snapshotter=self.snapshotter,
            containers=self.containers,
            groups=self.groups,
            lazyfs=self.lazyfs,
            manifests=self.manifests,
            provisioner=self.provisioner,
            group_mounts=paths.group_mounts,
            lazy_mountpoint=paths.lazy_mountpoint,
        )
        self.captures = Captures(self.envs, disk=self.provisioner)
        self.pauses = Pauses(
            self.provisioner, containers=self.containers, commands=self.commands, release_after=release_after_from_env()
        )
        self.resets = Resets(self.snapshotter, self.containers, self.commands, self.provisioner, self.pauses)
        self.forks = Forks(self.captures, self._create_child)

    @property
    def max_environments(self) -> int | None:
        return self.admission.max_environments

    @property
    def exec_counts(self) -> dict[str, int]:
        """Commands started through each launcher (``runc``: the fallback)."""
        return self.launchers.counts

    # --- lifetime -------------------------------------------------------------------
    def start(self) -> Node:
        """Take the home, start the FUSE daemon, and either recover what an
        earlier node process of this home left running (it was killed) or
        clear it.  Idempotent.

        Recovery: if the home's FUSE holder (:mod:`weenv.node.data.fuse.holder`)
        still keeps the lazy file system's connection, this node takes it over
        (reads that were waiting are served again), adopts the group mounts and
        every environment whose container still runs (its pid 1, overlay,
        cgroup and files stay as they are; exec, files and destroy work on it),
        and removes the rest (environments half created or whose container
        died).  Without a holder (both processes were killed, or none ran),
        the lazy file system's connection is gone: environments reading any
        group through it are removed with the lazy mounts, and those whose
        every group is mounted directly from its assembled image (no FUSE on
        their read path) are adopted as above (:mod:`weenv.node.state.recovery`).

        One node per ``WEENV_HOME``: it holds an flock(2) on ``run/weenv.lock``
        until :meth:`close` (the daemon's node is that one).  Raises
        :class:`BusyError` if another node (a daemon, or a program using
        :class:`Node` directly) runs on this home, before touching anything of it."""
        if self.admission.started:
            return self
        for d in (self.paths.node, self.paths.run):  # closed to other users: see weenv.config
            private_dir(d)
        envs_dir.prepare(self.paths, self.envs)
        self.paths.group_mounts.mkdir(parents=True, exist_ok=True)
        self.home.take()
        self.admission.open()
        try:
            self.disk.open()  # adopted with the environments on it, or made
        except BaseException:
            self.home.release()
            raise
        self.provisioner.disk_capacity = self.disk.size
        self.resets.check_moves(self.envs)
        self.captures.open()  # an earlier node process's captures are gone with it
        self.pool.open()
        try:
            if self.lazyfs.take_over():
                self.recovery.recover()
            else:
                self.recovery.recover_direct()
            try:
                self.provisioner.start()
            except BaseException:
                self.lazyfs.stop()
                raise
        except BaseException:
            with logged("closing the node's disk after a failed start"):
                self.disk.close()
            self.home.release()
            raise
        self.admission.started = True
        return self

    def _held_for_peer(self, digest: str, wait_s: float) -> bytes | None:
        """What this node serves a peer asking for chunk ``digest``: the cache's
        chunk, waiting up to ``wait_s`` seconds for a fetch of it in progress
        here, whether one by one (:meth:`ChunkCache.held`) or in a prefetch pack
        streaming now (:meth:`Prefetcher.wait_packed`: a peer placed with the
        same template takes its chunks from this node while this node's pack
        arrives, rather than from the store).  None: not held."""
        deadline = time.monotonic() + wait_s
        data = self.cache.held(digest, wait_s=wait_s)
        if data is None and self.prefetch.wait_packed(digest, max(0.0, deadline - time.monotonic())):
            data = self.cache.held(digest, wait_s=max(0.0, deadline - time.monotonic()))
        return data

    def close(self) -> None:
        """Destroy every environment, unmount every group, stop the FUSE daemon,
        release the home.  Idempotent."""
        if not self.admission.started:
            return
        self.admission.close()  # refuses creates; a create waiting for the pool goes on without
        self.provisioner.cancel_waits()  # a create waiting for room ends (ClosedError)
        self.pool.close()  # its fills use the groups and runc
        self.admission.wait()  # creates under way end (their environments are destroyed below)
        errors = []
        for env_id in self.table.ids():
            try:
                self.destroy(env_id)
            except Exception as exc:  # keep going: close must release everything it can
                log.exception("destroying %s on close", env_id)
                errors.append(exc)
        self.resets.close()  # its background work on the environments' directories ends
        self.provisioner.close()
        self.prefetch.close()
        self.peers.close()
        try:
            self.groups.unmount_all()
        finally:
            try:
                self.lazyfs.stop()
                self.commands.reset()
                self.captures.close()
                self.disk.close()  # every environment is gone: its directory, subvolume and overlay
                envs_dir.release(self.paths, self.envs)
                self.containers.dns.close()
                self.runc.close()
            finally:
                self.admission.started = False
                self.home.release()
        if errors:
            raise errors[0]

    def __enter__(self) -> Node:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # --- create -----------------------------------------------------------------------
    def create(
        self,
        request: CreateRequest | str,
        *,
        capabilities: tuple[str, ...] | None = None,
        prefetch: bool = True,
        undelivered: bool = False,
        sudo: bool = True,
        **fields,
    ) -> EnvironmentInfo:
        """Create and start an environment.

        ``request``: the :class:`CreateRequest` the server and SDK share, or a
        template (name or digest) with the request's other fields as keyword
        arguments (``resources``, ``first_command``, ``timeout``, ``envs``,
        ``metadata``, ``priority``), checked as the request model checks them
        (:class:`InvalidInputError`).  ``timeout``: seconds from now after
        which :meth:`reap_expired` destroys it (default :data:`DEFAULT_TIMEOUT_S`).

        In-process callers only: ``capabilities``, the processes' capability
        set (default :meth:`Containers.default_capabilities`: Docker's where
        every environment has a user namespace, ``WEENV_USERNS``, else runc's;
        in a user namespace at most Docker's, :class:`InvalidInputError`
        otherwise; build environments pass
        :data:`~weenv.node.runtime.bundle.DOCKER_DEFAULT_CAPS`); ``prefetch``, record the
        template's prefetch profile on its first start and replay it on later
        cold starts (off for transient build environments, which never use the
        warm pool); ``undelivered``, the caller hands the environment on (a
        server's answer) and calls :meth:`delivered` once it has; until then a
        node recovering after a crash removes it instead of adopting it;
        ``sudo``, False: a template whose runtime has ``sudo`` runs without it
        (no user namespace; build environments, whose upper dir becomes a group).

        Returns its info with the create's phase timings (seconds) and bytes
        fetched.  Raises :class:`ClosedError` (not started, closing),
        :class:`CapacityError` (``max_environments`` run or start, or the
        provisioner refuses its resources), :class:`NotFoundError` for an
        unknown template, :class:`DiskFullError` when a step found the node's
        disk full (``ENOSPC``), :class:`MountError` or :class:`RuntimeFailedError`
        when a step fails otherwise; every step already done is undone first.
        """
        self.admission.check_started()
        req = _request(request, fields)
        hint = req.metadata.get(PEERS_HINT)
        if hint is not None:  # the gateway's word to this node, not a label of the environment
            req = req.model_copy(update={"metadata": {k: v for k, v in req.metadata.items() if k != PEERS_HINT}})
        peer_hint = tuple(p for p in (hint or "").split(",") if p)
        if capabilities is None:
            capabilities = self.containers.default_capabilities()
        elif self.containers.userns_all and sudo:
            check_capabilities(tuple(capabilities))
        return self._admitted_create(
            _Create(req, tuple(capabilities), prefetch, undelivered, sudo=sudo, peer_hint=peer_hint)
        )

    def _admitted_create(self, c: _Create) -> EnvironmentInfo:
        with self.admission.admit():
            t0 = time.perf_counter()
            resolved = self.resolver.resolve(c.request.template)
            try:
                return self._create(t0, resolved, c)
            except Exception:
                current = self.resolver.moved(c.request.template, resolved)
                if current is None:
                    raise
                self.pool.forget(pool_key(resolved.digest, c.request.resources, c.capabilities))
            # it started the digest the name had before; the name moved meanwhile (undone): start the new one
            return self._create(t0, Resolved(current), c)

    def _create(self, t0: float, resolved: Resolved, c: _Create) -> EnvironmentInfo:
        """One try of :meth:`create` on ``resolved``, from the warm pool if it has one."""
        req = c.request
        if (
            not c.prefetch
            or not c.sudo
            or c.upper_from is not None
            or req.network is not None
            or req.allow_out
            or req.deny_out
        ):
            # build environments, fork children and networks of the create's own: never from the warm pool
            return self._create_env(t0, resolved, c, None)
        with self.warm.taken(pool_key(resolved.digest, c.request.resources, c.capabilities)) as pooled:
            return self._create_env(t0, resolved, c, pooled)

    def _create_env(self, t0: float, resolved: Resolved, c: _Create, pooled) -> EnvironmentInfo:
        """The create script: admission, rootfs, container, first command, each
        step undone if a later one fails; ``pooled`` (owned now) is started
        instead of making the environment if it still can serve."""
        try:
            return self._create_env_undone(t0, resolved, c, pooled)
        except OSError as exc:  # undone: a full disk said so as any other step's failure does
            if exc.errno not in FULL_ERRNOS or isinstance(exc, DiskFullError):
                raise
            who = (
                "a fork child" if c.upper_from is not None else "a new environment"
            ) + f" of template {c.request.template}"
            raise disk_full(who, f"cannot create it (writing {exc.filename or 'its files'})", exc) from exc

    def _create_env_undone(self, t0: float, resolved: Resolved, c: _Create, pooled) -> EnvironmentInfo:
        """:meth:`_create_env`'s script, each step undone if a later one fails."""
        req, digest, timing = c.request, resolved.digest, CreateTiming()
        fetched0, chunks0 = self.cache.bytes_fetched, self.cache.chunks_fetched
        with contextlib.ExitStack() as undo:
            env_id = self.warm.own(pooled, undo) if pooled is not None else secrets.token_hex(6)
            if c.peer_hint:
                self.peers.hint(env_id, c.peer_hint)
            # chunks flow while the manifests load (not on a node that refuses new environments)
            if c.prefetch and self.provisioner.admitting and self.prefetch.begin_early(env_id, digest):
                undo.callback(self.prefetch.cancel, env_id)
            # its profile names its groups: their manifests load beside the template's
            # and the group manifests it carries are taken from it (checked) rather than fetched
            manifest, group_manifests = self.resolver.load(
                digest, self.prefetch.known_groups(digest), self.prefetch.known_manifests(digest)
            )
            timing.manifest_s = time.perf_counter() - t0
            res = req.resources or manifest.runtime.resources
            # CapacityError if full (after waiting up to admission_wait_s for room the latency objective refused)
            t_reserve = time.perf_counter()
            self.provisioner.reserve(env_id, res, priority=req.priority, template=digest, wait=True)
            timing.reserve_s = time.perf_counter() - t_reserve
            undo.callback(self.provisioner.detach, env_id)
            if c.prefetch:
                self.prefetch.begin(env_id, digest, list(zip(manifest.groups, group_manifests)))
            undo.callback(self.prefetch.cancel, env_id)
            undo.callback(
                self.prefetch.end_recording, env_id, publish=False
            )  # runs first: a failed create records nothing
            lowers = self.warm.start(pooled, manifest, group_manifests, timing) if pooled is not None else None
            runtime, egress = _network(req, manifest.runtime)
            if runtime.network:  # before anything is made (a pooled one was made by this node's policy)
                network.check_policy(self.containers.network_allowed)
            if lowers is None:
                userns = self.containers.wants_userns(manifest.runtime) and c.sudo
                lowers = self.snapshotter.prepare(
                    env_id,
                    manifest.groups,
                    group_manifests,
                    res.disk_bytes,
                    undo,
                    timing,
                    upper_from=c.upper_from,
                    userns=userns,
                )
                _check_command(req.template, runtime, self.snapshotter.dir(env_id) / "rootfs")
                self.containers.make(
                    env_id,
                    self.snapshotter.dir(env_id),
                    runtime,
                    res,
                    c.capabilities,
                    undo,
                    timing,
                    start=True,
                    egress=egress,
                )
            self.provisioner.attach(env_id, f"/{container_id(env_id)}")
            self.resolver.check(req.template, resolved)  # RefMoved: undone; create starts the new digest
            env_dir = self.snapshotter.dir(env_id)
            e = Environment(_info(env_id, manifest, digest, res, req, env_dir, egress), manifest, env_dir)
            e.lowers = lowers
            if runtime.network:
                e.info.address = network.env_address(env_id)
            if c.undelivered:  # before env.json: recovery never adopts it without the mark
                (e.dir / UNDELIVERED).touch()
            if req.first_command:
                timing.first_command_s = self._first_command(e, req.template)
            undo.pop_all()
        e.info.timing = timing.model_copy(
            update=dict(
                resolved_from=resolved.source,
                resolved_age_s=resolved.age_s,
                total_s=time.perf_counter() - t0,
                bytes_fetched=self.cache.bytes_fetched - fetched0,
                chunks_fetched=self.cache.chunks_fetched - chunks0,
                template_bytes=sum(g.image_size for g in group_manifests),
                template_stored_bytes=sum(g.stored_size for g in group_manifests),
            )
        )
        e.info.expires_at = time.time() + e.info.timeout_s
        save_info(e.dir, e.info)
        self.table.add(e)
        return e.info

    def _first_command(self, e: Environment, template: str) -> float:
        """Run a probe in the new environment ``e``: the exec agent's ``-t``
        (weenv's own binary, so an image without ``true`` passes), or ``true``
        without the agent; its seconds.  Raises :class:`RuntimeFailedError` if
        the container ended under it, :class:`InvalidInputError` if it failed."""
        t = time.perf_counter()
        agent = e.agent_socket.exists()
        probe = [AGENT_PATH, "-t"] if agent else ["true"]
        try:
            # through the agent alone: it serves only once pid 1 has exec'd the template's command,
            # where a runc exec fallback could answer in the instant before a failed exec ends pid 1
            result = collect(
                self.commands.start(
                    e, probe, timeout=60, primary_reader=True, launcher=self.launchers.agent if agent else None
                )
            )
        except (BrokenError, AgentUnavailable) as exc:  # the container ended under its first command
            raise RuntimeFailedError(
                f"template {template}: the environment stopped as it started (does its "
                f"command {list(e.template.runtime.command)!r} exist and keep running?): {exc}"
            ) from exc
        if result.exit_code != 0:
            raise InvalidInputError(
                f"template {template}: {probe[0]!r} exited {result.exit_code} inside the "
                f"environment: {result.stderr.decode(errors='replace').strip()}"
            )
        return time.perf_counter() - t

    def _remember_resolved(self, template: str, digest: str) -> None:
        self.resolver.remember(template, digest)

    # --- the environment table --------------------------------------------------------
    def set_timeout(self, env_id: str, timeout: float) -> EnvironmentInfo:
        """Destroy the environment ``timeout`` seconds from now (instead of when
        it was due).  Raises :class:`NotFoundError`, or :class:`InvalidInputError`
        for a timeout not in (0, 7 days]."""
        return self.table.set_timeout(env_id, timeout)

    def set_priority(self, env_id: str, priority: int) -> EnvironmentInfo:
        """Set the environment's priority for elastic provisioning (higher: grows
        first, frozen last).  Raises :class:`NotFoundError`, or
        :class:`InvalidInputError` for a priority not an int in [-1000, 1000], :class:`DiskFullError`
        (no room to save it: the old priority stands)."""
        priority = check_priority(priority)
        e = self.table.get(env_id)
        with e.lock:  # as set_timeout
            with staged_info(e.dir, e.info.model_copy(update={"priority": priority})):  # kept across a restart
                self.provisioner.set_priority(env_id, priority)
                e.info.priority = priority
        return e.info

    def reap_expired(self, now: float | None = None) -> list[str]:
        """Destroy every environment whose ``expires_at`` has passed (or, created
        with ``on_timeout="pause"``, pause it releasing its memory); their ids.
        Then release the memory of those paused longer than
        ``WEENV_PAUSE_RELEASE_S`` (:mod:`weenv.node.state.pause`)."""
        now = time.time() if now is None else now
        reaped = self.table.reap(self._expire, now)
        for e in self.pauses.due(self.table.all(), now):
            with contextlib.suppress(NotFoundError, StateError):  # destroyed or released meanwhile
                self.pauses.release(e)
                log.info("released the memory of environment %s (paused past WEENV_PAUSE_RELEASE_S)", e.info.id)
        return reaped

    def _expire(self, env_id: str) -> None:
        """What environment ``env_id``'s timeout does: destroy it, or pause it (``on_timeout``)."""
        e = self.table.get(env_id)
        if e.info.on_timeout == "pause" and e.info.state == "running":
            self.pauses.release(e)
        else:
            self.destroy(env_id)

    def get(self, env_id: str) -> EnvironmentInfo:
        """The environment's info; its ``state`` is runc's (``"stopped"`` once its
        first process died).  Raises :class:`NotFoundError`."""
        e = self.table.get(env_id)
        if e.info.state == "running":
            _follow(e, self.containers.state(e.container_id))
        return e.info

    def list(self) -> list[EnvironmentInfo]:
        """Every environment's info, ``state`` from runc (one ``runc list``)."""
        return self.table.infos(self.containers.status)

    def count(self) -> int:
        """How many environments the node holds (no runc call)."""
        return len(self.table)

    def ids(self) -> list[str]:
        """The ids of the environments the node holds (no runc call)."""
        return self.table.ids()

    def _env(self, env_id: str) -> Environment:
        return self.table.get(env_id)

    # --- commands ---------------------------------------------------------------------
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
        user: str | None = None,
    ) -> ExecResult:
        """Run ``command`` (argv, or a ``/bin/sh -c`` string) in environment ``env_id``.

        ``env`` adds to the template's variables; ``cwd`` defaults to its working
        dir; ``timeout`` in seconds kills the command and its children, reported
        as ``timed_out`` (or raised as :class:`CommandTimeoutError`).

        The output comes through pipes (:meth:`run`): past ``max_output`` bytes
        the command is killed (:class:`OutputLimitError`), and what a background
        descendant (``cmd &``) writes after the command returned goes to the
        node's :class:`~weenv.node.runtime.process.PipeSink`, never to a file on the host.
        """
        r = self.run(env_id, command, env=env, cwd=cwd, timeout=timeout, stdin=stdin, max_output=max_output, user=user)
        if r.timed_out and raise_on_timeout:
            raise CommandTimeoutError(f"command timed out after {timeout} s in {env_id}")
        return r

    def spawn(
        self, env_id: str, command: CommandSpec | list[str] | str, *, primary_reader: bool = False, **fields
    ) -> Process:
        """Start ``command`` in environment ``env_id`` and return once it runs
        (or could not start: then its pid is 0 and it has already ended with
        127/126 and the reason on stderr, as runc words it).  ``command``: a
        :class:`~weenv.node.runtime.spec.CommandSpec` (passed whole to the
        launcher), or its ``command`` (argv or a ``/bin/sh -c`` string) with its
        other fields (``env``, ``cwd``, ``timeout``, ``stdin``, ``stdin_open``,
        ``tag``, ``user``, ``tty``) as keyword arguments.

        Its output streams through ``process.log`` (see :mod:`weenv.node.runtime.process`);
        ``stdin_open`` makes stdin a pipe for :meth:`Process.write_stdin`;
        ``primary_reader`` attaches a reader that sees every event (a foreground
        stream; read it to the end or detach it).  The process is kept under
        its pid (:meth:`process`) while it runs and a while after.

        ``user``: who it runs as, a name of the environment's ``/etc/passwd``
        or ``"UID[:GID]"`` (default: the template's user), with that user's
        gid, supplementary groups (``/etc/group``) and ``HOME``/``USER``/
        ``LOGNAME`` (:mod:`weenv.node.runtime.users`).  Raises :class:`NotFoundError`
        for an unknown environment, :class:`UnknownUserError` for a user it
        does not have and :class:`InvalidInputError` for a bad command,
        variable, directory, user or terminal size.

        ``tty``: ``(cols, rows)``: run it on a new pseudo-terminal of that size
        inside the environment (its stdin, stdout and stderr; ``stdin`` and
        ``stdin_open`` do not apply): its output is all ``stdout`` events,
        :meth:`Process.write_stdin` types into it and :meth:`Process.resize`
        resizes it.  Needs the exec agent (:class:`StateError` without it).
        """
        e = self.table.get(env_id)
        with e.gate.passing():  # not while a reset or pause replaces or freezes its container
            check_running(e)
            p = self.commands.start(e, command, primary_reader=primary_reader, **fields)
            self.commands.keep(e, p)  # before the gate opens: a reset now kills and forgets it
        self.prefetch.watch_command(env_id, p.wait)
        return p

    def process(self, env_id: str, pid: int) -> Process:
        """The streamed or background command ``pid`` of ``env_id``; :class:`NotFoundError` if unknown."""
        return self.commands.get(self.table.get(env_id), pid)

    def processes(self, env_id: str) -> list[ProcessInfo]:
        return self.commands.infos(self.table.get(env_id))

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
        user: str | None = None,
    ) -> ExecResult:
        """Like :meth:`exec`, through a streamed process whose output is counted
        as it comes: past ``max_output`` bytes (stdout + stderr) the command tree
        is killed and :class:`OutputLimitError` raised, so a huge output never
        fills the daemon's memory or disk."""
        p = self.spawn(env_id, command, env=env, cwd=cwd, timeout=timeout, stdin=stdin, primary_reader=True, user=user)
        return collect(p, max_output)

    def collect(self, p: Process, max_output: int = 64 << 20) -> ExecResult:
        """Wait for ``p`` (spawned with ``primary_reader``) and return its result
        with its whole output, as :meth:`run` does (:class:`OutputLimitError`
        past ``max_output`` bytes)."""
        return collect(p, max_output)

    # --- templates and files ----------------------------------------------------------
    def templates(self) -> list[TemplateInfo]:
        """The store's templates by name (name and digest only)."""
        return self.resolver.templates()

    def template(self, name: str) -> TemplateInfo:
        """One template (name or digest) with its groups, runtime and sizes; :class:`NotFoundError` if unknown."""
        return self.resolver.template(name)

    def files(self, env_id: str) -> RootFS:
        """File access inside the environment's root (paths cannot escape it;
        owners shifted into its id range, if it has one)."""
        e = self.table.get(env_id)
        return RootFS(e.rootfs, idmap.range_of(e.dir) or 0)

    def mounted_files(self, env_id: str) -> RootFS:
        """File access inside the environment as its processes see it: its root
        *with its mounts* (``/proc``, ``/dev``, ``/dev/shm``: through its first
        process's root, :class:`~weenv.host.procroot.ProcessRootFS`), confined as
        :meth:`files`; the bare root (:meth:`files`) while it has no running
        process.  Raises :class:`NotFoundError` if unknown."""
        e = self.table.get(env_id)
        shift = idmap.range_of(e.dir) or 0
        for _attempt in range(2):
            pid = e.init_pid
            if pid is None:
                state = self.runc.state(e.container_id) or {}
                if state.get("status") not in ("running", "paused") or not state.get("pid"):
                    return RootFS(e.rootfs, shift)
                pid = e.init_pid = int(state["pid"])
            try:
                return ProcessRootFS(pid, expect_cgroup=f"/{e.container_id}", shift=shift)
            except NotFoundError:
                e.init_pid = None  # restarted or gone: ask runc again
        return RootFS(e.rootfs, shift)

    def open_port(self, env_id: str, port: int) -> socket.socket:
        """A TCP connection to ``port`` on the environment's own loopback (inside
        its network namespace, with or without network; E2B's ``get_host``).
        Raises :class:`NotFoundError` (unknown or stopped), ``OSError`` (nothing listens)."""
        e = self.table.get(env_id)
        netns = e.dir / network.NETNS_FILE
        if netns.exists():
            return network.open_in(netns, port, timeout=5.0)
        # No network of its own: the namespace runc made, found through its first
        # process, pinned by a pidfd known to be in the environment's cgroup (a
        # number runc reported may name another process by the time it is used).
        state = self.runc.state(e.container_id)
        if not state or not state.get("pid"):
            raise NotFoundError(f"environment {env_id!r} is not running")
        pidfd = pin_process(int(state["pid"]), expect_cgroup=f"/{e.container_id}")
        try:
            return network.open_in(pidfd, port, timeout=5.0)
        except ProcessLookupError:
            raise NotFoundError(f"environment {env_id!r} is not running") from None
        finally:
            os.close(pidfd)

    def user(self, env_id: str, user: str | None = None) -> Identity:
        """``user`` (a name or ``"UID[:GID]"``; None: the template's) inside the
        environment: uid, gid, groups, home.  Raises :class:`NotFoundError`,
        :class:`UnknownUserError` or :class:`InvalidInputError`."""
        return self.commands.identity(self.table.get(env_id), user)

    # --- stop and destroy -------------------------------------------------------------
    def stop(self, env_id: str) -> Path:
        """Kill every process of environment ``env_id``, remove its container and
        unmount its rootfs; return its upper dir (the environment's own changes in
        overlayfs's upper-dir format: whiteouts, ``trusted.overlay.*`` xattrs),
        which stays on disk, no longer in use, until :meth:`destroy`.
        Idempotent.  Raises :class:`NotFoundError` if unknown."""
        e = self.table.get(env_id)
        with e.lock:
            self.containers.delete(env_id, e.dir)
            self.snapshotter.unmount(e.dir)
            self.containers.teardown_network(env_id, e.dir)
            e.info.state = "stopped"
        return e.upper

    def delivered(self, env_id: str) -> None:
        """The environment created ``undelivered`` reached its client: a
        recovering node adopts it from now on.  A gone environment is fine."""
        with contextlib.suppress(FileNotFoundError):
            (self.snapshotter.dir(env_id) / UNDELIVERED).unlink()

    def destroy(self, env_id: str) -> None:
        """Kill the environment's processes and remove its container, cgroup,
        overlay and directory.  Raises :class:`NotFoundError` if unknown."""
        e = self.table.pop(env_id)
        self.resets.forget(e)  # before its lock: a preparation waiting for it makes nothing
        with e.lock:
            procs = list(e.processes.values())
            for p in procs:
                p.log.abandon()
            try:
                self.provisioner.detach(env_id)  # before the cgroup goes
                self.pauses.thaw_for_destroy(e)  # a frozen process dies once thawed
                self.containers.delete(env_id, e.dir)
                for p in procs:  # their helpers exit with the container's processes
                    p.wait(10)
                self.snapshotter.unmount(e.dir)
            finally:
                self.commands.users.forget(RootFS(e.rootfs))
                self.prefetch.cancel(env_id)
                self.snapshotter.release(e.template.groups, e.lowers)
                self.containers.teardown_network(env_id, e.dir)
                self.snapshotter.remove_dir(e.dir)
                self.pauses.forget(e)
                self.pool.wake()  # room for the pool, if max_environments held it back

    # --- state: snapshot, fork, reset, pause (the mechanisms: snapshot.py, fork.py, reset.py, pause.py) ---
    def snapshot(self, env_id: str, name: str | None = None) -> SnapshotInfo:
        """Capture environment ``env_id``'s file system (frozen for milliseconds)
        and publish it as template ``name`` (default ``snapshot-<hex>``); the
        capture stays on this node for :meth:`reset`.  Raises :class:`NotFoundError`,
        :class:`StateError` (not running or paused), :class:`InvalidInputError`
        (bad name), :class:`BusyError` (the name is another template's or another
        environment's snapshot, checked before the capture: :func:`check_snapshot_name`),
        :class:`CapacityError` (the node's disk cannot hold its capture beside the
        environments' limits and the other snapshots' captures: :meth:`Captures.count`,
        checked before publishing), :class:`DiskFullError` (disk full: it runs on,
        files kept) and what publishing raises (nothing is kept then)."""
        name = new_snapshot_name() if name is None else check_name(name)  # "" too: the request model's rule
        e = self.table.get(env_id)
        check_snapshot_name(self.store, name, env_id)
        c = self.captures.take(e)
        try:
            held = self.captures.count(c, name)
            info = self.captures.publish(
                c,
                self.store,
                name,
                workdir=self.paths.node,
                publish_lock=lambda: store_lock(self.paths, exclusive=False),
            )
        except BaseException:
            self.captures.drop(c)
            raise
        self.captures.keep(name, c)
        self.resets.prepare(e, c.path)  # a reset to it swaps in an upper dir made ahead
        info.capture_bytes = held
        return info

    def snapshots(self) -> list[SnapshotInfo]:
        """Every snapshot in the store."""
        return list_snapshots(self.store)

    def delete_snapshot(self, name: str) -> None:
        """Remove snapshot ``name`` from the store (gc takes its data) and its capture from this node.
        Raises :class:`NotFoundError`, or :class:`InvalidInputError` for a template that is not a snapshot."""
        delete_snapshot(self.store, name)
        self.captures.forget(name)

    def fork(self, env_id: str, count: int, *, timeout: float | None = None) -> ForkResult:
        """``count`` new environments starting from environment ``env_id``'s file
        system as it is now.  Raises :class:`NotFoundError`, :class:`InvalidInputError`
        (count not in [1, ``WEENV_MAX_FORK``]), :class:`StateError`; each child's error is in the result."""
        self.admission.check_started()
        return self.forks.fork(self.table.get(env_id), count, timeout)

    def _create_child(self, c: Capture, timeout: float | None) -> EnvironmentInfo:
        info = c.info
        req = CreateRequest(
            template=c.template_digest,
            resources=info.resources,
            envs=info.envs,
            metadata=info.metadata,
            priority=info.priority,
            network=info.network,
            allow_out=info.allow_out,
            deny_out=info.deny_out,
            public_traffic=info.public_traffic,
            timeout=info.timeout_s if timeout is None else timeout,
        )
        return self._admitted_create(
            _Create(req, self.containers.default_capabilities(), False, False, upper_from=c.path)
        )

    def reset(self, env_id: str, snapshot: str | None = None) -> EnvironmentInfo:
        """Environment ``env_id`` back in place to its template's state, or to
        snapshot ``snapshot``'s (taken on this node, of the same template); its
        ``timing.total_s`` is the reset's seconds (``overlay_s``: its new upper dir
        and overlay, ``runtime_s``: its container run again).  Raises :class:`NotFoundError`
        (also: no such snapshot here), :class:`InvalidInputError` (another
        template's snapshot, or a name that is no template name), :class:`DiskFullError`
        (the node's disk has no room for its state: nothing is done), :class:`MountError`,
        :class:`RuntimeFailedError`."""
        if snapshot is not None:
            check_name(snapshot)  # as the request model checks it
        e = self.table.get(env_id)
        with contextlib.ExitStack() as pins:
            upper_from = None
            if snapshot is not None:  # kept on disk until the reset is done (a delete_snapshot waits)
                c = pins.enter_context(self.captures.pinned(snapshot))
                if c.template_digest != e.info.template_digest:
                    raise InvalidInputError(
                        f"snapshot {snapshot!r} is of template {c.template.name} "
                        f"({c.template_digest}), not of {env_id}'s ({e.info.template_digest})"
                    )
                upper_from = c.path
            t = self.resets.reset(e, upper_from)
        e.info.timing = CreateTiming(overlay_s=t.overlay_s, runtime_s=t.runtime_s, total_s=t.total_s)
        return e.info

    def pause(self, env_id: str, *, release_memory: bool = False) -> EnvironmentInfo:
        """Freeze environment ``env_id`` (processes and memory kept); with
        ``release_memory``, end its processes and keep its files instead (also
        of one paused already; :mod:`weenv.node.state.pause`).  Raises :class:`NotFoundError`, :class:`StateError`,
        :class:`DiskFullError` (the node's disk has no room for its state: it runs on, untouched)."""
        return self.pauses.pause(self.table.get(env_id), release_memory=release_memory)

    def resume(self, env_id: str, *, timeout: float | None = None) -> EnvironmentInfo:
        """Thaw the paused ``env_id`` (or, its memory released, run its first process
        again over its files), its timeout ``timeout`` s from now (default its own); it stayed
        counted while paused (:mod:`weenv.node.state.pause`).  Raises :class:`NotFoundError`, :class:`StateError`,
        :class:`CapacityError` (only if it was not provisioned; it stays paused), :class:`DiskFullError`
        (the node's disk has no room for its state: it stays paused)."""
        return self.pauses.resume(self.table.get(env_id), timeout)

    # --- stats and caches -------------------------------------------------------------
    def disk_usage(self, env_id: str) -> tuple[int, int]:
        """``(used, total)`` bytes: what the environment wrote (its upper dir's
        quota usage: data and metadata, counted by the kernel) and its disk
        limit (``resources.disk_bytes``).  Raises :class:`NotFoundError`."""
        e = self.table.get(env_id)
        try:
            used, limit = self.snapshotter.usage(e.dir)
        except FileNotFoundError:  # destroyed meanwhile
            raise NotFoundError(f"no environment {env_id!r}") from None
        return used, limit or e.info.resources.disk_bytes

    def provision_stats(self, env_id: str | None = None) -> ProvisionStats:
        """Quotas, usage history and events of elastic provisioning (:class:`NotFoundError` for an unknown id)."""
        return self.provisioner.stats(env_id)

    def stats(self) -> NodeStats:
        pool = self.pool.stats()
        return NodeStats(
            environments=len(self.table),
            groups_mounted=self.groups.mounted(),
            cache_chunks_fetched=self.cache.chunks_fetched,
            cache_bytes_fetched=self.cache.bytes_fetched,
            exec_agent=self.exec_counts["agent"],
            exec_runc=self.exec_counts["runc"],
            runtime=self.runtime.name,
            exec_agent_error=self.agent.error,
            pool_ready=pool.ready,
            pool_hits=pool.hits,
            pool_misses=pool.misses,
            chunks=asdict(self.peers.stats()),
        )

    def drop_caches(self) -> None:
        """Remove the warm pool's environments, unmount groups no environment
        uses, empty the node chunk cache, the kernel's page cache of the group
        images and the manifests and names the node knows (for cold-start measurements).  Raises :class:`InvalidInputError` while any
        environment runs."""
        self._check_idle()  # before the pool is drained for nothing
        self.pool.drain()  # its environments hold group mounts
        with self.table.lock:  # no create ends meanwhile
            self._check_idle(locked=True)
            self.groups.unmount_unused()
            self.groups.remove_images()
            self.lazyfs.drop_page_cache()
            self.cache.clear()
            self.resolver.clear()

    def _check_idle(self, locked: bool = False) -> None:
        if self.table.count_locked() if locked else len(self.table):
            raise InvalidInputError("cannot drop the node cache while environments run")


def _request(request: CreateRequest | str, fields: dict) -> CreateRequest:
    """The create's request: ``request`` itself, or one made of a template and
    ``fields`` (:class:`InvalidInputError` for what the model refuses); its
    variables' names and values as commands need them."""
    if isinstance(request, CreateRequest):
        if fields:
            raise TypeError(f"Node.create(CreateRequest) takes no {', '.join(sorted(fields))}")
    else:
        unknown = set(fields) - set(CreateRequest.model_fields) | {"template"} & set(fields)
        if unknown:
            raise TypeError(f"Node.create() got unexpected keyword arguments {sorted(unknown)}")
        try:
            request = CreateRequest(template=request, **{k: v for k, v in fields.items() if v is not None})
        except ValidationError as exc:
            raise InvalidInputError(f"bad create request: {_first_error(exc)}") from None
    for key, value in request.envs.items():
        if not key or "=" in key or "\0" in key or "\0" in value:
            raise InvalidInputError(f"bad environment variable {key!r}")
    return request


def _check_command(template: str, runtime: RuntimeConfig, rootfs: Path) -> None:
    """Raise :class:`RuntimeFailedError` when the template's command is an
    absolute path its root file system ``rootfs`` lacks: a first process that
    cannot exec ends the environment at once, and a probe may answer before it
    has (an init such as tini execs first), so it is refused before a container
    is made.  A bare name (found through ``PATH`` at exec) is not checked."""
    command = runtime.command
    if command and command[0].startswith("/") and not RootFS(rootfs).exists(command[0]):
        raise RuntimeFailedError(
            f"template {template}: its command {list(command)!r} names {command[0]!r}, which is not in its file system"
        )


def _network(req: CreateRequest, runtime: RuntimeConfig) -> tuple[RuntimeConfig, network.Egress]:
    """The runtime config and egress limits of a create: ``req.network`` (None:
    the template's) or a non-empty ``allow_out`` gives it network; without
    ``network`` True only ``allow_out`` is reachable (E2B: internet off is
    ``denyOut 0.0.0.0/0``, and allowed entries win)."""
    internet = runtime.network if req.network is None else req.network
    on = internet or bool(req.allow_out)
    if on != runtime.network:
        runtime = runtime.model_copy(update={"network": on})
    return runtime, network.egress_of(internet, req.allow_out, req.deny_out)


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err.get("loc", ()))
    return f"{where}: {err.get('msg')}" if where else str(err.get("msg"))


def _info(
    env_id: str,
    manifest: TemplateManifest,
    digest: str,
    res: Resources,
    req: CreateRequest,
    env_dir: Path,
    egress: network.Egress,
) -> EnvironmentInfo:
    """A new environment's info (its timing filled in when its create ends), with
    its network policy as ``egress`` (:func:`_network`) says (what a fork child inherits)."""
    return EnvironmentInfo(
        id=env_id,
        template=manifest.name,
        template_digest=digest,
        created_at=time.time(),
        state="running",
        rootfs=str(env_dir / "rootfs"),
        resources=res,
        timing=CreateTiming(),
        timeout_s=DEFAULT_TIMEOUT_S if req.timeout is None else float(req.timeout),
        envs=req.envs,
        metadata=req.metadata,
        priority=req.priority,
        public_traffic=req.public_traffic,
        network=egress.internet,
        allow_out=[*egress.allow, *egress.domains],
        deny_out=list(egress.deny),
        on_timeout=req.on_timeout,
    )
