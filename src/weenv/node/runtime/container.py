"""The container service: an environment's OCI bundle, network and runc container.

Per environment (in its directory, beside the rootfs the snapshotter mounted):
``bundle/`` (the OCI spec, :mod:`weenv.node.runtime.bundle`), with ``runtime.network``
its own network namespace and veth pair (:mod:`weenv.node.runtime.network`), the exec
agent's listening socket handed to the container's first process, and the
runc container itself (:mod:`weenv.node.runtime.runc`), in cgroup ``/<container id>``.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import time
from pathlib import Path

from weenv.api.models import CreateTiming
from weenv.errors import InvalidInputError, RuntimeFailedError
from weenv.formats.manifest import Resources, RuntimeConfig
from weenv.host.rootfs import RootFS
from weenv.node.disk import leftovers
from weenv.node.runtime import idmap, nameserver, network
from weenv.node.runtime.agent import AgentBinary
from weenv.node.runtime.agent import listen as agent_listen
from weenv.node.runtime.bundle import DOCKER_DEFAULT_CAPS, RUNC_DEFAULT_CAPS, write_bundle
from weenv.node.runtime.nameserver import DnsProxy
from weenv.node.runtime.runc import Runc
from weenv.node.runtime.users import lookup as lookup_user
from weenv.node.table import AGENT_SOCKET, CONTAINER_FILE, bundle_container_id, container_id, current_container_id

INIT = Path("/usr/bin/tini-static")
"""The environment's pid 1 (Debian's ``tini``): it reaps orphans, so killed and
backgrounded processes do not pile up as zombies against the pids limit."""


AHEAD = ".next"
"""The suffix of what a container made ahead for a reset uses in the environment's
directory beside its running container's: ``bundle.next/``, ``rootfs.next``
(its overlay, over the spare upper dir) and ``agent2.sock.next`` (its agent's socket)."""
RETIRING = ".old"
"""The suffix of the bundle of a container a reset replaced, until it is deleted:
``bundle.old.<container id>`` (a name of its own each: one whose deletion failed
does not stand in the next reset's way), or ``bundle.old`` (left by an older weenv)."""


RESOLV_FILE = "resolv.conf"
"""An environment with network's ``/etc/resolv.conf``, in its directory (outside its rootfs)."""


def check_capabilities(capabilities: tuple[str, ...]) -> None:
    """Refuse (:class:`InvalidInputError`) a capability set beyond Docker's default
    (:data:`DOCKER_DEFAULT_CAPS`): what root inside a user namespace may hold at most."""
    extra = sorted(set(capabilities) - set(DOCKER_DEFAULT_CAPS))
    if extra:
        raise InvalidInputError(
            f"capabilities {', '.join(extra)} are beyond Docker's default set: "
            "an environment may hold fewer, never more"
        )


class Containers:
    """Bundles and runc containers of environments (``runc``'s state root is the node's)."""

    def __init__(self, runc: Runc, agent: AgentBinary):
        self.runc = runc
        self.agent = agent
        self.net_cidr = network.cidr_from_env()
        """Where environments with network get their /30 (``WEENV_NET_CIDR``, :mod:`weenv.node.runtime.network`)."""
        self.network_allowed = network.policy_from_env()
        """The node's policy (``WEENV_NETWORK``): False refuses environments with network."""
        self.dns = DnsProxy()
        """The name servers of its environments with network (:mod:`weenv.node.runtime.nameserver`)."""
        self.userns_all = idmap.userns_from_env()
        """Whether every environment runs in a user namespace of its own (``WEENV_USERNS``,
        :mod:`weenv.node.runtime.idmap`), else only those of templates with ``runtime.sudo``."""

    def wants_userns(self, runtime: RuntimeConfig) -> bool:
        """Whether an environment of a template with ``runtime`` gets a user namespace (and a host id range)."""
        return runtime.sudo or self.userns_all

    def default_capabilities(self) -> tuple[str, ...]:
        """The capability set of a create that names none: Docker's default
        where every environment has a user namespace (root inside is an
        unprivileged id range on the host), else runc's."""
        return DOCKER_DEFAULT_CAPS if self.userns_all else RUNC_DEFAULT_CAPS

    def make(
        self,
        env_id: str,
        env_dir: Path,
        runtime: RuntimeConfig,
        resources: Resources,
        capabilities: tuple[str, ...],
        undo: contextlib.ExitStack,
        timing: CreateTiming,
        *,
        start: bool,
        egress: network.Egress = network.Egress(),
    ) -> str | None:
        """Environment ``env_id``'s network (if ``runtime.network``, limited
        by ``egress``), bundle and container over ``env_dir/rootfs``
        (``start``: running, ``runc run --detach``; else created and waiting,
        ``runc create``), each undo pushed on ``undo``; its seconds go to
        ``timing.runtime_s``.  Returns its address (None without network).
        An environment with a host id range (:func:`weenv.node.runtime.idmap.range_of`,
        given by :meth:`Snapshotter.prepare`) runs in a user namespace over it,
        without ``noNewPrivileges``, with ``capabilities`` (at most
        :data:`DOCKER_DEFAULT_CAPS`, in that namespace only; commands as other
        users hold none); one of a template with ``runtime.sudo`` holds all of
        Docker's (what ``sudo``'s root holds).  Raises :class:`NetworkForbiddenError` (network on a
        node whose policy forbids it, before anything is made),
        :class:`InvalidInputError` (capabilities beyond Docker's default in a
        user namespace), :class:`RuntimeFailedError` when runc fails."""
        t = time.perf_counter()
        host_id = idmap.range_of(env_dir)
        if host_id is not None:
            check_capabilities(capabilities)
            if runtime.sudo:
                capabilities = (*capabilities, *(c for c in DOCKER_DEFAULT_CAPS if c not in capabilities))
        if runtime.network:
            network.check_policy(self.network_allowed)
        link = self._network(env_id, env_dir, runtime.network, undo, egress, host_id)
        netns = link.netns if link is not None else None
        cid = container_id(env_id)
        bundle = env_dir / "bundle"
        bundle.mkdir()
        agent = self.agent.get()
        agent_user = None
        if agent is not None:  # the template's user with its groups, from the environment's own files
            who = lookup_user(RootFS(env_dir / "rootfs"), runtime.user)
            agent_user = f"{who.spec}:{','.join(map(str, who.groups))}"
        write_bundle(
            bundle,
            env_dir / "rootfs",
            runtime,
            hostname=f"weenv-{env_id}",
            cgroups_path=f"/{cid}",
            resources=resources,
            init=INIT if INIT.exists() else None,
            capabilities=capabilities,
            agent=agent,
            netns=netns,
            agent_user=agent_user,
            resolv_conf=env_dir / RESOLV_FILE if link is not None else None,
            userns=None if host_id is None else (host_id, idmap.ID_RANGE),
            userns_path=link.userns if link is not None else None,
        )
        listener = agent_listen(env_dir / AGENT_SOCKET) if agent is not None else None
        undo.callback(self.delete, env_id, env_dir)
        stdin = None if listener is None else listener.fileno()
        try:
            if start:  # create + start in one runc process
                self.runc.run_detached(cid, bundle, stdin=stdin)
            else:
                self.runc.create(cid, bundle, stdin=stdin)
        finally:
            if listener is not None:
                listener.close()  # the agent holds it now: when it dies, connects are refused
        timing.runtime_s = time.perf_counter() - t
        return str(link.env_addr.ip) if link is not None else None

    def restart(self, env_id: str, env_dir: Path) -> None:
        """Run environment ``env_id``'s container again from its bundle (its
        first process anew over the rootfs mounted at ``env_dir/rootfs``, the
        same network namespace, a new exec agent); the old container must be
        deleted (:meth:`delete`).  Raises :class:`RuntimeFailedError`."""
        if idmap.range_of(env_dir) is not None:  # the node's start closed node/ again
            idmap.open_parents(env_dir)
        agent = self.agent.get()
        listener = agent_listen(env_dir / AGENT_SOCKET) if agent is not None else None
        try:
            self.runc.run_detached(
                current_container_id(env_id, env_dir),
                env_dir / "bundle",
                stdin=None if listener is None else listener.fileno(),
            )
        finally:
            if listener is not None:
                listener.close()

    def start(self, env_id: str, timeout: float) -> None:
        """``runc start`` of a container :meth:`make` created unstarted; raises
        :class:`RuntimeFailedError` or :class:`NotFoundError` (``timeout`` seconds)."""
        self.runc.start(container_id(env_id), timeout=timeout)

    def kill(self, env_id: str, env_dir: Path) -> bool:
        """SIGKILL environment ``env_id``'s first process and wait (at most 1 s)
        until it is gone with every process of its pid namespace
        (:meth:`Runc.stop`); the container stays for :meth:`delete`.  True if it died."""
        return self.runc.stop(current_container_id(env_id, env_dir), env_dir / "bundle")

    def delete(self, env_id: str, env_dir: Path, *, ahead: bool = True) -> None:
        """Kill and remove environment ``env_id``'s container (its cgroup goes
        with it), one a reset replaced and not deleted yet, and (``ahead``) the
        one made ahead for its next reset (:meth:`discard_ahead`); idempotent."""
        self.runc.delete(current_container_id(env_id, env_dir), force=True, bundle=env_dir / "bundle")
        self.delete_retiring(env_id, env_dir)
        if ahead:
            self.discard_ahead(env_id, env_dir)

    # --- a container made ahead for a reset (weenv.node.state.reset) ---------------------------
    def make_ahead(self, env_id: str, env_dir: Path, cid: str) -> None:
        """Create (``runc create``, not started) container ``cid`` of environment
        ``env_id`` over the rootfs mounted at ``env_dir/rootfs.next``: its bundle
        ``bundle.next/`` is ``bundle/``'s config with that root and cgroup
        ``/cid``, its agent listens on ``agent2.sock.next``.  The config left
        in ``bundle.next/`` names ``env_dir/rootfs`` (where
        :meth:`promote_ahead` moves that rootfs) for a later :meth:`restart`.
        Raises :class:`RuntimeFailedError` (nothing is left then but the mount)."""
        bundle, ahead = env_dir / "bundle", env_dir / ("bundle" + AHEAD)
        config = json.loads((bundle / "config.json").read_text())
        remove_tree(ahead)
        ahead.mkdir()
        try:
            config["linux"]["cgroupsPath"] = f"/{cid}"
            config["root"]["path"] = os.fspath(env_dir / ("rootfs" + AHEAD))
            _write_json(ahead / "config.json", config)
            (ahead / CONTAINER_FILE).write_text(cid)
            socket = env_dir / (AGENT_SOCKET + AHEAD)
            listener = agent_listen(socket) if self.agent.get() is not None else None
            try:
                self.runc.create(cid, ahead, stdin=None if listener is None else listener.fileno())
            finally:
                if listener is not None:
                    listener.close()
            config["root"]["path"] = os.fspath(env_dir / "rootfs")
            _write_json(ahead / "config.json", config)
        except BaseException:
            self.discard_ahead(env_id, env_dir)
            raise

    def start_ahead(self, cid: str) -> None:
        """``runc start`` of container ``cid`` (made by :meth:`make_ahead`,
        :meth:`promote_ahead` made it the environment's).  Raises :class:`RuntimeFailedError`."""
        self.runc.start(cid)

    def ahead_id(self, env_id: str, env_dir: Path) -> str | None:
        """The id of the container made ahead for environment ``env_id``'s next reset, None if none."""
        ahead = env_dir / ("bundle" + AHEAD)
        return bundle_container_id(env_id, ahead) if (ahead / CONTAINER_FILE).exists() else None

    def promote_ahead(self, env_id: str, env_dir: Path) -> str:
        """Make the container made ahead environment ``env_id``'s own (its old
        one killed, its rootfs unmounted, and the one made ahead's moved to
        ``env_dir/rootfs``): ``bundle/`` becomes ``bundle.old.<its container id>/``
        (for :meth:`delete_retiring`), ``bundle.next/`` ``bundle/``, the agent's
        socket ``agent2.sock``: renames only (a replaced container not deleted
        yet stays apart under its own name).  Returns the new container's id
        (not started yet).  Raises :class:`OSError` (then nothing was renamed,
        or ``bundle/`` was put back)."""
        cid = bundle_container_id(env_id, env_dir / ("bundle" + AHEAD))
        old = env_dir / f"bundle{RETIRING}.{current_container_id(env_id, env_dir)}"
        if old.exists():  # the same id replaced twice (a reset ran it again in between): keep both apart
            old = old.with_name(f"{old.name}.{secrets.token_hex(4)}")
        os.rename(env_dir / "bundle", old)
        try:
            os.rename(env_dir / ("bundle" + AHEAD), env_dir / "bundle")
        except BaseException:
            os.rename(old, env_dir / "bundle")
            raise
        socket = env_dir / (AGENT_SOCKET + AHEAD)
        if socket.exists():
            os.replace(socket, env_dir / AGENT_SOCKET)
        return cid

    @staticmethod
    def retiring(env_dir: Path) -> list[Path]:
        """The bundles of containers :meth:`promote_ahead` replaced in ``env_dir``, not deleted yet."""
        return leftovers(env_dir, "bundle" + RETIRING)

    def delete_retiring(self, env_id: str, env_dir: Path) -> None:
        """Remove every container :meth:`promote_ahead` replaced, and its bundle;
        idempotent.  Each is tried; one that cannot be deleted stays (its bundle
        with it) for the next call, and the first error is raised after the rest."""
        first: Exception | None = None
        for old in self.retiring(env_dir):
            try:
                self.runc.delete(bundle_container_id(env_id, old), force=True, bundle=old)
            except Exception as exc:
                first = first or exc
                continue
            remove_tree(old)
        if first is not None:
            raise first

    def discard_ahead(self, env_id: str, env_dir: Path) -> None:
        """Remove the container made ahead (and its bundle and socket), if any;
        its rootfs stays mounted (the snapshotter's).  Idempotent."""
        ahead = env_dir / ("bundle" + AHEAD)
        if ahead.is_dir():
            if (ahead / CONTAINER_FILE).exists():
                self.runc.delete(bundle_container_id(env_id, ahead), force=True, bundle=ahead)
            remove_tree(ahead)
        with contextlib.suppress(FileNotFoundError):
            (env_dir / (AGENT_SOCKET + AHEAD)).unlink()

    def teardown_network(self, env_id: str, env_dir: Path) -> None:
        """Remove its name server, network namespace and link, if any; idempotent."""
        self.dns.detach(env_id)
        network.teardown(env_id, env_dir)

    def status(self) -> dict[str | None, str | None]:
        """Container id -> runc status of every container (one ``runc list``)."""
        return {s.get("id"): s.get("status") for s in self.runc.list()}

    def state(self, cid: str) -> str | None:
        """Runc's status of container ``cid`` (an environment's
        :attr:`~weenv.node.table.Environment.container_id`), None if gone."""
        state = self.runc.state(cid)
        return state["status"] if state else None

    def _network(
        self,
        env_id: str,
        env_dir: Path,
        wanted: bool,
        undo: contextlib.ExitStack,
        egress: network.Egress,
        host_id: int | None = None,
    ) -> network.Link | None:
        """With ``wanted``: environment ``env_id``'s own network namespace
        (owned by a user namespace over range ``host_id``, if given), link and
        egress table, its teardown pushed on ``undo``; its link, or None."""
        if not wanted:
            return None
        undo.callback(network.teardown, env_id, env_dir)
        link = network.setup(env_id, env_dir, self.net_cidr, egress, host_id)
        self.serve_names(env_id, env_dir, egress)
        undo.callback(self.dns.detach, env_id)
        return link

    def serve_names(self, env_id: str, env_dir: Path, egress: network.Egress) -> None:
        """Environment ``env_id``'s name server (in its namespace, ``env_dir/netns``)
        and the ``env_dir/resolv.conf`` naming it; again for an adopted environment.
        Raises :class:`RuntimeFailedError` when its sockets cannot be made."""
        (env_dir / RESOLV_FILE).write_text(nameserver.RESOLV_CONF)
        try:
            self.dns.attach(
                env_id,
                env_dir / network.NETNS_FILE,
                egress.names(),
                lambda addrs: network.open_addresses(env_id, addrs),
            )
        except OSError as exc:
            raise RuntimeFailedError(f"environment {env_id}'s name server: {exc}") from exc


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name("." + path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
