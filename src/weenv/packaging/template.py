"""Templates: an ordered stack of published groups plus runtime config.

A template manifest lists group digests bottom to top (the first group is the
base; later groups are stacked over it by overlayfs).  Creating one resolves each
group given by ref name or digest, checks it is a group manifest in the store,
publishes the template's canonical JSON and points ``templates/NAME`` at it.
"""

from __future__ import annotations

from weenv.errors import InvalidInputError
from weenv.formats.manifest import (
    RuntimeConfig,
    TemplateManifest,
    canonical_json,
    check_digest,
    check_name,
    manifest_kind,
    parse_template_manifest,
)
from weenv.packaging.group import load_group
from weenv.store.base import Store


def create_template(
    store: Store,
    name: str,
    groups: list[str],
    *,
    runtime: RuntimeConfig | None = None,
    version: str = "latest",
) -> tuple[str, TemplateManifest]:
    """Publish template ``name`` over ``groups`` (bottom to top; each a group ref
    name or a ``sha256:`` digest); return ``(digest, manifest)``.

    Raises :class:`InvalidInputError` for a bad name, an empty or repeated group
    list, or a digest that names a template; :class:`NotFoundError` for an
    unknown group.
    """
    check_name(name)
    if not groups:
        raise InvalidInputError(f"template {name!r} needs at least one group")
    digests: list[str] = []
    for entry in groups:
        digest = store.resolve("groups", entry)
        load_group(store, digest)  # a group manifest, present and intact
        if digest in digests:
            raise InvalidInputError(f"group {entry!r} ({digest}) is listed twice in template {name!r}")
        digests.append(digest)
    manifest = TemplateManifest(name=name, version=version, groups=digests, runtime=runtime or RuntimeConfig())
    digest = store.put_manifest(canonical_json(manifest))
    store.set_ref("templates", name, digest)
    return digest, manifest


def load_template(store: Store, name_or_digest: str) -> tuple[str, TemplateManifest]:
    """``(digest, manifest)`` of a template given by ref name or digest, verified.

    Raises :class:`NotFoundError` if unknown, :class:`InvalidInputError` for a bad
    name or digest or if the digest names a group manifest,
    :class:`DigestMismatchError` if the stored manifest is corrupt.
    """
    if name_or_digest.startswith("sha256:"):  # get_manifest checks it and raises NotFoundError itself
        digest = check_digest(name_or_digest)
    else:
        digest = store.resolve("templates", name_or_digest)
    data = store.get_manifest(digest)
    kind = manifest_kind(data)
    if kind != "template":
        raise InvalidInputError(f"{name_or_digest} is a {kind} manifest, not a template")
    return digest, parse_template_manifest(data, digest)
