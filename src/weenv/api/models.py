"""Request and response models of node operations, shared by the node, the
HTTP server and its client (one set of models for every face, as SWE-ReX does)."""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StringConstraints,
    field_validator,
)

from weenv.api.names import domain
from weenv.formats.manifest import (
    MAX_CPUS,
    MAX_DISK_BYTES,
    MAX_MEMORY_BYTES,
    MAX_PIDS,
    MIN_DISK_BYTES,
    MIN_MEMORY_BYTES,
    Name,
    Resources,
    RuntimeConfig,
)
from weenv.host.rootfs import EntryInfo

DEFAULT_TIMEOUT_S = 300.0
"""An environment's lifetime when its create does not say (seconds)."""
MAX_TIMEOUT_S = 7 * 86400.0

MAX_METADATA_ENTRIES = 64
"""Labels an environment may carry; each key 1..:data:`MAX_METADATA_KEY`
characters, each value at most :data:`MAX_METADATA_VALUE` (every list of
environments returns them)."""
MAX_METADATA_KEY = 256
MAX_METADATA_VALUE = 4096
MAX_ENV_ENTRIES = 1024
"""Variables one create or command may set; each name 1..:data:`MAX_ENV_KEY`
characters, each value at most :data:`MAX_ENV_VALUE` (Linux's
``MAX_ARG_STRLEN``), all together at most :data:`MAX_ENV_TOTAL` characters."""
MAX_ENV_KEY = 1024
MAX_ENV_VALUE = 128 << 10
MAX_ENV_TOTAL = 1 << 20
MAX_PATH = 4096
"""Longest path (a working directory), characters (Linux's ``PATH_MAX``)."""


def _env_total(value: dict[str, str]) -> dict[str, str]:
    total = sum(len(k) + len(v) + 2 for k, v in value.items())
    if total > MAX_ENV_TOTAL:
        raise ValueError(f"variables of {total} characters in all, more than {MAX_ENV_TOTAL}")
    return value


Metadata = Annotated[
    dict[
        Annotated[str, StringConstraints(min_length=1, max_length=MAX_METADATA_KEY)],
        Annotated[str, StringConstraints(max_length=MAX_METADATA_VALUE)],
    ],
    Field(max_length=MAX_METADATA_ENTRIES),
]
"""An environment's labels, bounded (:data:`MAX_METADATA_ENTRIES`)."""
Envs = Annotated[
    dict[
        Annotated[str, StringConstraints(min_length=1, max_length=MAX_ENV_KEY)],
        Annotated[str, StringConstraints(max_length=MAX_ENV_VALUE)],
    ],
    Field(max_length=MAX_ENV_ENTRIES),
    AfterValidator(_env_total),
]
"""Environment variables of a create or a command, bounded (:data:`MAX_ENV_ENTRIES`)."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", ser_json_bytes="base64", val_json_bytes="base64")


class CreateTiming(_Model):
    """Phases of one environment create, in seconds, and what it fetched."""

    manifest_s: float = 0.0
    """Fetching and parsing the template and group manifests."""
    groups_s: float = 0.0
    """Registering group images with the lazy file system and mounting them (EROFS),
    until they and the upper dir (``upper_s``, made meanwhile) are ready."""
    upper_s: float = 0.0
    """Making the private upper/work dirs (their disk subvolume and quota), while
    the group mounts are taken: a part of ``groups_s``, not added to it."""
    overlay_s: float = 0.0
    """Mounting the overlay rootfs once the group mounts and the upper dir are ready."""
    runtime_s: float = 0.0
    """Writing the OCI bundle and starting its container (``runc run --detach``); with
    ``runtime.network``, making its network namespace and veth pair first."""
    first_command_s: float | None = None
    """Running the first command (``true``) inside the environment, if asked."""
    reserve_s: float = 0.0
    """The provisioner admitting it (its reservation; waiting for room when the latency objective asks)."""
    pooled: bool = False
    """The warm pool had created it ahead (:mod:`weenv.node.state.pool`): ``runtime_s``
    is ``runc start`` alone, and the groups and overlay phases took place before."""
    total_s: float = 0.0
    resolved_from: Literal["store", "node"] = "store"
    """Who named the template's digest: ``store``, which answered during this
    create; or ``node``: the store did not answer (down, or slower than 1 s), and
    the node started the digest the store named the last time it answered
    (for a template given by digest: the manifest the node keeps)."""
    resolved_age_s: float | None = None
    """With ``resolved_from="node"`` for a template name: seconds since the store last named that digest."""
    bytes_fetched: int = 0
    """Stored (zstd) bytes fetched from the store during this create (node-wide counter delta)."""
    chunks_fetched: int = 0
    template_bytes: int = 0
    """Sum of the template's group image sizes (plaintext bytes)."""
    template_stored_bytes: int = 0
    """Sum of the template's stored chunk sizes (zstd bytes in the store)."""


