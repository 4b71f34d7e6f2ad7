"""``weenv bench update`` end to end, small: 2 templates, a one-wheel runtime, the
tools change only.  Real weenv builds into a file store, real Docker builds by a
private dockerd pushed to a private docker-registry on loopback; the services
are gone afterwards (no process, mount, cgroup or directory left)."""

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
from weenv_bench.update import SUMMARY_KEYS, run

pytestmark = pytest.mark.skipif(
    not (os.access(DOCKERD, os.X_OK) and os.access(REGISTRY, os.X_OK)),
    reason="needs Debian's docker.io and docker-registry",
)


def test_quick_update_benchmark_weenv_against_docker(paths, debian_root, leak_check, tmp_path):
    out = tmp_path / "update.json"
    work = tmp_path / "work"
    work.mkdir()
    result = run(2, json_path=out, work=work, quick=True, log=lambda _msg: None)

    written = json.loads(out.read_text())
    assert written == json.loads(json.dumps(result))
    s = written["summary"]
    assert set(SUMMARY_KEYS) <= set(s)
    assert s["templates"] == 2
    assert all(isinstance(s[k], (int, float)) and s[k] > 0 for k in SUMMARY_KEYS)
    assert s["weenv_bytes"] < s["docker_bytes"]
    assert s["bytes_ratio"] == round(s["docker_bytes"] / s["weenv_bytes"], 1) > 1
    assert written["machine"]["cpus"] >= 1 and written["machine"]["kernel"]

    # the table: one change (tools); weenv rebuilds only the tools group, once
    (tools,) = written["changes"]
    assert [r["rebuilt"] for r in tools["weenv"]["per_template"]] == [["tools"], []]
    # Docker rebuilds the tools layer once (then cached) and every task layer after it
    assert [r["layers_rebuilt"] for r in tools["docker"]["per_template"]] == [2, 1]
    assert all(r["layers_pushed"] >= 1 for r in tools["docker"]["per_template"])
    assert tools["docker"]["registry_bytes"] == sum(r["registry_bytes"] for r in tools["docker"]["per_template"])
    assert [x["templates"] for x in tools["scaling"]] == [1, 2]
    assert tools["scaling"][-1]["docker_bytes"] == s["docker_bytes"]
    # the initial build pushed the base image: far more than the update
    assert written["initial"]["docker"]["registry_bytes"] > 10 * s["docker_bytes"]
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # the services are gone: processes, mounts, cgroups, directories
    services = written["docker_services"]
    assert not alive(services["dockerd_pid"]) and not alive(services["registry_pid"])
    root = services["dockerd_root"]
    assert not Path(root).exists()
    assert not process.pids_mentioning(root + "/")
    assert not mounts.mounts_under(Path(root))
    assert not list(Path("/sys/fs/cgroup").glob("*/" + services["dockerd_cgroup_parent"].strip("/")))
    assert not (work / "registry").exists()
