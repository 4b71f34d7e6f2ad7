"""Prime Intellect's ``prime-sandboxes`` client (the sandboxes of ``verifiers``),
unchanged, against a real ``weenv serve``: create, commands (their timeout,
a timeout of 0 or NaN refused), upload and download, list, batch status,
delete and bulk delete, sync and async, an image of the loopback registry
imported on first use, an image weenv cannot find refused naming it.

The client lives in a venv of its own, ``/work/venvs/prime`` (``WEENV_PRIME_VENV``
elsewhere; ``scripts/setup.sh`` makes it): its ``connectrpc`` wants another
``protobuf-py`` than the ``e2b`` SDK of the test venv.  Without it the test is
skipped, saying so.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import httpx
import pytest

from e2b_fixture import e2b_daemon
from oci_push import e2b_base_image  # noqa: F401 - a fixture
from registry_fixture import oci_registry  # noqa: F401 - a fixture
from weenv.server.e2b.connect import envelope
from weenv.server.prime.proto import command_pb
from weenv.store.file import FileStore

VENV = Path(os.environ.get("WEENV_PRIME_VENV", "/work/venvs/prime"))
PYTHON = VENV / "bin" / "python"
CLIENT = Path(__file__).with_name("prime_client.py")

pytestmark = pytest.mark.skipif(
    not PYTHON.exists(), reason=f"the prime-sandboxes venv {VENV} is absent (scripts/setup.sh makes it)"
)


@pytest.fixture(scope="module")
def served(shared_store):
    """A daemon over a hard-linked copy of the shared store (template ``task``)."""
    root = Path(tempfile.mkdtemp(prefix="weenv-prime-"))
    try:
        subprocess.run(["cp", "-al", str(shared_store.root), str(root / "store")], check=True)
        with e2b_daemon(root, None, FileStore(root / "store").url) as d:
            yield d
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run_client(served, tmp_path: Path, *args: str) -> dict:
    env = {
        **os.environ,
        "PRIME_API_BASE_URL": served.daemon.url + "/prime",
        "PRIME_API_KEY": served.daemon.key,
        "HOME": str(tmp_path),
    }  # the client's auth cache (~/.prime) stays in the test's directory
    env.pop("PYTHONPATH", None)
    out = subprocess.run(
        [str(PYTHON), str(CLIENT), *args], check=False, env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, f"client failed:\n{out.stderr[-4000:]}\n{served.daemon.log()}"
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_prime_sandboxes_client_sync_and_async(served, e2b_base_image, tmp_path):  # noqa: F811
    seen = run_client(served, tmp_path, "task", e2b_base_image)
    served.daemon.track(seen["sync_id"], *seen["async_ids"], seen["registry_id"])  # no cgroup of theirs left at stop
    # sync: create with variables and labels, commands, their errors, files
    assert seen["sync_status"] == "RUNNING"
    assert seen["sync_exec"] == ["hi 0\n", "oops\n", 3]
    assert seen["sync_cwd"] == "/tmp\nx1\n"
    assert seen["sync_timeout"].startswith("CommandTimeoutError"), seen["sync_timeout"]
    assert "timeout must be non-negative" in seen["sync_timeout_nan"].lower()  # refused by the client itself
    payload = bytes(range(256)) * 36864
    assert seen["sync_upload"] == [True, "/tmp/dir/up.bin", len(payload)]
    assert seen["sync_upload_seen"] == hashlib.sha256(payload).hexdigest()[:16] + "\n"
    assert seen["sync_download_same"] is True
    assert seen["sync_read_file"] == "bytes here\n"
    assert "404" in seen["sync_missing_download"] and "/nope/none" in seen["sync_missing_download"]
    assert "no-such-image:1" in seen["sync_bad_image"] and "404" in seen["sync_bad_image"]
    assert seen["sync_background"] == [4, "done-hi\n", "err\n"]
    assert seen["sync_timeout_minutes"] == 7 * 24 * 60  # -1: the longest weenv allows
    assert seen["sync_list_ids"] == [seen["sync_id"]]
    assert "404" in seen["sync_after_delete"]
    assert seen["sync_exec_after_delete"].startswith("SandboxNotRunningError"), seen["sync_exec_after_delete"]
    # async: two at once, bulk wait, files, a timeout, batch status, bulk delete by label
    assert seen["async_exec"] == ["0\n", "1\n"]
    assert seen["async_read"] == "async bytes" and seen["async_download"] == "async bytes"
    assert seen["async_timeout"].startswith("CommandTimeoutError")
    assert seen["async_background"] == [[0, "bg-0\n"], [0, "bg-1\n"]]  # the batch status falls back to commands
    assert seen["async_process"] == [5, "got-hello\n", "to-err\n"]  # a live process: stdin in, output, exit
    assert seen["async_process_terminated"] != 0
    assert seen["async_list_ids"] == seen["async_ids"]
    assert seen["async_statuses"] == ["RUNNING", "RUNNING"]
    assert seen["registry_exec"] == "ok\n"
    assert seen["async_bulk_deleted"] == seen["async_ids"]
    assert seen["async_left"] == []
    assert seen["wrong_key"].startswith("UnauthorizedError")
    with served.daemon.http() as c:
        assert c.get("/environments").json() == []


def test_gateway_refuses_bad_timeouts_tokens_and_requests(served):
    """What the client cannot send: a Connect-Timeout-Ms of 0, NaN, negative or
    fractional (the client sends none for a timeout of 0: no deadline), a wrong
    gateway token, resources weenv does not have; and the OpenAPI document."""
    key = {"authorization": f"Bearer {served.daemon.key}"}
    with httpx.Client(base_url=served.daemon.url + "/prime", headers=key, timeout=120) as c:
        assert "/api/v1/sandbox" in c.get("/openapi.json").json()["paths"]
        assert c.get("/api/v1/sandbox", headers={"authorization": "Bearer nope"}).status_code == 401
        r = c.post("/api/v1/sandbox", json={"name": "x", "docker_image": "task", "timeout_minutes": 0})
        assert r.status_code == 400 and "timeout_minutes must be at least 1" in r.json()["detail"]
        r = c.post("/api/v1/sandbox", json={"name": "x", "docker_image": "task", "timeout_minutes": -2})
        assert r.status_code == 422 and "timeout_minutes" in r.json()["detail"]
        r = c.post("/api/v1/sandbox", json={"name": "x", "docker_image": "task", "gpu_count": 1})
        assert r.status_code == 400 and "GPU" in r.json()["detail"]
        r = c.post("/api/v1/sandbox", json={"name": "x", "docker_image": "127.0.0.1:1/none/such:1"})
        assert r.status_code == 404 and "'127.0.0.1:1/none/such:1' could not be imported" in r.json()["detail"]
        sb = c.post("/api/v1/sandbox", json={"name": "raw", "docker_image": "task", "idempotency_key": "k1"}).json()
        served.daemon.track(sb["id"])
        again = c.post("/api/v1/sandbox", json={"name": "raw", "docker_image": "task", "idempotency_key": "k1"})
        assert again.json()["id"] == sb["id"]  # a create retried with its key is the same sandbox
        try:
            auth = sb["gatewayAuth"]
            url = f"{auth['gateway_url']}/{auth['user_ns']}/{auth['job_id']}/command_session.CommandSession/Start"
            spec = command_pb.CommandSpec(cmd="/bin/bash", args=["-c", "echo ran"])
            body = envelope(0, command_pb.StartRequest(command=spec).SerializeToString())
            headers = {"authorization": f"Bearer {auth['token']}", "content-type": "application/connect+proto"}
            for bad in ("0", "nan", "-5", "1.5"):
                r = httpx.post(url, content=body, headers={**headers, "connect-timeout-ms": bad})
                assert r.status_code == 400 and r.json()["code"] == "invalid_argument", (bad, r.text)
                assert "positive whole number of milliseconds" in r.json()["message"]
            r = httpx.post(url, content=body, headers={**headers, "authorization": "Bearer " + "0" * 64})
            assert r.status_code == 401 and r.json()["code"] == "unauthenticated"
            upload = url.replace("command_session.CommandSession/Start", "upload")
            r = httpx.post(
                upload,
                params={"path": "/tmp/x"},
                files={"file": ("x", b"y" * (1 << 20))},
                headers={"authorization": "Bearer " + "0" * 64},
            )
            assert r.status_code in (401, 413), r.text  # a wrong token may not send a big body
            r = httpx.post(url, content=body, headers={**headers, "connect-timeout-ms": "5000"})
            assert r.status_code == 200 and b"ran\n" in r.content
        finally:
            assert c.delete(f"/api/v1/sandbox/{sb['id']}").status_code == 200
