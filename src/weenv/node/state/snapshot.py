"""Snapshots of running environments' file systems: captures, and snapshots published as templates.

A **capture** is an environment's own changes to its template (its overlay
upper dir: files written, whiteouts of files deleted, opaque directories that
replaced a lower one) at one instant.  Taking one (:meth:`Captures.take`):

1. freeze the environment's cgroup (the freezer: every process, its commands'
   groups included, stops where it is; memory kept), unless it is paused already;
2. snapshot its disk subvolume read-only (:meth:`NodeDisk.snapshot`): the
   kernel writes the subvolume's dirty data back first (that is the sync) and
   copies metadata only, however many bytes the environment wrote;
3. thaw it.

The environment is stopped only for steps 1-3 (``pause_s``, milliseconds).
Captures live on the node's disk in ``envs/.captures/<id>`` (a subvolume with
``upper/`` and ``work/``, as an environment's; the directory is there only
while a capture is); a new environment's upper dir
made from one (:meth:`NodeDisk.clone`) shares its extents, so a fork child or a
reset costs metadata, not a copy of what the parent wrote.  They are the
node's own: they go with its disk, and a node started on a home removes those
an earlier node process left.

A capture kept for a snapshot (:meth:`Captures.keep`: what reset goes back to)
pins the extents the environment had, however the environment changes or
whether it is destroyed, so it is counted against the node's disk with the
environments' declared limits (:meth:`Captures.count`, the provisioner's
:meth:`~weenv.node.provision.Provisioner.hold_disk`: the bytes its tree
references, ``du``'s count, :meth:`NodeDisk.tree_bytes`) before the snapshot is
published, refused with :class:`CapacityError` if the node's disk × its
overcommit cannot hold it, and freed when it is dropped (the snapshot
deleted, re-taken under its name, or the node closed).  A fork's capture is
not counted: it lives only until its children have their upper dirs, and
each child's declared limit is.

A **snapshot** is a capture published to the store as a template
(:meth:`Captures.publish`): the environment's template's groups with the
capture on top as one more layer group (the upper dir cleaned of overlayfs's
bookkeeping, :func:`~weenv.packaging.upperdir.clean_upper`, then an EROFS image
chunked like any group: whiteouts and opaque markers in overlayfs's own form,
which the kernel applies as it does in any group), and the runtime config of
the environment (its template's, with the create's variables and resources,
and ``network`` true only if the environment reached the network without a
``deny_out`` list: a create from a snapshot asks its own network as any create
does, and by default gets none when its parent had none, or only an
``allow_out`` list, or a ``deny_out`` list, which a template cannot hold).
So a snapshot starts on any node that reaches the store, lazily like any
template, is listed and garbage-collected as one, and its top group's
``source`` (``type: snapshot``, the environment, its template's digest) tells
snapshots apart from built templates (:func:`list_snapshots`).

A snapshot's name is a template name in a store other nodes and users share, so
a snapshot never moves a ref it does not own (:func:`check_snapshot_name`): it
takes a name no template has, or the name of an earlier snapshot *of the same
environment* (its top group's ``source.environment``: re-taking a checkpoint
under its name).  A name held by a built template (``task``), an E2B
template's, or another environment's snapshot is refused with
:class:`BusyError` (HTTP 409) before anything is captured; to reuse
another's snapshot name, delete that snapshot first.  The ref is written with
the store's compare-and-swap (:meth:`Store.swap_ref`), expecting what the check
before publishing saw: of two snapshots publishing one name at once (on one
node or two), one wins and the other gets :class:`BusyError`, its published
data left for gc.  (``oci://``'s tags have no compare-and-swap: there the
check and the write can still race.)  The default name, ``snapshot-<12 hex>``,
is fresh.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from weenv.api.models import EnvironmentInfo, SnapshotInfo
from weenv.errors import FULL_ERRNOS, BusyError, InvalidInputError, NotFoundError, StateError, disk_full
from weenv.formats.manifest import TemplateManifest, canonical_json, check_name
from weenv.node.cgroups import open_cgroups
from weenv.node.disk import SUBVOLUME, NodeDisk
from weenv.node.provision import Provisioner
from weenv.node.runtime import idmap
from weenv.node.table import Environment
from weenv.packaging.group import build_group, load_group
from weenv.packaging.template import load_template
from weenv.packaging.upperdir import clean_upper
from weenv.store import Store
from weenv.store.lease import Lease, LeasedStore

log = logging.getLogger(__name__)

CAPTURES = ".captures"
"""The captures' directory in the environments' directory (a dot name: never an environment's id)."""
SNAPSHOT_SOURCE = "snapshot"
"""``source.type`` of a snapshot's top group."""
FREEZE_TIMEOUT_S = 10.0


@dataclass
class Capture:
    """One capture (see the module doc)."""

    id: str
    path: Path
    """The read-only subvolume: ``upper/`` is the environment's upper dir as it was."""
    env_id: str
    template: TemplateManifest
    template_digest: str
    info: EnvironmentInfo
    """The environment's info when captured (a copy)."""
    pause_s: float
    """Seconds the environment was frozen for it (0 if it was paused already)."""


def new_snapshot_name() -> str:
    return f"snapshot-{secrets.token_hex(6)}"


class Captures:
    """The node's captures, in ``environments/.captures``."""

    def __init__(
        self, environments: Path, *, freeze_timeout: float = FREEZE_TIMEOUT_S, disk: Provisioner | None = None
    ):
        """``disk``: the provisioner whose disk admission counts kept captures (None: not counted)."""
        self.root = environments / CAPTURES
        self.freeze_timeout = freeze_timeout
        self.disk = disk
        self._lock = threading.Lock()
        self._named: dict[str, Capture] = {}
        """Captures kept under a snapshot's name (:meth:`keep`): what reset goes back to."""
        self._pins: dict[str, int] = {}
        """Capture id -> resets reading it now (:meth:`pinned`)."""
        self._doomed: dict[str, Capture] = {}
        """Pinned captures dropped meanwhile: deleted when the last pin goes."""

    def open(self) -> None:
        """Remove the captures an earlier node process of this home left on the (open) node disk."""
        with self._lock:
            self._named.clear()
            if not self.root.is_dir():
                return
            for leftover in self.root.iterdir():
                log.info("removing capture %s left by an earlier node process", leftover.name)
                with contextlib.suppress(Exception):
                    NodeDisk.delete_subvolume(self.root, leftover.name)
            self._remove_root()

    def _remove_root(self) -> None:
        """Remove the captures' directory if no capture is left in it (under ``_lock``)."""
        with contextlib.suppress(OSError):
            self.root.rmdir()

    def close(self) -> None:
        """Drop every capture (the disk goes next)."""
        with self._lock:
            named, self._named = list(self._named.values()), {}
        for c in named:
            self.drop(c)

    def take(self, e: Environment) -> Capture:
        """Capture environment ``e``'s file system (see the module doc).  Its
        processes are frozen meanwhile (and stay so if it was paused, or frozen
        by the provisioner).  Raises :class:`BrokenError` (its cgroup is gone or
        did not freeze), :class:`StateError` (it is not running or paused),
        :class:`DiskFullError` (the node's disk is full: nothing is left
        and the environment runs on with its files), :class:`MountError`.
        An environment in a user namespace is captured as it is, its files
        owned by its host id range: what starts from the capture, or
        publishes it, moves them (:func:`weenv.node.runtime.idmap.shift_owners`)."""
        with e.lock:  # not while it is destroyed or reset
            if e.info.state not in ("running", "paused") or not e.dir.exists():
                raise StateError(f"environment {e.info.id} is {e.info.state}: cannot capture it")
            return self._take(e)

    def _take(self, e: Environment) -> Capture:
        cid = secrets.token_hex(6)
        cg = None if e.info.memory_released else open_cgroups(f"/{e.container_id}")
        t = time.perf_counter()
        frozen_before = e.info.memory_released or cg.is_frozen()  # released: no process to freeze
        if not frozen_before:
            cg.freeze(timeout=self.freeze_timeout)
        try:
            with self._lock:
                try:
                    self.root.mkdir(mode=0o700, exist_ok=True)
                    NodeDisk.snapshot(e.dir / SUBVOLUME, self.root, cid, readonly=True)
                except BaseException as exc:
                    self._remove_root()
                    if isinstance(exc, OSError) and exc.errno in FULL_ERRNOS:
                        raise disk_full(f"environment {e.info.id}", "cannot capture its file system", exc) from exc
                    raise
        finally:
            if not frozen_before:
                cg.thaw()
        pause_s = 0.0 if frozen_before else time.perf_counter() - t
        return Capture(
            cid, self.root / cid, e.info.id, e.template, e.info.template_digest, e.info.model_copy(deep=True), pause_s
        )

    def count(self, c: Capture, name: str) -> int:
        """Count capture ``c``, to be kept as snapshot ``name``'s, against the
        node's disk (see the module doc) until it is dropped; its bytes.
        Raises :class:`CapacityError` if the disk cannot hold it (it is not
        counted then; the caller drops it)."""
        nbytes = NodeDisk.tree_bytes(c.path)
        if self.disk is not None:
            self.disk.hold_disk(f"capture-{c.id}", nbytes, f"snapshot {name!r}'s capture")
        return nbytes

    def drop(self, c: Capture) -> None:
        """Delete capture ``c`` (environments made from it keep their files:
        extents are shared) and free its count on the node's disk; a capture
        :meth:`pinned` now is deleted when its last pin goes."""
        with self._lock:
            if self._pins.get(c.id):
                self._doomed[c.id] = c
                return
        if self.disk is not None:
            self.disk.free_disk(f"capture-{c.id}")
        with self._lock:
            try:
                NodeDisk.delete_subvolume(self.root, c.id)
            except Exception as exc:
                log.warning("cannot delete capture %s: %s", c.id, exc)
            self._remove_root()

    # --- named captures: what reset returns to ---------------------------------------
    def keep(self, name: str, c: Capture) -> None:
        """Keep ``c`` on the node as snapshot ``name``'s capture (a previous one is dropped)."""
        with self._lock:
            old, self._named[name] = self._named.get(name), c
        if old is not None:
            self.drop(old)

    def named(self, name: str) -> Capture:
        """Snapshot ``name``'s capture on this node; :class:`NotFoundError` if none."""
        with self._lock:
            c = self._named.get(name)
        if c is None:
            raise NotFoundError(f"no snapshot {name!r} taken on this node")
        return c

    @contextlib.contextmanager
    def pinned(self, name: str) -> Iterator[Capture]:
        """Snapshot ``name``'s capture, kept on disk while the block runs (a
        reset reads it): a :meth:`forget` or :meth:`drop` meanwhile deletes it
        after the block.  Raises :class:`NotFoundError` if none."""
        with self._lock:
            c = self._named.get(name)
            if c is None:
                raise NotFoundError(f"no snapshot {name!r} taken on this node")
            self._pins[c.id] = self._pins.get(c.id, 0) + 1
        try:
            yield c
        finally:
            with self._lock:
                self._pins[c.id] -= 1
                last = not self._pins[c.id]
                if last:
                    del self._pins[c.id]
                doomed = self._doomed.pop(c.id, None) if last else None
            if doomed is not None:
                self.drop(doomed)

    def forget(self, name: str) -> None:
        """Drop snapshot ``name``'s capture on this node, if any."""
        with self._lock:
            c = self._named.pop(name, None)
        if c is not None:
            self.drop(c)

    # --- publishing --------------------------------------------------------------------
    def publish(
        self,
        c: Capture,
        store: Store,
        name: str,
        *,
        workdir: Path,
        publish_lock: Callable[[], contextlib.AbstractContextManager],
        record: dict[str, str] | None = None,
    ) -> SnapshotInfo:
        """Publish capture ``c`` to ``store`` as snapshot (template) ``name``
        (see the module doc); ``workdir``: where the EROFS image is written
        meanwhile (not on the node's disk); ``record``: entries added to the top
        group's ``source`` (a published pause's, :mod:`weenv.node.state.handoff`).  The capture itself is unchanged
        (a writable snapshot of it is cleaned and removed after).  Raises
        :class:`InvalidInputError` (bad name), :class:`BusyError` (the name is
        another template's: :func:`check_snapshot_name`; or another publish
        of it won meanwhile: :meth:`Store.swap_ref`), :class:`MountError`,
        what building a group raises (:func:`build_group`) and what the store
        raises; nothing of the snapshot is referenced then."""
        seen = check_snapshot_name(store, name, c.env_id)
        t = time.perf_counter()
        scratch = f"{c.id}.publish"
        NodeDisk.snapshot(c.path, self.root, scratch, readonly=False)
        try:
            upper = self.root / scratch / "upper"
            idmap.shift_owners(upper, idmap.range_of_subvolume(c.path), 0)  # the ids as they are inside
            clean_upper(upper)
            info = c.info
            # The lease names the group's chunks, its manifest, the template's and
            # the groups below until the ref is set (weenv.store.lease).
            with publish_lock(), Lease(store, what=f"snapshot {name}") as lease:
                lease.cover(c.template.groups)
                for g in c.template.groups:
                    lease.cover(ref.digest for ref in load_group(store, g).chunks)
                store = LeasedStore(store, lease)
                result = build_group(
                    upper,
                    store,
                    name=name,
                    version=c.id,
                    workdir=workdir,
                    ref=False,
                    source={
                        **(record or {}),
                        "type": SNAPSHOT_SOURCE,
                        "environment": info.id,
                        "template": c.template_digest,
                    },
                )
                runtime = c.template.runtime.model_copy(
                    update={
                        "env": {**c.template.runtime.env, **info.envs},
                        "resources": info.resources,
                        "network": info.network and not info.deny_out,
                    }
                )
                manifest = TemplateManifest(
                    name=name, version=c.id, groups=[*c.template.groups, result.digest], runtime=runtime
                )
                digest = store.put_manifest(canonical_json(manifest))
                lease.check()
                try:  # the ref only if it is still what the check saw: of two publishes of a name, one wins
                    store.swap_ref("templates", name, digest, expected=seen)
                except BusyError as exc:
                    raise BusyError(
                        f"snapshot name {name!r} in {store.url} was taken while this snapshot was published ({exc})"
                    ) from None
        finally:
            try:
                NodeDisk.delete_subvolume(self.root, scratch)
            except Exception as exc:
                log.warning("cannot delete %s: %s", self.root / scratch, exc)
        return SnapshotInfo(
            name=name,
            digest=digest,
            group=result.digest,
            environment=info.id,
            template=c.template_digest,
            bytes_published=result.bytes_written,
            capture_s=c.pause_s,
            publish_s=time.perf_counter() - t,
        )


def check_snapshot_name(store: Store, name: str, environment: str) -> str | None:
    """Whether environment ``environment`` may publish a snapshot as template
    ``name`` (see the module doc): no template has that name (None is
    returned), or it is a snapshot of that environment (the digest its ref
    holds is returned: what :meth:`Store.swap_ref` expects).  Raises :class:`InvalidInputError` (a bad
    name), :class:`BusyError` (it names a built template, another environment's
    snapshot, or a ref whose template cannot be read), what the store raises."""
    check_name(name)
    seen = store.ref_or_none("templates", name)
    if seen is None:
        return None
    try:
        owner = snapshot_of(store, name).environment
    except (InvalidInputError, NotFoundError) as exc:
        raise BusyError(
            f"template {name!r} exists in {store.url} and is not a snapshot ({exc}): a snapshot takes a name of its own"
        ) from None
    if owner != environment:
        raise BusyError(
            f"snapshot {name!r} in {store.url} is of environment {owner!r}, not of {environment}: "
            f"a snapshot replaces only its own environment's (delete that one first)"
        )
    return seen


def snapshot_of(store: Store, name: str) -> SnapshotInfo:
    """Snapshot ``name`` (a template name or digest) as the store holds it.
    Raises :class:`NotFoundError` if unknown, :class:`InvalidInputError` if it
    names a template that is not a snapshot."""
    digest, manifest = load_template(store, name)
    top = load_group(store, manifest.groups[-1])
    if top.source.get("type") != SNAPSHOT_SOURCE:
        raise InvalidInputError(f"template {name!r} is not a snapshot")
    return SnapshotInfo(
        name=manifest.name,
        digest=digest,
        group=manifest.groups[-1],
        environment=top.source.get("environment", ""),
        template=top.source.get("template", ""),
    )


def list_snapshots(store: Store) -> list[SnapshotInfo]:
    """Every snapshot the store names (templates whose top group is a capture), by name."""
    found = []
    for name in sorted(store.list_refs("templates")):
        with contextlib.suppress(InvalidInputError, NotFoundError):
            found.append(snapshot_of(store, name))
    return found


def delete_snapshot(store: Store, name: str) -> None:
    """Remove snapshot ``name``'s ref (its manifests and chunks go at the next gc,
    as a deleted template's do).  Raises :class:`NotFoundError` if unknown,
    :class:`InvalidInputError` if ``name`` is a template but not a snapshot."""
    check_name(name)
    snapshot_of(store, name)
    store.delete_ref("templates", name)
