"""``WeenvDeployment``: a SWE-ReX deployment whose runtime runs in a weenv environment.

``start()`` makes sure the store holds the server's layer group
(:mod:`weenv.adapters.swerex.server_group`) and a template stacking it on the
task's (``TASK.swerex-KEY``: the task's groups and runtime config, the server
group on top; the task's own template is not touched), creates an
environment from it, starts ``swerex-remote`` inside on the environment's own
loopback, and waits until it answers.  ``runtime`` is then SWE-ReX's
``RemoteRuntime`` reaching that server through the daemon's port relay (the
``PORT-ENVID.`` host of :mod:`weenv.server.e2b.ports`, given as the requests'
``Host``), with a token of its own.  ``stop()`` closes the runtime and
destroys the environment; ``is_alive()`` asks the server, as SWE-ReX's
deployments do.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator
from swerex.deployment.abstract import AbstractDeployment
from swerex.deployment.hooks.abstract import CombinedDeploymentHook, DeploymentHook
from swerex.exceptions import DeploymentNotStartedError, DeploymentStartupError
from swerex.runtime.abstract import IsAliveResponse
from swerex.runtime.remote import RemoteRuntime

from weenv.adapters._resources import GIB, MIB, ceiling
from weenv.errors import InvalidInputError, NotFoundError, WeenvError
from weenv.server.kit.relay import IDLE_HEADER, KEY_HEADER

SERVER_PORT = 8000
"""The server's port on the environment's loopback (swerex-remote's default)."""
RELAY_DOMAIN = "weenv"
"""The host's tail after ``PORT-ENVID.``: the daemon's relay routes by the head only."""


class WeenvDeploymentConfig(BaseModel):
    """Configuration of :class:`WeenvDeployment` (one environment per deployment)."""

    template: str | None = None
    """The weenv template (name or digest) the environment starts from."""
    image: str | None = None
    """Instead of ``template``: an image (``docker://HOST/REPO:TAG``, an OCI layout or
    archive) imported into the store on first use as the template of its name."""
    store: str | None = None
    """The store URL the node reads (default ``WEENV_STORE``, else the local node's)."""
    api_url: str | None = None
    """The node's (or cluster gateway's) address; default ``WEENV_API_URL``, else the local node's TCP listener."""
    api_key: str | None = None
    """Its API key; default ``WEENV_API_KEY``, else the local node's."""
    cpus: float | None = None
    """Elastic ceiling, cores (None: the template's resources); also ``memory_mib``, ``disk_gib``."""
    memory_mib: int | None = Field(default=None, gt=0)
    disk_gib: int | None = Field(default=None, gt=0)
    lifetime: float = Field(default=3600.0, gt=0)
    """Seconds the environment lives at most (the node destroys it then)."""
    startup_timeout: float = Field(default=180.0, gt=0)
    """Seconds ``start()`` waits for the environment and the server to answer."""
    runtime_timeout: float = Field(default=10.0, gt=0)
    """``RemoteRuntime``'s timeout: seconds an ``is_alive`` may take."""
    request_idle: float = Field(default=3600.0, gt=0, le=86400.0)
    """Seconds a runtime request may wait for its answer with no byte moving (a session
    command's longest run): asked of the daemon's port relay, whose own default is 60 s."""

    type: Literal["weenv"] = "weenv"
    """Discriminator for (de)serialization/CLI. Do not change."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="after")
    def _one_source(self) -> Self:
        if (self.template is None) == (self.image is None):
            raise ValueError("give exactly one of 'template' and 'image'")
        return self

    def get_deployment(self) -> WeenvDeployment:
        return WeenvDeployment.from_config(self)


class WeenvRuntime(RemoteRuntime):
    """SWE-ReX's ``RemoteRuntime`` addressed through the daemon's port relay:
    every request carries ``Host: PORT-ENVID.weenv`` and, with the node's API
    key, the relay's idle timeout it may wait for an answer (a command quiet
    for minutes is no idle connection).  Once its deployment is stopped,
    every call raises ``DeploymentNotStartedError`` naming the environment."""

    def __init__(self, *, relay_host: str, env_id: str, node_key: str | None, request_idle: float, **kwargs: Any):
        super().__init__(**kwargs)
        self._relay = {"Host": relay_host}
        if node_key:
            self._relay.update({IDLE_HEADER: f"{request_idle:g}", KEY_HEADER: node_key})
        self._env_id = env_id
        self._stopped = False

    @property
    def _headers(self) -> dict[str, str]:
        return {**super()._headers, **self._relay}

    def _check(self) -> None:
        if self._stopped:
            raise DeploymentNotStartedError(
                f"the weenv deployment was stopped: environment {self._env_id} "
                "is destroyed (start the deployment again for a new runtime)"
            )

    async def is_alive(self, *, timeout: float | None = None) -> IsAliveResponse:
        self._check()
        return await super().is_alive(timeout=timeout)

    async def _request(self, endpoint: str, payload: BaseModel | None, output_class: Any, num_retries: int = 0):
        self._check()
        return await super()._request(endpoint, payload, output_class, num_retries)

    async def upload(self, request):
        self._check()
        return await super().upload(request)


class WeenvDeployment(AbstractDeployment):
    def __init__(self, *, logger: logging.Logger | None = None, **kwargs: Any):
        """A SWE-ReX deployment in a weenv environment; see
        :class:`WeenvDeploymentConfig` for the keyword arguments."""
        self.logger = logger or logging.getLogger("rex-deploy")
        self._hooks = CombinedDeploymentHook()
        self._runtime: WeenvRuntime | None = None
        self._sandbox = None
        self._stopped = False
        try:
            self._config = WeenvDeploymentConfig(**kwargs)
        except ValueError as e:  # pydantic's ValidationError: weenv's kind, one line
            first = e.errors()[0] if hasattr(e, "errors") else {"msg": str(e), "loc": ()}
            where = ".".join(map(str, first["loc"]))
            raise InvalidInputError(f"WeenvDeployment: {where + ': ' if where else ''}{first['msg']}") from None

    @classmethod
    def from_config(cls, config: WeenvDeploymentConfig) -> Self:
        return cls(**config.model_dump(exclude={"type"}))

    def add_hook(self, hook: DeploymentHook) -> None:
        self._hooks.add_hook(hook)

    @property
    def env_id(self) -> str | None:
        """The environment's id while started."""
        return None if self._sandbox is None else self._sandbox.id

    @property
    def runtime(self) -> WeenvRuntime:
        """The runtime while started; ``DeploymentNotStartedError`` before ``start()`` and after ``stop()``."""
        if self._runtime is None:
            raise DeploymentNotStartedError(
                "the weenv deployment was stopped: start it again for a new runtime"
                if self._stopped
                else "the weenv deployment is not started: call start()"
            )
        return self._runtime

    async def is_alive(self, *, timeout: float | None = None) -> IsAliveResponse:
        """Whether the server answers (its environment running); raises
        ``DeploymentNotStartedError`` before ``start()`` and after ``stop()``."""
        runtime = self.runtime
        if not await self._sandbox.is_running():
            return IsAliveResponse(is_alive=False, message=f"weenv environment {self.env_id} is gone")
        return await runtime.is_alive(timeout=timeout)

    async def start(self) -> None:
        """Create the environment, start the server in it and wait until it answers.
        Raises weenv's errors (:class:`~weenv.errors.NotFoundError` for an unknown
        template) and ``DeploymentStartupError`` if the server does not come up."""
        if self._runtime is not None:
            return
        from weenv.sdk import AsyncSandbox

        c = self._config
        api_url, api_key = _node_address(c.api_url, c.api_key)
        self._hooks.on_custom_step("Preparing the weenv template")
        template, argv = await asyncio.to_thread(_prepared_template, c)
        resources = ceiling(
            cpus=c.cpus,
            memory_bytes=None if c.memory_mib is None else c.memory_mib * MIB,
            disk_bytes=None if c.disk_gib is None else c.disk_gib * GIB,
        )
        self._hooks.on_custom_step("Creating the weenv environment")
        self._sandbox = await AsyncSandbox.create(
            template,
            timeout=c.lifetime,
            resources=resources,
            metadata={"harness": "swe-rex"},
            api_url=api_url,
            api_key=api_key,
            request_timeout=c.startup_timeout,
        )
        self._stopped = False
        try:
            token = secrets.token_hex(16)
            self._hooks.on_custom_step("Starting runtime")
            server = await self._sandbox.commands.run(
                [*argv, "--host", "127.0.0.1", "--port", str(SERVER_PORT), "--auth-token", token],
                background=True,
                tag="swerex-remote",
            )
            self._runtime = WeenvRuntime(
                host=api_url,
                auth_token=token,
                timeout=c.runtime_timeout,
                relay_host=f"{SERVER_PORT}-{self._sandbox.id}.{RELAY_DOMAIN}",
                env_id=self._sandbox.id,
                node_key=api_key,
                request_idle=c.request_idle,
                logger=self.logger,
            )
            await self._wait_until_alive(server)
        except BaseException:
            await self.stop()
            raise
        self.logger.info("SWE-ReX runtime up in weenv environment %s (template %s)", self.env_id, template)

    async def _wait_until_alive(self, server) -> None:
        deadline = time.monotonic() + self._config.startup_timeout
        while True:
            if (await self._runtime.is_alive(timeout=self._config.runtime_timeout)).is_alive:
                return
            info = await server.refresh()
            if not info.running:
                out = await server.wait()
                raise DeploymentStartupError(
                    f"swerex-remote exited ({info.exit_code}) in weenv environment "
                    f"{self.env_id}: {(out.stderr or out.stdout)[-2000:]}"
                )
            if time.monotonic() > deadline:
                raise DeploymentStartupError(
                    f"swerex-remote did not answer within {self._config.startup_timeout} s "
                    f"in weenv environment {self.env_id}"
                )
            await asyncio.sleep(0.1)

    async def stop(self) -> None:
        """Close the runtime and destroy the environment (idempotent)."""
        runtime, self._runtime = self._runtime, None
        sandbox, self._sandbox = self._sandbox, None
        if runtime is not None:
            try:
                await runtime.close()
            except Exception as e:  # noqa: BLE001 - the server may be gone already: the environment goes anyway
                self.logger.debug("closing the SWE-ReX runtime: %s", e)
            runtime._stopped = True
        if sandbox is not None:
            self._stopped = True
            try:
                await sandbox.kill()
            except WeenvError as e:
                self.logger.warning("could not destroy weenv environment %s: %s", sandbox.id, e)


