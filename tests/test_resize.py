"""Live resize (``PATCH /v1/environments/{id}``, the SDK's ``set_resources``)
against a real ``weenv serve`` in ``static`` provisioning: the cgroup files and
the disk quota change, admission counts the new resources, a resize the node
cannot hold is refused with nothing changed, bad input gets a clear error."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from daemon_fixture import environ, point_sdk_at, start_daemon
from weenv import AsyncSandbox, Sandbox
from weenv.errors import StateError
from weenv.sdk import CapacityError, InvalidInputError, NodeClient, NotFoundError

MIB = 1 << 20
CGROUP = Path("/sys/fs/cgroup")


@pytest.fixture(scope="module")
def daemon(shared_store, tmp_path_factory):
    # a 1 GiB node disk counted without overcommit, the cores without overcommit, no warm pool
    with environ(
        WEENV_PROVISION_MODE="static",
        WEENV_DISK_BYTES=str(1 << 30),
        WEENV_DISK_OVERCOMMIT="1",
        WEENV_CPU_OVERCOMMIT="1",
        WEENV_POOL_SIZE="0",
    ):
        d = start_daemon(tmp_path_factory.mktemp("resize") / "home", shared_store.url)
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture(scope="module")
def http(daemon):
    with daemon.http() as c:
        yield c


def create(daemon, http, **resources) -> dict:
    resources.setdefault("disk_bytes", 128 * MIB)  # the node's disk is 1 GiB
    r = http.post("/environments", json={"template": "task", "timeout": 120, "resources": resources})
    assert r.status_code == 201, r.text
    info = r.json()
    daemon.track(info["id"])
    return info


def limits(env_id: str) -> tuple[float, int, int]:
    """(cores, memory bytes, pids) as the kernel has them in the environment's cgroup."""
    quota = int((CGROUP / "cpu" / f"weenv-{env_id}" / "cpu.cfs_quota_us").read_text())
    period = int((CGROUP / "cpu" / f"weenv-{env_id}" / "cpu.cfs_period_us").read_text())
    memory = int((CGROUP / "memory" / f"weenv-{env_id}" / "memory.limit_in_bytes").read_text())
    pids = int((CGROUP / "pids" / f"weenv-{env_id}" / "pids.max").read_text())
    return quota / period, memory, pids


def resize(http, env_id: str, **resources):
    return http.patch(f"/environments/{env_id}", json={"resources": resources})


def write_mib(http, env_id: str, mib: int) -> int:
    r = http.post(
        f"/environments/{env_id}/commands",
        json={
            "command": f"dd if=/dev/zero of=/workspace/f bs=1M count={mib} conv=fsync 2>&1; s=$?; rm -f /workspace/f; exit $s"
        },
    )
    assert r.status_code == 200, r.text
    return r.json()["exit_code"]


