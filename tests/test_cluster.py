"""weenv on a real Ray cluster on this machine (weenv.cluster): a head and two
more Ray nodes (ray.cluster_utils.Cluster), each with its own weenv home, one
node actor and daemon per node, the placement actor, the cluster client.

The Ray cluster is the session's (:mod:`ray_fixture`: test_cluster_peers runs
on it too; bringing one up takes 10-14 s), weenv is up on it for the module;
the tests run in order: one kills a node (and adds one), and the last takes the
cluster down and up again with the CLI.  Everything is cleaned by pid at the
module's end: the daemons (through ``weenv cluster down``, or ``weenv stop`` on
a killed node's home), and the check that nothing is left: no mount or cgroup,
no daemon process, the gateway's port closed (the Ray processes: at the
session's end).
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest

ray = pytest.importorskip("ray")

from conftest import CACHE, system_snapshot  # noqa: E402
from net_sockets import beyond_loopback, descendants, sockets_of  # noqa: E402
from ray_fixture import alive as _alive  # noqa: E402
from weenv import cluster  # noqa: E402
from weenv.cluster.client import ClusterClient  # noqa: E402
from weenv.config import Paths  # noqa: E402
from weenv.errors import CapacityError, InvalidInputError, LostError, NotFoundError, WeenvError  # noqa: E402
from weenv.formats.manifest import Resources, RuntimeConfig  # noqa: E402
from weenv.host import mounts  # noqa: E402
from weenv.node.cgroups import environment_dirs  # noqa: E402
from weenv.node.runtime import envs_dir  # noqa: E402
from weenv.server import daemon  # noqa: E402
from weenv.store.file import FileStore  # noqa: E402

SMALL = Resources(cpus=0.1, memory_bytes=256 << 20)
MiB = 1 << 20


@pytest.fixture(scope="module")
def cluster_store(tmp_path_factory, debian_root):
    """Templates ``t1`` (base + a 24 MiB ``/workspace/a.bin``) and ``t2`` (base + ``b.bin``)."""
    from weenv.packaging.group import build_group
    from weenv.packaging.template import create_template

    root = tmp_path_factory.mktemp("cluster-store")
    store = FileStore(root / "store")
    build_group(debian_root, store, name="base")
    for t, f in (("t1", "a.bin"), ("t2", "b.bin")):
        (root / t / "workspace").mkdir(parents=True)
        (root / t / "workspace" / f).write_bytes(os.urandom(24 * MiB))
        build_group(root / t, store, name=f"task-{t}")
        create_template(store, t, ["base", f"task-{t}"], runtime=RuntimeConfig(working_dir="/workspace"))
    return store


@pytest.fixture(scope="module")
def ray_cluster(ray_nodes, tmp_path_factory, cluster_store):
    """The session's Ray cluster of 3 nodes with weenv up on it; taken down and checked by pid."""
    yield from run_cluster(
        ray_nodes,
        tmp_path_factory,
        cluster_store,
        max_environments=2,
        heartbeat_s=0.3,
        heartbeat_timeout_s=5,
        reconcile_s=0.3,
        cache_scan_s=0.3,
        batch_queue_s=3,
    )


def run_cluster(ray_nodes, tmp_path_factory, cluster_store, **settings):
    """Yield ``(nodes, workers, config, homes)``: the session's Ray cluster
    (:class:`ray_fixture.RayNodes`, three alive nodes) with weenv up on it
    (``settings``: :class:`ClusterConfig` fields); weenv taken down after, its
    daemons stopped by pid and checked gone, nothing left under ``homes``."""
    homes = tmp_path_factory.mktemp("cluster-homes")
    before = system_snapshot(homes)
    ray_nodes.ensure()
    if cluster.down():  # not this module's settings: a module before did not take its weenv down
        print("a weenv cluster was up: taken down")
    daemon_pids: list[int] = []
    try:
        config = cluster.ClusterConfig(
            home=f"{homes}/{{node}}", store=cluster_store.url, cache=str(CACHE), **{"gateway_port": 0, **settings}
        )
        t0 = time.monotonic()
        nodes = cluster.up(config, timeout=120)
        print(f"cluster up: {len(nodes)} nodes in {time.monotonic() - t0:.1f} s")
        yield ray_nodes, ray_nodes.workers, config, homes
    finally:
        try:
            gateway = cluster.gateway()
            daemon_pids = [
                int(Paths(home=h, cache=CACHE, store_url="").pidfile.read_text())
                for h in homes.iterdir()
                if Paths(home=h, cache=CACHE, store_url="").pidfile.exists()
            ]
            try:
                cluster.down()
            except Exception as exc:  # a killed node's daemon: stopped below
                print(f"cluster down: {exc}")
            with pytest.raises(httpx.ConnectError):  # the gateway is gone with the cluster
                httpx.get(gateway.url + "/v1/health", timeout=5)
        finally:
            for home in homes.iterdir():
                daemon.stop(Paths(home=home, cache=CACHE, store_url=cluster_store.url))
            assert daemon_pids and not [p for p in daemon_pids if _alive(p)], "a node's daemon outlived the cluster"
            after = system_snapshot(homes)
            for key in after:
                assert not sorted(set(after[key]) - set(before[key])), f"leaked {key}"


def _node_of_home(homes: Path, node_id: str) -> Path:
    return homes / node_id[:12]


