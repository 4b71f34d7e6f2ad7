"""The create script of :class:`~weenv.node.node.Node`: admission, rootfs,
container, first command, each step undone if a later one fails
(:class:`CreateScript`, a part of the node), and the checks of a create request."""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from weenv.api.models import (
    DEFAULT_TIMEOUT_S,
    CreateRequest,
    CreateTiming,
    EnvironmentInfo,
)
from weenv.errors import (
    FULL_ERRNOS,
    BrokenError,
    DiskFullError,
    InvalidInputError,
    RuntimeFailedError,
    disk_full,
)
from weenv.formats.manifest import Resources, RuntimeConfig, TemplateManifest
from weenv.host.rootfs import RootFS
from weenv.node.data.peers import PEERS_HINT
from weenv.node.resolver import Resolved
from weenv.node.runtime import network
from weenv.node.runtime.agent.client import AgentUnavailable
from weenv.node.runtime.bundle import AGENT_PATH
from weenv.node.runtime.commands import collect
from weenv.node.runtime.container import check_capabilities
from weenv.node.state.fork import request_like
from weenv.node.state.snapshot import Capture
from weenv.node.state.warm import pool_key
from weenv.node.table import (
    UNDELIVERED,
    Environment,
    container_id,
    save_info,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Create:
    """One create: the shared request and what only in-process callers ask."""

    request: CreateRequest
    capabilities: tuple[str, ...]
    prefetch: bool
    undelivered: bool
    upper_from: Path | None = None
    """A capture's subvolume its upper dir starts from (a fork child), else empty."""
    sudo: bool = True
    """Whether a template with ``runtime.sudo`` gets it (build environments: no,
    their upper dir becomes a group and must hold unshifted owners)."""
    peer_hint: tuple[str, ...] = ()
    """The peers the cluster's placement says hold or fetch the template (:data:`PEERS_HINT`)."""
    env_id: str | None = None
    """The id it gets (a published pause resumed here), else a new one."""


class CreateScript:
    """:meth:`create` and its steps; a part of :class:`~weenv.node.node.Node`, over its collaborators."""

    # --- create -----------------------------------------------------------------------
    def create(
        self,
        request: CreateRequest | str,
        *,
        capabilities: tuple[str, ...] | None = None,
        prefetch: bool = True,
        undelivered: bool = False,
        sudo: bool = True,
        **fields,
    ) -> EnvironmentInfo:
        """Create and start an environment.

        ``request``: the :class:`CreateRequest` the server and SDK share, or a
        template (name or digest) with the request's other fields as keyword
        arguments (``resources``, ``first_command``, ``timeout``, ``envs``,
        ``metadata``, ``priority``), checked as the request model checks them
        (:class:`InvalidInputError`).  ``timeout``: seconds from now after
        which :meth:`reap_expired` destroys it (default :data:`DEFAULT_TIMEOUT_S`).

        In-process callers only: ``capabilities``, the processes' capability
        set (default :meth:`Containers.default_capabilities`: Docker's where
        every environment has a user namespace, ``WEENV_USERNS``, else runc's;
        in a user namespace at most Docker's, :class:`InvalidInputError`
        otherwise; build environments pass
        :data:`~weenv.node.runtime.bundle.DOCKER_DEFAULT_CAPS`); ``prefetch``, record the
        template's prefetch profile on its first start and replay it on later
        cold starts (off for transient build environments, which never use the
        warm pool); ``undelivered``, the caller hands the environment on (a
        server's answer) and calls :meth:`delivered` once it has; until then a
        node recovering after a crash removes it instead of adopting it;
        ``sudo``, False: a template whose runtime has ``sudo`` runs without it
        (no user namespace; build environments, whose upper dir becomes a group).

        Returns its info with the create's phase timings (seconds) and bytes
        fetched.  Raises :class:`ClosedError` (not started, closing),
        :class:`CapacityError` (``max_environments`` run or start, or the
        provisioner refuses its resources), :class:`NotFoundError` for an
        unknown template, :class:`DiskFullError` when a step found the node's
        disk full (``ENOSPC``), :class:`MountError` or :class:`RuntimeFailedError`
        when a step fails otherwise; every step already done is undone first.
        """
        self.admission.check_started()
        req = _request(request, fields)
        hint = req.metadata.get(PEERS_HINT)
        if hint is not None:  # the gateway's word to this node, not a label of the environment
            req = req.model_copy(update={"metadata": {k: v for k, v in req.metadata.items() if k != PEERS_HINT}})
        peer_hint = tuple(p for p in (hint or "").split(",") if p)
        if capabilities is None:
            capabilities = self.containers.default_capabilities()
        elif self.containers.userns_all and sudo:
            check_capabilities(tuple(capabilities))
        return self._admitted_create(
            _Create(req, tuple(capabilities), prefetch, undelivered, sudo=sudo, peer_hint=peer_hint)
        )

    def _admitted_create(self, c: _Create) -> EnvironmentInfo:
        with self.admission.admit():
            t0 = time.perf_counter()
            resolved = self.resolver.resolve(c.request.template)
            try:
                return self._create(t0, resolved, c)
            except Exception:
                current = self.resolver.moved(c.request.template, resolved)
                if current is None:
                    raise
                self.pool.forget(pool_key(resolved.digest, c.request.resources, c.capabilities))
            # it started the digest the name had before; the name moved meanwhile (undone): start the new one
            return self._create(t0, Resolved(current), c)

    def _create(self, t0: float, resolved: Resolved, c: _Create) -> EnvironmentInfo:
        """One try of :meth:`create` on ``resolved``, from the warm pool if it has one."""
        req = c.request
        if (
            not c.prefetch
            or not c.sudo
            or c.upper_from is not None
            or c.env_id is not None
            or req.network is not None
            or req.allow_out
            or req.deny_out
        ):
            # build environments, fork children and networks of the create's own: never from the warm pool
            return self._create_env(t0, resolved, c, None)
        with self.warm.taken(pool_key(resolved.digest, c.request.resources, c.capabilities)) as pooled:
            return self._create_env(t0, resolved, c, pooled)

    def _create_env(self, t0: float, resolved: Resolved, c: _Create, pooled) -> EnvironmentInfo:
        """The create script: admission, rootfs, container, first command, each
        step undone if a later one fails; ``pooled`` (owned now) is started
        instead of making the environment if it still can serve."""
        try:
            return self._create_env_undone(t0, resolved, c, pooled)
        except OSError as exc:  # undone: a full disk said so as any other step's failure does
            if exc.errno not in FULL_ERRNOS or isinstance(exc, DiskFullError):
                raise
            who = (
                "a fork child" if c.upper_from is not None else "a new environment"
            ) + f" of template {c.request.template}"
            raise disk_full(who, f"cannot create it (writing {exc.filename or 'its files'})", exc) from exc

    def _create_env_undone(self, t0: float, resolved: Resolved, c: _Create, pooled) -> EnvironmentInfo:
        """:meth:`_create_env`'s script, each step undone if a later one fails."""
        req, digest, timing = c.request, resolved.digest, CreateTiming()
        fetched0, chunks0 = self.cache.bytes_fetched, self.cache.chunks_fetched
        with contextlib.ExitStack() as undo:
            env_id = self.warm.own(pooled, undo) if pooled is not None else c.env_id or secrets.token_hex(6)
            if c.peer_hint:
                self.peers.hint(env_id, c.peer_hint)
            # chunks flow while the manifests load (not on a node that refuses new environments)
            if c.prefetch and self.provisioner.admitting and self.prefetch.begin_early(env_id, digest):
                undo.callback(self.prefetch.cancel, env_id)
            # its profile names its groups: their manifests load beside the template's
            # and the group manifests it carries are taken from it (checked) rather than fetched
            manifest, group_manifests = self.resolver.load(
                digest, self.prefetch.known_groups(digest), self.prefetch.known_manifests(digest)
            )
            timing.manifest_s = time.perf_counter() - t0
            res = req.resources or manifest.runtime.resources
            # CapacityError if full (after waiting up to admission_wait_s for room the latency objective refused)
            t_reserve = time.perf_counter()
            self.provisioner.reserve(env_id, res, priority=req.priority, template=digest, wait=True)
            timing.reserve_s = time.perf_counter() - t_reserve
            undo.callback(self.provisioner.detach, env_id)
            if c.prefetch:
                self.prefetch.begin(env_id, digest, list(zip(manifest.groups, group_manifests)))
            undo.callback(self.prefetch.cancel, env_id)
            undo.callback(
                self.prefetch.end_recording, env_id, publish=False
            )  # runs first: a failed create records nothing
            lowers = self.warm.start(pooled, manifest, group_manifests, timing) if pooled is not None else None
            runtime, egress = _network(req, manifest.runtime)
            if runtime.network:  # before anything is made (a pooled one was made by this node's policy)
                network.check_policy(self.containers.network_allowed)
            if lowers is None:
                userns = self.containers.wants_userns(manifest.runtime) and c.sudo
                lowers = self.snapshotter.prepare(
                    env_id,
                    manifest.groups,
                    group_manifests,
                    res.disk_bytes,
                    undo,
                    timing,
                    upper_from=c.upper_from,
                    userns=userns,
                )
                _check_command(req.template, runtime, self.snapshotter.dir(env_id) / "rootfs")
                self.containers.make(
                    env_id,
                    self.snapshotter.dir(env_id),
                    runtime,
                    res,
                    c.capabilities,
                    undo,
                    timing,
                    start=True,
                    egress=egress,
                )
            self.provisioner.attach(env_id, f"/{container_id(env_id)}")
            self.resolver.check(req.template, resolved)  # RefMoved: undone; create starts the new digest
            env_dir = self.snapshotter.dir(env_id)
            e = Environment(_info(env_id, manifest, digest, res, req, env_dir, egress), manifest, env_dir)
            e.lowers = lowers
            if runtime.network:
                e.info.address = network.env_address(env_id)
            if c.undelivered:  # before env.json: recovery never adopts it without the mark
                (e.dir / UNDELIVERED).touch()
            if req.first_command:
                timing.first_command_s = self._first_command(e, req.template)
            undo.pop_all()
        e.info.timing = timing.model_copy(
            update=dict(
                resolved_from=resolved.source,
                resolved_age_s=resolved.age_s,
                total_s=time.perf_counter() - t0,
                bytes_fetched=self.cache.bytes_fetched - fetched0,
                chunks_fetched=self.cache.chunks_fetched - chunks0,
                template_bytes=sum(g.image_size for g in group_manifests),
                template_stored_bytes=sum(g.stored_size for g in group_manifests),
            )
        )
        e.info.expires_at = time.time() + e.info.timeout_s
        save_info(e.dir, e.info)
        self.table.add(e)
        return e.info

    def _first_command(self, e: Environment, template: str) -> float:
        """Run a probe in the new environment ``e``: the exec agent's ``-t``
        (weenv's own binary, so an image without ``true`` passes), or ``true``
        without the agent; its seconds.  Raises :class:`RuntimeFailedError` if
        the container ended under it, :class:`InvalidInputError` if it failed."""
        t = time.perf_counter()
        agent = e.agent_socket.exists()
        probe = [AGENT_PATH, "-t"] if agent else ["true"]
        try:
            # through the agent alone: it serves only once pid 1 has exec'd the template's command,
            # where a runc exec fallback could answer in the instant before a failed exec ends pid 1
            result = collect(
                self.commands.start(
                    e, probe, timeout=60, primary_reader=True, launcher=self.launchers.agent if agent else None
                )
            )
        except (BrokenError, AgentUnavailable) as exc:  # the container ended under its first command
            raise RuntimeFailedError(
                f"template {template}: the environment stopped as it started (does its "
                f"command {list(e.template.runtime.command)!r} exist and keep running?): {exc}"
            ) from exc
        if result.exit_code != 0:
            raise InvalidInputError(
                f"template {template}: {probe[0]!r} exited {result.exit_code} inside the "
                f"environment: {result.stderr.decode(errors='replace').strip()}"
            )
        return time.perf_counter() - t

    def _remember_resolved(self, template: str, digest: str) -> None:
        self.resolver.remember(template, digest)

    def _create_child(self, c: Capture, timeout: float | None) -> EnvironmentInfo:
        req = request_like(c.info, c.template_digest, timeout=timeout)
        return self._admitted_create(
            _Create(req, self.containers.default_capabilities(), False, False, upper_from=c.path)
        )


def _request(request: CreateRequest | str, fields: dict) -> CreateRequest:
    """The create's request: ``request`` itself, or one made of a template and
    ``fields`` (:class:`InvalidInputError` for what the model refuses); its
    variables' names and values as commands need them."""
    if isinstance(request, CreateRequest):
        if fields:
            raise TypeError(f"Node.create(CreateRequest) takes no {', '.join(sorted(fields))}")
    else:
        unknown = set(fields) - set(CreateRequest.model_fields) | {"template"} & set(fields)
        if unknown:
            raise TypeError(f"Node.create() got unexpected keyword arguments {sorted(unknown)}")
        try:
            request = CreateRequest(template=request, **{k: v for k, v in fields.items() if v is not None})
        except ValidationError as exc:
            raise InvalidInputError(f"bad create request: {_first_error(exc)}") from None
    for key, value in request.envs.items():
        if not key or "=" in key or "\0" in key or "\0" in value:
            raise InvalidInputError(f"bad environment variable {key!r}")
    return request


def _check_command(template: str, runtime: RuntimeConfig, rootfs: Path) -> None:
    """Raise :class:`RuntimeFailedError` when the template's command is an
    absolute path its root file system ``rootfs`` lacks: a first process that
    cannot exec ends the environment at once, and a probe may answer before it
    has (an init such as tini execs first), so it is refused before a container
    is made.  A bare name (found through ``PATH`` at exec) is not checked."""
    command = runtime.command
    if command and command[0].startswith("/") and not RootFS(rootfs).exists(command[0]):
        raise RuntimeFailedError(
            f"template {template}: its command {list(command)!r} names {command[0]!r}, which is not in its file system"
        )


def _network(req: CreateRequest, runtime: RuntimeConfig) -> tuple[RuntimeConfig, network.Egress]:
    """The runtime config and egress limits of a create: ``req.network`` (None:
    the template's) or a non-empty ``allow_out`` gives it network; without
    ``network`` True only ``allow_out`` is reachable (E2B: internet off is
    ``denyOut 0.0.0.0/0``, and allowed entries win)."""
    internet = runtime.network if req.network is None else req.network
    on = internet or bool(req.allow_out)
    if on != runtime.network:
        runtime = runtime.model_copy(update={"network": on})
    return runtime, network.egress_of(internet, req.allow_out, req.deny_out)


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err.get("loc", ()))
    return f"{where}: {err.get('msg')}" if where else str(err.get("msg"))


def _info(
    env_id: str,
    manifest: TemplateManifest,
    digest: str,
    res: Resources,
    req: CreateRequest,
    env_dir: Path,
    egress: network.Egress,
) -> EnvironmentInfo:
    """A new environment's info (its timing filled in when its create ends), with
    its network policy as ``egress`` (:func:`_network`) says (what a fork child inherits)."""
    return EnvironmentInfo(
        id=env_id,
        template=manifest.name,
        template_digest=digest,
        created_at=time.time(),
        state="running",
        rootfs=str(env_dir / "rootfs"),
        resources=res,
        timing=CreateTiming(),
        timeout_s=DEFAULT_TIMEOUT_S if req.timeout is None else float(req.timeout),
        envs=req.envs,
        metadata=req.metadata,
        priority=req.priority,
        public_traffic=req.public_traffic,
        network=egress.internet,
        allow_out=[*egress.allow, *egress.domains],
        deny_out=list(egress.deny),
        on_timeout=req.on_timeout,
    )