def test_resize_up_and_down_reaches_the_cgroup_and_the_disk_quota(daemon, http):
    e = create(daemon, http, cpus=0.5, memory_bytes=128 * MIB, pids=64, disk_bytes=64 * MIB)
    assert limits(e["id"]) == (0.5, 128 * MIB, 64)
    assert write_mib(http, e["id"], 96) != 0  # past its 64 MiB quota

    r = resize(http, e["id"], cpus=1.5, memory_bytes=256 * MIB, pids=200, disk_bytes=256 * MIB)
    assert r.status_code == 200, r.text
    assert r.json()["resources"] == {"cpus": 1.5, "memory_bytes": 256 * MIB, "pids": 200, "disk_bytes": 256 * MIB}
    assert limits(e["id"]) == (1.5, 256 * MIB, 200)
    assert write_mib(http, e["id"], 96) == 0  # the quota grew live

    r = resize(http, e["id"], cpus=0.25, pids=32)  # what is left out stays
    assert r.status_code == 200, r.text
    assert limits(e["id"]) == (0.25, 256 * MIB, 32)
    assert http.get(f"/environments/{e['id']}").json()["resources"]["disk_bytes"] == 256 * MIB
    p = http.get("/stats/provision", params={"env": e["id"]}).json()["environments"][0]
    assert (p["cpu_ceiling"], p["memory_ceiling"], p["pids_limit"]) == (0.25, 256 * MIB, 32)

    r = resize(http, e["id"], memory_bytes=96 * MIB, disk_bytes=64 * MIB)
    assert r.status_code == 200, r.text
    assert limits(e["id"])[1] == 96 * MIB
    assert write_mib(http, e["id"], 96) != 0  # the quota shrank live

    # a reset keeps them (its new container, its new upper dir)
    r = http.post(f"/environments/{e['id']}/reset", json={})
    assert r.status_code == 200, r.text
    assert limits(e["id"]) == (0.25, 96 * MIB, 32)
    assert write_mib(http, e["id"], 96) != 0

    # and so does a resume after its memory was released (its first process run again)
    assert http.post(f"/environments/{e['id']}/pause", json={"release_memory": True}).status_code == 200
    assert http.post(f"/environments/{e['id']}/resume", json={}).status_code == 200
    assert limits(e["id"]) == (0.25, 96 * MIB, 32)

    # a fork's children start from the parent's resources as they are now
    r = http.post(f"/environments/{e['id']}/fork", json={"count": 1})
    assert r.status_code == 201, r.text
    child = r.json()["children"][0]["environment"]
    daemon.track(child["id"])
    assert child["resources"] == {"cpus": 0.25, "memory_bytes": 96 * MIB, "pids": 32, "disk_bytes": 64 * MIB}
    assert limits(child["id"]) == (0.25, 96 * MIB, 32)
    for env_id in (child["id"], e["id"]):
        assert http.delete(f"/environments/{env_id}").status_code == 204


def test_admission_counts_a_resize_and_refuses_what_the_node_cannot_hold(daemon, http):
    a = create(daemon, http, cpus=0.5, disk_bytes=600 * MIB)
    r = http.post("/environments", json={"template": "task", "resources": {"cpus": 0.5, "disk_bytes": 600 * MIB}})
    assert r.status_code == 503 and "disk" in r.json()["error"]["message"], r.text

    assert resize(http, a["id"], disk_bytes=300 * MIB).status_code == 200
    b = create(daemon, http, cpus=0.5, disk_bytes=600 * MIB)  # fits now

    before = http.get(f"/environments/{a['id']}").json()["resources"]
    for grow, what in (({"disk_bytes": 600 * MIB}, "disk"), ({"cpus": 1.8, "pids": 99}, "CPU")):
        r = resize(http, a["id"], **grow)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["kind"] == "capacity" and what in r.json()["error"]["message"]
        assert "nothing changed" in r.json()["error"]["message"]
        assert http.get(f"/environments/{a['id']}").json()["resources"] == before
        assert limits(a["id"]) == (0.5, before["memory_bytes"], before["pids"])

    r = resize(http, a["id"], cpus=1.5)  # 1.5 + 0.5 cores: the node's two, exactly
    assert r.status_code == 200, r.text
    for env_id in (a["id"], b["id"]):
        assert http.delete(f"/environments/{env_id}").status_code == 204


