"""``weenv update TEMPLATE --component NAME --from-dir DIR``: replace one group of a template.

The new group is built from ``DIR`` with the old group's name and version (so
an unchanged file keeps its chunks) and published; a new template manifest
lists the same groups with that one replaced, keeps the runtime config, gets a
new version label and becomes ``templates/NAME`` (a prefetch profile, recorded
over the old groups, is not carried over).  Nothing else is rebuilt or
written: the cost is the new group's new chunks plus two manifests, reported in
bytes and seconds.

``--profile`` (issue 18, startup files together): the template's published
prefetch profile names the reads of its first start; the new group lays the
files those reads touched first, contiguous, in access order
(:mod:`weenv.packaging.layout`), and its manifest's ``layout`` names the
profile.  From the same directory the tree is the same, only its data order
(and so the group's digest) changes.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from weenv.config import Paths
from weenv.errors import InvalidInputError, NotFoundError
from weenv.formats.manifest import GroupManifest, Layout, TemplateManifest, canonical_json, utc_now
from weenv.packaging.buildcache import store_lock
from weenv.packaging.group import build_group, load_group
from weenv.packaging.layout import startup_files
from weenv.packaging.profile import REF_KIND, load_profile, ref_name
from weenv.packaging.template import load_template
from weenv.progress import QUIET, Progress
from weenv.store.base import Store
from weenv.store.lease import Lease, LeasedStore


@dataclass(frozen=True)
class UpdateResult:
    """What :func:`update_component` published."""

    template: str
    template_digest: str
    previous_digest: str
    version: str
    component: str
    group_digest: str
    chunks_written: int
    bytes_published: int
    """Stored bytes written: the group's new chunks, its manifest and the template manifest."""
    seconds: float


def next_version(previous: str) -> str:
    """``"3"`` -> ``"4"``; any other label -> a UTC time stamp ``YYYYmmddTHHMMSSZ``."""
    if previous.isdigit():
        return str(int(previous) + 1)
    return utc_now().replace("-", "").replace(":", "")


def _profile_layout(
    store: Store, template_digest: str, group_digest: str, group: GroupManifest
) -> tuple[list[str], Layout]:
    """The startup files of ``group`` by ``template_digest``'s published profile, and the layout naming it."""
    try:
        digest = store.get_ref(REF_KIND, ref_name(template_digest))
    except NotFoundError:
        raise NotFoundError(f"template {template_digest} has no prefetch profile yet: start it once first") from None
    recorded = load_profile(store, template_digest)
    if recorded is None:
        raise NotFoundError(f"the prefetch profile {digest} of {template_digest} is unreadable")
    return startup_files(store, group_digest, group, recorded), Layout(order="profile", profile=digest)


def update_component(
    store: Store,
    template: str,
    component: str,
    from_dir: str | os.PathLike[str],
    *,
    version: str | None = None,
    paths: Paths | None = None,
    profile: bool = False,
    progress: Progress = QUIET,
) -> UpdateResult:
    """Publish a new version of ``template`` whose group ``component`` (a group
    name in it) is rebuilt from ``from_dir``; every other group stays as it is.

    ``version``: the new template's label (default :func:`next_version`).
    ``profile``: lay out the new group's files with the old template's
    published prefetch profile (the files it read first, contiguous, in the
    order it read them: :mod:`weenv.packaging.layout`); :class:`NotFoundError`
    if the template has none.  Republishing with the same ``from_dir`` keeps
    the file tree and changes only the order of its data (and the digest).
    Raises :class:`NotFoundError` (unknown template), :class:`InvalidInputError`
    (no such component in the template, bad directory), :class:`BusyError`
    if ``templates/NAME`` was moved by another writer meanwhile (an update or
    publish from elsewhere: its ref is kept; this one's manifests stay
    unreferenced until ``weenv gc``; update again), and what
    :func:`~weenv.packaging.group.build_group` raises.
    """
    t0 = time.monotonic()
    paths = paths or Paths.from_env()
    with store_lock(paths, exclusive=False), Lease(store, what=f"update {template}") as lease:
        # the lease names what it stores or finds stored until the template is published:
        # gc from another home (the store lock is this home's only) keeps it meanwhile
        store = LeasedStore(store, lease)
        old_digest, old = load_template(store, template)
        named = store.ref_or_none("templates", old.name)  # what the name points at now, for the swap
        names = [load_group(store, g).name for g in old.groups]
        hits = [i for i, n in enumerate(names) if n == component]
        if not hits:
            raise InvalidInputError(
                f"template {old.name} has no component {component!r} (its groups: {', '.join(names)})"
            )
        index = hits[-1]
        old_group = load_group(store, old.groups[index])
        progress.start(component, total=2, status=f"replacing group {index} of template {old.name}")
        first, layout = None, None
        if profile:
            first, layout = _profile_layout(store, old_digest, old.groups[index], old_group)
        progress.advance(component, 0, status=f"writing {from_dir} into a group")
        r = build_group(
            from_dir,
            store,
            name=component,
            version=old_group.version,
            source={"type": "update", "replaces": old.groups[index]},
            first=first,
            layout=layout,
        )
        progress.advance(component, status=f"{r.chunks_written} new chunks stored; publishing the template")
        groups = list(old.groups)
        groups[index] = r.digest
        if r.digest in groups[:index] + groups[index + 1 :]:
            raise InvalidInputError(f"the new {component!r} group is already in template {old.name}")
        manifest = TemplateManifest(
            name=old.name,
            version=version or next_version(old.version),
            groups=groups,
            runtime=old.runtime,
            prefetch=None,
        )
        data = canonical_json(manifest)
        store.lease.cover(groups)  # the groups it keeps
        digest = store.put_manifest(data)
        store.lease.check()
        store.swap_ref("templates", old.name, digest, expected=named)  # a concurrent update is not lost
        progress.finish(component, status=f"template {old.name} version {manifest.version} published")
    written = r.bytes_written + len(canonical_json(r.manifest)) + len(data)
    return UpdateResult(
        template=old.name,
        template_digest=digest,
        previous_digest=old_digest,
        version=manifest.version,
        component=component,
        group_digest=r.digest,
        chunks_written=r.chunks_written,
        bytes_published=written,
        seconds=time.monotonic() - t0,
    )
