"""The cluster view's room for a batch and its routes (weenv.cluster.view): plain state, no Ray."""

from weenv.cluster.node import NodeReport
from weenv.cluster.view import ClusterView

GiB = 1 << 30


def report(node_id: str, *, cpus: float = 2, memory: int = 8 * GiB, envs: int = 0) -> NodeReport:
    import time

    return NodeReport(
        node_id=node_id,
        home=f"/h/{node_id}",
        api_url=f"http://{node_id}:1",
        api_key="k" * 40,
        at=time.time(),
        cpu_capacity=cpus,
        memory_capacity=memory,
        cpu_reserved=0.0,
        memory_reserved=0,
        cpu_used=0.0,
        memory_used=0,
        environments=[f"{node_id}-{i}" for i in range(envs)],
    )


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


def _node_reserving(view: ClusterView, node_id: str) -> float:
    return next(view._load(n).cpu_reserved for n in view._nodes.values() if n.node_id == node_id)


def test_a_destroy_frees_its_reservation_at_once_before_or_after_the_next_report():
    """An environment killed before its node's next heartbeat held its cores for
    30 s in the view (its create's reservation ended only with a report listing
    it), so a hinted create was passed over for another node.  Now a destroy
    through the cluster frees them at once, whether the last report lists the
    environment yet or not."""
    from weenv.cluster.view import REPORT_GRACE_S

    view = ClusterView()
    view.heartbeat(report("a"))
    view.heartbeat(report("b"))
    # killed before any report lists it
    placed = view.place("t", cpus=2.0, memory_bytes=1 * GiB, node="a")
    assert placed.route.node_id == "a"
    view.done(placed.token, "a", "e1")
    assert _node_reserving(view, "a") == 2.0
    assert view.place("t", cpus=2.0, memory_bytes=1 * GiB, node="a").route.node_id == "b", "a is full: passed over"
    view.done(2, "b", None)
    view.forget("e1")
    assert _node_reserving(view, "a") == 0.0
    again = view.place("t", cpus=2.0, memory_bytes=1 * GiB, node="a")
    assert again.route.node_id == "a", "the hinted node has its cores back"
    view.done(again.token, "a", "e2")
    # listed (and reserved) by a report, then killed: taken off that report's reservations
    listed = report("a")
    listed.environments, listed.cpu_reserved, listed.memory_reserved = ["e2"], 1.5, 1 * GiB
    listed.reservations = {"e2": (1.5, 1 * GiB)}  # its elastic reservation, as the node counts it now
    view.heartbeat(listed)
    assert _node_reserving(view, "a") == 1.5
    view.forget("e2")
    assert _node_reserving(view, "a") == 0.0
    assert view.place("t", cpus=2.0, memory_bytes=1 * GiB, node="a").route.node_id == "a"
    # a report taken before the destroy, arriving after it, neither routes it again nor reserves it
    view.heartbeat(listed)
    assert "e2" not in view.environments() and _node_reserving(view, "a") == 0.0
    after = report("a")
    after.at += REPORT_GRACE_S + 1  # the next one, taken well after the destroy, lacks it: the release ends
    view.heartbeat(after)
    assert not next(n for n in view._nodes.values() if n.node_id == "a").released


def test_a_report_read_during_a_kill_before_any_report_listed_it_frees_it_too():
    """CI (stop 25): an environment created and killed between two reports, the
    second report read while the kill ran (its reservation still counted, the
    environment no longer listed): the view took the report's 0.5 cores as
    reserved, and the next create of 2 cores hinted to that node went to another."""
    view = ClusterView()
    view.heartbeat(report("a"))
    view.heartbeat(report("b"))
    placed = view.place("t", cpus=2.0, memory_bytes=1 * GiB, node="a")
    view.done(placed.token, "a", "e1")
    view.forget("e1")  # before any report listed it
    during = report("a")
    during.cpu_reserved, during.memory_reserved, during.reservations = 0.5, 1 * GiB, {"e1": (0.5, 1 * GiB)}
    view.heartbeat(during)
    assert _node_reserving(view, "a") == 0.0
    assert view.place("t", cpus=2.0, memory_bytes=1 * GiB, node="a").route.node_id == "a"
    during.environments = ["e1"]  # one read before the kill: not routed again either
    view.heartbeat(during)
    assert "e1" not in view.environments() and _node_reserving(view, "a") == 0.0


def test_a_create_destroyed_on_its_node_before_any_report_stops_reserving_after_the_grace():
    import time

    from weenv.cluster.view import REPORT_GRACE_S

    view = ClusterView()
    view.heartbeat(report("a"))
    placed = view.place("t", cpus=1.0, memory_bytes=1 * GiB)
    view.done(placed.token, "a", "e1")
    view.heartbeat(report("a"))  # taken just now: may predate the create's end, the reservation stays
    assert _node_reserving(view, "a") == 1.0
    late = report("a")
    late.at = time.time() + REPORT_GRACE_S + 1  # taken well after the create ended, and it lacks e1
    view.heartbeat(late)
    assert _node_reserving(view, "a") == 0.0