def _wait_cached(client_nodes, node_id: str, at_least: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(s.node_id == node_id and s.cached_bytes >= at_least for s in cluster.status()):
            return
        time.sleep(0.2)
    raise AssertionError(f"node {node_id} did not report {at_least} cached bytes: {cluster.status()}")


def test_up_starts_one_node_actor_and_daemon_per_node(ray_cluster):
    c, workers, config, homes = ray_cluster
    status = cluster.status()
    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert {s.node_id for s in status} == alive and len(alive) == 3
    for s in status:
        assert s.state == "alive" and s.heartbeat_age_s < 3
        assert s.home == str(_node_of_home(homes, s.node_id))
        assert daemon.is_running(Paths(home=Path(s.home), cache=CACHE, store_url=""))
    # each node actor runs on its own node
    for s in status:
        actor = ray.get_actor(f"weenv-node-{s.node_id}", namespace=cluster.NAMESPACE)
        assert ray.get(actor.info.remote())["node_id"] == s.node_id
    assert cluster.up(config) and len(cluster.status()) == 3  # idempotent


def test_placement_by_cached_bytes_and_routing(ray_cluster):
    c, workers, config, homes = ray_cluster
    with ClusterClient() as client:
        e1 = client.create("t1", resources=SMALL)
        p = e1.node_id
        r = client.exec(e1.id, "cat /workspace/a.bin | wc -c")
        assert r.exit_code == 0 and r.stdout.strip() == str(24 * MiB).encode()
        _wait_cached(None, p, 24 * MiB)
        e2 = client.create("t1", resources=SMALL)
        assert e2.node_id == p, "t1 is warm on its first node, which has room"
        e3 = client.create("t1", resources=SMALL)
        assert e3.node_id != p, "the warm node is full (max_environments=2): elsewhere"
        q = e3.node_id
        # t2 warmed on a third node through a hint; then t2 goes there rather than the empty one
        (r_node,) = {s.node_id for s in cluster.status()} - {p, q}
        e4 = client.create("t2", resources=SMALL, node=r_node)
        assert e4.node_id == r_node
        assert client.exec(e4.id, "cat /workspace/b.bin > /dev/null").exit_code == 0
        _wait_cached(None, r_node, 24 * MiB)
        client.destroy(e4.id)
        e5 = client.create("t2", resources=SMALL)
        assert e5.node_id == r_node
        e6 = client.create("t2", resources=SMALL, near=e3.id)
        assert e6.node_id == q
        # per-environment traffic goes to the owning node
        client.write_file(e5.id, "/workspace/x.txt", b"hi")
        assert client.read_file(e5.id, "/workspace/x.txt") == b"hi"
        envs = client.environments()
        assert {envs[e.id] for e in (e1, e2)} == {p} and envs[e5.id] == r_node
        for e in (e1, e2, e3, e5, e6):
            client.destroy(e.id)
        with pytest.raises(NotFoundError):
            client.exec(e1.id, "true")


def test_bad_hints_and_a_full_cluster_get_clear_errors(ray_cluster):
    with ClusterClient() as client:
        with pytest.raises(InvalidInputError, match="no node 'nope'"):
            client.create("t1", resources=SMALL, node="nope")
        with pytest.raises(NotFoundError, match="no environment"):
            client.create("t1", resources=SMALL, near="missing")
        made = []
        try:
            with pytest.raises(CapacityError, match="no node can take"):
                for _ in range(7):  # 3 nodes x max_environments=2
                    made.append(client.create("t1", resources=SMALL, first_command=False))
            assert len(made) == 6
        finally:
            for e in made:
                client.destroy(e.id)


def _cluster_pids(ray_nodes, homes: Path) -> set[int]:
    """This driver, the Ray processes, every node's daemon and what each started."""
    daemons = {
        int(p.read_text()) for h in homes.iterdir() if (p := Paths(home=h, cache=CACHE, store_url="").pidfile).exists()
    }
    return descendants({os.getpid(), *ray_nodes.pids, *daemons})


def test_nothing_the_cluster_opens_leaves_loopback(ray_cluster):
    """Every socket of the test cluster (Ray's processes and workers, the node
    actors, the gateway, the nodes' daemons and their helpers, this driver)
    listens on and talks to 127.0.0.0/8 or ::1 only, read from /proc while
    environments run on every node and traffic goes through the gateway: no
    wildcard bind, nothing on the machine's interface address."""
    from weenv.sdk import NodeClient

    c, workers, config, homes = ray_cluster
    gw = cluster.gateway()
    with ClusterClient() as client, NodeClient(api_url=gw.url, api_key=gw.api_key) as through_gateway:
        made = [client.create("t1", resources=SMALL, node=n) for n in _alive_nodes()]
        try:
            g = through_gateway.create("t2", resources=SMALL)
            assert through_gateway.exec(g.id, "echo hi").stdout == b"hi\n"
            for e in made:
                assert client.exec(e.id, "head -c 1 /workspace/a.bin | wc -c").stdout.strip() == b"1"
            pids = _cluster_pids(c, homes)
            sockets = sockets_of(pids)
            commands = {s.command for s in sockets}
            assert {"gcs_server", "raylet"} <= commands and len(sockets) > 20, sorted(commands)
            outside = beyond_loopback(sockets)
            assert not outside, "sockets beyond loopback:\n" + "\n".join(sorted({str(s) for s in outside}))
            assert httpx.URL(gw.url).host == "127.0.0.1"
            assert all(httpx.URL(s.api_url).host == "127.0.0.1" for s in cluster.status())
            through_gateway.destroy(g.id)
        finally:
            for e in made:
                client.destroy(e.id)
        _wait_forgotten(client)


# --- the cluster's one address (weenv.cluster.gateway) ------------------------------------
def _alive_nodes() -> list[str]:
    return sorted(s.node_id for s in cluster.status() if s.state == "alive")


def _wait_forgotten(client: ClusterClient, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while client.environments() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not client.environments(), client.environments()


def test_the_e2b_sdk_unchanged_against_the_cluster_address(ray_cluster):
    """The official e2b SDK pointed at the gateway (E2B_API_URL, E2B_SANDBOX_URL,
    E2B_API_KEY as for one ``weenv serve``): sandboxes on every node, their
    commands, files and kill routed to the node owning each."""
    e2b = pytest.importorskip("e2b")
    from daemon_fixture import environ

    gw = cluster.gateway()
    nodes = _alive_nodes()
    with environ(**gw.environ()):
        made = [e2b.Sandbox.create("t1", timeout=300, metadata={"weenv.node": n, "who": "sdk"}) for n in nodes]
        try:
            for sb, n in zip(made, nodes):
                assert sb.get_info().metadata["weenv.node"] == n
                r = sb.commands.run("cat /workspace/a.bin | wc -c; echo $((6*7))")
                assert r.exit_code == 0 and r.stdout.split() == [str(24 * MiB), "42"]
                sb.files.write("/workspace/note.txt", f"on {n}")
                assert sb.files.read("/workspace/note.txt") == f"on {n}"
                handle = sb.commands.run("for i in 1 2 3; do echo $i; sleep 0.1; done", background=True)
                seen = []
                assert handle.wait(on_stdout=seen.append).exit_code == 0 and "".join(seen).split() == ["1", "2", "3"]
            # signed URLs (no token, no sandbox header: the signature names the sandbox, and so its node)
            a, b = made[0], made[-1]
            assert httpx.get(a.download_url("/workspace/note.txt"), timeout=30).text == f"on {nodes[0]}"
            assert httpx.get(b.download_url("/workspace/note.txt"), timeout=30).text == f"on {nodes[-1]}"
            body = os.urandom(1 * MiB)
            r = httpx.post(b.upload_url("/workspace/up.bin"), files={"file": ("up.bin", body)}, timeout=60)
            assert r.status_code == 200, r.text
            assert b.files.read("/workspace/up.bin", format="bytes") == body and not a.files.exists("/workspace/up.bin")
            # a PTY's stream and a directory watcher, relayed
            pty_out = bytearray()
            h = a.pty.create(e2b.PtySize(rows=24, cols=80), timeout=60)
            a.pty.send_stdin(h.pid, b"echo up-$((1+2)); exit\n")
            assert h.wait(on_pty=pty_out.extend).exit_code == 0 and b"up-3" in pty_out
            w = a.files.watch_dir("/workspace")
            a.files.write("/workspace/watched.txt", "x")
            deadline = time.monotonic() + 10
            names: set = set()
            while "watched.txt" not in names and time.monotonic() < deadline:
                names |= {e.name for e in w.get_new_events()}
                time.sleep(0.1)
            w.stop()
            assert "watched.txt" in names
            listed = {
                s.sandbox_id: s.metadata["weenv.node"]
                for s in e2b.Sandbox.list(query=e2b.SandboxQuery(metadata={"who": "sdk"})).next_items()
            }
            assert listed == {sb.sandbox_id: n for sb, n in zip(made, nodes)}, "listed over every node"
            # "near environment X" through the E2B API: placed on X's node (each node runs one: any could take it)
            for sb, n in ((made[0], nodes[0]), (made[-1], nodes[-1])):
                near = e2b.Sandbox.create("t1", timeout=300, metadata={"weenv.near": sb.sandbox_id})
                try:
                    assert near.get_info().metadata["weenv.node"] == n
                    assert near.commands.run("echo near").stdout.strip() == "near"  # routed to that node
                finally:
                    near.kill()
            # a wrong access token is refused at the gateway, as on one node
            r = httpx.get(
                gw.url + "/e2b/envd/health", headers={"e2b-sandbox-id": made[0].sandbox_id, "x-access-token": "0" * 32}
            )
            assert r.status_code == 401
        finally:
            for sb in made:
                sb.kill()
        assert not made[0].is_running()
        assert e2b.Sandbox.list(query=e2b.SandboxQuery(metadata={"who": "sdk"})).next_items() == []
    with ClusterClient() as client:
        _wait_forgotten(client)


def _wait_idle(timeout: float = 20.0) -> None:
    """Until no node reports an environment or a reservation (kills reach the reports a heartbeat later)."""
    deadline = time.monotonic() + timeout
    while any(s.environments or s.cpu_reserved for s in cluster.status() if s.state == "alive"):
        assert time.monotonic() < deadline, f"the cluster is not idle: {cluster.status()}"
        time.sleep(0.2)


def test_e2b_template_build_through_the_cluster_address(ray_cluster, tmp_path):
    """e2b.Template.build against the gateway (was 501): the build goes to one
    node, its COPY upload through the gateway's link (checked there for the
    node's token), its status polled there; what it built is in the store, so
    Sandbox.create(alias) starts it on every node, and its id and tags do too
    (resolved by the template's node); list, tags and delete at the gateway.

    The gateway is restarted after the build (its template -> node map was in
    memory only): ids and NAME:TAG still resolve, asked of the nodes.  Its
    sandboxes take a node's 2 cores, each created with a hint right after the
    one before on that node was killed: a kill gives the cores back at once
    (they stayed reserved in the view until a report, ~30 s if the kill came
    before the node's next heartbeat, and the hinted node was passed over)."""
    e2b = pytest.importorskip("e2b")
    from daemon_fixture import environ

    c, workers, config, homes = ray_cluster
    gw = cluster.gateway()
    nodes = _alive_nodes()
    headers = {"x-api-key": "e2b_" + gw.api_key}
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "hello.txt").write_text("copied\n")
    tpl = (
        e2b.Template(file_context_path=str(ctx))
        .from_template("t1")
        .copy("hello.txt", "/opt/hello.txt", user="root")
        .run_cmd("echo built > /opt/built.txt", user="root")
    )
    with environ(**gw.environ()):
        info = e2b.Template.build(tpl, "c-built:v1", tags=["stable"], cpu_count=2, memory_mb=256)
        records = {n: _node_of_home(homes, n) / "e2b" / "templates.json" for n in nodes}
        held = [n for n, p in records.items() if p.exists() and info.template_id in p.read_text()]
        assert len(held) == 1, "the template's records are on one node"
        listed = [t for t in httpx.get(gw.url + "/e2b/templates", headers=headers).json() if t["names"] == ["c-built"]]
        assert [(t["templateID"], t["buildStatus"]) for t in listed] == [(info.template_id, "ready")]
        assert e2b.Template.exists("c-built") and not e2b.Template.exists("c-absent")
        assert {t.tag for t in e2b.Template.get_tags("c-built")} == {"v1", "stable"}
        others = [n for n in nodes if n != held[0]]
    _wait_idle()
    cluster._stop_gateway()  # a new gateway: it knows no template's node
    cluster.up(config)
    gw = cluster.gateway()
    headers = {"x-api-key": "e2b_" + gw.api_key}
    with environ(**gw.environ()):
        assert {t.tag for t in e2b.Template.get_tags("c-built")} == {"v1", "stable"}
        refs = [
            *(("c-built", n) for n in nodes),
            (info.template_id, nodes[-1]),
            ("c-built:stable", nodes[-1]),
            ("c-built:v1", held[0]),
            (info.template_id, held[0]),
            (info.template_id, None),
        ]
        for ref, node in refs:  # each right after a kill on the node it names: no wait for a heartbeat
            t = time.monotonic()
            sb = e2b.Sandbox.create(ref, timeout=120, metadata={"weenv.node": node} if node else None)
            try:
                assert node is None or sb.get_info().metadata["weenv.node"] == node, (ref, cluster.status())
                assert sb.commands.run("cat /opt/hello.txt /opt/built.txt").stdout == "copied\nbuilt\n", ref
            finally:
                sb.kill()
            print(f"{ref} on {node and node[:12]}: created, run and killed in {time.monotonic() - t:.2f} s")
        with pytest.raises(Exception, match="does not exist"):
            e2b.Sandbox.create("c-built:nope", timeout=60, metadata={"weenv.node": others[0]})
        # an upload without the node's token: refused at the gateway before its body (64 KiB for the keyless)
        up = f"{gw.url}/e2b/templates/{info.template_id}/files/{'0' * 64}/upload"
        assert httpx.put(up, headers={"x-weenv-upload-token": "x"}, content=b"0" * MiB).status_code == 413
        assert httpx.put(up, headers={"x-weenv-upload-token": "x"}, content=b"0").status_code == 401
        assert httpx.delete(f"{gw.url}/e2b/templates/{info.template_id}", headers=headers).status_code == 204
        assert not e2b.Template.exists("c-built")
        with pytest.raises(e2b.exceptions.SandboxException):
            e2b.Sandbox.create("c-built", timeout=60)
    with ClusterClient() as client:
        _wait_forgotten(client)


def _chunks_held(home: Path) -> int:
    return sum(1 for f in (home / "node" / "cache" / "sha256").glob("*/*") if not f.name.startswith(".tmp-"))


def test_node_admin_calls_through_the_gateway_reach_the_nodes(ray_cluster):
    """POST /v1/cache/drop at the cluster's address was the gateway's 404 ("does
    not serve this"): now it is every alive node's own call (``?node=ID``: that
    node's alone), refused naming the nodes still running environments, and the
    SDK's drop_cache works against the cluster's address as against one node.
    A node's shutdown and peer table are refused with what to do instead."""
    from weenv.sdk import NodeClient

    c, workers, config, homes = ray_cluster
    gw = cluster.gateway()
    nodes = _alive_nodes()
    key = {"x-api-key": gw.api_key}
    with ClusterClient() as client:
        made = [client.create("t1", resources=SMALL, node=n) for n in nodes]
        try:
            for e in made:
                assert client.exec(e.id, "cat /workspace/a.bin > /dev/null").exit_code == 0
            r = httpx.post(gw.url + "/v1/cache/drop", headers=key, timeout=60)
            message = r.json()["error"]["message"]
            assert r.status_code == 400 and f"{len(nodes)} of {len(nodes)} nodes did not drop" in message, r.text
            assert all(n in message for n in nodes) and "while environments run" in message
        finally:
            for e in made:
                client.destroy(e.id)
    held = {n: _chunks_held(_node_of_home(homes, n)) for n in nodes}
    assert all(held.values()), held
    r = httpx.post(gw.url + "/v1/cache/drop", params={"node": nodes[0]}, headers=key, timeout=60)
    assert r.status_code == 204, r.text
    assert _chunks_held(_node_of_home(homes, nodes[0])) == 0
    assert all(_chunks_held(_node_of_home(homes, n)) == held[n] for n in nodes[1:]), "only the node named"
    with NodeClient(api_url=gw.url, api_key=gw.api_key) as through:
        through.drop_cache()
    assert all(_chunks_held(_node_of_home(homes, n)) == 0 for n in nodes)
    r = httpx.post(gw.url + "/v1/cache/drop", params={"node": "nope"}, headers=key, timeout=60)
    assert r.status_code == 400 and "no node 'nope' in the cluster" in r.json()["error"]["message"], r.text
    assert httpx.post(gw.url + "/v1/cache/drop", timeout=60).status_code == 401
    r = httpx.post(gw.url + "/v1/shutdown", headers=key, timeout=60)
    assert r.status_code == 400 and "weenv cluster down" in r.json()["error"]["message"], r.text
    r = httpx.put(gw.url + "/v1/peers", headers=key, json={}, timeout=60)
    assert r.status_code == 400 and "node actor" in r.json()["error"]["message"], r.text
    assert _alive_nodes() == nodes
    with ClusterClient() as client:  # the nodes still serve, cold
        e = client.create("t1", resources=SMALL, node=nodes[0])
        assert client.exec(e.id, "wc -c < /workspace/a.bin").stdout.strip() == str(24 * MiB).encode()
        client.destroy(e.id)
        _wait_forgotten(client)


def test_weenv_sdk_and_batch_across_nodes(ray_cluster):
    """weenv.connect_cluster(): weenv.Sandbox as against one node; a batch of
    many templates streamed from every node; one larger than the cluster holds
    refused whole at once, nothing made."""
    import weenv

    c = weenv.connect_cluster()
    with weenv.meter("cluster-batch") as tally, c.create("t2", resources=SMALL) as sb:
        assert sb.commands.run("wc -c < /workspace/b.bin").stdout.strip() == str(24 * MiB)
        data = os.urandom(3 * MiB)  # streamed through the gateway both ways
        assert sb.files.write("/workspace/x", data).size == len(data)
        assert sb.files.read("/workspace/x", format="bytes") == data
        assert weenv.Sandbox.connect(sb.id, api_url=c.url, api_key=c.api_key).info.id == sb.id
    # the meter's report went to the cluster's address (was 404): kept there, beside the nodes' own seconds
    tax = c.client().tax()
    assert [b.name for b in tax.batches] == ["cluster-batch"] and tax.batches[0].environments == 1
    assert tax.batches[0].phases["create"] == pytest.approx(tally.phases["create"])
    assert tax.requests["create"] >= 1 and tax.node["create"] > 0  # the node that made it measured it
    # 3 nodes x max_environments=2: a batch of 6 must use all three
    items = [{"template": t, "resources": SMALL.model_dump(), "first_command": False} for t in ("t1", "t2") * 3]
    lines = []
    t0 = time.monotonic()
    with httpx.Client(base_url=c.url, headers={"x-api-key": c.api_key}, timeout=120) as h:
        with h.stream("POST", "/v1/environments/batch", json={"items": items}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
            for line in r.iter_lines():
                lines.append((time.monotonic() - t0, json.loads(line)))
        print("batch of 6 across 3 nodes: lines at " + ", ".join(f"{t:.2f}" for t, _ in lines) + " s")
        assert sorted(ev["index"] for _, ev in lines) == list(range(6))
        envs = [ev["environment"] for _, ev in lines]
        assert all(ev.get("error") is None for _, ev in lines), lines
        where = {e["id"]: e["metadata"]["weenv.node"] for e in envs}
        assert set(where.values()) == set(_alive_nodes())
        assert {e["id"] for e in h.get("/v1/environments").json()} == set(where)
        # the cluster is full now: one more, alone or in a batch, is refused at once
        r = h.post("/v1/environments/batch", json={"items": items[:1]})
        assert r.status_code == 503 and "more than the cluster can hold now: room for 0" in r.json()["error"]["message"]
        for e in envs:
            assert h.delete(f"/v1/environments/{e['id']}").status_code == 204
        # larger than the cluster: refused before any create
        t = time.monotonic()
        r = h.post("/v1/environments/batch", json={"items": items + items[:1]})
        assert r.status_code == 503, r.text
        # the room counted may still lag a node's heartbeat after the deletes (CI saw 5 of 6): at most 6
        message = r.json()["error"]["message"]
        assert re.search(r"a batch of 7 environments is more than the cluster can hold now: room for [0-6] ", message)
        assert time.monotonic() - t < 30, "refused, never a hang"
        assert h.get("/v1/environments").json() == []
    made = c.create_many(["t1", "t2"] * 2, resources=SMALL)
    try:
        assert len({sb.info.metadata["weenv.node"] for sb in made}) >= 2
    finally:
        for sb in made:
            sb.kill()
    with ClusterClient() as client:
        _wait_forgotten(client)


def test_bad_cluster_urls_hints_and_keys_get_clear_errors(ray_cluster):
    import weenv
    from weenv.errors import AuthenticationError, DaemonError

    e2b = pytest.importorskip("e2b")
    from daemon_fixture import environ

    gw = cluster.gateway()
    node_url = next(s.api_url for s in cluster.status() if s.state == "alive")
    with pytest.raises(InvalidInputError, match="not a weenv cluster's address but a single weenv node"):
        weenv.connect_cluster(node_url, api_key=gw.api_key)
    with pytest.raises(InvalidInputError, match="not an http"):
        weenv.connect_cluster("ray://nowhere:10001", api_key=gw.api_key)
    with pytest.raises(InvalidInputError, match="is not a weenv cluster's address: GET /v1/health answered 404"):
        weenv.connect_cluster(gw.url + "/elsewhere", api_key=gw.api_key)
    with pytest.raises(DaemonError, match="nothing answers at the cluster URL"):
        weenv.connect_cluster("http://127.0.0.1:9", api_key=gw.api_key)
    with pytest.raises(AuthenticationError, match="refuses this API key"):
        weenv.connect_cluster(gw.url, api_key="ab" * 20)
    c = weenv.connect_cluster()
    with pytest.raises(InvalidInputError, match="no node 'nope'"):
        c.create("t1", resources=SMALL, metadata={"weenv.node": "nope"})
    with pytest.raises(NotFoundError, match="no environment"):
        c.create("t1", resources=SMALL, metadata={"weenv.near": "0123456789ab"})
    with environ(**gw.environ()):
        with pytest.raises(e2b.exceptions.SandboxException, match="no node 'nope'"):
            e2b.Sandbox.create("t1", metadata={"weenv.node": "nope"})
    with environ(**{**gw.environ(), "E2B_API_KEY": "e2b_" + "ab" * 20}):
        with pytest.raises(e2b.exceptions.AuthenticationException):
            e2b.Sandbox.create("t1")
    r = httpx.post(gw.url + "/v1/environments/batch", json={"items": []}, headers={"x-api-key": gw.api_key})
    assert r.status_code == 400 and r.json()["error"]["kind"] == "invalid_input"
    r = httpx.get(gw.url + "/v1/environments/0123456789ab", headers={"x-api-key": gw.api_key})
    assert r.status_code == 404 and "no environment 0123456789ab in the cluster" in r.json()["error"]["message"]
    assert httpx.get(gw.url + "/v1/environments").status_code == 401
    assert httpx.get(gw.url + "/v1/health").json() == {"status": "ok", "cluster": True}


UNPOOLED = Resources(cpus=0.1, memory_bytes=264 << 20)
"""A request no other test makes: no node's warm pool holds an environment ready for it."""


def _settled(directory: Path, quiet_s: float = 1.0, timeout: float = 30.0) -> set[str]:
    """The entries of ``directory`` once they stayed the same for ``quiet_s``."""
    seen, since, deadline = set(os.listdir(directory)), time.monotonic(), time.monotonic() + timeout
    while time.monotonic() - since < quiet_s and time.monotonic() < deadline:
        time.sleep(0.05)
        now = set(os.listdir(directory))
        if now != seen:
            seen, since = now, time.monotonic()
    return seen


def _kill_tree(pids: set[int]) -> None:
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 10
    while [p for p in pids if _alive(p)]:
        assert time.monotonic() < deadline, f"alive after SIGKILL: {[p for p in pids if _alive(p)]}"
        time.sleep(0.02)


def test_the_gateway_dashboard_lists_the_nodes_behind_the_key(ray_cluster, tmp_path):
    """The gateway's ``/ui``: without the key a redirect to the login form and
    no node's id; with it the node table lists every alive node, each linking
    to its environments, asked of the node through the gateway; an unknown
    node's page is 404.  One browser load: the login form, then the table."""
    gw = cluster.gateway()
    alive = sorted(s.node_id for s in cluster.status() if s.state == "alive")
    assert len(alive) == 3, cluster.status()
    with httpx.Client(base_url=gw.url, timeout=30) as anon:
        for path in ("/ui/", f"/ui/nodes/{alive[0]}"):
            r = anon.get(path)
            assert r.status_code == 303 and r.headers["location"] == "/ui/login", (path, r.status_code)
            assert not [n for n in alive if n[:12] in r.text], path
        form = anon.get("/ui/login")
        assert form.status_code == 200 and "weenv cluster status" in form.text
        assert not [n for n in alive if n[:12] in form.text]
        wrong = anon.post("/ui/login", data={"key": "not-the-key"})
        assert wrong.status_code == 401 and not [n for n in alive if n[:12] in wrong.text]
    with ClusterClient() as client:
        e = client.create("t1", resources=SMALL, node=alive[0])
        try:
            with httpx.Client(base_url=gw.url, headers={"x-api-key": gw.api_key}, timeout=30) as keyed:
                table = keyed.get("/ui/")
                assert table.status_code == 200, table.text
                rows = dict(re.findall(r'data-node="([^"]+)" data-state="([^"]+)"', table.text))
                assert {n for n, state in rows.items() if state == "alive"} == set(alive), rows
                for n in alive:
                    assert f'href="/ui/nodes/{n}"' in table.text
                page = keyed.get(f"/ui/nodes/{alive[0]}")
                assert page.status_code == 200 and f'data-env="{e.id}"' in page.text, page.text
                other = keyed.get(f"/ui/nodes/{alive[1]}")
                assert other.status_code == 200 and e.id not in other.text
                unknown = keyed.get("/ui/nodes/no-such-node")
                assert unknown.status_code == 404 and "no node &#39;no-such-node&#39; in the cluster" in unknown.text
            _screenshot_of_the_node_table(gw, tmp_path / "gateway-nodes.png", alive)
        finally:
            client.destroy(e.id)


def _screenshot_of_the_node_table(gw, shot: Path, alive: list[str]) -> None:
    """Log in through the gateway's form in Debian's headless Chromium; the node table, screenshot to ``shot``."""
    import shutil

    sync_api = pytest.importorskip("playwright.sync_api")
    chromium = shutil.which("chromium")
    assert chromium, "Debian's chromium is not installed (scripts/setup.sh installs it)"
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])  # root: no setuid sandbox
        try:
            page = browser.new_page(base_url=gw.url, viewport={"width": 1400, "height": 600})
            page.goto("/ui/")
            assert page.url.endswith("/ui/login")
            page.fill("input[name=key]", gw.api_key)
            page.click("button[type=submit]")
            page.wait_for_url("**/ui/")
            for n in alive:
                sync_api.expect(page.locator(f'tr[data-node="{n}"][data-state="alive"]')).to_be_visible()
            page.screenshot(path=shot, full_page=True)
            print(f"gateway dashboard screenshot: {shot}")
        finally:
            browser.close()


