"""The formats: group manifest, template manifest, digests.

A *digest* is ``"sha256:" + 64 lowercase hex digits`` (OCI image spec,
descriptor.md).  A manifest's digest is the sha256 of its canonical JSON: keys
sorted, no whitespace, UTF-8 (:func:`canonical_json`).  Groups and templates are
referred to by these digests; names are only refs that point at a digest.

Group manifest schema versions (:data:`GROUP_SCHEMA_VERSIONS`): nodes read
both, builds write v2.

- v1 (``application/vnd.weenv.group.v1+json``): the image, its chunks, provenance.
- v2 (``application/vnd.weenv.group.v2+json``): v1 plus ``layout``
  (:class:`Layout`): how the image's file data is ordered, and the access
  profile the order came from (issue 18: startup files together), so a node
  or a rebuild can tell a profile-ordered image from a tree-ordered one
  without reading the image.

A manifest of any other version (or a group media type of another version) is
refused in one line naming its digest and version (:func:`parse_group_manifest`).
"""

from __future__ import annotations

import hashlib
import json
import re
from datetime import UTC, datetime
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

from weenv.errors import ContentLimitError, InvalidInputError
from weenv.formats.limits import (
    MAX_CHUNK_SIZE,
    MAX_CHUNKS,
    MAX_MANIFEST_BYTES,
    MAX_TEMPLATE_GROUPS,
    frame_bound,
)

SCHEMA_VERSION = 1
"""Of template manifests."""
GROUP_SCHEMA_VERSION = 2
"""What builds write."""
GROUP_SCHEMA_VERSIONS = (1, 2)
"""What nodes read."""
GROUP_MEDIA_TYPE_V1 = "application/vnd.weenv.group.v1+json"
GROUP_MEDIA_TYPE = "application/vnd.weenv.group.v2+json"
GROUP_MEDIA_TYPES = {1: GROUP_MEDIA_TYPE_V1, 2: GROUP_MEDIA_TYPE}
_GROUP_MEDIA_RE = re.compile(r"^application/vnd\.weenv\.group\.v([0-9]{1,9})\+json\Z")
TEMPLATE_MEDIA_TYPE = "application/vnd.weenv.template.v1+json"
DEFAULT_CHUNK_SIZE = 1 << 20
MAX_START_COMMAND = 64 << 10
"""Characters of a template's start or ready command."""
EROFS_BLOCK_SIZE = 4096

_DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}\Z")
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,127}\Z")


def check_digest(value: str) -> str:
    """Return ``value`` if it is a sha256 digest; raise :class:`InvalidInputError`."""
    if not isinstance(value, str) or not _DIGEST_RE.match(value):
        raise InvalidInputError(f"not a sha256 digest: {value!r} (want 'sha256:' + 64 hex digits)")
    return value


def check_name(value: str) -> str:
    """Return ``value`` if it is a valid group/template name; raise :class:`InvalidInputError`.

    Names are lowercase ``[a-z0-9][a-z0-9._-]*``, at most 128 characters.
    """
    if not isinstance(value, str) or not _NAME_RE.match(value):
        raise InvalidInputError(f"bad name {value!r}: use lowercase letters, digits, '.', '_' and '-' (at most 128)")
    return value


def _digest_validator(value: str) -> str:
    if not _DIGEST_RE.match(value):
        raise ValueError(f"not a sha256 digest: {value!r}")
    return value


def _name_validator(value: str) -> str:
    if not _NAME_RE.match(value):
        raise ValueError(f"bad name {value!r}")
    return value


Digest = Annotated[str, AfterValidator(_digest_validator)]
Name = Annotated[str, AfterValidator(_name_validator)]


