"""Where weenv keeps things on a machine, and every setting it reads.

Every setting is one field of :class:`Settings`, grouped by part (``paths``,
``store``, ``cache``, ``pool``, ``runtime``, ``disk``, ``network``,
``provision``, ``server``, ``build``, ``client``).  Each is read from, in this
order of precedence:

1. its environment variable (``WEENV_HOME``, ``WEENV_POOL_SIZE``...: the name
   is in the field's ``env``); an empty variable counts as unset;
2. the settings file, TOML, one table per group (``[pool]`` ``size = 2``):
   ``WEENV_CONFIG`` if set, else ``$WEENV_HOME/config.toml`` when it exists;
3. the field's default.

Modules read settings through :func:`settings` (cached until a ``WEENV_*``
variable or the file changes, so a test's ``monkeypatch.setenv`` is seen at the
next call); nothing else reads ``WEENV_*`` variables.  A bad value raises
:class:`~weenv.errors.InvalidInputError` in one line naming the variable (or
the file and key) and what it accepts; so does an unknown key in the file.
``weenv config`` prints every setting, its value and where it came from.

Paths (:class:`Paths`): ``WEENV_HOME`` holds the embedded store, the node's
chunk cache, mounts, environments, the daemon's socket and log;
``WEENV_CACHE`` big downloads that are slow to redo and safe to share between
homes (debootstrap output, PyPI files); ``WEENV_STORE`` is the store URL.

``node/`` and ``run/`` are closed to other users (mode 0700, :func:`private_dir`):
below them are environments' root file systems and upper dirs (which hold what
code inside wrote, setuid files and device nodes included), the chunk cache,
runc's state, the daemon's socket and API key.  Only root (weenv, runc, the FUSE
holder) goes through them.
"""

from __future__ import annotations

import ipaddress
import os
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from weenv.errors import InvalidInputError

PRIVATE_MODE = 0o700

CONFIG_ENV = "WEENV_CONFIG"
"""The settings file (TOML); unset: ``$WEENV_HOME/config.toml`` if it exists."""
DEFAULT_HOME = "/var/lib/weenv"
ENV_PREFIX = "WEENV_"


