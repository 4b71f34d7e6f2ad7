"""NeMo Gym on weenv: ``WeenvProvider``, a sandbox provider (NeMo Gym's
``nemo_gym.sandbox.providers.base.SandboxProvider`` contract), registered as
``weenv`` in the ``nemo_gym.sandbox_providers`` entry point group
(``pip install 'weenv[nemo]'``), so a NeMo Gym config selects it by name::

    sandbox:
      weenv:
        api_url: http://HOST:PORT        # default: WEENV_API_URL, else the local daemon
        api_key: ...                     # default: WEENV_API_KEY
        template: my-task                # used when a SandboxSpec has no image

How a :class:`SandboxSpec` maps onto a weenv create: ``image`` is the
template's name (after ``image_rewrites``, NeMo Gym's prefix rewrites), else
``template``; ``ttl_s`` the environment's ``timeout`` (default
``default_ttl_s``); ``ready_timeout_s`` the seconds the create may take;
``resources`` the elastic ceiling (``cpu`` cores, ``memory_mib``,
``disk_gib``; a ``gpu`` is refused); ``env`` the variables of every command,
``metadata`` its labels; ``workdir`` is made and commands run there;
``entrypoint`` is started in the background; ``provider_options`` may hold
``priority`` (elastic provisioning).  A create that fails raises
:class:`SandboxCreateError` (with weenv's error as its cause).

``exec`` runs ``command`` with ``/bin/sh -c``; ``timeout_s`` kills it (the
result has ``error_type="timeout"``, the node's exit code 137 and the output
so far); ``user``: ``None`` runs as the template's user, a name or uid as that user
where the SDK's ``commands.run`` takes ``user=`` (weenv's per-command users);
without them, ``"root"`` runs as the template's user and any other user is
refused (``error_type="sandbox"``: ``su`` cannot work, an environment has no
``CAP_SETUID``); an environment
gone or unreachable gives ``error_type="sandbox"`` and return code 125.  The
handle's ``raw`` is the :class:`weenv.AsyncSandbox` (``raw.node``: the node it
runs on).  Files are streamed both ways.
"""

from __future__ import annotations

import inspect
from pathlib import Path

from nemo_gym.sandbox.providers.base import (
    SandboxCreateError,
    SandboxExecResult,
    SandboxHandle,
    SandboxSpec,
    SandboxStatus,
)
from nemo_gym.sandbox.utils import rewrite_image

from weenv.adapters._resources import GIB, MIB, ceiling
from weenv.errors import CommandTimeoutError, NotFoundError, WeenvError
from weenv.sdk import AsyncSandbox

SANDBOX_ERROR_CODE = 125
"""Return code of a command the sandbox could not run (NeMo Gym's providers' convention)."""
PROVIDER_OPTIONS = frozenset({"priority"})


def _commands_take_a_user(sandbox: AsyncSandbox) -> bool:
    """Whether this SDK's ``commands.run`` takes ``user=`` (weenv's per-command users)."""
    return "user" in inspect.signature(sandbox.commands.run).parameters


