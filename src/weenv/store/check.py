"""``weenv store check``: is everything the store names there, and intact?

:func:`check_store` walks every ref (but leases: a lease names what a writer
may still write), every manifest and every chunk of a store:

- a ref must point at a manifest that is stored and hashes to its digest;
  a ``templates/`` ref at a template, a ``groups/`` or ``buildcache/`` ref at
  a group;
- a template's groups must be stored group manifests;
- a group manifest's chunks must be stored (a missing chunk is what makes
  every file of a template read EIO);
- every manifest must hash to its digest and parse as what it says it is
  (group, template, prefetch or usage profile, lease);
- every chunk must decode to bytes that hash to its digest (``deep``; else
  only the chunks some group names are checked for presence).

Nothing is changed.  Problems are reported one line each, naming the blob and
who refers to it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from weenv.errors import ContentLimitError, DigestMismatchError, InvalidInputError, NotFoundError
from weenv.formats.manifest import (
    GroupManifest,
    TemplateManifest,
    manifest_kind,
    parse_group_manifest,
    parse_template_manifest,
)
from weenv.store.base import REF_KINDS, Store
from weenv.store.lease import REF_KIND as LEASE_KIND
from weenv.store.lease import is_lease


@dataclass
class CheckReport:
    """What :func:`check_store` looked at and found wrong."""

    refs: int = 0
    manifests: int = 0
    chunks: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


_BROKEN = (NotFoundError, DigestMismatchError, ContentLimitError, InvalidInputError)


def check_store(store: Store, *, deep: bool = True) -> CheckReport:
    """Check ``store`` (module docstring); the :class:`CheckReport`."""
    report = CheckReport()
    parsed: dict[str, TemplateManifest | GroupManifest | str] = {}  # digest -> manifest, or its problem

    def load(digest: str) -> TemplateManifest | GroupManifest | str:
        if digest not in parsed:
            try:
                data = store.get_manifest(digest)
                if is_lease(data):
                    parsed[digest] = "a lease record"
                else:
                    try:
                        kind = manifest_kind(data)
                    except InvalidInputError:
                        kind = _media_type(data)
                    if kind == "template":
                        parsed[digest] = parse_template_manifest(data)
                    elif kind == "group":
                        parsed[digest] = parse_group_manifest(data)
                    else:
                        parsed[digest] = f"a {kind} manifest"
            except NotFoundError:
                parsed[digest] = "missing"
            except _BROKEN as exc:
                parsed[digest] = f"corrupt: {exc}"
        return parsed[digest]

    listed = set(store.list_manifests())

    def want(digest: str, cls: type, who: str) -> None:
        if digest not in listed and not store.has_manifest(digest):
            # (an oci:// store reads a deleted manifest by digest until the registry's gc)
            parsed[digest] = "missing"
        m = load(digest)
        if isinstance(m, str) and (m == "missing" or m.startswith("corrupt")):
            report.problems.append(f"{m} manifest {digest} ({who})")
        elif cls is not object and not isinstance(m, cls):
            what = m if isinstance(m, str) else type(m).__name__
            report.problems.append(f"manifest {digest} ({who}) is {what}, not a {cls.__name__}")

    for kind in REF_KINDS:
        if kind == LEASE_KIND:
            continue
        for name, digest in store.list_refs(kind).items():
            report.refs += 1
            cls = {"templates": TemplateManifest, "groups": GroupManifest, "buildcache": GroupManifest}.get(
                kind, object
            )
            want(digest, cls, f"ref {kind}/{name}")

    for digest in sorted(listed):
        report.manifests += 1
        m = load(digest)
        if isinstance(m, str) and m.startswith("corrupt"):
            report.problems.append(f"{m} manifest {digest}")
    for digest, m in list(parsed.items()):
        if isinstance(m, TemplateManifest):
            for g in m.groups:
                want(g, GroupManifest, f"group of template {m.name} {digest}")
    chunk_users: dict[str, str] = {}
    for digest, m in parsed.items():
        if isinstance(m, GroupManifest):
            for c in m.chunks:
                chunk_users.setdefault(c.digest, f"chunk of group {m.name} {digest}")

    stored = set(store.list_chunks())
    for digest, who in chunk_users.items():
        if digest not in stored:
            report.problems.append(f"missing chunk {digest} ({who})")
    for digest in sorted(stored) if deep else ():
        report.chunks += 1
        try:
            store.get_chunk(digest)
        except NotFoundError:
            continue  # deleted since the listing (gc): absent, not corrupt; a user above was reported
        except _BROKEN as exc:
            report.problems.append(f"corrupt chunk {digest}: {exc}")
    if not deep:
        report.chunks = len(stored)
    return report


def _media_type(data: bytes) -> str:
    try:
        return str(json.loads(data).get("media_type") or "unknown")
    except (ValueError, AttributeError, RecursionError):
        return "unparsable"
