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
import time
from pathlib import Path

from weenv.api.models import (
    EnvironmentInfo,
)
from weenv.config import Paths, private_dir, settings
from weenv.errors import (
    NotFoundError,
    StateError,
)
from weenv.host.mounts import overlay_lowers as _overlay_lowers  # noqa: F401  (where it always was)
from weenv.host.rootfs import RootFS
from weenv.node.admission import Admission
from weenv.node.data.cache import ChunkCache
from weenv.node.data.groups import GroupMounts
from weenv.node.data.lazyfs import LazyFS
from weenv.node.data.peers import PeerChunks
from weenv.node.data.prefetch import PACK_BYTES, Prefetcher
from weenv.node.disk import NodeDisk
from weenv.node.home import HomeLock
from weenv.node.manifests import KnownNames, NodeManifests
from weenv.node.node.commands import CommandsAndFiles
from weenv.node.node.create import CreateScript
from weenv.node.node.operations import EnvironmentOperations
from weenv.node.provision import ProvisionConfig, Provisioner
from weenv.node.provision.profiles import TemplateProfiles
from weenv.node.resolver import Resolver
from weenv.node.runtime import envs_dir
from weenv.node.runtime.agent import AgentBinary
from weenv.node.runtime.commands import KEEP_FINISHED, Commands
from weenv.node.runtime.container import Containers
from weenv.node.runtime.launcher import Launchers
from weenv.node.runtime.process import DEFAULT_RETAIN
from weenv.node.runtime.runtime import NodeRuntime
from weenv.node.snapshotter import Snapshotter
from weenv.node.state.fork import Forks
from weenv.node.state.handoff import Handoffs
from weenv.node.state.pause import Pauses, release_after_from_env
from weenv.node.state.pool import pool_size_from_env
from weenv.node.state.recovery import Recovery, logged
from weenv.node.state.reset import Resets
from weenv.node.state.resize import Resizes
from weenv.node.state.snapshot import (
    Captures,
)
from weenv.node.state.warm import WarmStarts
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


class Node(CreateScript, CommandsAndFiles, EnvironmentOperations):
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
        self.handoffs = Handoffs(
            self.captures,
            self.store,
            workdir=paths.node,
            publish_lock=lambda: store_lock(self.paths, exclusive=False),
            enabled=settings().runtime.pause_publish,
        )
        """Memory-released pauses published to the store, resumed on any node (:mod:`weenv.node.state.handoff`)."""
        self.pauses = Pauses(
            self.provisioner,
            containers=self.containers,
            commands=self.commands,
            release_after=release_after_from_env(),
            handoffs=self.handoffs,
        )
        self.resets = Resets(self.snapshotter, self.containers, self.commands, self.provisioner, self.pauses)
        self.forks = Forks(self.captures, self._create_child)
        self.resizes = Resizes(self.provisioner, self.disk)

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
                self.destroy(env_id, keep_published=True)  # a node stopping is no destroy of the cluster's
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

    def destroy(self, env_id: str, *, keep_published: bool = False) -> None:
        """Kill the environment's processes and remove its container, cgroup,
        overlay and directory, and the published pause of one whose memory was
        released (unless ``keep_published``: the node stops, the environment
        lives on in the store).  Raises :class:`NotFoundError` if unknown."""
        e = self.table.pop(env_id)
        if e.info.memory_released and self.handoffs.enabled and not keep_published:
            self.handoffs.consumed(env_id)
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
