"""Template usage profiles on real environments (issue 19): one environment's
usage, recorded when it is destroyed, sizes the next one of its template on a
fresh node (through the store) and survives the node's restart."""

from __future__ import annotations

import contextlib
import time

import pytest

from weenv.config import Paths
from weenv.errors import NotFoundError
from weenv.formats.manifest import Resources
from weenv.node.provision import ProvisionConfig

MIB = 1 << 20
GIB = 1 << 30
FAST = dict(
    interval_s=0.2,
    cpu_window_s=2.0,
    cpu_cooldown_s=1.0,
    memory_hold_s=1.5,
    memory_half_life_s=1.0,
    profile_startup_s=1.0,
    profile_min_observed_s=2.0,
)  # (defaults 2 s and 5 s: 4.5 s more of waiting)
SPIKE = (
    'python3 -c \'import time\nb = bytearray(300 << 20); b[::4096] = b"x" * (len(b) // 4096)\n'
    "t = time.time()\nwhile time.time() - t < 1.5: pass'"
)
RES = Resources(cpus=1.0, memory_bytes=GIB, pids=256)


def test_a_profile_recorded_by_one_environment_sizes_the_next_on_a_fresh_node(
    paths, tmp_path, shared_store, leak_check
):
    from weenv.node.node import Node

    name = shared_store.get_ref("templates", "task").split(":")[1]
    with contextlib.suppress(NotFoundError):  # taught by earlier tests' environments
        shared_store.delete_ref("usage", name)
    try:
        _recorded_then_used(paths, tmp_path, shared_store, Node)
    finally:  # the session's store is shared: later tests start the template unknown
        digest = shared_store.get_ref("templates", "task")
        with contextlib.suppress(NotFoundError):
            shared_store.delete_ref("usage", digest.split(":")[1])


def _wait_history(node, env_id: str, seconds: float) -> None:
    """Until ``env_id`` has ``seconds`` of history: samples x interval (passes run late on a loaded host)."""
    deadline = time.monotonic() + 60
    while len(node.provision_stats(env_id).environments[0].history) * FAST["interval_s"] < seconds:
        assert time.monotonic() < deadline, "the provisioner took no samples of the environment"
        time.sleep(0.2)


def _recorded_then_used(paths, tmp_path, shared_store, Node):
    with Node(paths, store=shared_store, provisioning=ProvisionConfig(**FAST)) as a:
        env = a.create("task", resources=RES, first_command=False)
        assert a.provision_stats(env.id).environments[0].memory_limit == 256 * MIB  # unknown: memory_initial
        _wait_history(a, env.id, FAST["profile_startup_s"])  # the CPU of its start-up is not what it teaches
        a.exec(env.id, SPIKE)
        _wait_history(a, env.id, FAST["profile_startup_s"] + FAST["profile_min_observed_s"] + 1)
        digest = env.template_digest
        a.destroy(env.id)
        recorded = a.provisioner.profiles.get(digest)
    assert recorded is not None and recorded.memory_peak >= 300 * MIB, recorded
    assert recorded.cpu_burst > 0.5 and 0 < recorded.cpu_duty < 1, recorded
    assert (paths.node / "usage" / f"{digest.split(':')[1]}.json").is_file()

    with Node(paths, store=None, provisioning=ProvisionConfig(**FAST)) as again:  # restarted, its own store
        assert again.provisioner.profiles._read_local(digest) == recorded

    fresh = Paths(home=tmp_path / "fresh", cache=paths.cache, store_url=paths.store_url)
    fresh.home.mkdir()
    with Node(fresh, store=shared_store, provisioning=ProvisionConfig(**FAST)) as b:
        env = b.create("task", resources=RES, first_command=False)
        st = b.provision_stats(env.id).environments[0]
        # sized from the profile: the peak working set plus headroom, not memory_initial (256 MiB)
        assert st.memory_limit >= recorded.memory_peak * 1.2 - MIB, st
        b.destroy(env.id)