def _finite(v: float | None) -> float | None:
    if v is not None and not math.isfinite(v):
        raise ValueError("must be a finite number of seconds")
    return v


MAX_NET_RULES = 1024
"""Most CIDRs in one of a create's ``allow_out`` / ``deny_out`` lists."""


def _cidr(value: str) -> str:
    """``value`` as a normalized IPv4 network (``"10.0.0.1"`` -> ``"10.0.0.1/32"``);
    ValueError naming it for anything else (host bits set included)."""
    import ipaddress

    try:
        net = ipaddress.ip_network(value.strip(), strict=True) if isinstance(value, str) and len(value) <= 64 else None
    except ValueError:
        net = None
    if net is not None and net.version == 6:
        raise ValueError(
            f"{str(value)[:64]!r}: IPv6 is not served (environments have no IPv6 address or route); give IPv4 CIDRs"
        )
    if net is None:
        raise ValueError(f"{str(value)[:64]!r} is not an IPv4 CIDR such as 10.1.2.0/24 or an address such as 10.1.2.3")
    return str(net)


def _cidr_or_domain(value: str) -> str:
    """An ``allow_out`` entry: :func:`_cidr`'s, or a domain name (``example.com``,
    ``*.example.com``, lowercased: :func:`weenv.api.names.domain`)."""
    try:
        return _cidr(value)
    except ValueError as exc:
        name = domain(value) if isinstance(value, str) and len(value) <= 253 and ":" not in value else None
        if name is None:
            if "IPv6" in str(exc):
                raise
            raise ValueError(
                f"{str(value)[:64]!r} is not an IPv4 CIDR such as 10.1.2.0/24, an address such as "
                "10.1.2.3, or a domain name such as example.com or *.example.com"
            ) from None
        return name


def _deny_entry(value: str) -> str:
    if isinstance(value, str) and len(value) <= 253 and domain(value) is not None:
        raise ValueError(
            f"{value[:64]!r}: domain names are not supported in deny_out (as E2B's denyOut); give IPv4 CIDRs"
        )
    return _cidr(value)