def sha256_digest(data: bytes) -> str:
    """The digest of ``data``: ``"sha256:<hex>"``."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def canonical_json(model: BaseModel) -> bytes:
    """Canonical JSON of a manifest: sorted keys, no whitespace, UTF-8."""
    return json.dumps(
        model.model_dump(mode="json", context={"canonical": True}),
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
    ).encode()


def utc_now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ChunkRef(_Model):
    """One chunk of a group image."""

    digest: Digest
    """sha256 of the chunk's plaintext: the chunk's address in stores and caches."""
    size: int = Field(ge=0, le=MAX_CHUNK_SIZE)
    """Plaintext size in bytes (the chunk size, or less for the last chunk; at most
    :data:`~weenv.formats.limits.MAX_CHUNK_SIZE`)."""
    stored_size: int = Field(ge=0, le=frame_bound(MAX_CHUNK_SIZE))
    """Size in bytes of the zstd frame a store keeps (at most :func:`~weenv.formats.limits.frame_bound` of ``size``)."""
    stored_digest: Digest
    """sha256 of the zstd frame, for stores that address blobs by their stored bytes (OCI)."""

    @model_validator(mode="after")
    def _frame_fits(self) -> ChunkRef:
        if self.stored_size > frame_bound(self.size):
            raise ValueError(f"a frame of {self.stored_size} bytes for a chunk of {self.size}: more than zstd makes")
        return self


class Layout(_Model):
    """How a group image's file data is ordered (group manifest v2)."""

    order: Literal["tree", "profile"] = "tree"
    """``tree``: regular files' data in the writer's tree order; ``profile``:
    the files an access profile read first, contiguous in the order it read
    them, then the others in tree order.  The file tree is the same either way."""
    profile: Digest | None = None
    """The digest of the prefetch profile the order came from; set exactly when ``order`` is ``profile``."""

    @model_validator(mode="after")
    def _profile_iff_profile_order(self) -> Layout:
        if (self.order == "profile") != (self.profile is not None):
            raise ValueError("a layout names a profile exactly when its order is 'profile'")
        return self


class GroupManifest(_Model):
    """A layer group: one EROFS image, split into fixed-size chunks.

    Chunk ``i`` covers image bytes ``[i * chunk_size, i * chunk_size + chunks[i].size)``.
    ``schema_version`` 2 (the default) has a ``layout``, 1 has none; each has its
    own ``media_type`` (:data:`GROUP_MEDIA_TYPES`, filled in when left out).
    """

    schema_version: Literal[1, 2] = GROUP_SCHEMA_VERSION
    media_type: Literal["application/vnd.weenv.group.v1+json", "application/vnd.weenv.group.v2+json"] = GROUP_MEDIA_TYPE
    name: Name
    version: str = "latest"
    image_size: int = Field(ge=0, description="bytes of the EROFS image")
    block_size: int = EROFS_BLOCK_SIZE
    chunk_size: int = Field(gt=0, le=MAX_CHUNK_SIZE, description="bytes per chunk (the last may be shorter)")
    chunks: list[ChunkRef] = Field(max_length=MAX_CHUNKS)
    file_count: int = Field(ge=0, description="inodes in the image (files, dirs, links, nodes)")
    source: dict[str, str] = Field(default_factory=dict, description="provenance")
    created: str = Field(default_factory=utc_now)
    layout: Layout | None = None
    """v2 only (filled with the tree order when left out); left out of a v1 manifest's JSON."""

    @model_validator(mode="before")
    @classmethod
    def _version_defaults(cls, data):
        if isinstance(data, dict):
            version = data.get("schema_version", GROUP_SCHEMA_VERSION)
            if type(version) is not int:  # a list or object (unhashable) is no version: the field check names it
                return data
            if version in GROUP_MEDIA_TYPES and "media_type" not in data:
                data = {**data, "media_type": GROUP_MEDIA_TYPES[version]}
            if version == 2 and data.get("layout") is None:
                data = {**data, "layout": Layout()}
        return data

    @model_validator(mode="after")
    def _fields_of_its_version(self) -> GroupManifest:
        if self.media_type != GROUP_MEDIA_TYPES[self.schema_version]:
            raise ValueError(
                f"schema version {self.schema_version} has media type "
                f"{GROUP_MEDIA_TYPES[self.schema_version]}, not {self.media_type}"
            )
        if self.schema_version == 1 and self.layout is not None:
            raise ValueError("a version 1 group manifest has no layout")
        return self

    @model_serializer(mode="wrap")
    def _omit_v1_layout(self, handler):
        data = handler(self)
        if isinstance(data, dict) and data.get("layout") is None:
            data.pop("layout", None)
        return data

    @model_validator(mode="after")
    def _chunks_tile_the_image(self) -> GroupManifest:
        """Every chunk but the last is ``chunk_size`` bytes, the last 1..``chunk_size``,
        and together they cover ``[0, image_size)``."""
        sizes = [c.size for c in self.chunks]
        if (
            sum(sizes) != self.image_size
            or any(s != self.chunk_size for s in sizes[:-1])
            or (sizes and not 0 < sizes[-1] <= self.chunk_size)
        ):
            raise ValueError(
                f"chunks ({len(sizes)}, {sum(sizes)} bytes) do not tile an image of "
                f"{self.image_size} bytes in {self.chunk_size}-byte chunks"
            )
        return self

    def digest(self) -> str:
        return sha256_digest(canonical_json(self))

    @property
    def stored_size(self) -> int:
        """Bytes the store keeps for this group (sum of zstd frames)."""
        return sum(c.stored_size for c in self.chunks)


