"""Garbage collection of a store and the node chunk cache, and the dedupe report.

**Reachable** = every template a ``templates/NAME`` ref points at, plus every
template a running environment was created from; their group manifests; those
groups' chunks (and a template's prefetch profile manifest: its ``prefetch`` field
or the ``prefetch/<hex>`` ref a node published; and that profile's pack).  :func:`collect`
removes every other manifest, chunk and pack from the store, every other chunk from
the node chunk cache (``$WEENV_HOME/node/cache``), and the ``groups/`` and
``buildcache/`` and ``prefetch/`` refs that pointed at removed manifests.

The running environments' templates are the caller's to give (``in_use``):
the CLI asks the node daemon of ``$WEENV_HOME``
(:func:`weenv.server.daemon.running_templates`, which refuses with
:class:`DaemonError` rather than guess when a daemon runs but does not answer);
in-process nodes give their own.  Builds of the same home hold the store lock
shared (:func:`weenv.packaging.buildcache.store_lock`); gc takes it exclusive and
refuses while a build runs.  Writers anywhere else (another home or machine
sharing the store) are seen through their leases (:mod:`weenv.store.lease`):
gc keeps what a live write lease names, deletes by the protocol there, and
removes expired leases; with a grace period it also keeps what was stored
more recently than that.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from weenv.config import Paths
from weenv.errors import DigestMismatchError, InvalidInputError, NotFoundError
from weenv.formats.manifest import (
    GroupManifest,
    TemplateManifest,
    manifest_kind,
    parse_group_manifest,
    parse_template_manifest,
)
from weenv.packaging.buildcache import store_lock
from weenv.packaging.profile import PrefetchProfile
from weenv.store.base import Store
from weenv.store.lease import (
    REF_KIND,
    LeaseRecord,
    delete_unused,
    gc_grace_seconds,
    is_lease,
    leased_digests,
    parse_lease,
)


@dataclass(frozen=True)
class DedupeReport:
    """How much sharing saves: the templates' logical bytes against what the store keeps."""

    templates: int
    groups: int
    """Distinct groups the templates use."""
    chunks: int
    """Distinct chunks of those groups."""
    logical_bytes: int
    """Sum over templates of their groups' image sizes: one full image per template."""
    group_bytes: int
    """Sum of image sizes of the distinct groups."""
    unique_bytes: int
    """Plaintext bytes of the distinct chunks."""
    stored_bytes: int
    """zstd bytes of the distinct chunks: what the store holds for these templates."""

    @property
    def dedupe_ratio(self) -> float:
        """Logical over unique plaintext bytes (sharing of groups and chunks)."""
        return self.logical_bytes / self.unique_bytes if self.unique_bytes else 0.0

    @property
    def ratio(self) -> float:
        """Logical over stored bytes (sharing and compression)."""
        return self.logical_bytes / self.stored_bytes if self.stored_bytes else 0.0


@dataclass(frozen=True)
class GcResult:
    """What :func:`collect` removed (or, with ``dry_run``, would remove)."""

    manifests_removed: list[str] = field(default_factory=list)
    chunks_removed: int = 0
    packs_removed: int = 0
    bytes_freed: int = 0
    """Stored bytes of removed chunks whose size a manifest told (orphans without one count 0)."""
    cache_chunks_removed: int = 0
    cache_bytes_freed: int = 0
    refs_removed: list[str] = field(default_factory=list)
    """``kind/name`` of removed refs."""
    kept_for_running: list[str] = field(default_factory=list)
    """Manifests no ref reaches, kept because a running environment uses them."""
    dry_run: bool = False


@dataclass
class _Reach:
    manifests: set[str] = field(default_factory=set)
    chunks: set[str] = field(default_factory=set)
    packs: set[str] = field(default_factory=set)


def _load(store: Store, digest: str, *, leases: bool = False) -> TemplateManifest | GroupManifest | LeaseRecord | None:
    """The manifest ``digest`` parsed (with ``leases``, a lease record too), None if unreadable."""
    try:
        data = store.get_manifest(digest)
        if leases and is_lease(data):
            return parse_lease(data)
        kind = manifest_kind(data)
        return parse_template_manifest(data) if kind == "template" else parse_group_manifest(data)
    except (NotFoundError, InvalidInputError):
        return None


def _pack_of(store: Store, profile_digest: str) -> str | None:
    """The digest of the pack of prefetch profile ``profile_digest``, if it has one."""
    try:
        return PrefetchProfile.model_validate_json(store.get_manifest(profile_digest)).pack.digest
    except (NotFoundError, InvalidInputError, ValueError, AttributeError):
        return None