class CreateRequest(_Model):
    template: str = Field(min_length=1)
    """Template name (a ref in the store) or digest."""
    resources: Resources | None = None
    """Overrides the template's default resources."""
    first_command: bool = True
    """Run ``true`` inside once started, and time it (the "first command" phase)."""
    timeout: float | None = Field(default=None, gt=0, le=MAX_TIMEOUT_S)
    """Seconds from now after which the node destroys the environment (default
    :data:`DEFAULT_TIMEOUT_S`); see ``SetTimeoutRequest``."""
    envs: Envs = Field(default_factory=dict)
    """Variables of every command run inside (over the template's; a command's own win);
    bounded as :data:`Envs` says."""
    metadata: Metadata = Field(default_factory=dict)
    """Free-form labels kept with the environment and returned in its info; at
    most :data:`MAX_METADATA_ENTRIES`, keys and values bounded."""
    priority: int = Field(default=0, ge=-1000, le=1000)
    """Elastic provisioning: under memory shortage, higher priorities grow
    first and are frozen last (see ``SetPriorityRequest``)."""
    network: bool | None = None
    """Outbound network (its own namespace, veth and NAT: :mod:`weenv.node.runtime.network`):
    True on, False off, None the template's ``runtime.network``.  A node whose
    ``WEENV_NETWORK`` is ``off`` refuses environments with network."""
    allow_out: list[str] = Field(default_factory=list, max_length=MAX_NET_RULES)
    """IPv4 CIDRs (or addresses) and domain names (``example.com``, ``*.example.com``:
    the addresses their answers carry, :mod:`weenv.node.runtime.nameserver`) always reachable,
    whatever ``deny_out`` says (E2B's ``allowOut``: allowed entries take
    precedence); non-empty turns the network on, and with ``network`` not True
    only these are reachable."""
    deny_out: list[str] = Field(default_factory=list, max_length=MAX_NET_RULES)
    """IPv4 CIDRs (or addresses) refused (E2B's ``denyOut``); ``0.0.0.0/0``: all but ``allow_out``."""
    public_traffic: bool = True
    """E2B's ``allowPublicTraffic``: whether its ports relayed by ``get_host``
    answer without its traffic access token (:mod:`weenv.server.e2b.ports`)."""
    on_timeout: Literal["kill", "pause"] = "kill"
    """At its timeout: destroy it, or pause it releasing its memory (E2B's
    ``lifecycle.on_timeout``; resume or connect brings it back)."""

    _check_timeout = field_validator("timeout")(_finite)
    _check_allow = field_validator("allow_out")(lambda v: [_cidr_or_domain(c) for c in v])
    _check_deny = field_validator("deny_out")(lambda v: [_deny_entry(c) for c in v])


class BatchCreateRequest(_Model):
    """Create several environments at once (a rollout batch)."""

    items: list[CreateRequest] = Field(min_length=1, max_length=4096)
    concurrency: int | None = Field(default=None, ge=1, le=256)
    """Creates running at the same time (default: the node's choice)."""


class ErrorInfo(_Model):
    kind: str
    """An error kind of :mod:`weenv.errors` (``not_found``, ``invalid_input``...)."""
    message: str


class ErrorResponse(_Model):
    """The body of every error answer of the weenv API."""

    error: ErrorInfo


class BatchCreateEvent(_Model):
    """One line of a batch create's NDJSON answer, sent when item ``index`` is
    done: ``environment`` on success, ``error`` on failure."""

    index: int
    environment: EnvironmentInfo | None = None
    error: ErrorInfo | None = None


class SetTimeoutRequest(_Model):
    timeout: float = Field(gt=0, le=MAX_TIMEOUT_S)
    """Seconds from now after which the environment is destroyed."""

    _check_timeout = field_validator("timeout")(_finite)


class SetPriorityRequest(_Model):
    priority: int = Field(ge=-1000, le=1000)
    """Higher: raised first, frozen last under shortage."""


class ResourcesUpdate(_Model):
    """New limits of a running environment: the fields of
    :class:`~weenv.formats.manifest.Resources`, each within its bounds, those
    left out kept as they are."""

    cpus: float | None = Field(default=None, gt=0, le=MAX_CPUS, allow_inf_nan=False)
    memory_bytes: StrictInt | None = Field(default=None, ge=MIN_MEMORY_BYTES, le=MAX_MEMORY_BYTES)
    pids: StrictInt | None = Field(default=None, ge=1, le=MAX_PIDS)
    disk_bytes: StrictInt | None = Field(default=None, ge=MIN_DISK_BYTES, le=MAX_DISK_BYTES)

    def applied_to(self, current: Resources) -> Resources:
        """``current`` with the fields given here."""
        return current.model_copy(update=self.model_dump(exclude_none=True))