MAX_CPUS = 1024.0
"""Largest CPU quota in cores a template or create may ask for."""
MIN_MEMORY_BYTES = 4 << 20
"""Smallest memory limit (runc and the kernel refuse less than a few MiB)."""
MAX_MEMORY_BYTES = 1 << 50
"""Largest memory limit (1 PiB)."""
MAX_PIDS = 1 << 22
"""Largest pids limit (the kernel's PID_MAX_LIMIT)."""
DEFAULT_DISK_BYTES = 10 << 30
"""An environment's disk limit unless declared (10 GiB)."""
MIN_DISK_BYTES = 16 << 20
"""Smallest disk limit: room for the overlay's work dir and a few files."""
MAX_DISK_BYTES = 1 << 50
"""Largest disk limit (1 PiB)."""
_USER_RE = re.compile(r"^\d{1,10}(:\d{1,10})?\Z")


class Resources(_Model):
    """Default limits of an environment (cgroup quota and limits, disk quota).

    ``cpus``: finite, in (0, :data:`MAX_CPUS`]; ``memory_bytes``: in
    [:data:`MIN_MEMORY_BYTES`, :data:`MAX_MEMORY_BYTES`]; ``pids``: in [1,
    :data:`MAX_PIDS`]; ``disk_bytes``: in [:data:`MIN_DISK_BYTES`,
    :data:`MAX_DISK_BYTES`].  Anything else fails validation (a ``ValueError``)."""

    cpus: float = Field(
        default=1.0, gt=0, le=MAX_CPUS, allow_inf_nan=False, description="CPU quota in cores (quota/period)"
    )
    memory_bytes: int = Field(
        default=2 << 30, ge=MIN_MEMORY_BYTES, le=MAX_MEMORY_BYTES, description="memory limit in bytes"
    )
    pids: int = Field(default=1024, ge=1, le=MAX_PIDS, description="pids limit")
    disk_bytes: int = Field(
        default=DEFAULT_DISK_BYTES,
        ge=MIN_DISK_BYTES,
        le=MAX_DISK_BYTES,
        description="disk limit in bytes: what the environment may write (its overlay "
        "upper dir, data and metadata; see weenv.node.disk)",
    )
    """Left out of a manifest's canonical JSON when it is the default, so
    templates made before it existed keep their digests."""

    @model_serializer(mode="wrap")
    def _omit_default_disk(self, handler, info):
        data = handler(self)
        if (
            isinstance(data, dict)
            and info.context
            and info.context.get("canonical")
            and data.get("disk_bytes") == DEFAULT_DISK_BYTES
        ):
            data.pop("disk_bytes", None)
        return data


def _check_user(value: str) -> str:
    if not _USER_RE.match(value):
        raise ValueError(f"bad user {value!r}: want numeric 'UID:GID' or 'UID'")
    return value


