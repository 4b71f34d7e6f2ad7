"""Run in the prime venv (``/work/venvs/prime``) by tests/test_prime.py: drives the
unchanged ``prime-sandboxes`` client, sync then async, against ``weenv serve``
(``PRIME_API_BASE_URL``, ``PRIME_API_KEY`` set by the test) and prints what it
saw as one JSON object.  ``argv[1]``: the image to start; ``argv[2]``: the
loopback registry image (or ``-``)."""

import asyncio
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

from prime_sandboxes import (
    APIClient,
    APIError,
    AsyncSandboxClient,
    CommandTimeoutError,
    CreateSandboxRequest,
    SandboxClient,
)

IMAGE, REGISTRY_IMAGE = sys.argv[1], sys.argv[2]
out: dict = {}


def error_of(fn) -> str:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test reads the words
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def sync_flow() -> None:
    c = SandboxClient(APIClient())
    sb = c.create(
        CreateSandboxRequest(
            name="sync-one",
            docker_image=IMAGE,
            labels=["weenv-test", "sync"],
            timeout_minutes=-1,
            environment_vars={"GREETING": "hi"},
        )
    )
    c.wait_for_creation(sb.id)
    got = c.get(sb.id)
    out["sync_status"], out["sync_timeout_minutes"] = got.status, got.timeout_minutes
    r = c.execute_command(sb.id, 'echo "$GREETING $(id -u)"; echo oops >&2; exit 3', timeout=30)
    out["sync_exec"] = [r.stdout, r.stderr, r.exit_code]
    r = c.execute_command(sb.id, "pwd; echo $EXTRA", working_dir="/tmp", env={"EXTRA": "x1"})
    out["sync_cwd"] = r.stdout
    out["sync_timeout"] = error_of(lambda: c.execute_command(sb.id, "sleep 30", timeout=1))
    out["sync_timeout_nan"] = error_of(lambda: c.execute_command(sb.id, "true", timeout=math.nan))
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "up.bin")
        payload = bytes(range(256)) * 36864  # 9 MiB: past the daemon's 8 MiB body limit of requests but uploads
        Path(src).write_bytes(payload)
        up = c.upload_file(sb.id, "/tmp/dir/up.bin", src)
        out["sync_upload"] = [up.success, up.path, up.size]
        out["sync_upload_seen"] = c.execute_command(sb.id, "sha256sum /tmp/dir/up.bin | cut -c1-16").stdout
        dst = os.path.join(d, "down.bin")
        c.download_file(sb.id, "/tmp/dir/up.bin", dst)
        out["sync_download_same"] = Path(dst).read_bytes() == payload
    c.upload_bytes(sb.id, "/tmp/b.txt", b"bytes here\n", "b.txt")
    out["sync_read_file"] = c.read_file(sb.id, "/tmp/b.txt").content
    out["sync_missing_download"] = error_of(lambda: c.download_file(sb.id, "/nope/none", "/dev/null"))
    out["sync_bad_image"] = error_of(lambda: c.create(CreateSandboxRequest(name="bad", docker_image="no-such-image:1")))
    job = c.start_background_job(sb.id, "sleep 1; echo done-$GREETING; echo err >&2; exit 4", working_dir="/tmp")
    while not (status := c.get_background_job(sb.id, job)).completed:
        time.sleep(0.2)
    out["sync_background"] = [status.exit_code, status.stdout, status.stderr]
    out["sync_list_ids"] = [s.id for s in c.list(labels=["sync"]).sandboxes]
    out["sync_id"] = sb.id
    c.delete(sb.id)
    out["sync_after_delete"] = error_of(lambda: c.get(sb.id))
    out["sync_exec_after_delete"] = error_of(lambda: c.execute_command(sb.id, "true"))


async def async_flow() -> None:
    c = AsyncSandboxClient()
    try:
        sbs = await asyncio.gather(
            *(
                c.create(CreateSandboxRequest(name=f"a{i}", docker_image=IMAGE, labels=["weenv-test", "async"]))
                for i in range(2)
            )
        )
        ids = [s.id for s in sbs]
        await c.bulk_wait_for_creation(ids)
        rs = await asyncio.gather(*(c.execute_command(i, f"echo {n} > /tmp/n; cat /tmp/n") for n, i in enumerate(ids)))
        out["async_exec"] = [r.stdout for r in rs]
        await c.upload_bytes(ids[0], "/tmp/a.txt", b"async bytes", "a.txt")
        out["async_read"] = (await c.execute_command(ids[0], "cat /tmp/a.txt")).stdout
        with tempfile.TemporaryDirectory() as d:
            await c.download_file(ids[0], "/tmp/a.txt", os.path.join(d, "a"))
            out["async_download"] = Path(d, "a").read_text()
        try:
            await c.execute_command(ids[1], "sleep 30", timeout=1)
            out["async_timeout"] = "no error"
        except CommandTimeoutError as exc:
            out["async_timeout"] = f"CommandTimeoutError: {exc}"
        jobs = [await c.start_background_job(i, f"echo bg-{n}") for n, i in enumerate(ids)]
        done = await c.get_background_jobs(jobs)
        while not all(s.completed for s in done):
            await asyncio.sleep(0.2)
            done = await c.get_background_jobs(jobs)
        out["async_background"] = [[s.exit_code, s.stdout] for s in done]
        proc = await c.open_process(ids[0], "read line; echo got-$line; echo to-err >&2; exit 5")
        await proc.write_stdin(b"hello\n")
        code = await proc.wait()
        got = b"".join([chunk async for chunk in proc.stdout])
        err = b"".join([chunk async for chunk in proc.stderr])
        out["async_process"] = [code, got.decode(), err.decode()]
        await proc.aclose()
        proc = await c.open_process(ids[1], "sleep 60")
        await proc.terminate()
        out["async_process_terminated"] = await proc.wait()
        await proc.aclose()
        out["async_list_ids"] = sorted(s.id for s in (await c.list(labels=["async"])).sandboxes)
        out["async_ids"] = sorted(ids)
        statuses = await c.get_sandbox_statuses(ids)
        out["async_statuses"] = sorted(s.status.value for s in statuses.statuses)
        if REGISTRY_IMAGE != "-":
            sb = await c.create(CreateSandboxRequest(name="from-registry", docker_image=REGISTRY_IMAGE))
            out["registry_id"] = sb.id
            await c.wait_for_creation(sb.id)
            out["registry_exec"] = (
                await c.execute_command(sb.id, "cat /etc/debian_version >/dev/null && echo ok")
            ).stdout
            await c.delete(sb.id)
        deleted = await c.bulk_delete(labels=["async"])
        out["async_bulk_deleted"] = sorted(deleted.succeeded)
        out["async_left"] = [s.id for s in (await c.list(labels=["weenv-test"])).sandboxes]
    finally:
        await c.aclose()


sync_flow()
asyncio.run(async_flow())
try:
    SandboxClient(APIClient(api_key="wrong")).list()
    out["wrong_key"] = "no error"
except APIError as exc:
    out["wrong_key"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
