"""Peer chunk sharing on a real Ray cluster on this machine (weenv.cluster.peers,
weenv.node.data.peers): a head and two more nodes, each with its own weenv home and
chunk cache, reading one file store.  A chunk comes from a peer that holds it
instead of the store; a template started on two nodes at once comes from the
store once; a peer answering other bytes, a slow peer (busy: its rate's
tokens would come after the asker's timeout) and a gone peer are passed over
for the store.  The tests run in order (the last stops a
node's daemon).
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

ray = pytest.importorskip("ray")

from conftest import CACHE  # noqa: E402
from test_cluster import SMALL, cluster_store, run_cluster  # noqa: E402,F401  (cluster_store: a fixture)
from weenv import cluster  # noqa: E402
from weenv.cluster.client import ClusterClient  # noqa: E402
from weenv.config import Paths  # noqa: E402
from weenv.formats.manifest import parse_group_manifest  # noqa: E402
from weenv.node.data.peers import PeerSettings, PeerUpdate  # noqa: E402
from weenv.sdk import NodeClient  # noqa: E402
from weenv.server import daemon  # noqa: E402

MiB = 1 << 20
FILE = 24 * MiB


@pytest.fixture(scope="module")
def peer_cluster(ray_nodes, tmp_path_factory, cluster_store):  # noqa: F811
    # a node silent for long stays listed as a peer: the gone-peer test stops a daemon under its actor;
    # the two windows the tests wait out are short (the defaults: 10 s passed over, 30 s placed)
    for up in run_cluster(
        ray_nodes,
        tmp_path_factory,
        cluster_store,
        max_environments=4,
        heartbeat_s=0.3,
        heartbeat_timeout_s=600,
        reconcile_s=0.3,
        cache_scan_s=0.3,
        peer_timeout_s=1.0,
        peer_pass_over_s=3.0,
        placed_expect_s=4.0,
    ):
        yield (*up, cluster_store)


def _home(homes: Path, node_id: str) -> Path:
    return homes / node_id[:12]


def _chunks(homes: Path, node_id: str) -> dict[str, int]:
    with NodeClient(socket=Paths(home=_home(homes, node_id), cache=CACHE, store_url="").socket) as c:
        return c.stats().chunks


def _delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before.get(k, 0) for k in after}


def _wait_listed(holder: str, asker: str, cached: int, timeout: float = 30.0) -> None:
    """Until ``holder`` reports ``cached`` bytes and ``asker``'s peer table lists its groups (and got it)."""
    actor = cluster.placement_actor()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        held = any(s.node_id == holder and s.cached_bytes >= cached for s in cluster.status())
        table = {p.node_id: p for p in ray.get(actor.peers.remote(asker))}
        if held and holder in table and table[holder].groups:
            time.sleep(1.0)  # a few heartbeats: the asker's daemon has this table
            return
        time.sleep(0.2)
    raise AssertionError(f"{asker}'s peer table never listed {holder} holding {cached} bytes")


def _read_file_on(client: ClusterClient, template: str, node: str, path: str) -> str:
    e = client.create(template, resources=SMALL, node=node)
    assert e.node_id == node
    r = client.exec(e.id, f"cat {path} | wc -c")
    assert r.exit_code == 0 and r.stdout.strip() == str(FILE).encode(), r
    return e.id


