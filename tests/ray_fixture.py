"""One Ray cluster on this machine for a test session (``ray.cluster_utils.Cluster``:
a head and two more nodes, one CPU each, this process its driver), for every
module that runs weenv on Ray (test_cluster, test_cluster_peers): bringing one
up takes 10-14 s here (29 s for the two modules' on CI).  Each module brings
weenv up on it with its own settings and homes and takes it down again
(:func:`test_cluster.run_cluster`: daemons, mounts and actors checked gone at
the module's end); the Ray processes are stopped after the run's last module
that uses them (not kept up under the rest of the suite) and checked gone by
pid (at the session's end, whatever is left: ``conftest.pytest_sessionfinish``).

Fixtures (``tests/conftest.py`` imports them):

- ``ray_nodes`` (module, over one cluster for the run): a :class:`RayNodes`.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field

import pytest

from weenv.cluster.loopback import LOOPBACK, keep_on_loopback, node_args

keep_on_loopback()  # before anything imports ray: the driver keeps 127.0.0.1 (weenv.cluster.loopback)

__all__ = ["RayNodes", "alive", "children", "note_users", "ray_nodes", "stop"]

NODES = 3
"""Alive Ray nodes (the head among them) each module starts with."""


def children(pid: int) -> set[int]:
    out = set()
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1]) == pid:
                    out.add(int(d))
            except (OSError, IndexError, ValueError):
                pass
    return out


def alive(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@dataclass
class RayNodes:
    """The session's Ray cluster: ``cluster`` (a ``ray.cluster_utils.Cluster``)
    and its ``workers`` (the nodes added to the head, alive ones); add and
    remove nodes here (the list and the processes to stop are kept)."""

    cluster: object
    workers: list = field(default_factory=list)
    pids: set[int] = field(default_factory=set)
    """The Ray processes started (this process's children), stopped at the end."""

    @property
    def address(self) -> str:
        return self.cluster.address

    def ensure(self) -> None:
        """:data:`NODES` alive nodes: a module that removed one (test_cluster kills a node) leaves
        the node it added back in, and one added here makes up for a module that failed before."""
        import ray

        before = children(os.getpid())
        live = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        self.workers = [w for w in self.workers if w.node_id in live]
        while len(self.workers) + 1 < NODES:
            self.workers.append(self.cluster.add_node(**node_args(num_cpus=1)))
        self.cluster.wait_for_nodes()
        self.pids |= children(os.getpid()) - before

    def add_node(self):
        """A node joining the cluster (its processes stopped at the session's end too)."""
        before = children(os.getpid())
        node = self.cluster.add_node(**node_args(num_cpus=1))
        self.workers.append(node)
        self.pids |= children(os.getpid()) - before
        return node

    def remove_node(self, node) -> None:
        self.cluster.remove_node(node)
        self.workers.remove(node)


_shared: RayNodes | None = None
_users: list[str] = []
"""The node ids of this run's tests that use ``ray_nodes``, in run order (:func:`note_users`)."""


def note_users(items) -> None:
    """Called with the session's items once collected (and deselected): which use ``ray_nodes``."""
    _users[:] = [item.nodeid for item in items if "ray_nodes" in getattr(item, "fixturenames", ())]


def _start() -> RayNodes:
    keep_on_loopback()
    import ray
    from ray.cluster_utils import Cluster

    from weenv import cluster

    before = children(os.getpid())
    c = Cluster(initialize_head=True, head_node_args=node_args(num_cpus=1, include_dashboard=False))
    nodes = RayNodes(c, pids=children(os.getpid()) - before)
    try:
        ray.init(address=c.address, namespace=cluster.NAMESPACE, log_to_driver=False, _node_ip_address=LOOPBACK)
        nodes.pids |= children(os.getpid()) - before
        nodes.ensure()
    except BaseException:
        stop(nodes)
        raise
    return nodes


def stop(nodes: RayNodes | None = None) -> list[int]:
    """Shut the Ray cluster down (the shared one by default); the Ray processes
    that were left and had to be killed (none, normally)."""
    global _shared
    import ray

    if nodes is None:
        nodes, _shared = _shared, None
        if nodes is None:
            return []
    try:
        if ray.is_initialized():
            ray.shutdown()
    finally:
        nodes.cluster.shutdown()
        deadline = time.monotonic() + 10
        while any(alive(p) for p in nodes.pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [p for p in nodes.pids if alive(p)]
        for p in left:
            os.kill(p, signal.SIGKILL)
    return left


@pytest.fixture(scope="module")
def ray_nodes(request):
    """The run's Ray cluster (:class:`RayNodes`), this process connected to it:
    started by the first module that uses it, shut down after the last one
    (not kept up under the rest of the suite: its processes take CPU), the
    Ray processes checked gone by pid then."""
    global _shared
    pytest.importorskip("ray")
    if _shared is None:
        _shared = _start()
    yield _shared
    prefix = request.node.nodeid + "::"
    mine = [i for i, nodeid in enumerate(_users) if nodeid.startswith(prefix)]
    if not mine or mine[-1] == len(_users) - 1:  # no later module of the run uses it
        left = stop()
        assert not left, f"Ray processes left after shutdown: {left}"