def _node_address(api_url: str | None, api_key: str | None) -> tuple[str, str | None]:
    """The node's TCP address and key: given, else ``WEENV_API_URL``/``WEENV_API_KEY``,
    else the local node's (its run directory).  The runtime speaks HTTP over TCP,
    so a node serving only its Unix socket is refused."""
    from weenv.config import Paths
    from weenv.sdk._core import ConnectionConfig

    conn = ConnectionConfig.resolve(api_url, api_key)
    if conn.api_url:
        return conn.api_url, conn.api_key
    paths = Paths.from_env()
    try:
        url = paths.api_url.read_text().strip()
    except FileNotFoundError:
        raise InvalidInputError(
            f"no weenv node address: set api_url (or WEENV_API_URL); the local node "
            f"({paths.run}) serves no TCP listener"
        ) from None
    key = conn.api_key
    if key is None and paths.api_key.exists():
        key = paths.api_key.read_text().strip()
    return url.rstrip("/"), key


def _prepared_template(c: WeenvDeploymentConfig) -> tuple[str, list[str]]:
    """The template stacking the server group on the task's (published if new), and the server's argv."""
    from weenv.adapters.swerex.server_group import ensure_group
    from weenv.config import Paths
    from weenv.packaging.template import create_template, load_template
    from weenv.store import open_store

    url = c.store or Paths.from_env().store_url
    store = open_store(url)
    name = c.template
    if c.image is not None:
        name = _imported(store, c.image)
    try:
        digest, manifest = load_template(store, name)
    except NotFoundError:
        raise NotFoundError(f"template {name!r} does not exist in the store {url}") from None
    group = ensure_group(store)
    base = digest[7:19] if name.startswith("sha256:") else manifest.name
    derived = f"{base[:100]}.swerex-{group.name.rsplit('-', 1)[-1]}"
    group_digest = store.resolve("groups", group.name)
    if group_digest in manifest.groups:  # the template holds the server already
        return name, group.argv
    create_template(
        store, derived, [*manifest.groups, group_digest], runtime=manifest.runtime, version=manifest.version
    )
    return derived, group.argv


def _imported(store, image: str) -> str:
    """The template of ``image``'s default name, imported now if the store has none."""
    from weenv.packaging.importer.image_import import default_name, import_image

    name = default_name(image)
    try:
        store.resolve("templates", name)
    except NotFoundError:
        import_image(image, store, name=name)
    return name