def _set_peer_settings(homes: Path, node_id: str, settings: PeerSettings) -> None:
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(_home(homes, node_id) / "run" / "weenv.sock"))) as h:
        r = h.put(
            "http://weenv/v1/peers",
            content=PeerUpdate(settings=settings).model_dump_json(),
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 204, r.text


def _nodes() -> list[str]:
    return sorted(s.node_id for s in cluster.status())


def test_a_chunk_comes_from_a_peer_instead_of_the_store(peer_cluster):
    c, workers, config, homes, _store = peer_cluster
    a, b, _ = _nodes()
    with ClusterClient() as client:
        before_a, before_b = _chunks(homes, a), _chunks(homes, b)
        ea = _read_file_on(client, "t1", a, "/workspace/a.bin")
        got_a = _delta(_chunks(homes, a), before_a)
        assert got_a["store_bytes"] >= FILE and got_a["peer_bytes"] == 0, got_a
        _wait_listed(a, b, FILE)
        before_a = _chunks(homes, a)
        eb = _read_file_on(client, "t1", b, "/workspace/a.bin")
        got_b, served = _delta(_chunks(homes, b), before_b), _delta(_chunks(homes, a), before_a)
        print(f"node B: {got_b}")
        assert got_b["peer_bytes"] >= FILE, got_b
        # what B read of the template, A had read too: nothing (or nearly) from the store
        assert got_b["store_bytes"] < 4 * MiB, got_b
        assert served["served_bytes"] == got_b["peer_bytes"] and served["store_bytes"] == 0, served
        for e in (ea, eb):
            client.destroy(e)


def test_a_peer_serving_other_bytes_is_caught_and_the_store_serves(peer_cluster):
    c, workers, config, homes, _store = peer_cluster
    a, b, d = _nodes()
    with ClusterClient() as client:
        ea = _read_file_on(client, "t2", a, "/workspace/b.bin")
        _wait_listed(a, d, FILE)
        client.destroy(ea)
        # A's cached chunks of t2's own group go bad on its disk (same size: A does not notice, it serves them)
        store = _store
        group = parse_group_manifest(store.get_manifest(store.get_ref("groups", "task-t2")))
        cache = _home(homes, a) / "node" / "cache" / "sha256"
        bad = 0
        for ch in group.chunks:
            f = cache / ch.digest[7:9] / ch.digest[7:]
            if f.exists() and ch.size == MiB:
                f.write_bytes(bytes(ch.size))
                bad += 1
        assert bad >= 20
        before_d, before_a = _chunks(homes, d), _chunks(homes, a)
        ed = _read_file_on(client, "t2", d, "/workspace/b.bin")  # wc reads it whole: the right bytes
        r = client.exec(ed, "sha256sum /workspace/b.bin")
        assert r.exit_code == 0
        got = _delta(_chunks(homes, d), before_d)
        print(f"node D: {got}")
        # one bad answer, and A is passed over: the store serves the rest
        assert got["peer_bad"] >= 1 and got["store_bytes"] >= bad * MiB, got
        assert _delta(_chunks(homes, a), before_a)["served_chunks"] >= 1
        # and what D now holds is the store's content (D serves the right bytes, A is the odd one)
        ref = client.exec(_read_file_on(client, "t2", b, "/workspace/b.bin"), "sha256sum /workspace/b.bin")
        assert ref.stdout.split()[0] == r.stdout.split()[0]
        client.destroy(ed)
        for e in list(client.environments()):
            client.destroy(e)


def test_a_template_started_on_two_nodes_at_once_streams_its_pack_from_the_store_once(peer_cluster, tmp_path):
    """Two creates of one template placed on two nodes at once: each node's peer
    table (a heartbeat old) listed neither, so both streamed the template's
    prefetch pack from the store (two packs' bytes: 2 x 24 MiB).  Placement
    names the node placed with it in each create (the hint): the template's
    bytes come from the store once (its pack, or its chunks one by one: two
    nodes asking each other answer 404 at once, and one of them goes to the
    store), and the other node takes them from that one."""
    import os
    import threading

    from weenv.formats.manifest import RuntimeConfig
    from weenv.packaging.group import build_group
    from weenv.packaging.template import create_template

    c, workers, config, homes, store = peer_cluster
    a, b, d = _nodes()
    (tmp_path / "workspace").mkdir()
    (tmp_path / "workspace" / "c.bin").write_bytes(os.urandom(FILE))
    build_group(tmp_path, store, name="task-t3")
    create_template(store, "t3", ["base", "task-t3"], runtime=RuntimeConfig(working_dir="/workspace"))
    with ClusterClient() as client:
        # d records t3's profile and publishes its pack, then forgets t3's chunks
        packs = set(store.list_packs())
        client.destroy(_read_file_on(client, "t3", d, "/workspace/c.bin"))
        deadline = time.monotonic() + 30
        while not set(store.list_packs()) - packs:
            assert time.monotonic() < deadline, "no prefetch pack published"
            time.sleep(0.2)
        with NodeClient(socket=Paths(home=_home(homes, d), cache=CACHE, store_url="").socket) as n:
            n.drop_cache()
        time.sleep(config.placed_expect_s + 1)  # d no longer counts as placed with t3 lately
        before = {n: _chunks(homes, n) for n in (a, b)}
        made, errors = [], []

        def one(node: str) -> None:
            try:
                made.append(_read_file_on(client, "t3", node, "/workspace/c.bin"))
            except Exception as exc:  # shown by the assertion below
                errors.append(exc)

        threads = [threading.Thread(target=one, args=(n,)) for n in (a, b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        got = {n: _delta(_chunks(homes, n), before[n]) for n in (a, b)}
        print(f"t3 on a and b at once: {got}")
        assert sum(g["pack_bytes"] for g in got.values()) < 1.5 * FILE, got  # one pack, not two
        assert sum(g["store_bytes"] for g in got.values()) < 1.5 * FILE, got
        assert max(g["peer_bytes"] for g in got.values()) >= FILE // 2, got
        for e in made:
            client.destroy(e)


def test_a_slow_peer_and_a_gone_peer_are_passed_over_for_the_store(peer_cluster):
    c, workers, config, homes, _store = peer_cluster
    a, b, d = _nodes()
    with ClusterClient() as client:
        # t1 is on a and b (first test); d reads it with a and b slow: 1 MiB chunks at 256 KiB/s, so an
        # answer's tokens come 3 s or more after its request, past d's 1 s timeout: a and b refuse at once
        # (busy, with Retry-After), and d passes them over for the store. (They slept out every wait all
        # the same, for answers d had given up on: 15 s of debt slept off before their daemons stopped.)
        settings = ray.get(cluster.placement_actor().peer_settings.remote())
        for slow in (a, b):
            _set_peer_settings(homes, slow, settings.model_copy(update={"serve_bytes_per_s": 256 << 10}))
        _wait_listed(a, d, FILE)
        before = _chunks(homes, d)
        before_slow = {n: _chunks(homes, n) for n in (a, b)}
        t = time.monotonic()
        ed = _read_file_on(client, "t1", d, "/workspace/a.bin")
        got = _delta(_chunks(homes, d), before)
        print(f"node D with slow peers: {got} in {time.monotonic() - t:.1f} s")
        assert got["peer_busy"] >= 1 and got["store_bytes"] >= FILE, got
        refused = {n: _delta(_chunks(homes, n), before_slow[n]) for n in (a, b)}
        assert sum(r["served_refused"] for r in refused.values()) == got["peer_busy"], refused
        asks_again = time.monotonic() + config.peer_pass_over_s  # d passed a and b over (Retry-After, at most this)
        client.destroy(ed)
        # a's and b's daemons stop (their actors live, so they stay listed): d's asks are refused, the store serves
        with NodeClient(socket=Paths(home=_home(homes, d), cache=CACHE, store_url="").socket) as n:
            n.drop_cache()
        for gone in (a, b):
            t = time.monotonic()
            assert daemon.stop(Paths(home=_home(homes, gone), cache=CACHE, store_url=""))
            print(f"node {gone[:12]}'s daemon stopped in {time.monotonic() - t:.1f} s")
        time.sleep(max(0.0, asks_again - time.monotonic()))  # d asks a and b again
        assert {a, b} <= {p.node_id for p in ray.get(cluster.placement_actor().peers.remote(d))}
        before = _chunks(homes, d)
        ed = _read_file_on(client, "t1", d, "/workspace/a.bin")
        got = _delta(_chunks(homes, d), before)
        print(f"node D with b gone: {got}")
        assert got["peer_unreachable"] >= 1 and got["store_bytes"] >= FILE, got
        client.destroy(ed)