def _must_load(store: Store, digest: str, what: str) -> TemplateManifest | GroupManifest | None:
    """Manifest ``digest`` that ``what`` reaches, None if it is gone (a dangling
    ref: nothing to keep); :class:`InvalidInputError` if it is stored but
    cannot be read here (a newer weenv's schema, damaged bytes): what it names
    is unknown, so nothing may be deleted on its account."""
    try:
        data = store.get_manifest(digest)
        kind = manifest_kind(data)
        return parse_template_manifest(data) if kind == "template" else parse_group_manifest(data)
    except NotFoundError:
        return None
    except (InvalidInputError, DigestMismatchError) as exc:
        raise InvalidInputError(
            f"{what} {digest} in {store.url} cannot be read ({exc}): gc stops and deletes "
            f"nothing, since it cannot tell what that manifest keeps (a newer weenv's gc "
            f"can; if it is garbage, delete the ref that reaches it)"
        ) from None


def _reach(store: Store, templates: Iterable[str], reach: _Reach) -> None:
    for digest in templates:
        if digest in reach.manifests:
            continue
        t = _must_load(store, digest, "template")
        if not isinstance(t, TemplateManifest):
            continue  # a dangling ref: nothing to keep
        reach.manifests.add(digest)
        profiles = [t.prefetch] if t.prefetch else []
        try:  # a profile recorded by a node (weenv.node.data.prefetch): prefetch/<hex of the template digest>
            profiles.append(store.get_ref("prefetch", digest.split(":", 1)[1]))
        except (NotFoundError, InvalidInputError):
            pass
        try:  # a template's usage profile (weenv.node.provision.profiles): usage/<hex>, no pack
            reach.manifests.add(store.get_ref("usage", digest.split(":", 1)[1]))
        except (NotFoundError, InvalidInputError):
            pass
        for p_digest in profiles:
            reach.manifests.add(p_digest)
            pack = _pack_of(store, p_digest)
            if pack is not None:
                reach.packs.add(pack)
        for g_digest in t.groups:
            _reach_group(store, g_digest, reach)


def _reach_group(store: Store, digest: str, reach: _Reach) -> None:
    if digest in reach.manifests:
        return
    g = _must_load(store, digest, "group")
    if isinstance(g, GroupManifest):
        reach.manifests.add(digest)
        reach.chunks.update(c.digest for c in g.chunks)


def published_digests(store: Store) -> set[str]:
    """Every manifest, chunk and pack a ref of any kind reaches (a rollback's
    "someone published it"; read when called)."""
    reach = _Reach()
    _reach(store, store.list_refs("templates").values(), reach)
    for kind in ("groups", "buildcache"):
        for digest in store.list_refs(kind).values():
            _reach_group(store, digest, reach)
    for kind in ("prefetch", "usage"):
        for digest in store.list_refs(kind).values():
            reach.manifests.add(digest)
            pack = _pack_of(store, digest)
            if pack is not None:
                reach.packs.add(pack)
    return reach.manifests | reach.chunks | reach.packs