class ResizeRequest(_Model):
    """``PATCH /v1/environments/{id}``: resize it live (:mod:`weenv.node.state.resize`)."""

    resources: ResourcesUpdate


class SnapshotRequest(_Model):
    name: Name | None = Field(default=None, min_length=1, max_length=128)
    """The snapshot's template name (default ``snapshot-<hex>``): a template
    name (:func:`~weenv.formats.manifest.check_name`, as :meth:`Node.snapshot` checks it)."""


class SnapshotInfo(_Model):
    """A snapshot published to the store: a template whose top group is an
    environment's captured file system (:mod:`weenv.node.state.snapshot`)."""

    name: str
    """Its template name (E2B's snapshot id): ``create`` starts it."""
    digest: str
    """Its template manifest's digest."""
    group: str
    """The digest of its top group (the capture)."""
    environment: str
    """The environment it was taken of."""
    template: str
    """The digest of that environment's template."""
    bytes_published: int = 0
    """Stored bytes of the chunks the store did not have."""
    capture_s: float = 0.0
    """Seconds the environment was frozen for the capture."""
    publish_s: float = 0.0
    """Seconds publishing took (the environment runs meanwhile)."""
    capture_bytes: int = 0
    """Bytes of the node's disk its capture, kept on the node that took it, is
    counted at in that node's disk admission (:meth:`Captures.count`)."""


class ForkRequest(_Model):
    count: StrictInt = Field(default=1, ge=1, le=10_000)
    """Children (the node's maximum, ``WEENV_MAX_FORK``, default 100, applies too)."""
    timeout: float | None = Field(default=None, gt=0, le=MAX_TIMEOUT_S)
    """Each child's timeout, seconds (default the parent's ``timeout_s``)."""

    _check_timeout = field_validator("timeout")(_finite)


class ForkChild(_Model):
    """One child of a fork: its info, or the error that kept it from starting."""

    environment: EnvironmentInfo | None = None
    error: ErrorInfo | None = None


class ForkResponse(_Model):
    parent: str
    children: list[ForkChild]
    pause_s: float
    """Seconds the parent was frozen for the capture."""
    total_s: float
    """Seconds until every child answered its first command (or failed)."""


class ResetRequest(_Model):
    snapshot: Name | None = Field(default=None, min_length=1, max_length=128)
    """A snapshot taken on this node of the same template (default: the template's state); a
    template name (:func:`~weenv.formats.manifest.check_name`, as :meth:`Node.reset` checks it)."""


class PauseRequest(_Model):
    release_memory: StrictBool = False
    """End its processes and keep its files (memory back to the node; resume
    starts its first process anew) instead of freezing it (:mod:`weenv.node.state.pause`).
    A JSON boolean only (``1`` or ``"no"`` is refused, not read as true/false)."""


class ResumeRequest(_Model):
    timeout: float | None = Field(default=None, gt=0, le=MAX_TIMEOUT_S)
    """Its timeout from now, seconds (default its ``timeout_s``)."""

    _check_timeout = field_validator("timeout")(_finite)


class ResumePublishedRequest(ResumeRequest):
    """Resume on this node a paused environment published by another (:mod:`weenv.node.state.handoff`)."""

    metadata: Metadata = Field(default_factory=dict)
    """Entries set over its own (the cluster's gateway names the node it runs on now)."""


class ProfileReset(_Model):
    """What ``DELETE /v1/templates/{name}/profile`` did: the template's usage profile forgotten."""

    template: str
    digest: str
    had_profile: bool
    """Whether the node or the store had one."""


class TemplateInfo(_Model):
    name: str
    digest: str
    version: str = "latest"
    groups: list[str] = Field(default_factory=list)
    """Group digests, bottom to top."""
    runtime: RuntimeConfig | None = None
    image_bytes: int = 0
    """Sum of the group image sizes (plaintext bytes)."""
    stored_bytes: int = 0
    """Sum of the stored (zstd) chunk sizes."""