def test_a_node_killed_mid_create_is_gone_with_its_daemon_and_leaves_nothing(ray_cluster):
    """A node dies (its Ray node removed, and everything weenv ran there killed,
    as a machine's death does) while a create on it is in flight: the create
    fails, the node is gone and its environments lost, the cluster still creates
    elsewhere, no process of the node's daemon is left, and the home, started
    again, keeps neither the half-made environment nor a mount or cgroup of it."""
    import threading

    c, workers, config, homes = ray_cluster
    with ClusterClient() as client:
        victim = workers[0]
        victim_id = victim.node_id
        paths = Paths(home=_node_of_home(homes, victim_id), cache=CACHE, store_url=config.store)
        kept = client.create("t1", resources=UNPOOLED, node=victim_id)  # made before: lost with the node
        assert kept.node_id == victim_id
        daemon_pid = int(paths.pidfile.read_text())
        before = _settled(paths.environments)  # the warm pool's fills for earlier tests' requests done
        outcome: dict = {}

        def create() -> None:
            with ClusterClient() as other:
                try:
                    outcome["env"] = other.create("t1", resources=UNPOOLED, node=victim_id)
                except Exception as exc:
                    outcome["error"] = exc

        making = threading.Thread(target=create)
        making.start()
        deadline = time.monotonic() + 60
        # the daemon is making it: its directory, and its container's cgroups (runc create makes them first)
        while not (half := {d for d in set(os.listdir(paths.environments)) - before if environment_dirs(d)}):
            assert time.monotonic() < deadline and making.is_alive(), ("no container was being made", outcome)
            time.sleep(0.001)
        tree = descendants({daemon_pid})
        _kill_tree(tree)  # the node's daemon with everything it started, at once
        c.remove_node(victim)  # and its raylet and the node actor
        assert "env" not in outcome, "the create returned before the node died: not a kill mid-create"
        making.join(timeout=120)
        assert not making.is_alive(), "the create in flight hangs after its node died"
        assert isinstance(outcome.get("error"), WeenvError), outcome
        assert not [p for p in tree if _alive(p)], "a process of the dead node's daemon is left"
        deadline = time.monotonic() + 30
        while not [s for s in cluster.status() if s.node_id == victim_id and s.state == "gone"]:
            assert time.monotonic() < deadline, cluster.status()
            time.sleep(0.2)
        assert client.lost() == {kept.id: victim_id}
        assert victim_id not in client.environments().values()
        with pytest.raises(LostError, match=f"lost with node {victim_id}"):
            client.exec(kept.id, "true")
        gw = cluster.gateway()  # through the cluster's address: lost too (weenv's 410, kind lost)
        r = httpx.get(f"{gw.url}/v1/environments/{kept.id}", headers={"x-api-key": gw.api_key})
        assert r.status_code == 410 and r.json()["error"]["kind"] == "lost", r.text
        # the gateway's dashboard: the node is lost in its table, and its page says it left
        table = httpx.get(f"{gw.url}/ui/", headers={"x-api-key": gw.api_key}, timeout=30)
        assert f'data-node="{victim_id}" data-state="lost"' in table.text, table.text
        left = httpx.get(f"{gw.url}/ui/nodes/{victim_id}", headers={"x-api-key": gw.api_key}, timeout=30)
        assert left.status_code == 410 and f"node {victim_id} left the cluster" in left.text, left.text
        other = client.create("t1", resources=SMALL)  # the cluster still answers
        assert other.node_id != victim_id
        client.destroy(other.id)
        # the dead node's home, started again (as its machine coming back; its mounts, cut off from
        # their FUSE daemon, are recovered there): the half-made environment is not kept, and once
        # stopped nothing of it or of the one made before is left on the host
        daemon.start_background(paths)
        with daemon.connect(paths, autostart=False) as node_client:
            assert not half & {e.id for e in node_client.list()}
        assert daemon.stop(paths)
        envs = envs_dir.environments_dir(paths)  # node/envs, or its /run alias (a home under a closed directory)
        assert not envs.exists() or not os.listdir(envs)
        left = system_snapshot(paths.home)
        assert left["mounts"] == [] and not mounts.mounts_under(envs), left["mounts"]
        assert not [g for g in left["cgroups"] if any(i in g for i in {*half, kept.id})], left["cgroups"]
        # a node joining later gets its actor and daemon
        joined = c.add_node()  # (the session's nodes: the victim's place taken)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if any(s.node_id == joined.node_id and s.state == "alive" for s in cluster.status()):
                break
            time.sleep(0.3)
        else:
            raise AssertionError(f"the joined node got no weenv: {cluster.status()}")
        e = client.create("t2", resources=SMALL, node=joined.node_id)
        assert client.exec(e.id, "echo ok").stdout == b"ok\n"
        client.destroy(e.id)


