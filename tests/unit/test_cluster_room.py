"""The cluster view's room for a batch and its routes (weenv.cluster.view): plain state, no Ray."""

from weenv.cluster.node import NodeReport
from weenv.cluster.view import ClusterView

GiB = 1 << 30


def report(node_id: str, *, cpus: float = 2, memory: int = 8 * GiB, envs: int = 0) -> NodeReport:
    import time

    return NodeReport(node_id=node_id, home=f"/h/{node_id}", api_url=f"http://{node_id}:1", api_key="k" * 40,
                      at=time.time(), cpu_capacity=cpus, memory_capacity=memory, cpu_reserved=0.0,
                      memory_reserved=0, cpu_used=0.0, memory_used=0, environments=[f"{node_id}-{i}" for i in range(envs)])


def test_room_counts_what_fits_across_nodes_by_capacity_and_max_environments():
    view = ClusterView(max_environments=3)
    view.heartbeat(report("a", envs=1))
    view.heartbeat(report("b"))
    one_cpu = ("t", 1.0, 1 * GiB)
    # a: 2 cores (1 env there already: room for 2 by environments, 2 by cpus); b: 2 cores
    assert view.room([one_cpu] * 10) == 4
    assert view.room([("t", 0.5, 1 * GiB)] * 10) == 2 + 3  # a: max 3 environments, one there; b: 3
    assert view.room([("t", 4.0, 1 * GiB)]) == 0  # larger than any node
    assert view.room([("t", 1.0, 9 * GiB)]) == 0


def test_room_counts_creates_in_progress_but_not_their_number_per_node():
    view = ClusterView()
    view.heartbeat(report("a", cpus=16, memory=64 * GiB))
    for _ in range(8):  # MAX_INFLIGHT creates in progress: placement passes the node over for now...
        view.place("t", cpus=1.0, memory_bytes=1 * GiB)
    assert view.room([("t", 1.0, 1 * GiB)] * 20) == 8  # ...but it has room for 8 more (16 cores)


def test_routes_are_the_alive_nodes():
    view = ClusterView()
    view.heartbeat(report("a"))
    view.heartbeat(report("b"))
    view.gone("b", "ray reports the node dead")
    assert [r.node_id for r in view.routes()] == ["a"]
    assert view.room([("t", 1.0, 1 * GiB)] * 5) == 2