def test_bad_resizes_get_clear_errors(daemon, http):
    e = create(daemon, http, cpus=0.5)
    env_id = e["id"]
    for bad, field in (
        ({"cpus": 0}, "cpus"),
        ({"cpus": -1}, "cpus"),
        ({"memory_bytes": 0}, "memory_bytes"),
        ({"pids": -5}, "pids"),
        ({"disk_bytes": 1}, "disk_bytes"),
        ({"cpus": "many"}, "cpus"),
    ):
        r = resize(http, env_id, **bad)
        assert r.status_code == 400 and field in r.json()["error"]["message"], (bad, r.text)
    r = http.patch(
        f"/environments/{env_id}", content=b'{"resources": {"cpus": NaN}}', headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and "cpus" in r.json()["error"]["message"], r.text
    r = resize(http, env_id, cpus=64)  # beyond the node: never, not only now
    assert r.status_code == 400 and "more than the node's" in r.json()["error"]["message"], r.text
    r = resize(http, env_id, memory_bytes=1 << 49)
    assert r.status_code == 400 and "memory_bytes" in r.json()["error"]["message"], r.text
    assert limits(env_id) == (0.5, e["resources"]["memory_bytes"], e["resources"]["pids"])

    assert http.post(f"/environments/{env_id}/pause", json={}).status_code == 200
    r = resize(http, env_id, cpus=1)
    assert r.status_code == 409 and "paused" in r.json()["error"]["message"], r.text
    assert http.post(f"/environments/{env_id}/resume", json={}).status_code == 200
    assert http.delete(f"/environments/{env_id}").status_code == 204
    r = resize(http, env_id, cpus=1)
    assert r.status_code == 404 and r.json()["error"]["kind"] == "not_found", r.text


def test_sdk_set_resources(daemon, monkeypatch):
    point_sdk_at(daemon, monkeypatch)
    with Sandbox.create(
        "task", timeout=60, resources={"cpus": 0.5, "memory_bytes": 128 * MIB, "disk_bytes": 128 * MIB}
    ) as sb:
        daemon.track(sb.id)
        sb.set_resources(cpus=1.25, pids=100)
        assert (sb.info.resources.cpus, sb.info.resources.pids) == (1.25, 100)
        assert limits(sb.id) == (1.25, 128 * MIB, 100)
        for bad in ({"cpus": 0.0}, {"cpus": float("nan")}, {"cpus": -2.0}, {"memory_bytes": -1}, {}):
            with pytest.raises(InvalidInputError):
                sb.set_resources(**bad)
        with pytest.raises(InvalidInputError, match="more than the node's"):
            sb.set_resources(cpus=64)
        with pytest.raises(InvalidInputError, match="node's disk"):
            sb.set_resources(disk_bytes=2 << 30)  # never: the node's disk is 1 GiB
        with Sandbox.create("task", timeout=60, resources={"cpus": 0.1, "disk_bytes": 128 * MIB}) as other:
            daemon.track(other.id)
            with pytest.raises(CapacityError, match="disk"):
                sb.set_resources(disk_bytes=1000 * MIB)  # not now: beside the other's 128 MiB
        sb.pause()
        with pytest.raises(StateError, match="paused"):
            sb.set_resources(cpus=1)
        sb.resume()

        async def shrink() -> tuple[float, int]:
            a = await AsyncSandbox.connect(sb.id)
            await a.set_resources(cpus=0.5, memory_bytes=96 * MIB)
            return a.info.resources.cpus, a.info.resources.memory_bytes

        assert asyncio.run(shrink()) == (0.5, 96 * MIB)
        assert limits(sb.id) == (0.5, 96 * MIB, 100)
    with NodeClient() as client, pytest.raises(NotFoundError):  # destroyed when the block ended
        client.set_resources(sb.id, cpus=1)


def test_elastic_provisioning_resizes_within_the_new_ceilings(shared_store, tmp_path_factory):
    """In elastic mode (the default) the CFS quota is the new ceiling at once and
    the memory limit in force comes down to a lowered ceiling."""
    with environ(WEENV_DISK_BYTES=str(1 << 30), WEENV_POOL_SIZE="0"):
        d = start_daemon(tmp_path_factory.mktemp("resize-elastic") / "home", shared_store.url)
    try:
        with d.http() as http:
            e = create(d, http, cpus=0.5, memory_bytes=512 * MIB)
            assert limits(e["id"])[0] == 0.5
            r = resize(http, e["id"], cpus=1.5, memory_bytes=96 * MIB)
            assert r.status_code == 200, r.text
            cores, memory, _ = limits(e["id"])
            assert cores == 1.5 and memory <= 96 * MIB
            p = http.get("/stats/provision", params={"env": e["id"]}).json()["environments"][0]
            assert (p["cpu_ceiling"], p["memory_ceiling"]) == (1.5, 96 * MIB) and p["memory_limit"] <= 96 * MIB
            assert http.delete(f"/environments/{e['id']}").status_code == 204
    finally:
        d.stop()