class EnvironmentInfo(_Model):
    id: str
    template: str
    template_digest: str
    created_at: float
    """Unix time, seconds."""
    state: str
    """``running`` or what runc reports (``stopped``...)."""
    rootfs: str
    resources: Resources
    timing: CreateTiming
    timeout_s: float = DEFAULT_TIMEOUT_S
    """The lifetime last set (at create or by ``set_timeout``), seconds."""
    expires_at: float = 0.0
    """Unix time after which the node's reaper destroys the environment."""
    envs: dict[str, str] = Field(default_factory=dict)
    metadata: dict[str, str] = Field(default_factory=dict)
    priority: int = 0
    """Its priority for elastic provisioning (at create or by ``set_priority``)."""
    address: str | None = None
    """Its IPv4 address on its veth, when it has network (:mod:`weenv.node.runtime.network`)."""
    public_traffic: bool = True
    """As its create's ``public_traffic`` (E2B's ``allowPublicTraffic``)."""
    network: bool = False
    """Whether it reaches destinations in neither list below: its create's
    ``network``, else its template's ``runtime.network`` (False with
    ``allow_out`` alone: only those are reachable).  A fork child gets its
    parent's three fields (:mod:`weenv.node.state.fork`)."""
    allow_out: list[str] = Field(default_factory=list)
    """Its create's ``allow_out`` (normalized IPv4 CIDRs), reachable whatever ``deny_out`` says."""
    deny_out: list[str] = Field(default_factory=list)
    """Its create's ``deny_out`` (normalized IPv4 CIDRs)."""
    paused_at: float | None = None
    """When it was paused (time.time()), while it is paused."""
    memory_released: bool = False
    """Paused with its memory released: its processes ended, its files kept
    (:mod:`weenv.node.state.pause`); resume starts its first process anew."""
    on_timeout: Literal["kill", "pause"] = "kill"
    """What its timeout does: destroy it, or pause it releasing its memory (E2B's ``on_timeout``)."""


class ExecRequest(_Model):
    command: list[str] | str
    """argv, or a shell string run with ``/bin/sh -c``."""
    env: Envs = Field(default_factory=dict)
    cwd: str | None = Field(default=None, max_length=MAX_PATH)
    timeout: float | None = Field(default=None, gt=0)
    """Seconds; the command and its children are killed after it."""
    stdin: bytes | None = None
    """Bytes the command reads (then end of file); none: ``/dev/null`` unless ``stdin_open``."""
    stdin_open: bool = False
    """Keep stdin a pipe the client writes later (``ProcessStdin``); for streamed
    and background commands."""
    tag: str | None = Field(default=None, max_length=256)
    """A label to find a background command by (returned in its ``ProcessInfo``)."""
    user: str | None = Field(default=None, min_length=1, max_length=256)
    """Who it runs as: a user of the environment's ``/etc/passwd`` or ``"UID[:GID]"``
    (default: the template's user), with that user's groups and ``HOME``."""

    _check_timeout = field_validator("timeout")(_finite)


class ExecResult(_Model):
    """What a command did.

    ``exit_code``: its exit status; 128 + signal number if a signal killed it;
    137 after a timeout; 127 if the executable was not found and 126 if it could
    not be started (as a shell and ``docker exec`` report them, with runc's
    message in ``stderr``).  ``duration_s``: wall-clock seconds of the whole exec.
    """

    exit_code: int
    stdout: bytes
    stderr: bytes
    duration_s: float
    timed_out: bool = False