# --- value types ------------------------------------------------------------------------------------
_SIZE = re.compile(r"^\s*(\d+)\s*([kmgt]?)i?b?\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """``"1073741824"``, ``"512M"``, ``"10GiB"`` -> bytes (binary units).
    Raises :class:`InvalidInputError`."""
    m = _SIZE.match(text or "")
    if not m:
        raise InvalidInputError(f"bad size {text!r}: want bytes, or a number with K, M, G or T")
    return int(m.group(1)) << (10 * " kmgt".index(m.group(2).lower() or " "))


def _bytes(value: Any) -> Any:
    return parse_bytes(value) if isinstance(value, str) else value


def _ipv4_network(value: Any) -> Any:
    """A string as an IPv4 network with no host bits set and room for one /30."""
    if isinstance(value, str):
        value = ipaddress.IPv4Network(value.strip(), strict=True)
    if isinstance(value, ipaddress.IPv4Network) and value.prefixlen > 30:
        raise ValueError("want a /30 or larger")
    return value


def _upstreams(value: Any) -> Any:
    """``ADDRESS[:PORT],...`` checked: IPv4 addresses, ports 1-65535."""
    if isinstance(value, str):
        for part in value.split(","):
            host, _, port = part.strip().partition(":")
            ipaddress.IPv4Address(host)
            if not 0 < int(port or 53) < 65536:
                raise ValueError("port out of range")
    return value


Bytes = Annotated[int, BeforeValidator(_bytes), Field(ge=0)]
"""A byte count: an integer, or a string such as ``64G`` (binary units)."""


def setting(
    default: Any, env: str, doc: str, *, unit: str = "", accepts: str = "", secret: bool = False, **constraints: Any
) -> Any:
    """A field of a settings group: ``default``, its variable ``env``, a one-line
    ``doc``, the ``unit`` of its value, what it ``accepts`` (said in errors),
    and whether it is a ``secret`` (never printed)."""
    return Field(
        default,
        description=doc,
        **constraints,
        json_schema_extra={"env": env, "unit": unit, "accepts": accepts, "secret": secret},
    )


def extra(info: FieldInfo) -> dict[str, Any]:
    """The ``env``, ``unit``, ``accepts`` and ``secret`` of a settings field."""
    return dict(info.json_schema_extra or {})  # type: ignore[arg-type]


class _Group(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)


# --- the groups -------------------------------------------------------------------------------------
class PathSettings(_Group):
    """Where a node keeps its state and where weenv finds its store."""

    home: Path = setting(
        Path(DEFAULT_HOME),
        "WEENV_HOME",
        "The embedded store, the node's chunk cache, mounts, environments, the daemon's socket and log.",
        unit="path",
        accepts="a directory path",
    )
    cache: Path = setting(
        Path("/var/cache/weenv"),
        "WEENV_CACHE",
        "Big downloads slow to redo and safe to share between homes (debootstrap output, PyPI files).",
        unit="path",
        accepts="a directory path",
    )
    store: str | None = setting(
        None,
        "WEENV_STORE",
        "The store URL (file://, oci://, s3://); unset: file://$WEENV_HOME/store.",
        unit="URL",
        accepts="a store URL",
    )


class StoreSettings(_Group):
    """Writers' leases and gc in a store, and the S3 endpoint."""

    lease_s: float = setting(
        300.0,
        "WEENV_STORE_LEASE_S",
        "How long a writer's lease protects its digests without being renewed.",
        unit="s",
        accepts="a positive number of seconds",
        gt=0,
    )
    gc_grace_s: float = setting(
        0.0,
        "WEENV_GC_GRACE_S",
        "gc spares blobs stored more recently than this.",
        unit="s",
        accepts="a number of seconds, 0 or more",
        ge=0,
    )
    s3_endpoint: str | None = setting(
        None,
        "WEENV_S3_ENDPOINT",
        "The S3 endpoint URL of s3:// stores; unset: botocore's own (AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL, AWS).",
        unit="URL",
        accepts="an http(s) URL",
    )


class CacheSettings(_Group):
    """The node chunk cache."""

    max_bytes: Bytes | None = setting(
        None,
        "WEENV_CACHE_BYTES",
        "Bound of the node chunk cache; unset: 20% of its file system, at most 10 GiB.",
        unit="bytes",
        accepts="bytes, or a number with K, M, G or T",
    )


class PoolSettings(_Group):
    """The warm pool of started environments."""

    size: int = setting(
        1,
        "WEENV_POOL_SIZE",
        "Environments kept started ahead per template (0: no pool).",
        unit="environments",
        accepts="an integer >= 0",
        ge=0,
    )


class RuntimeSettings(_Group):
    """The OCI runtime and what environments run with."""

    name: Literal["auto", "crun", "runc"] = setting(
        "auto",
        "WEENV_RUNTIME",
        "The OCI runtime: auto (crun if it runs here, else runc), crun or runc.",
        accepts="one of auto, crun, runc",
    )
    userns: bool = setting(
        True,
        "WEENV_USERNS",
        "Every environment runs in a user namespace of its own (root inside is not root outside); "
        "off: only those of templates with runtime.sudo.",
        accepts="on or off",
    )
    reset_ahead: bool = setting(
        True, "WEENV_RESET_AHEAD", "Resets start a container made ahead of time.", accepts="on or off"
    )
    max_fork: int = setting(
        100, "WEENV_MAX_FORK", "Children one fork may ask for.", unit="environments", accepts="a positive integer", ge=1
    )
    pause_release_s: float | None = setting(
        None,
        "WEENV_PAUSE_RELEASE_S",
        "Seconds after which a paused environment's memory is released; unset: never, unless asked.",
        unit="s",
        accepts="a positive number of seconds",
        gt=0,
    )
    pause_publish: bool = setting(
        False,
        "WEENV_PAUSE_PUBLISH",
        "Releasing a paused environment's memory also publishes its files to the store, so that any node "
        "resumes it (a cluster's nodes have it on).",
        accepts="on or off",
    )


class DiskSettings(_Group):
    """The node disk holding environments' upper dirs (btrfs image)."""

    size_bytes: Bytes | None = setting(
        None,
        "WEENV_DISK_BYTES",
        "Size of the node disk image; unset: 80% of the home file system's free space.",
        unit="bytes",
        accepts="bytes, or a number with K, M, G or T",
    )


class NetworkSettings(_Group):
    """Environments' network."""

    enabled: bool = setting(
        True, "WEENV_NETWORK", "The node's policy: off refuses environments with network.", accepts="on or off"
    )
    cidr: Annotated[ipaddress.IPv4Network, BeforeValidator(_ipv4_network)] = setting(
        ipaddress.IPv4Network("10.200.0.0/16"),
        "WEENV_NET_CIDR",
        "Where environments with network get their /30.",
        unit="IPv4 network",
        accepts="an IPv4 network of a /30 or larger, such as 10.200.0.0/16",
    )
    dns_upstream: Annotated[str | None, BeforeValidator(_upstreams)] = setting(
        None,
        "WEENV_DNS_UPSTREAM",
        "Name servers environments' names are resolved through; unset: the IPv4 ones of /etc/resolv.conf.",
        unit="ADDRESS[:PORT],...",
        accepts="IPv4 ADDRESS[:PORT],...",
    )


class ProvisionSettings(_Group):
    """Elastic provisioning and admission (the rest of its knobs: ``ProvisionConfig``)."""

    mode: Literal["elastic", "static", "off"] = setting(
        "elastic",
        "WEENV_PROVISION_MODE",
        "elastic: quotas follow usage; static: declared resources; off: no admission, no adjustment.",
        accepts="one of elastic, static, off",
    )
    interval_s: float = setting(
        1.0,
        "WEENV_PROVISION_INTERVAL",
        "Time between two passes of the controller.",
        unit="s",
        accepts="a positive number of seconds",
        gt=0,
    )
    cpu_overcommit: float = setting(
        4.0,
        "WEENV_CPU_OVERCOMMIT",
        "The sum of CPU quotas may reach the cores times this.",
        unit="ratio",
        accepts="a positive number",
        gt=0,
    )
    memory_overcommit: float = setting(
        1.0,
        "WEENV_MEMORY_OVERCOMMIT",
        "The sum of memory limits may reach the memory times this.",
        unit="ratio",
        accepts="a positive number",
        gt=0,
    )
    disk_overcommit: float = setting(
        4.0,
        "WEENV_DISK_OVERCOMMIT",
        "The sum of declared disk limits may reach the node disk's size times this.",
        unit="ratio",
        accepts="a positive number",
        gt=0,
    )
    cpu_quota_at: Literal["ceiling", "reservation"] = setting(
        "ceiling",
        "WEENV_CPU_QUOTA_AT",
        "An elastic environment's CFS quota: its declared cores (ceiling) or its elastic reservation.",
        accepts="one of ceiling, reservation",
    )
    admission: Literal["burst", "peak", "reservations", "static"] = setting(
        "burst",
        "WEENV_ADMISSION",
        "How a new environment is admitted in elastic mode.",
        accepts="one of burst, peak, reservations, static",
    )
    admission_sigmas: float = setting(
        2.0,
        "WEENV_ADMISSION_SIGMAS",
        "admission=peak: standard deviations above the mean the predicted peak is.",
        unit="sigmas",
        accepts="a number >= 0",
        ge=0,
    )
    admission_wait_s: float = setting(
        20.0,
        "WEENV_ADMISSION_WAIT",
        "admission=burst: how long a refused create waits for room.",
        unit="s",
        accepts="a number of seconds from 0 to 3600",
        ge=0,
        le=3600,
    )
    reclaim: bool = setting(
        True,
        "WEENV_RECLAIM",
        "Idle environments' page cache is reclaimed (their limits stay; v2 memory.reclaim, v1 a limit lowered "
        "and put back).",
        accepts="on or off",
    )


class ServerSettings(_Group):
    """The daemon's E2B-compatible API and its port relay."""

    e2b_upload_ttl_s: float = setting(
        3600.0,
        "WEENV_E2B_UPLOAD_TTL_S",
        "How long an upload token lives, and an upload no build holds is kept.",
        unit="s",
        accepts="a positive number of seconds",
        gt=0,
    )
    e2b_uploads_max_bytes: Bytes = setting(
        16 << 30,
        "WEENV_E2B_UPLOADS_MAX_BYTES",
        "Bytes all template uploads of a node hold at once.",
        unit="bytes",
        accepts="bytes, or a number with K, M, G or T",
    )
    e2b_ready_timeout_s: float = setting(
        120.0,
        "WEENV_E2B_READY_TIMEOUT_S",
        "How long a create waits for a template's ready command.",
        unit="s",
        accepts="a positive number of seconds",
        gt=0,
    )
    relay_max: int | None = setting(
        None,
        "WEENV_RELAY_MAX",
        "Port-relay connections at once; unset: a quarter of the daemon's TCP "
        "connection cap (always at most the cap - 8).",
        unit="connections",
        accepts="a positive integer",
        gt=0,
    )
    relay_idle_s: float = setting(
        60.0,
        "WEENV_RELAY_IDLE_S",
        "A relayed connection quiet this long ends.",
        unit="s",
        accepts="a positive number of seconds",
        gt=0,
    )


class BuildSettings(_Group):
    """Builds and imports."""

    e2b_registry: str = setting(
        "docker.io",
        "WEENV_E2B_REGISTRY",
        "Registry of an E2B template's FROM image named without one.",
        unit="host",
        accepts="a registry host",
    )
    import_skopeo: bool = setting(
        False,
        "WEENV_IMPORT_SKOPEO",
        "Import images from a loopback registry through skopeo too (tests).",
        accepts="on or off",
    )


class ClientSettings(_Group):
    """Where the SDK and the CLI find a daemon or a cluster (read in the user's process)."""

    api_url: str | None = setting(
        None,
        "WEENV_API_URL",
        "The daemon's http(s) URL; unset: the local daemon's Unix socket.",
        unit="URL",
        accepts="an http(s) URL",
    )
    api_key: str | None = setting(
        None, "WEENV_API_KEY", "The API key for WEENV_API_URL.", accepts="an API key", secret=True
    )
    cluster_url: str | None = setting(
        None, "WEENV_CLUSTER_URL", "A cluster's gateway URL.", unit="URL", accepts="an http(s) URL"
    )
    cluster_key: str | None = setting(
        None, "WEENV_CLUSTER_KEY", "The API key of WEENV_CLUSTER_URL.", accepts="an API key", secret=True
    )


class Settings(BaseSettings):
    """Every setting of weenv, one group per part.  Construct it with
    :func:`settings` (cached, errors naming the variable); ``Settings()`` reads
    the same sources (environment, then the settings file)."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", frozen=True)

    paths: PathSettings = Field(default_factory=PathSettings)
    store: StoreSettings = Field(default_factory=StoreSettings)
    cache: CacheSettings = Field(default_factory=CacheSettings)
    pool: PoolSettings = Field(default_factory=PoolSettings)
    runtime: RuntimeSettings = Field(default_factory=RuntimeSettings)
    disk: DiskSettings = Field(default_factory=DiskSettings)
    network: NetworkSettings = Field(default_factory=NetworkSettings)
    provision: ProvisionSettings = Field(default_factory=ProvisionSettings)
    server: ServerSettings = Field(default_factory=ServerSettings)
    build: BuildSettings = Field(default_factory=BuildSettings)
    client: ClientSettings = Field(default_factory=ClientSettings)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # first wins: arguments, then WEENV_* variables, then the settings file
        return init_settings, _LayerSource(settings_cls, "env"), _LayerSource(settings_cls, "file")


def groups() -> dict[str, type[_Group]]:
    """Group name -> its model, in the order of :class:`Settings`."""
    return {name: info.annotation for name, info in Settings.model_fields.items()}  # type: ignore[misc]


def fields() -> list[tuple[str, str, FieldInfo]]:
    """``(group, key, field)`` of every setting, in the model's order."""
    return [(g, k, info) for g, model in groups().items() for k, info in model.model_fields.items()]


# --- sources ----------------------------------------------------------------------------------------
Layer = dict[str, dict[str, Any]]


def env_layer(environ: dict[str, str] | None = None) -> Layer:
    """The settings the ``WEENV_*`` variables of ``environ`` (default: this
    process's) give, as ``{group: {key: text}}``; an empty variable is unset."""
    environ = os.environ if environ is None else environ
    out: Layer = {}
    for group, key, info in fields():
        raw = environ.get(extra(info)["env"])
        if raw is not None and raw.strip():
            out.setdefault(group, {})[key] = raw.strip()
    return out


def config_path(environ: dict[str, str] | None = None) -> tuple[Path, bool]:
    """The settings file and whether it was named (``WEENV_CONFIG``) rather than
    the default ``$WEENV_HOME/config.toml``."""
    environ = os.environ if environ is None else environ
    named = (environ.get(CONFIG_ENV) or "").strip()
    if named:
        return Path(named), True
    home = (environ.get("WEENV_HOME") or "").strip() or DEFAULT_HOME
    return Path(home) / "config.toml", False


def file_layer(path: Path, named: bool) -> Layer:
    """The settings file ``path`` as ``{group: {key: value}}``; {} when it is the
    default one and does not exist.  Raises :class:`InvalidInputError` naming
    the file when it cannot be read or is not TOML."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        if named:
            raise InvalidInputError(f"{CONFIG_ENV}={str(path)!r}: no such settings file") from None
        return {}
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidInputError(f"settings file {path}: cannot be read ({exc})") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise InvalidInputError(f"settings file {path}: not valid TOML ({exc})") from None


class _LayerSource(PydanticBaseSettingsSource):
    """The ``env`` or ``file`` layer as a pydantic-settings source."""

    def __init__(self, settings_cls: type[BaseSettings], kind: str):
        super().__init__(settings_cls)
        self.kind = kind

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # unused: __call__ gives the whole layer

    def __call__(self) -> dict[str, Any]:
        return env_layer() if self.kind == "env" else file_layer(*config_path())


# --- loading ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Loaded:
    """Settings, the layers they were read from and the file's path."""

    settings: Settings
    env: Layer
    file: Layer
    path: Path

    def origin(self, group: str, key: str) -> str:
        """Where the value of ``[group] key`` came from: ``env``, ``file`` or ``default``."""
        if key in self.env.get(group, {}):
            return "env"
        return "file" if key in (self.file.get(group) or {}) else "default"


def _one_line(exc: ValidationError, env: Layer, file: Layer, path: Path) -> InvalidInputError:
    """The first error of ``exc`` as one line naming the variable, or the file and key."""
    err = exc.errors()[0]
    loc = [str(p) for p in err.get("loc", ())]
    known = groups()
    if not loc or loc[0] not in known:
        return InvalidInputError(
            f"settings file {path}: unknown group [{loc[0] if loc else '?'}]; known: {', '.join(known)}"
        )
    group = loc[0]
    if len(loc) == 1:
        return InvalidInputError(f"settings file {path}: {group} must be a table ([{group}])")
    key = loc[1]
    info = known[group].model_fields.get(key)
    if info is None:
        return InvalidInputError(
            f"settings file {path}: unknown setting [{group}] {key}; "
            f"known in [{group}]: {', '.join(known[group].model_fields)}"
        )
    meta = extra(info)
    want = meta["accepts"] or err["msg"]
    if key in env.get(group, {}):
        return InvalidInputError(f"{meta['env']}={env[group][key]!r}: want {want}")
    return InvalidInputError(f"settings file {path}: [{group}] {key} = {file[group][key]!r}: want {want}")


def load(environ: dict[str, str] | None = None) -> Loaded:
    """Read the settings from ``environ`` (default: this process's) and the
    settings file, uncached.  Raises :class:`InvalidInputError` in one line."""
    env = env_layer(environ)
    path, named = config_path(environ)
    file = file_layer(path, named)
    merged: Layer = {g: dict(v) if isinstance(v, dict) else v for g, v in file.items()}
    for group, values in env.items():
        base = merged.get(group)
        merged[group] = {**(base if isinstance(base, dict) else {}), **values}
    try:
        return Loaded(Settings.model_validate(merged), env, file, path)
    except ValidationError as exc:
        raise _one_line(exc, env, file, path) from None


_cache: tuple[object, Loaded] | None = None
_variables: tuple[str, ...] | None = None
"""Every variable a setting is read from (and ``WEENV_CONFIG``), once known."""


def _stamp() -> object:
    """What the settings depend on: the ``WEENV_*`` variables and the file's identity."""
    global _variables
    if _variables is None:
        _variables = (CONFIG_ENV, *(extra(info)["env"] for _, _, info in fields()))
    environ = os.environ
    variables = tuple(environ.get(name) for name in _variables)
    path, _ = config_path()
    try:
        st = path.stat()
        file: object = (st.st_ino, st.st_size, st.st_mtime_ns)
    except OSError:
        file = None
    return variables, file


def loaded() -> Loaded:
    """:func:`load` of this process's environment, cached until a ``WEENV_*``
    variable or the settings file changes."""
    global _cache
    stamp = _stamp()
    hit = _cache
    if hit is not None and hit[0] == stamp:
        return hit[1]
    result = load()
    _cache = (stamp, result)
    return result


def settings() -> Settings:
    """The effective settings (see the module doc)."""
    return loaded().settings


# --- paths ------------------------------------------------------------------------------------------
def private_dir(path: Path) -> Path:
    """Make directory ``path`` (and missing parents) and set its mode to
    :data:`PRIVATE_MODE` (an existing one too); return it."""
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, PRIVATE_MODE)
    return path


