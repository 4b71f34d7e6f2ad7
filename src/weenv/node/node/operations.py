"""Operations over :class:`~weenv.node.node.Node`'s environments: snapshot,
fork, reset, pause, resume (the mechanisms are :mod:`weenv.node.state`'s), and
the node's stats and caches (:class:`EnvironmentOperations`, a part of the node)."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import asdict

from pydantic import ValidationError

from weenv.api.models import (
    CreateTiming,
    EnvironmentInfo,
    NodeStats,
    ProfileReset,
    ResourcesUpdate,
)
from weenv.errors import (
    BusyError,
    InvalidInputError,
    NotFoundError,
)
from weenv.formats.manifest import check_name
from weenv.node.node.create import _Create, _first_error
from weenv.node.provision import ProvisionStats
from weenv.node.state.fork import ForkResult
from weenv.node.state.snapshot import (
    SnapshotInfo,
    check_snapshot_name,
    delete_snapshot,
    list_snapshots,
    new_snapshot_name,
)
from weenv.node.table import save_info
from weenv.packaging.buildcache import store_lock

log = logging.getLogger(__name__)


class EnvironmentOperations:
    """Snapshot, fork, reset, pause, resume, stats and caches; a part of
    :class:`~weenv.node.node.Node`, over its collaborators."""

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

    def published_pause(self, env_id: str) -> EnvironmentInfo:
        """The info, as it was paused, of ``env_id`` published to the store when its
        memory was released (:mod:`weenv.node.state.handoff`).  Raises :class:`NotFoundError`."""
        return self.handoffs.record(env_id)[1]

    def resume_published(
        self, env_id: str, *, timeout: float | None = None, metadata: dict[str, str] | None = None
    ) -> EnvironmentInfo:
        """Resume on this node the environment ``env_id`` whose memory was released
        and published on another node (gone, or full): an environment of its
        snapshot with its id, variables, metadata (``metadata`` over them),
        resources and network policy, its first process started anew over its
        files, its timeout ``timeout`` s from now (default its own), its template
        name its own (its digest its snapshot's); its record is consumed.  Raises
        :class:`BusyError` if ``env_id`` is on this node, :class:`NotFoundError` if
        the store holds no such pause, and what :meth:`create` raises
        (:class:`CapacityError`...: the record is kept)."""
        self.admission.check_started()
        if env_id in self.table.ids():
            raise BusyError(
                f"environment {env_id} is on this node: resume it here (POST /v1/environments/{env_id}/resume)"
            )
        digest, record, req = self.handoffs.request(env_id, timeout=timeout, metadata=metadata or {})
        caps = self.containers.default_capabilities()
        info = self._admitted_create(_Create(req, caps, False, False, env_id=env_id))
        e = self.table.get(env_id)
        with e.lock:  # named by its template as before (its digest is its snapshot's: what its files are)
            e.info.template = record.template
            save_info(e.dir, e.info)
        self.handoffs.consumed(env_id, digest)
        return info

    def set_resources(self, env_id: str, resources: ResourcesUpdate | dict) -> EnvironmentInfo:
        """Resize the running ``env_id`` live: cgroup limits and disk quota, within
        the node's admission (fields left out stay; :mod:`weenv.node.state.resize`).
        Raises :class:`NotFoundError`, :class:`StateError` (paused, not running, or
        using more than the new limits allow), :class:`InvalidInputError` (a bad
        value, or beyond the node), :class:`CapacityError` (the node cannot hold
        it); nothing is changed then."""
        if not isinstance(resources, ResourcesUpdate):
            try:
                resources = ResourcesUpdate.model_validate(resources)
            except ValidationError as exc:
                raise InvalidInputError(f"bad resources: {_first_error(exc)}") from None
        return self.resizes.resize(self.table.get(env_id), resources)

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

    def reset_profile(self, name: str) -> ProfileReset:
        """Forget the usage profile of template ``name`` (name or digest) on this node and in
        the store (:meth:`Provisioner.reset_profile`); :class:`NotFoundError` if the template is unknown."""
        digest = self.template(name).digest
        return ProfileReset(template=name, digest=digest, had_profile=self.provisioner.reset_profile(digest))

    def provision_stats(self, env_id: str | None = None) -> ProvisionStats:
        """Quotas, usage history and events of elastic provisioning (:class:`NotFoundError` for an unknown id)."""
        return self.provisioner.stats(env_id)

    def stats(self) -> NodeStats:
        pool = self.pool.stats()
        cache = self.cache.stats()
        return NodeStats(
            environments=len(self.table),
            groups_mounted=self.groups.mounted(),
            cache_chunks_fetched=self.cache.chunks_fetched,
            cache_bytes_fetched=self.cache.bytes_fetched,
            cache_reads_hit=cache.reads_hit,
            cache_reads_missed=cache.reads_missed,
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