def collect(
    store: Store,
    paths: Paths | None = None,
    *,
    in_use: Iterable[str] | Callable[[], Iterable[str]],
    dry_run: bool = False,
    grace: float | None = None,
) -> GcResult:
    """Remove what no template ref nor running environment reaches (module docstring).

    ``in_use``: template digests of running environments, or a function
    returning them, called once the store lock is held (the CLI's:
    :func:`weenv.server.daemon.running_templates`).  ``dry_run``: only report.
    ``grace``: seconds; blobs stored more recently are kept (default
    :func:`~weenv.store.lease.gc_grace_seconds`).  What a live write lease
    names is kept; deletes follow :func:`~weenv.store.lease.delete_unused`, so
    a writer that finds a blob stored while gc runs keeps it.  Expired leases
    are removed.  Raises :class:`InvalidInputError` (a build is running) and
    what ``in_use`` raises (:class:`DaemonError`: a daemon running, not answering).
    """
    paths = paths or Paths.from_env()
    grace = gc_grace_seconds() if grace is None else grace
    with store_lock(paths, exclusive=True):
        running = list(in_use() if callable(in_use) else in_use)
        leased = leased_digests(store, "write")  # before the refs: see weenv.store.lease
        by_ref = _Reach()
        _reach(store, store.list_refs("templates").values(), by_ref)
        reach = _Reach(set(by_ref.manifests), set(by_ref.chunks), set(by_ref.packs))
        _reach(store, running, reach)

        sizes: dict[str, int] = {}
        doomed: list[str] = []
        stale_leases: list[str] = []
        now = time.time()
        for digest in store.list_manifests():
            if digest in reach.manifests or digest in leased:
                continue
            try:
                m = _load(store, digest, leases=True)
            except DigestMismatchError:  # other bytes than its digest, or past the manifest limit: garbage
                m = None
            if isinstance(m, LeaseRecord):
                if not m.live(now):
                    stale_leases.append(digest)
                continue
            doomed.append(digest)
            if isinstance(m, GroupManifest):
                sizes.update((c.digest, c.stored_size) for c in m.chunks)
        chunks = [d for d in store.list_chunks() if d not in reach.chunks and d not in leased]
        packs = [d for d in store.list_packs() if d not in reach.packs and d not in leased]
        if grace > 0:
            doomed, chunks, packs = (
                [d for d in ds if _older(store, space, d, now - grace)]
                for space, ds in (("manifests", doomed), ("chunks", chunks), ("packs", packs))
            )
        lease_refs = [(n, d) for n, d in store.list_refs(REF_KIND).items() if d in stale_leases]
        cache_files = _unreachable_cache_files(paths.chunk_cache, reach.chunks)
        cache_bytes = sum(_size(p) for p in cache_files)
        if not dry_run:

            def reached_now() -> set[str]:
                again = _Reach()
                _reach(store, [*store.list_refs("templates").values(), *running], again)
                return again.manifests | again.chunks | again.packs

            done = delete_unused(
                store, {"manifests": doomed, "chunks": chunks, "packs": packs}, reached=reached_now, what="gc"
            )
            removed = set(done.removed)
            doomed, chunks, packs = ([d for d in ds if d in removed] for ds in (doomed, chunks, packs))
            for name, digest in lease_refs:
                store.delete_ref(REF_KIND, name, expected=digest)
            for digest in stale_leases:
                store.delete_manifest(digest)
            for p in cache_files:
                p.unlink(missing_ok=True)
        gone = set(doomed)
        refs = [
            (kind, name, digest)
            for kind in ("groups", "buildcache", "prefetch", "usage", REF_KIND)  # a damaged lease's too
            for name, digest in store.list_refs(kind).items()
            if digest in gone or not store.has_manifest(digest)
        ]
        if not dry_run:
            for kind, name, digest in refs:
                store.delete_ref(kind, name, expected=digest)
        return GcResult(
            manifests_removed=sorted(doomed),
            chunks_removed=len(chunks),
            packs_removed=len(packs),
            bytes_freed=sum(sizes.get(d, 0) for d in chunks),
            cache_chunks_removed=len(cache_files),
            cache_bytes_freed=cache_bytes,
            refs_removed=[f"{k}/{n}" for k, n, _ in refs],
            kept_for_running=sorted(reach.manifests - by_ref.manifests),
            dry_run=dry_run,
        )


def _older(store: Store, space: str, digest: str, cutoff: float) -> bool:
    """Whether blob ``digest`` was stored before ``cutoff`` (unknown: yes)."""
    when = store._modified(space, digest)
    return when is None or when < cutoff


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except OSError:
        return 0


def _unreachable_cache_files(root: Path, keep: set[str]) -> list[Path]:
    """Files of the node chunk cache (``root/sha256/ab/<hex>``) whose chunk is not in ``keep``."""
    base = Path(root) / "sha256"
    if not base.is_dir():
        return []
    found = []
    for sub in os.scandir(base):
        if not sub.is_dir(follow_symlinks=False):
            continue
        for entry in os.scandir(sub.path):
            if entry.name.startswith(".tmp-") or not entry.is_file(follow_symlinks=False):
                continue
            if f"sha256:{entry.name}" not in keep:
                found.append(Path(entry.path))
    return found


def dedupe_report(store: Store) -> DedupeReport:
    """The :class:`DedupeReport` of every template a ref points at."""
    templates: list[TemplateManifest] = []
    for digest in store.list_refs("templates").values():
        t = _load(store, digest)
        if isinstance(t, TemplateManifest):
            templates.append(t)
    groups: dict[str, GroupManifest] = {}
    for t in templates:
        for g_digest in t.groups:
            if g_digest not in groups:
                g = _load(store, g_digest)
                if isinstance(g, GroupManifest):
                    groups[g_digest] = g
    chunks: dict[str, tuple[int, int]] = {}
    for g in groups.values():
        for c in g.chunks:
            chunks[c.digest] = (c.size, c.stored_size)
    return DedupeReport(
        templates=len(templates),
        groups=len(groups),
        chunks=len(chunks),
        logical_bytes=sum(groups[g].image_size for t in templates for g in t.groups if g in groups),
        group_bytes=sum(g.image_size for g in groups.values()),
        unique_bytes=sum(size for size, _ in chunks.values()),
        stored_bytes=sum(stored for _, stored in chunks.values()),
    )
