"""The container service: an environment's OCI bundle, network and runc container.

Per environment (in its directory, beside the rootfs the snapshotter mounted):
``bundle/`` (the OCI spec, :mod:`weenv.node.bundle`), with ``runtime.network``
its own network namespace and veth pair (:mod:`weenv.node.network`), the exec
agent's listening socket handed to the container's first process, and the
runc container itself (:mod:`weenv.node.runc`), in cgroup ``/<container id>``.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

from weenv.node import network
from weenv.node.agent import AgentBinary, listen as agent_listen
from weenv.node.bundle import write_bundle
from weenv.node.runc import Runc
from weenv.node.table import AGENT_SOCKET, container_id
from weenv.packaging.manifest import Resources, RuntimeConfig

INIT = Path("/usr/bin/tini-static")
"""The environment's pid 1 (Debian's ``tini``): it reaps orphans, so killed and
backgrounded processes do not pile up as zombies against the pids limit."""


class Containers:
    """Bundles and runc containers of environments (``runc``'s state root is the node's)."""

    def __init__(self, runc: Runc, agent: AgentBinary):
        self.runc = runc
        self.agent = agent
        self.net_cidr = network.cidr_from_env()
        """Where environments with network get their /30 (``WEENV_NET_CIDR``, :mod:`weenv.node.network`)."""

    def make(self, env_id: str, env_dir: Path, runtime: RuntimeConfig, resources: Resources,
             capabilities: tuple[str, ...], undo: contextlib.ExitStack, timing: dict, *, start: bool) -> None:
        """Environment ``env_id``'s network (if ``runtime.network``), bundle
        and container over ``env_dir/rootfs`` (``start``: running, ``runc run
        --detach``; else created and waiting, ``runc create``), each undo
        pushed on ``undo``; its seconds go to ``timing["runtime_s"]``.  Raises
        :class:`RuntimeFailedError` when runc fails."""
        t = time.perf_counter()
        netns = self._network(env_id, env_dir, runtime.network, undo)
        cid = container_id(env_id)
        bundle = env_dir / "bundle"
        bundle.mkdir()
        agent = self.agent.get()
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
        timing["runtime_s"] = time.perf_counter() - t

    def restart(self, env_id: str, env_dir: Path) -> None:
        """Run environment ``env_id``'s container again from its bundle (its
        first process anew over the rootfs mounted at ``env_dir/rootfs``, the
        same network namespace, a new exec agent); the old container must be
        deleted (:meth:`delete`).  Raises :class:`RuntimeFailedError`."""
        agent = self.agent.get()
        listener = agent_listen(env_dir / AGENT_SOCKET) if agent is not None else None
        try:
            self.runc.run_detached(container_id(env_id), env_dir / "bundle",
                                   stdin=None if listener is None else listener.fileno())  # fmt: skip
        finally:
            if listener is not None:
                listener.close()

    def start(self, env_id: str, timeout: float) -> None:
        """``runc start`` of a container :meth:`make` created unstarted; raises
        :class:`RuntimeFailedError` or :class:`NotFoundError` (``timeout`` seconds)."""
        self.runc.start(container_id(env_id), timeout=timeout)

    def delete(self, env_id: str, env_dir: Path) -> None:
        """Kill and remove environment ``env_id``'s container (its cgroup goes with it); idempotent."""
        self.runc.delete(container_id(env_id), force=True, bundle=env_dir / "bundle")

    def teardown_network(self, env_id: str, env_dir: Path) -> None:
        """Remove its network namespace and link, if any; idempotent."""
        network.teardown(env_id, env_dir)

    def status(self) -> dict[str | None, str | None]:
        """Container id -> runc status of every container (one ``runc list``)."""
        return {s.get("id"): s.get("status") for s in self.runc.list()}

    def state(self, env_id: str) -> str | None:
        """Runc's status of environment ``env_id``'s container, None if gone."""
        state = self.runc.state(container_id(env_id))
        return state["status"] if state else None

    def _network(self, env_id: str, env_dir: Path, wanted: bool, undo: contextlib.ExitStack) -> Path | None:
        """With ``wanted``: environment ``env_id``'s own network namespace and
        link, its teardown pushed on ``undo``; the namespace file, or None."""
        if not wanted:
            return None
        undo.callback(network.teardown, env_id, env_dir)
        return network.setup(env_id, env_dir, self.net_cidr).netns
