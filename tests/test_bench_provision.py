"""``weenv bench provision``, trimmed: static then elastic provisioning of the same
bursty workload on one node, environments admitted while it runs; the JSON's
summary, the PNG, and nothing left behind (mounts, cgroups, processes)."""

from __future__ import annotations

import json
import os

from weenv_bench.provision import BURSTS, run

SUMMARY = ("static_envs", "elastic_envs", "density_ratio", "p95_burst_slowdown", "oom_kills", "rollouts_per_hour")


def test_provision_benchmark_static_against_elastic(paths, debian_root, leak_check, tmp_path):
    out = tmp_path / "provision.json"
    # 15 s a mode, think times at a quarter of the real ones (seed 7: each agent's first burst and first
    # rollout come within its first 4 s of think time, so every mode has bursts and rollouts)
    result = run(
        quick=True,
        json_path=out,
        max_envs=3,
        duration_s=15,
        think_s=1.0,
        steps=4,
        baseline_runs=1,
        sim_sizes=((16, 64),),
        sim_duration_s=20,
        log=lambda _msg: None,
    )
    written = json.loads(out.read_text())
    s = written["summary"]
    assert set(SUMMARY) <= set(s) and s == json.loads(json.dumps(result["summary"]))
    assert s["static_envs"] == min(3, os.cpu_count())  # 1 declared core each, capacity x 1
    assert 1 <= s["elastic_envs"] <= 3 and s["density_ratio"] == s["elastic_envs"] / s["static_envs"]
    for mode in ("static", "elastic"):
        m = written[mode]
        assert m["bursts"] and not m["errors"], m["errors"]
        assert s["p95_burst_slowdown"][mode] > 0 and s["rollouts_per_hour"][mode] > 0
        assert s["oom_kills"][mode] == 0
        assert [n for _t, n in m["held"]] == sorted(n for _t, n in m["held"])  # admitted over time, never dropped
    assert written["config"]["elastic"]["admission"] == "burst"
    # each environment's usage recorded, replayed through the real provisioner (issue 19)
    assert set(written["static"]["traces"]) == {
        e for e in written["static"]["history"] if len(written["static"]["history"][e]) >= 2
    }
    assert set(s["sim"]["16"]) == {"density_ratio", "p95_burst_slowdown", "bursts_slowed_over_10pct", "oom_kills"}
    assert s["sim"]["16"]["oom_kills"] == 0 and s["calibration_error"] is not None
    # the machine's other load, per second of each mode, replayed beside the traces in the calibration
    for mode in ("static", "elastic"):
        bg = written[mode]["background"]
        assert bg["interval_s"] == 1.0 and len(bg["cores"]) >= 12 and all(0 <= x <= os.cpu_count() for x in bg["cores"])
        assert all("background" in b for b in written[mode]["bursts"]) and written[mode]["node_cpu_cores"] >= 0
    assert set(written["simulation"]["calibration"]["background_cores"]) == {"static", "elastic"}
    assert s["p95_slowdown_vs_static"] == s["p95_burst_slowdown"]["elastic"] / s["p95_burst_slowdown"]["static"]
    assert 1.0 <= s["p95_unloaded"]  # the unloaded runs' own spread (p95 over the median)
    assert {b["base"] for b in written["static"]["bursts"]} & {f"{k}:cold" for k in BURSTS}  # first of a kind
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(paths.home.glob("bench-provision-*"))  # its private home is removed
