"""``weenv bench start --quick`` end to end, trimmed: the smallest template (the
Debian tree and one small real wheel, ~230 MB), published to a private docker-registry as weenv
groups (``oci://``) and as a Docker image; cold and warm starts of both at
concurrency 1 and 16.  Afterwards nothing of the node, the dockerd or the
registry remains (processes, mounts, cgroups, directories)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from weenv.host import mounts
from weenv_bench.services import process
from weenv_bench.services.dockerd import DOCKERD
from weenv_bench.services.process import alive
from weenv_bench.services.registry import REGISTRY
from weenv_bench.start import SUMMARY_KEYS, run

SMALLEST = ("mpmath==1.3.0",)
"""One small pure-Python wheel: the template is the Debian tree and little more."""

pytestmark = pytest.mark.skipif(
    not (os.access(DOCKERD, os.X_OK) and os.access(REGISTRY, os.X_OK)),
    reason="needs Debian's docker.io and docker-registry",
)


def test_quick_start_benchmark_weenv_against_docker(paths, debian_root, leak_check, tmp_path):
    out = tmp_path / "start.json"
    work = tmp_path / "work"
    work.mkdir()
    result = run(
        quick=True,
        json_path=out,
        work=work,
        cold_runs=2,
        warm_runs=3,
        exec_runs=10,
        commands=(),
        wheels=SMALLEST,
        log=lambda _msg: None,
    )

    written = json.loads(out.read_text())
    assert written == json.loads(json.dumps(result))
    s = written["summary"]
    assert set(SUMMARY_KEYS) <= set(s)
    for key in (
        "cold_p50_s",
        "warm_p50_s",
        "docker_cold_p50_s",
        "docker_warm_p50_s",
        "exec_p50_s",
    ):
        assert 0 < s[key] < 120, key
    assert s["cold_ratio"] == round(s["docker_cold_p50_s"] / s["cold_p50_s"], 1)
    # a cold weenv start fetches part of the template; a cold Docker start pulls it all
    assert 0 < s["fetched_fraction"] < 1
    assert s["warm_p50_s"] < s["cold_p50_s"] and s["docker_warm_p50_s"] < s["docker_cold_p50_s"]
    assert 200e6 < s["template_bytes"] < 600e6 and written["template"]["wheels"] == list(SMALLEST)

    rows = {(r["system"], r["kind"], r["concurrency"]): r for r in written["table"]}
    for system in ("weenv", "docker"):
        for kind in ("cold", "warm"):
            for c in (1, 16):
                r = rows[(system, kind, c)]
                assert r["n"] == (c if c > 1 else {"cold": 2 if system == "weenv" else 1, "warm": 3}[kind])
                assert 0 < r["p50_s"] <= r["p99_s"]
                assert r["daemon_cpu_s"] >= 0 and r["daemon_peak_bytes"] > 0
    assert {r["template"] for r in written["table"]} == {"start-quick"} == {t["name"] for t in written["templates"]}
    assert any("3 GB" in n for n in written["not_run"])  # quick: no large template
    # cold starts as built (tree layout), then with the groups republished by weenv update --profile
    cold = {
        r["layout"]: r
        for r in written["table"]
        if r["system"] == "weenv" and r["kind"] == "cold" and r["concurrency"] == 1
    }
    assert set(cold) == {"tree", "profile"} and s["cold_p50_s"] == cold["profile"]["p50_s"]
    assert (
        s["cold_p50_tree_layout_s"] == cold["tree"]["p50_s"]
        and s["cold_phases_p50_s"] == cold["profile"]["phases_p50_s"]
    )
    for r in cold.values():  # the create's phases and the time to the first output after it
        phases = r["phases_p50_s"]
        assert {"manifest_s", "groups_s", "overlay_s", "runtime_s", "create_s", "command_s", "demand_chunks"} <= set(
            phases
        )
        assert 0 < phases["create_s"] < r["p50_s"] * 2 and phases["runtime_s"] > 0
    assert rows[("weenv", "warm", 1)]["bytes_fetched"] == 0  # warm: nothing fetched
    # warm x1 right after cold x1: the second create fills the warm pool, the third starts that one
    assert rows[("weenv", "warm", 1)]["pooled_starts"] >= 1 and rows[("weenv", "warm", 1)]["pool_size"] == 1
    no_pool = rows[("weenv", "warm-no-pool", 1)]
    assert (no_pool["n"], no_pool["pooled_starts"], no_pool["pool_size"]) == (3, 0, 0)
    assert s["warm_no_pool_p50_s"] == no_pool["p50_s"] > 0
    assert rows[("weenv", "cold", 16)]["bytes_fetched"] > 0
    assert rows[("docker", "cold", 1)]["bytes_fetched"] == written["template"]["docker_image_bytes"] > 50e6
    assert {e["system"] for e in written["exec"]} == {"weenv", "docker"}
    assert written["machine"]["cpus"] >= 1 and len(written["load"]["start"]) == 3
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # nothing left behind: daemons, containerd, mounts, cgroups, the node's home
    services = written["docker_services"]
    assert not alive(services["dockerd_pid"]) and not alive(services["registry_pid"])
    root = services["dockerd_root"]
    assert not Path(root).exists()
    assert not process.pids_mentioning(root + "/")
    assert not mounts.mounts_under(Path(root))
    assert not list(Path("/sys/fs/cgroup").glob("*/" + services["dockerd_cgroup_parent"].strip("/")))
    assert not mounts.mounts_under(work)
    assert not (work / "registry").exists()
    assert not process.pids_mentioning(str(work) + "/")