@dataclass(frozen=True)
class Paths:
    """Every on-disk location under one ``home`` (a directory path)."""

    home: Path
    cache: Path
    store_url: str

    @classmethod
    def from_env(cls) -> Paths:
        """The paths of :func:`settings` (``WEENV_HOME``, ``WEENV_CACHE``, ``WEENV_STORE``)."""
        p = settings().paths
        home = p.home.absolute()
        return cls(home=home, cache=p.cache.absolute(), store_url=p.store or f"file://{home / 'store'}")

    @property
    def node(self) -> Path:
        return self.home / "node"

    @property
    def chunk_cache(self) -> Path:
        """The node chunk cache (plaintext chunks by digest); never the store."""
        return self.node / "cache"

    @property
    def lazy_mountpoint(self) -> Path:
        """Where the lazy FUSE file system shows one file per group image."""
        return self.node / "lazy"

    @property
    def group_mounts(self) -> Path:
        """Parent of the shared, read-only EROFS mount of each group."""
        return self.node / "groups"

    @property
    def environments(self) -> Path:
        """Parent of each environment's bundle, upper/work dirs and rootfs."""
        return self.node / "envs"

    @property
    def run(self) -> Path:
        return self.home / "run"

    @property
    def socket(self) -> Path:
        """The node daemon's HTTP API, on a Unix socket."""
        return self.run / "weenv.sock"

    @property
    def api_key(self) -> Path:
        """The daemon's API key (hex, mode 0600), created on its first start."""
        return self.run / "api-key"

    @property
    def api_url(self) -> Path:
        """``http://HOST:PORT`` of the daemon's TCP listener while it serves one."""
        return self.run / "api-url"

    @property
    def pidfile(self) -> Path:
        return self.run / "weenv.pid"

    @property
    def daemon_log(self) -> Path:
        return self.run / "daemon.log"

    @property
    def runc_root(self) -> Path:
        """runc's state directory (``runc --root``), private to this home."""
        return self.run / "runc"

    @property
    def crun_root(self) -> Path:
        """crun's state directory (``crun --root``), private to this home."""
        return self.run / "crun"

    @property
    def runtime_roots(self) -> dict[str, Path]:
        """OCI runtime name -> its state directory."""
        return {"runc": self.runc_root, "crun": self.crun_root}
