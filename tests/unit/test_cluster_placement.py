"""Placement's scoring (weenv.cluster.placement): pure logic, no Ray."""

import random

import pytest

from weenv.cluster.placement import NodeLoad, Policy, Request, cached_share, eligible, place
from weenv.errors import CapacityError, InvalidInputError

GiB = 1 << 30
T = Request(cpus=1, memory_bytes=1 * GiB, groups=(("sha256:base", 800), ("sha256:task", 200)))


def node(name, **kw):
    return NodeLoad(node_id=name, cpu_capacity=kw.pop("cpus", 8), memory_capacity=kw.pop("memory", 32 * GiB), **kw)


def test_the_least_loaded_node_wins_when_none_is_warm():
    nodes = [node("a", cpu_reserved=4), node("b", cpu_reserved=1), node("c", cpu_reserved=6)]
    assert place(nodes, T, rng=random.Random(1)) == "b"


def test_a_warm_node_wins_over_a_less_loaded_cold_one():
    nodes = [node("a"), node("b", cpu_reserved=3, group_bytes={"sha256:base": 800, "sha256:task": 200})]
    assert cached_share(nodes[1], T) == 1.0
    assert place(nodes, T) == "b"


def test_the_cache_bonus_is_bounded_a_warm_node_loses_when_much_busier():
    warm = node("b", cpu_reserved=6, group_bytes={"sha256:base": 800, "sha256:task": 200})
    assert place([node("a"), warm], T) == "a"


def test_a_shared_base_counts_for_a_template_never_run_there():
    nodes = [node("a"), node("b", group_bytes={"sha256:base": 800})]
    assert cached_share(nodes[1], T) == pytest.approx(0.8)
    assert place(nodes, T) == "b"


def test_the_warm_node_is_a_candidate_whatever_the_sample():
    nodes = [node(f"n{i}") for i in range(50)] + [node("warm", group_bytes={"sha256:base": 800, "sha256:task": 200})]
    for seed in range(20):
        assert place(nodes, T, rng=random.Random(seed)) == "warm"


def test_never_a_node_over_capacity_or_at_its_bounds():
    full_cpu = node("cpu", cpus=2, cpu_reserved=1.5, group_bytes={"sha256:base": 800, "sha256:task": 200})
    full_mem = node("mem", memory=2 * GiB, memory_reserved=int(1.5 * GiB), group_bytes={"sha256:base": 800})
    at_max = node("max", environments=4, max_environments=4, group_bytes={"sha256:base": 800})
    busy = node("busy", inflight=Policy().max_inflight, group_bytes={"sha256:base": 800})
    for n in (full_cpu, full_mem, at_max, busy):
        assert not eligible(n, T)
    assert place([full_cpu, full_mem, at_max, busy, node("cold", cpu_reserved=7)], T) == "cold"
    with pytest.raises(CapacityError, match="no node can take"):
        place([full_cpu, full_mem, at_max, busy], T)


def test_inflight_creates_count_toward_capacity():
    n = node("a", cpus=2, cpu_inflight=1.5, inflight=1)
    assert not eligible(n, T)
    n2 = node("b", environments=3, inflight=1, max_environments=4)
    assert not eligible(n2, T)


def test_a_gone_node_is_never_chosen():
    with pytest.raises(CapacityError, match="0 of 1 nodes alive"):
        place([node("a", alive=False)], T)


def test_the_preferred_node_wins_when_eligible_else_the_others_compete():
    nodes = [node("a"), node("b", cpu_reserved=5), node("c", group_bytes={"sha256:base": 800, "sha256:task": 200})]
    assert place(nodes, T, preferred="b") == "b"
    nodes[1].cpu_reserved = 7.5
    assert place(nodes, T, preferred="b") == "c"


def test_a_hint_naming_an_unknown_node_is_refused():
    with pytest.raises(InvalidInputError, match="no node 'zz'"):
        place([node("a")], T, preferred="zz")


def test_the_cache_bonus_ends_at_the_bound_of_environments_per_node():
    """16 small environments (0.05 cores on 2) weigh 0.4 of load, less than a
    warm node's bonus (0.5): a rollout batch piled on the nodes holding its
    templates (bench cluster: one node of 4 took 16 of a batch's 32, max/mean
    2.0).  Past ceil((1 + balance) x demand / nodes) + 1 environments a warm
    node gets no bonus and the least loaded takes the create."""
    from weenv.cluster.placement import bonus_cap

    small = Request(cpus=0.05, memory_bytes=64 << 20, groups=(("sha256:task", 200),))
    policy = Policy()
    assert bonus_cap(32, 4, policy) == 11 and bonus_cap(16, 4, policy) == 6 and bonus_cap(1, 3, policy) == 2
    assert bonus_cap(32, 4, Policy(balance=None)) is None and bonus_cap(32, 0, policy) is None
    warm_bytes = {"sha256:task": 200}

    def cluster(on_warm: int):
        return [
            node("warm", cpus=2, environments=on_warm, cpu_reserved=0.05 * on_warm, group_bytes=warm_bytes),
            *(node(f"cold{i}", cpus=2, environments=4, cpu_reserved=0.2) for i in range(3)),
        ]

    cap = bonus_cap(32, 4, policy)
    assert place(cluster(cap - 1), small, cap=cap) == "warm", "below the bound: the bonus counts"
    assert place(cluster(cap), small, cap=cap) != "warm", "at it: the load decides"
    assert place(cluster(16), small) == "warm", "without a bound the warm node takes them all"
    # a hint wins at the bound as before
    assert place(cluster(cap), small, cap=cap, preferred="warm") == "warm"
    # the warm node under the bound is a candidate whatever the sample, those past it are not preferred
    over = [node(f"w{i}", environments=cap, group_bytes=warm_bytes) for i in range(3)]
    under = node("under", environments=1, group_bytes={"sha256:task": 100})
    nodes = [node(f"n{i}", environments=4, cpu_reserved=4) for i in range(50)] + over + [under]
    for seed in range(10):
        assert place(nodes, small, rng=random.Random(seed), cap=cap) == "under"


def test_a_template_no_node_holds_started_by_several_creates_goes_to_two_nodes():
    """``spread`` (the creates of a cold template placed lately, per node): the node
    with half of them gets no bonus for the next, so the template ends warm on two
    nodes; a template one node holds (no ``spread``) stays there."""
    from weenv.cluster.placement import has_bonus

    cold = Request(cpus=0.05, memory_bytes=64 << 20, groups=(("template:t", 1),))
    assert has_bonus(node("a"), spread={}) and has_bonus(node("a"), spread={"b": 1})
    assert not has_bonus(node("a"), spread={"a": 1}), "the second create of the burst goes elsewhere"
    assert has_bonus(node("a"), spread={"a": 1, "b": 1}) and not has_bonus(node("a"), spread={"a": 2, "b": 1})
    nodes = [node(n) for n in ("a", "b", "c", "d")]
    spread: dict[str, int] = {}
    for _ in range(8):
        chosen = place(nodes, cold, spread=spread, rng=random.Random(len(spread)))
        spread[chosen] = spread.get(chosen, 0) + 1
        n = next(x for x in nodes if x.node_id == chosen)
        n.group_bytes["template:t"], n.inflight = 1, n.inflight + 1  # the view's "expected"
    assert sorted(spread.values()) == [4, 4], spread
    warm = [node("a", group_bytes={"template:t": 1}, environments=3), node("b"), node("c")]
    assert place(warm, cold) == "a", "held: no spread, the warm node keeps it"