def _check_working_dir(value: str) -> str:
    if not value.startswith("/") or "\0" in value:
        raise ValueError(f"working dir {value!r} is not an absolute path")
    return value


def _check_env(value: dict[str, str]) -> dict[str, str]:
    for key, v in value.items():
        if not key or "=" in key or "\0" in key or "\0" in v:
            raise ValueError(f"bad environment variable {key!r}")
    return value


def _check_argv(value: list[str] | None) -> list[str] | None:
    if value is not None and any("\0" in a for a in value):
        raise ValueError("a command argument holds a NUL byte")
    return value


class RuntimeConfig(_Model):
    """How an environment runs: its first process and defaults for commands.

    Validated: ``command`` non-empty, ``user`` numeric ``UID[:GID]``,
    ``working_dir`` absolute, variable names without ``=``, no NUL bytes."""

    command: Annotated[list[str], AfterValidator(_check_argv)] = Field(
        default_factory=lambda: ["sleep", "infinity"], min_length=1
    )
    """The environment's first process (argv).  It must keep running; commands are exec'd beside it."""
    env: Annotated[dict[str, str], AfterValidator(_check_env)] = Field(
        default_factory=lambda: {
            "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": "/root",
            "LANG": "C.UTF-8",
        }
    )
    working_dir: Annotated[str, AfterValidator(_check_working_dir)] = "/"
    user: Annotated[str, AfterValidator(_check_user)] = "0:0"
    """``UID:GID`` (numeric) the processes run as."""
    resources: Resources = Field(default_factory=Resources)
    network: bool = False
    """Whether the environment reaches out: its own network namespace with a veth pair
    to the host, NATed, the host itself unreachable (:mod:`weenv.node.runtime.network`); default:
    its own namespace, loopback only.  Never the host's network namespace."""
    default_command: Annotated[list[str] | None, AfterValidator(_check_argv)] = None
    """The command an imported image would run (its Entrypoint + Cmd), kept for
    ``weenv run TEMPLATE`` without a command; never the first process, since an
    image's command may exit.  Left out of the JSON when unset, so templates
    made without it keep their digests."""

    start_command: str | None = Field(default=None, min_length=1, max_length=MAX_START_COMMAND)
    """A shell command (``/bin/sh -c``) started in the background as each
    environment is created (E2B's ``startCmd``); left out of the JSON when unset."""
    ready_command: str | None = Field(default=None, min_length=1, max_length=MAX_START_COMMAND)
    """A shell command run after the start command until it exits 0: only then
    is a create done (E2B's ``readyCmd``); left out of the JSON when unset."""
    sudo: bool = False
    """Whether setuid programs (``sudo``) work inside: each environment then runs
    in a user namespace of its own over an unprivileged host id range, without
    ``noNewPrivileges`` (:mod:`weenv.node.runtime.idmap`, README's "Security model");
    left out of the JSON when False, so other templates keep their digests."""

    @model_serializer(mode="wrap")
    def _omit_unset_default_command(self, handler):
        data = handler(self)
        if isinstance(data, dict):
            for key in ("default_command", "start_command", "ready_command"):
                if data.get(key) is None:
                    data.pop(key, None)
            if data.get("sudo") is False:
                data.pop("sudo")
        return data

    @field_validator("start_command", "ready_command")
    @classmethod
    def _no_nul(cls, v: str | None) -> str | None:
        if v is not None and "\0" in v:
            raise ValueError("a command holds a NUL byte")
        return v


class TemplateManifest(_Model):
    """A template: group digests bottom to top, plus runtime config."""

    schema_version: Literal[1] = SCHEMA_VERSION
    media_type: Literal["application/vnd.weenv.template.v1+json"] = TEMPLATE_MEDIA_TYPE
    name: Name
    version: str = "latest"
    groups: list[Digest] = Field(min_length=1, max_length=MAX_TEMPLATE_GROUPS)
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    prefetch: Digest | None = None
    created: str = Field(default_factory=utc_now)

    def digest(self) -> str:
        return sha256_digest(canonical_json(self))