def test_stats_metrics_and_port_relays_through_the_gateway(ray_cluster):
    """The gateway answered 404/501 to /v1/stats, /v1/metrics and E2B's
    get_host addresses.  Now stats are summed over the nodes (the one-node
    shape) and given per node, metrics are every node's labelled node="ID",
    and a sandbox's port (HTTP and WebSocket) is reached through the cluster's
    address on whichever node the sandbox is."""
    e2b = pytest.importorskip("e2b")
    from wsproto.events import AcceptConnection, CloseConnection, Message

    from daemon_fixture import environ
    from test_e2b_ports import PORT, SERVER, WS_PORT, WS_SERVER, _WsClient
    from weenv.sdk import NodeClient

    gw = cluster.gateway()
    nodes = _alive_nodes()
    key = {"x-api-key": gw.api_key}
    with environ(**gw.environ()):
        made = [e2b.Sandbox.create("t1", timeout=300, metadata={"weenv.node": n}) for n in nodes[:2]]
        try:
            per_node = httpx.get(gw.url + "/v1/stats/nodes", headers=key, timeout=30).json()
            assert set(per_node) == set(nodes) and sum(s["environments"] for s in per_node.values()) == 2
            with NodeClient(api_url=gw.url, api_key=gw.api_key) as through:
                total = through.stats()  # the SDK's NodeStats, as from one node
            assert total.environments == 2
            assert total.cache_bytes_fetched == sum(s["cache_bytes_fetched"] for s in per_node.values())
            r = httpx.get(gw.url + "/v1/metrics", headers=key, timeout=30)
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
            from prometheus_client.parser import text_string_to_metric_families

            fams = {f.name: f for f in text_string_to_metric_families(r.text)}
            assert {s.labels["node"] for s in fams["weenv_environments"].samples} == set(nodes)
            assert sum(s.value for s in fams["weenv_environments"].samples) == 2
            assert fams["weenv_cluster_nodes"].samples[0].value == len(nodes)
            assert httpx.get(gw.url + "/v1/metrics", timeout=30).status_code == 401
            assert httpx.get(gw.url + "/v1/stats", timeout=30).status_code == 401
            # get_host through the cluster's address, for sandboxes on two nodes
            for sb in made:
                sb.files.write("/tmp/server.py", SERVER)
                sb.commands.run(f"python3 /tmp/server.py {PORT} >/dev/null 2>&1", background=True)
                host = sb.get_host(PORT)
                deadline = time.monotonic() + 20
                while (
                    r := httpx.get(gw.url + "/headers", headers={"Host": host, "x-mine": "1"}, timeout=10)
                ).status_code != 200 and time.monotonic() < deadline:
                    time.sleep(0.2)
                assert r.status_code == 200 and r.json()["x-mine"] == "1", r.text
                body = os.urandom(2 * MiB)
                r = httpx.post(gw.url + "/count", headers={"Host": host}, content=body, timeout=30)
                assert r.status_code == 200 and r.text == str(len(body))
            r = httpx.get(gw.url + "/", headers={"Host": f"{PORT + 1}-{made[0].sandbox_id}.e2b.app"}, timeout=30)
            assert r.status_code == 502 and "port is not open" in r.json()["message"]
            r = httpx.get(gw.url + "/", headers={"Host": f"{PORT}-0123456789ab.e2b.app"}, timeout=30)
            assert r.status_code == 502 and "0123456789ab was not found" in r.json()["message"]
            # a WebSocket, relayed gateway -> node -> sandbox
            sb = made[-1]
            sb.files.write("/tmp/ws.py", WS_SERVER)
            sb.commands.run(f"python3 /tmp/ws.py {WS_PORT} >/dev/null 2>&1", background=True)
            deadline = time.monotonic() + 20
            while True:
                c = _WsClient(gw.url, sb.get_host(WS_PORT), "/chat", ["one"], [("x-mine", "7")])
                first = c.next()
                if isinstance(first, AcceptConnection) or time.monotonic() > deadline:
                    break
                c.sock.close()
                time.sleep(0.3)
            assert isinstance(first, AcceptConnection), first
            assert c.message().startswith("hello /chat 7")
            c.send(Message(data="abc"))
            assert c.message() == "cba"
            c.send(CloseConnection(code=1000, reason="done"))
            assert isinstance(closed := c.next(), CloseConnection) and closed.code == 1000, closed
            c.sock.close()
        finally:
            for sb in made:
                sb.kill()
    with ClusterClient() as client:
        _wait_forgotten(client)


