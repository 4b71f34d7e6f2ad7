"""API fuzzing: Schemathesis against the OpenAPI schemas a real ``weenv serve``
publishes, weenv's (``/openapi.json``), the E2B face's
(``/e2b/openapi.json``) and the prime-sandboxes control plane's
(``/prime/openapi.json``), with the API key.

Each run is bounded (a fixed seed, :data:`EXAMPLES` cases per operation, the
fuzzing phase and the stateful phase, whose links Schemathesis infers from the
schema: create, then get, pause, files... on what was created).  The
environment-scoped operations get a real environment's id (Schemathesis'
``parameters``), so commands, files and processes reach a running environment.
Checks: no 5xx answer (``not_a_server_error``; E2B's 501 for a route weenv does
not serve is one too, so the run holds that every route it publishes is
served), no request hanging past :data:`REQUEST_TIMEOUT_S`, the daemon the same
process at the end, nothing in its log but request lines, and, once the
environments are destroyed, nothing left behind (no mount under its home, no
cgroup, container, FUSE connection, interface or nft table: the daemon's stop and
the suite's leak snapshot).

``WEENV_FUZZ_SCALE=N`` runs N times the cases and the coverage phase (a longer search).  Operations
left out (:data:`EXCLUDED`) would end the run's own subjects: stopping the
daemon, destroying or shortening the life of the environment under test,
forking it (each fork a new environment per case), starting a template build
(it would pull fuzzed base images)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import store_copy_without_profiles, system_snapshot
from daemon_fixture import start_daemon

SCALE = int(os.environ.get("WEENV_FUZZ_SCALE", "1"))
EXAMPLES = 5
"""Cases per operation in CI (times ``WEENV_FUZZ_SCALE``)."""
SEED = 1
PHASES = "fuzzing,stateful" if SCALE == 1 else "coverage,fuzzing,stateful"
"""CI: generated cases and the stateful links; a longer run adds the coverage phase (every
operation's boundary values and methods it does not take: hundreds of cases each)."""
REQUEST_TIMEOUT_S = 30
SCHEMATHESIS = Path(sys.executable).with_name("schemathesis")

EXCLUDED = {
    "weenv": {
        "shutdown_v1_shutdown_post": "stops the daemon",
        "destroy_v1_environments__env_id__delete": "destroys the environment under test",
        "set_timeout_v1_environments__env_id__timeout_post": "a short timeout has the reaper destroy it",
        "fork_v1_environments__env_id__fork_post": "each case forks new environments",
    },
    "e2b": {
        "kill_sandboxes__sandbox_id__delete": "destroys the sandbox under test",
        "set_timeout_sandboxes__sandbox_id__timeout_post": "a short timeout has the reaper destroy it",
        "fork_sandboxes__sandbox_id__fork_post": "each case forks new sandboxes",
        "start_build_v2_templates__template_id__builds__build_id__post": "a build pulls its (fuzzed) base image",
    },
    "prime": {
        "delete_api_v1_sandbox__sandbox_id__delete": "destroys the sandbox under test",
        "bulk_delete_api_v1_sandbox_delete": "a fuzzed label or id list may name the sandbox under test",
    },
}
"""Operation ids left out of each API's run, with why."""
UNEXPECTED_METHODS = {
    "weenv": "",
    "prime": "",
    "e2b": '[phases.coverage]\nunexpected-methods = ["TRACE", "OPTIONS", "QUERY"]\n',
}
"""Methods a path does not take, sent by the coverage phase: the E2B face answers one of E2B's
API methods (GET, POST, PUT, PATCH, DELETE) that a path lacks with 501, by design ("weenv does
not serve PUT /sandboxes/ID/timeout yet": E2B may have that route), others with 405."""
API = {
    "weenv": ("/openapi.json", "", "env_id", ""),
    "e2b": ("/e2b/openapi.json", "/e2b", "sandbox_id", "e2b_"),
    "prime": ("/prime/openapi.json", "/prime", "sandbox_id", ""),
}
"""API -> (schema path, base path, id parameter of its environment operations, API key prefix)."""


@pytest.fixture(scope="module")
def served(shared_store, tmp_path_factory):
    """A daemon over a copy of the shared store (snapshots fuzzed into it stay
    there); at the end it is stopped and nothing of it may be left."""
    root = tmp_path_factory.mktemp("fuzz-api")
    before = system_snapshot(root)
    d = start_daemon(root / "home", store_copy_without_profiles(shared_store, root / "store").url)
    try:
        yield d
    finally:
        d.stop()
        after = system_snapshot(root)
        # cgroups are the host's: only those of environments this daemon had count (another
        # session on the machine makes its own meanwhile); Daemon.stop checked those too
        after["cgroups"] = [c for c in after["cgroups"] if c.rsplit("weenv-", 1)[-1] in d.ids]
        for kind in after:
            assert not set(after[kind]) - set(before[kind]), f"leaked {kind}"


def test_published_schemas_offer_no_transport_header_as_a_parameter(served):
    """Content-Length and Transfer-Encoding are the transport's: a client (a
    fuzzer) offered them as parameters sends a length its body does not have,
    and the daemon waits for bytes that never come."""
    with served.http() as c:
        for path in ("/openapi.json", "/e2b/openapi.json", "/prime/openapi.json"):
            schema = c.get(served.url + path).json()
            headers = {
                p["name"].lower()
                for ops in schema["paths"].values()
                for op in ops.values()
                for p in op.get("parameters", [])
                if p["in"] == "header"
            }
            assert not headers & {"content-length", "transfer-encoding"}, (path, headers)


def _run(served, api: str, env_id: str, workdir: Path) -> str:
    schema_path, base, id_param, key_prefix = API[api]
    config = workdir / f"schemathesis-{api}.toml"
    config.write_text(f'[parameters]\n"path.{id_param}" = "{env_id}"\n' + UNEXPECTED_METHODS[api])
    cmd = [
        str(SCHEMATHESIS),
        "--config-file",
        str(config),
        "run",
        served.url + schema_path,
        "--url",
        served.url + base,
        "-H",
        f"x-api-key: {key_prefix}{served.key}",
        "--max-examples",
        str(EXAMPLES * SCALE),
        "--seed",
        str(SEED),
        "--phases",
        PHASES,
        "--checks",
        "not_a_server_error",
        "--workers",
        "1",
        "--request-timeout",
        str(REQUEST_TIMEOUT_S),
        "--no-color",
        "--suppress-health-check",
        "all",
        *(a for op in EXCLUDED[api] for a in ("--exclude-operation-id", op)),
    ]
    run = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        cwd=workdir,
        timeout=600,
        check=False,
        env=dict(os.environ, SCHEMATHESIS_HOOKS=""),
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, f"schemathesis found failures in the {api} API:\n{out[-12000:]}"
    return out


@pytest.mark.parametrize("api", ["weenv", "e2b", "prime"])
def test_fuzzed_requests_get_no_server_error_and_leave_nothing(served, api, tmp_path):
    with served.http() as c:
        r = c.post("/environments", json={"template": "task", "timeout": 900})
        assert r.status_code == 201, r.text
        env_id = r.json()["id"]
        served.track(env_id)
        pid = served.proc.pid
        out = _run(served, api, env_id, tmp_path)
        cases = re.search(r"(\d+) generated", out)
        print(f"{api} API: {cases.group(1) if cases else '?'} cases, seed {SEED}")  # the count, in -s output
        assert served.proc.poll() is None and served.proc.pid == pid, "the daemon exited during the run"
        assert c.get("/health").status_code == 200
        left = [e["id"] for e in c.get("/environments").json()]
        served.track(*left)
        for other in left:  # ours, and what the run created (its creates name fuzzed templates: rarely any)
            assert c.delete(f"/environments/{other}").status_code in (200, 204, 404)
        assert c.get("/environments").json() == []
    log = served.log()
    assert "Traceback" not in log and " failed" not in log, log
