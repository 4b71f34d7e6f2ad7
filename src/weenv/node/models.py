"""Request and response models of node operations, shared by the node, the
HTTP server and its client (one set of models for every face, as SWE-ReX does)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from weenv.packaging.manifest import Resources


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", ser_json_bytes="base64", val_json_bytes="base64")


class CreateTiming(_Model):
    """Phases of one environment create, in seconds, and what it fetched."""

    manifest_s: float = 0.0
    """Fetching and parsing the template and group manifests."""
    groups_s: float = 0.0
    """Registering group images with the lazy file system and mounting them (EROFS)."""
    overlay_s: float = 0.0
    """Making the private upper/work dirs and mounting the overlay rootfs."""
    runtime_s: float = 0.0
    """Writing the OCI bundle and ``runc create`` + ``runc start``."""
    first_command_s: float | None = None
    """Running the first command (``true``) inside the environment, if asked."""
    total_s: float = 0.0
    bytes_fetched: int = 0
    """Stored (zstd) bytes fetched from the store during this create (node-wide counter delta)."""
    chunks_fetched: int = 0
    template_bytes: int = 0
    """Sum of the template's group image sizes (plaintext bytes)."""
    template_stored_bytes: int = 0
    """Sum of the template's stored chunk sizes (zstd bytes in the store)."""


class CreateRequest(_Model):
    template: str
    """Template name (a ref in the store) or digest."""
    resources: Resources | None = None
    """Overrides the template's default resources."""
    first_command: bool = True
    """Run ``true`` inside once started, and time it (the "first command" phase)."""


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


class ExecRequest(_Model):
    command: list[str] | str
    """argv, or a shell string run with ``/bin/sh -c``."""
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = None
    timeout: float | None = Field(default=None, gt=0)
    """Seconds; the command and its children are killed after it."""
    stdin: bytes | None = None


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