def test_batches_racing_for_the_room_are_refused_or_queued_never_hung(ray_cluster):
    """Two batches of 6 sent at once to a cluster with room for 6 (3 nodes x
    max_environments=2): the waiting path of batch create.  Each batch is
    refused whole at once (503) or streamed to its end; exactly 6
    environments are made; every other item is a ``capacity`` line after the
    queue's 3 s (batch_queue_s), none missing, none hung (the client's
    timeout fails the test)."""
    import threading

    gw = cluster.gateway()
    items = [{"template": t, "resources": SMALL.model_dump(), "first_command": False} for t in ("t1", "t2") * 3]
    results: list = [None, None]

    def send(i: int) -> None:
        with httpx.Client(base_url=gw.url, headers={"x-api-key": gw.api_key}, timeout=60) as h:
            with h.stream("POST", "/v1/environments/batch", json={"items": items, "concurrency": 6}) as r:
                if r.status_code != 200:
                    r.read()
                    results[i] = (r.status_code, r.json())
                else:
                    results[i] = (200, [json.loads(line) for line in r.iter_lines()])

    threads = [threading.Thread(target=send, args=(i,)) for i in range(2)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    assert not any(t.is_alive() for t in threads), "a batch hung"
    print(f"two racing batches: {[r[0] for r in results]} in {time.monotonic() - t0:.1f} s")
    made, refused = [], []
    for status, doc in results:
        if status == 503:
            assert (
                doc["error"]["kind"] == "capacity" and "more than the cluster can hold now" in doc["error"]["message"]
            )
            continue
        assert status == 200, doc
        assert sorted(ev["index"] for ev in doc) == list(range(6)), "a line per item"
        for ev in doc:
            if ev.get("error") is None:
                made.append(ev["environment"]["id"])
            else:
                assert ev["error"]["kind"] == "capacity", ev
                assert "no node had room for it within 3 s" in ev["error"]["message"], ev
                refused.append(ev["index"])
    try:
        assert len(made) == 6, (made, results)
        assert len(refused) == 6 * sum(r[0] == 200 for r in results) - 6
    finally:
        with httpx.Client(base_url=gw.url, headers={"x-api-key": gw.api_key}, timeout=60) as h:
            for env_id in made:
                assert h.delete(f"/v1/environments/{env_id}").status_code == 204
    with ClusterClient() as client:
        _wait_forgotten(client)


def test_a_paused_environment_resumes_on_another_node_when_its_own_is_gone(ray_cluster, cluster_store):
    """An environment paused with its memory released is published to the store
    (snapshot ``paused-ID``); its node goes (its Ray node removed, its daemon
    stopped); a resume through the cluster's address with no node having room is
    refused (503, the snapshot kept); with room, E2B's connect resumes it on
    another node with its id, files, variables, metadata and network policy.
    A resume of an id that never existed is 404 in both APIs."""
    e2b = pytest.importorskip("e2b")
    from daemon_fixture import environ

    c, workers, config, homes = ray_cluster
    gw = cluster.gateway()
    victim = workers[0]
    paths = Paths(home=_node_of_home(homes, victim.node_id), cache=CACHE, store_url=config.store)
    snapshot = None
    with httpx.Client(base_url=gw.url, headers={"x-api-key": gw.api_key}, timeout=120) as h:
        r = h.post(
            "/v1/environments",
            json={
                "template": "t1",
                "resources": SMALL.model_dump(),
                "envs": {"WHO": "me"},
                "deny_out": ["10.0.0.0/8"],
                "metadata": {"weenv.node": victim.node_id, "who": "resume"},
            },
        )
        assert r.status_code == 201, r.text
        env_id = r.json()["id"]
        snapshot = f"paused-{env_id}"
        r = h.post(f"/v1/environments/{env_id}/commands", json={"command": "echo kept > /workspace/kept.txt"})
        assert r.json()["exit_code"] == 0, r.text
        r = h.post(f"/v1/environments/{env_id}/pause", json={"release_memory": True})
        assert r.status_code == 200 and r.json()["memory_released"], r.text
        assert cluster_store.ref_or_none("templates", snapshot), "the release published it"
        c.remove_node(victim)  # its node goes: Ray's node and the node's daemon
        daemon.stop(paths)
        deadline = time.monotonic() + 30
        while not [s for s in cluster.status() if s.node_id == victim.node_id and s.state == "gone"]:
            assert time.monotonic() < deadline, cluster.status()
            time.sleep(0.2)
        assert h.get(f"/v1/environments/{env_id}").status_code == 410  # lost, and resumable
        fillers = []
        with ClusterClient() as client:
            try:
                with pytest.raises(CapacityError):
                    for _ in range(2 * len(_alive_nodes()) + 1):
                        fillers.append(client.create("t2", resources=SMALL, first_command=False))
                r = h.post(f"/v1/environments/{env_id}/resume", json={})
                assert r.status_code == 503 and r.json()["error"]["kind"] == "capacity", r.text
                assert f"no node has room to resume environment {env_id}" in r.json()["error"]["message"]
                assert f"snapshot {snapshot}) is kept" in r.json()["error"]["message"]
                assert cluster_store.ref_or_none("templates", snapshot), "a refused resume keeps the snapshot"
            finally:
                for e in fillers:
                    client.destroy(e.id)
        with environ(**gw.environ()):
            sb = e2b.Sandbox.connect(env_id, timeout=300)  # E2B's connect resumes a paused sandbox
            assert sb.sandbox_id == env_id
            assert sb.files.read("/workspace/kept.txt") == "kept\n"
            assert sb.commands.run("echo $WHO; wc -c < /workspace/a.bin").stdout.split() == ["me", str(24 * MiB)]
            metadata = sb.get_info().metadata
            assert metadata["who"] == "resume" and metadata["weenv.node"] in _alive_nodes()
            with pytest.raises(e2b.exceptions.NotFoundException):
                e2b.Sandbox.connect("0123456789ab")
        info = h.get(f"/v1/environments/{env_id}").json()
        got = (info["state"], info["template"], info["network"], info["deny_out"], info["envs"])
        assert got == ("running", "t1", False, ["10.0.0.0/8"], {"WHO": "me"})
        assert info["metadata"]["weenv.node"] != victim.node_id
        assert cluster_store.ref_or_none("templates", snapshot) is None, "a resume consumes its published pause"
        r = h.post(f"/v1/environments/{env_id}/resume", json={})
        assert r.status_code == 409, r.text  # it runs: not paused
        r = h.post("/v1/environments/0123456789ab/resume", json={})
        assert r.status_code == 404 and "no environment 0123456789ab in the cluster" in r.text, r.text
        # paused again on its new node, then destroyed: its published pause goes with it (no resume after)
        r = h.post(f"/v1/environments/{env_id}/pause", json={"release_memory": True})
        assert r.status_code == 200 and cluster_store.ref_or_none("templates", snapshot), r.text
        assert h.delete(f"/v1/environments/{env_id}").status_code == 204
        assert cluster_store.ref_or_none("templates", snapshot) is None, "a destroy drops its published pause"
        assert h.post(f"/v1/environments/{env_id}/resume", json={}).status_code == 404
    with ClusterClient() as client:
        _wait_forgotten(client)


def test_the_cli_takes_the_cluster_down_and_up_leaving_nothing(ray_cluster):
    """``weenv cluster status``, ``down`` and ``up`` as a user runs them (each its
    own process and Ray driver) on the running Ray cluster: ``down`` leaves no
    node's daemon, mount, weenv actor or gateway; ``status`` then says no
    cluster is up; ``up`` brings a daemon and actor back on every alive node
    and the address answers.  (The cluster stays up for the fixture's ``down``
    and its check that nothing is left.)"""
    import subprocess
    import sys

    c, workers, config, homes = ray_cluster
    environ_ = {**os.environ, "RAY_ADDRESS": c.address, "WEENV_CACHE": str(CACHE)}

    def weenv(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "weenv", "cluster", *args], env=environ_, capture_output=True, text=True, timeout=240
        )

    alive = _alive_nodes()
    r = weenv("status")
    assert r.returncode == 0, r.stderr
    assert all(n[:12] in r.stdout for n in alive) and r.stdout.count("alive") == len(alive), r.stdout
    gw = cluster.gateway()
    assert gw.url in r.stderr and gw.api_key in r.stderr
    pids = {
        h.name: int(p.read_text())
        for h in homes.iterdir()
        if (p := Paths(home=h, cache=CACHE, store_url="").pidfile).exists()
    }
    assert len(pids) >= len(alive)

    gone = [s.node_id for s in cluster.status() if s.state == "gone"]  # the node an earlier test killed
    r = weenv("down")
    if gone:  # its daemon cannot be reached through Ray: said so, the rest taken down all the same
        assert r.returncode == 1 and "daemons were not stopped" in r.stderr and gone[0] in r.stderr, r.stderr
    else:
        assert r.returncode == 0 and "weenv cluster down" in r.stderr, r.stderr
    assert not [h for h, p in pids.items() if _alive(p)], "a node's daemon outlived weenv cluster down"
    assert not [m for m in system_snapshot(homes)["mounts"]], "mounts left under the nodes' homes"
    assert not [a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == cluster.NAMESPACE]
    with pytest.raises(httpx.ConnectError):
        httpx.get(gw.url + "/v1/health", timeout=5)
    r = weenv("status")
    assert r.returncode == 1 and "no weenv cluster runs on this Ray cluster" in r.stderr, (r.stdout, r.stderr)
    r = weenv("down")
    assert r.returncode == 0 and "no weenv cluster was up" in r.stderr, r.stderr

    r = weenv("up", "--home", config.home, "--store", config.store, "--gateway-port", "0", "--max-environments", "2")
    assert r.returncode == 0, r.stderr
    assert f"weenv cluster up: {len(alive)} nodes" in r.stderr and r.stdout.count("alive") == len(alive), r.stdout
    # its progress, as plain lines on a pipe: one per node whose daemon answers
    said = r.stderr.splitlines()
    assert f"nodes 0/{len(alive)}: starting weenv" in said, said
    assert f"nodes {len(alive)}/{len(alive)}: {len(alive)} nodes up" in said, said
    assert len([line for line in said if line.startswith("nodes ") and line.endswith(" up")]) == len(alive) + 1
    status = cluster.status()
    assert sorted(s.node_id for s in status if s.state == "alive") == sorted(alive)
    for s in status:
        assert daemon.is_running(Paths(home=Path(s.home), cache=CACHE, store_url=""))
    gw = cluster.gateway()
    assert gw.url in r.stderr
    assert httpx.get(gw.url + "/v1/health", headers={"x-api-key": gw.api_key}, timeout=10).json()["nodes"] == len(alive)
    env = dict(line.removeprefix("export ").split("=", 1) for line in weenv("env").stdout.splitlines())
    assert env["E2B_API_URL"] == gw.url + "/e2b" and env["WEENV_API_KEY"] == gw.api_key