def check_manifest_size(data: bytes, what: str = "manifest") -> bytes:
    """``data`` if it has at most :data:`~weenv.formats.limits.MAX_MANIFEST_BYTES`;
    else :class:`ContentLimitError` (``what`` names it: a digest, a path)."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise ContentLimitError(f"{what} has {len(data)} bytes, more than a manifest may ({MAX_MANIFEST_BYTES})")
    return data


def parse_group_manifest(data: bytes, digest: str | None = None) -> GroupManifest:
    """Parse a group manifest (``digest``: its digest, named in errors); raise
    :class:`InvalidInputError` on bad JSON or fields (past
    :data:`~weenv.formats.limits.MAX_CHUNKS` chunks, chunks past
    :data:`~weenv.formats.limits.MAX_CHUNK_SIZE`): one line naming the digest
    and the first bad field; :class:`ContentLimitError` past
    :data:`~weenv.formats.limits.MAX_MANIFEST_BYTES`."""
    check_manifest_size(data, "group manifest")
    try:
        return GroupManifest.model_validate_json(data)
    except ValueError as exc:
        _check_group_version(data, digest)  # only then: a valid manifest is parsed once
        raise _not_a_manifest("group", digest, exc) from exc


def _check_group_version(data: bytes, digest: str | None) -> None:
    """Raise :class:`InvalidInputError` in one line naming ``digest`` and the
    version when ``data`` is a group manifest of a schema version this node
    does not read (a newer weenv wrote it); anything else is left to the model."""
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError):
        return
    if not isinstance(obj, dict):
        return
    version, media_type = obj.get("schema_version"), obj.get("media_type")
    named = _GROUP_MEDIA_RE.match(media_type) if isinstance(media_type, str) else None
    if version is None and named is None:
        return
    if version is None:
        version = int(named.group(1))
    if isinstance(version, bool) or version not in GROUP_SCHEMA_VERSIONS:
        raise InvalidInputError(
            f"group manifest{f' {digest}' if digest else ''} has schema version {version!r:.40}: this node reads "
            f"versions {', '.join(map(str, GROUP_SCHEMA_VERSIONS))} (written by a newer weenv?)"
        )


def parse_template_manifest(data: bytes, digest: str | None = None) -> TemplateManifest:
    """Parse a template manifest (``digest`` as for :func:`parse_group_manifest`);
    raise :class:`InvalidInputError` on bad JSON or fields (past
    :data:`~weenv.formats.limits.MAX_TEMPLATE_GROUPS` groups),
    :class:`ContentLimitError` past :data:`~weenv.formats.limits.MAX_MANIFEST_BYTES`."""
    check_manifest_size(data, "template manifest")
    try:
        return TemplateManifest.model_validate_json(data)
    except ValueError as exc:
        raise _not_a_manifest("template", digest, exc) from exc


def _not_a_manifest(kind: str, digest: str | None, exc: ValueError) -> InvalidInputError:
    """One line: which manifest, the first bad field and why (pydantic's own
    message spans lines and repeats the input)."""
    errors = exc.errors(include_input=False) if hasattr(exc, "errors") else []
    if errors:
        first = errors[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "document"
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        why = f"{where}: {first.get('msg', 'invalid')}{more}"
    else:
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return InvalidInputError(f"not a weenv {kind} manifest{f' ({digest})' if digest else ''}: {why}")


def manifest_kind(data: bytes) -> str:
    """``"group"`` or ``"template"`` from a manifest's ``media_type``."""
    try:
        media_type = json.loads(data).get("media_type")
    except (ValueError, AttributeError, RecursionError):  # RecursionError: arrays nested too deep
        raise InvalidInputError("manifest is not a JSON object") from None
    if isinstance(media_type, str) and _GROUP_MEDIA_RE.match(media_type):
        return "group"  # of any version: parse_group_manifest says which it cannot read
    if media_type == TEMPLATE_MEDIA_TYPE:
        return "template"
    raise InvalidInputError(f"unknown manifest media type {media_type!r}")