class WeenvProvider:
    """NeMo Gym sandbox provider backed by a weenv node (see the module docstring)."""

    name = "weenv"

    def __init__(
        self,
        *,
        api_url: str | None = None,
        api_key: str | None = None,
        template: str | None = None,
        default_ttl_s: float | None = 3600.0,
        image_rewrites: list[dict[str, str]] | None = None,
        request_timeout_s: float | None = None,
    ) -> None:
        self.api_url = api_url
        self.api_key = api_key
        self.template = template
        self.default_ttl_s = default_ttl_s
        self.image_rewrites = list(image_rewrites or [])
        self.request_timeout_s = request_timeout_s

    def _template(self, spec: SandboxSpec) -> str:
        image = rewrite_image(spec.image, self.image_rewrites) if spec.image else None
        template = image or self.template
        if not template:
            raise SandboxCreateError("the SandboxSpec names no image and the weenv provider has no template")
        return template

    async def create(self, spec: SandboxSpec) -> SandboxHandle:
        """A running environment for ``spec``; raises :class:`SandboxCreateError`
        (weenv's error as its cause), or ``ValueError`` for unknown provider options."""
        unknown = set(spec.provider_options) - PROVIDER_OPTIONS
        if unknown:
            raise ValueError(
                f"unknown weenv provider option(s): {', '.join(sorted(unknown))}; "
                f"supported: {', '.join(sorted(PROVIDER_OPTIONS))}"
            )
        r = spec.resources
        template = self._template(spec)
        try:
            resources = ceiling(
                cpus=r.cpu,
                memory_bytes=None if r.memory_mib is None else r.memory_mib * MIB,
                disk_bytes=None if r.disk_gib is None else r.disk_gib * GIB,
                gpus=r.gpu,
            )
            sandbox = await AsyncSandbox.create(
                template,
                timeout=spec.ttl_s if spec.ttl_s is not None else self.default_ttl_s,
                envs={str(k): str(v) for k, v in spec.env.items()},
                metadata={str(k): str(v) for k, v in spec.metadata.items()},
                resources=resources,
                priority=int(spec.provider_options.get("priority", 0)),
                api_url=self.api_url,
                api_key=self.api_key,
                request_timeout=spec.ready_timeout_s if spec.ready_timeout_s is not None else self.request_timeout_s,
            )
        except WeenvError as exc:
            raise SandboxCreateError(f"weenv could not create a sandbox of {template!r}: {exc}") from exc
        try:
            if spec.workdir:
                await sandbox.files.make_dir(spec.workdir)
            if spec.entrypoint:
                await sandbox.commands.run(list(spec.entrypoint), background=True, cwd=spec.workdir, tag="entrypoint")
        except WeenvError as exc:
            await sandbox.kill()
            raise SandboxCreateError(f"weenv sandbox {sandbox.id} failed to start: {exc}") from exc
        return SandboxHandle(sandbox_id=sandbox.id, provider_name=self.name, raw=sandbox)

    async def exec(
        self,
        handle: SandboxHandle,
        command: str,
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_s: int | float | None = None,
        user: str | int | None = None,
    ) -> SandboxExecResult:
        sandbox: AsyncSandbox = handle.raw
        as_user: dict[str, str] = {}
        if user is not None:
            if not _commands_take_a_user(sandbox):
                if user not in ("root", 0):
                    return SandboxExecResult(
                        stdout=None,
                        stderr=f"weenv: this weenv SDK runs commands as the template's user only, not as {user!r}",
                        return_code=SANDBOX_ERROR_CODE,
                        error_type="sandbox",
                    )
            else:
                as_user = {"user": str(user)}
        try:
            r = await sandbox.commands.run(
                ["/bin/sh", "-c", command],
                cwd=cwd,
                envs=env,
                timeout=float(timeout_s) if timeout_s else None,
                **as_user,
            )
        except CommandTimeoutError as exc:
            partial = getattr(exc, "result", None)
            return SandboxExecResult(
                stdout=partial.stdout if partial else None,
                stderr=(partial.stderr if partial else "") + f"weenv: {exc}",
                return_code=partial.exit_code if partial else SANDBOX_ERROR_CODE,
                error_type="timeout",
            )
        except WeenvError as exc:
            return SandboxExecResult(
                stdout=None, stderr=f"weenv: {exc}", return_code=SANDBOX_ERROR_CODE, error_type="sandbox"
            )
        return SandboxExecResult(stdout=r.stdout, stderr=r.stderr, return_code=r.exit_code)

    async def upload_file(self, handle: SandboxHandle, source_path: Path, target_path: str) -> None:
        await handle.raw.files.upload(source_path, target_path)

    async def download_file(self, handle: SandboxHandle, source_path: str, target_path: Path) -> None:
        Path(target_path).parent.mkdir(parents=True, exist_ok=True)
        await handle.raw.files.download(source_path, target_path)

    async def status(self, handle: SandboxHandle) -> SandboxStatus:
        try:
            info = await handle.raw.get_info()
        except NotFoundError:
            return SandboxStatus.STOPPED
        except WeenvError:
            return SandboxStatus.UNKNOWN
        return {
            "running": SandboxStatus.RUNNING,
            "created": SandboxStatus.STARTING,
            "stopped": SandboxStatus.STOPPED,
        }.get(info.state, SandboxStatus.UNKNOWN)

    async def close(self, handle: SandboxHandle) -> None:
        """Destroy the environment (fine if it is gone already)."""
        await handle.raw.kill()

    async def aclose(self) -> None:
        """Nothing provider-wide to close: each sandbox holds its connection until closed."""
        return None