class NodeStats(_Model):
    environments: int
    groups_mounted: dict[str, int]
    """Group digest -> environments using its mount."""
    cache_chunks_fetched: int
    cache_bytes_fetched: int
    cache_reads_hit: int = 0
    """Reads of the node chunk cache (not prefetches) that found their chunk there."""
    cache_reads_missed: int = 0
    """Reads of the node chunk cache that did not (the chunk was fetched)."""
    exec_agent: int = 0
    """Commands started through environments' exec agents (the fast path)."""
    exec_runc: int = 0
    """Commands started with ``runc exec`` (no agent in the environment, or it was gone)."""
    runtime: str = "runc"
    """The OCI runtime that makes the node's containers: ``crun`` or ``runc``."""
    exec_agent_error: str | None = None
    """Why the node has no exec agent (e.g. no C compiler), None if it has one."""
    pool_ready: int = 0
    """Environments the warm pool holds created ahead (:mod:`weenv.node.state.pool`)."""
    pool_hits: int = 0
    """Creates given an environment of the warm pool (created ahead)."""
    pool_misses: int = 0
    """Creates given none (they created theirs)."""
    chunks: dict[str, int] = Field(default_factory=dict)
    """Where the cache's chunks came from and what went to peers, plaintext bytes
    (:class:`weenv.node.data.peers.PeerStats`: ``store_bytes``, ``peer_bytes``,
    ``peer_failures``, ``served_bytes``, ...)."""


class ProcessInfo(_Model):
    """A command started by a streamed or background run.

    ``pid``: its process id inside the environment (its pid namespace); unique
    among the environment's live processes.  ``exit_code``: None while it runs;
    then as in :class:`ExecResult`.
    """

    pid: int
    command: list[str] | str
    tag: str | None = None
    cwd: str | None = None
    started_at: float
    """Unix time, seconds."""
    running: bool
    exit_code: int | None = None
    timed_out: bool = False
    duration_s: float | None = None
    output_dropped: int = 0
    """Bytes of output no longer kept (a background command's retained output is bounded)."""


class ProcessEvent(_Model):
    """One line of a command's NDJSON output stream, in order:
    ``start`` (``pid``), any number of ``stdout``/``stderr`` (``data``), then
    ``end`` (``exit_code``, ``timed_out``, ``duration_s``), or ``error``
    (``error``) if the run failed."""

    type: Literal["start", "stdout", "stderr", "end", "error"]
    pid: int | None = None
    data: bytes | None = None
    exit_code: int | None = None
    timed_out: bool | None = None
    duration_s: float | None = None
    error: ErrorInfo | None = None


class ProcessStdin(_Model):
    data: bytes = b""
    """Bytes written to the command's stdin (base64 in JSON)."""
    eof: bool = False
    """Close stdin after writing (the command reads end of file)."""


class KillRequest(_Model):
    signal: str | int = "KILL"
    """A signal name (``TERM``, ``SIGKILL``) or number; ``KILL`` kills the whole command tree."""


class RenameRequest(_Model):
    """Paths may hold surrogate escapes (names that are not UTF-8, as
    ``os.fsdecode`` gives them): plain ``str`` fields keep them, where a
    length-constrained ``str`` refuses them (pydantic-core 2.50)."""

    src: str
    dst: str

    @field_validator("src", "dst")
    @classmethod
    def _not_empty(cls, path: str) -> str:
        if not path:
            raise ValueError("a path is not empty")
        return path


class WriteInfo(_Model):
    path: str
    size: int
    """Bytes written."""


__all__ = [
    "BatchCreateEvent",
    "BatchCreateRequest",
    "CreateRequest",
    "CreateTiming",
    "EntryInfo",
    "EnvironmentInfo",
    "ErrorInfo",
    "ErrorResponse",
    "ExecRequest",
    "ExecResult",
    "ForkChild",
    "ForkRequest",
    "ForkResponse",
    "KillRequest",
    "NodeStats",
    "ProcessEvent",
    "ProcessInfo",
    "ProcessStdin",
    "RenameRequest",
    "ResetRequest",
    "ResumeRequest",
    "SetPriorityRequest",
    "SetTimeoutRequest",
    "SnapshotInfo",
    "SnapshotRequest",
    "TemplateInfo",
    "WriteInfo",
]

BatchCreateEvent.model_rebuild()
ForkChild.model_rebuild()