def test_a_profile_taught_by_a_short_test_like_environment_refuses_nothing_on_an_idle_node(
    paths, shared_store, leak_check
):
    """An environment that lived 6 s running a short command now and then (as
    the suite's do) teaches its template what it did after its start-up (the
    default 2 s; observed 2 s after it at least, not the default 5: it lived
    15 s for that, running five commands 3 s apart); then
    8 concurrent 1-core creates on an idle node are all admitted by the
    default burst admission (the warm pool's test was refused after earlier
    tests had taught the shared store's template)."""
    import concurrent.futures

    from weenv.node.node import Node

    name = shared_store.get_ref("templates", "task").split(":")[1]
    with contextlib.suppress(NotFoundError):
        shared_store.delete_ref("usage", name)
    try:
        teach = ProvisionConfig.from_env().model_copy(update={"profile_min_observed_s": 2.0})
        with Node(paths, store=shared_store, pool_size=0, provisioning=teach) as node:
            env = node.create("task")
            for _ in range(2):
                assert node.exec(env.id, "python3 hello.py").exit_code == 0
                time.sleep(3)
            node.destroy(env.id)
            node.provisioner.profiles.close()  # published
            taught = node.provisioner.profiles.get(env.template_digest)
        assert taught is not None and taught.cpu_mean < 0.01, taught
        with Node(
            paths,
            store=shared_store,
            pool_size=0,
            # the same minimum as the teaching node's: a profile weighing less is forgotten
            provisioning=teach.model_copy(update={"admission": "burst"}),
        ) as node:
            assert node.provisioner.config.admission == "burst"
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                infos = list(pool.map(lambda _: node.create("task", first_command=False), range(8)))
            assert node.provisioner.profiles.get(env.template_digest) is not None  # judged with it
            for i in infos:
                node.destroy(i.id)
    finally:
        with contextlib.suppress(NotFoundError):
            shared_store.delete_ref("usage", name)


def test_a_create_the_objective_refuses_waits_for_room_on_a_real_node(paths, shared_store, leak_check):
    """On 2 cores, a template known to burst (20 % of the time at 1 core): two
    1-core environments fit the cores and are admitted; a third would meet
    both in ~16 % of its bursts, so its create waits (the default burst
    admission, ``admission_wait_s``) and is admitted once one of the two is
    destroyed; one still waiting when the node closes ends with ClosedError."""
    import concurrent.futures

    from weenv.errors import ClosedError
    from weenv.node.node import Node
    from weenv.node.provision.profiles import UsageProfile

    digest = shared_store.get_ref("templates", "task")
    bursty = UsageProfile(
        template=digest,
        cpu_duty=0.2,
        cpu_burst=1.0,
        cpu_p95=1.0,
        memory_working_set=20 * MIB,
        memory_peak=40 * MIB,
        seconds=600.0,
        environments=10,
        updated=time.time(),
    )
    config = ProvisionConfig.from_env().model_copy(update={"cpu_capacity": 2.0, "admission_wait_s": 60.0})
    assert config.admission == "burst"  # the default
    with (
        concurrent.futures.ThreadPoolExecutor(2) as pool,
        Node(paths, store=shared_store, pool_size=0, provisioning=config) as node,
    ):  # the node closes first
        node.provisioner.profiles.record(bursty)
        a, b = (node.create("task", resources=RES, first_command=False) for _ in range(2))
        third = pool.submit(node.create, "task", resources=RES, first_command=False)
        time.sleep(1.5)
        assert not third.done()  # waiting for room, not refused
        node.destroy(a.id)
        c = third.result(timeout=30)
        assert sorted(e.id for e in node.list()) == sorted([b.id, c.id])
        kinds = [e.message for e in node.provisioner.events() if e.env_id == c.id and e.kind == "admission"]
        assert kinds[0].startswith("waiting up to 60 s for room") and kinds[-1] == "admitted after waiting for room"
        fourth = pool.submit(node.create, "task", resources=RES, first_command=False)
        time.sleep(1.0)
        assert not fourth.done()
    with pytest.raises(ClosedError):  # the node closed under it
        fourth.result(timeout=30)


def test_a_test_leaves_a_bursty_profile_in_the_shared_store(shared_store):
    """As an earlier test's CPU loop would teach the template ``task`` (with the
    next test: the suite's fixture ``fresh_usage_profiles``)."""
    from weenv.node.provision.profiles import UsageProfile, publish

    digest = shared_store.get_ref("templates", "task")
    publish(
        shared_store,
        UsageProfile(
            template=digest,
            cpu_duty=0.5,
            cpu_burst=1.0,
            cpu_p95=1.0,
            memory_working_set=MIB,
            memory_peak=MIB,
            seconds=60.0,
            environments=1,
            updated=time.time(),
        ),
    )
    assert shared_store.list_refs("usage")


def test_the_next_test_starts_with_its_templates_unknown(node):
    """What the previous test taught ``task`` is gone: 8 concurrent 1-core
    creates on 2 cores are admitted at once by the default burst admission
    (with the profile left, the warm pool's test of 8 concurrent creates was
    refused: half of a 1-core burst's 7 neighbours busy at any time)."""
    import concurrent.futures

    assert node.store.list_refs("usage") == {}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        infos = list(pool.map(lambda _: node.create("task", first_command=False), range(8)))
    assert not [e for e in node.provisioner.events() if e.kind == "admission"]  # none waited, none refused
    for i in infos:
        node.destroy(i.id)
