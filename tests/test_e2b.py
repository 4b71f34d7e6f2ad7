"""The E2B-compatible API driven by the real ``e2b`` SDK (PyPI) against a weenv
daemon, a real ``weenv serve`` on loopback TCP.

One daemon per module (its own WEENV_HOME, the session's shared store with
template ``task``), stopped at the end and checked for leaks; the SDK finds it
through ``E2B_API_URL``, ``E2B_SANDBOX_URL`` and ``E2B_API_KEY``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import pytest

e2b = pytest.importorskip("e2b")

from e2b import CommandExitException, Sandbox
from e2b.exceptions import (
    AuthenticationException,
    FileNotFoundException,
    NotFoundException,
    SandboxException,
    TimeoutException,
)

from conftest import system_snapshot
from daemon_fixture import Daemon, environ, start_daemon
from weenv.server.e2b import create_e2b_app

TEMPLATE = "task"


class E2BDaemon:
    """A real ``weenv serve`` on 127.0.0.1 (see daemon_fixture), seen as E2B sees it."""

    def __init__(self, daemon: Daemon):
        self.daemon = daemon
        self.key = "e2b_" + daemon.key
        self.api_url = daemon.url + "/e2b"
        self.sandbox_url = daemon.url + "/e2b/envd"

    def environment_ids(self) -> list[str]:
        with self.daemon.http() as c:
            return [e["id"] for e in c.get("/environments").json()]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, shared_store):
    home = tmp_path_factory.mktemp("e2b-home")
    before = system_snapshot(home)
    d = E2BDaemon(start_daemon(home, shared_store.url))
    try:
        with environ(E2B_API_URL=d.api_url, E2B_SANDBOX_URL=d.sandbox_url, E2B_API_KEY=d.key):
            yield d
    finally:
        d.daemon.stop()  # checks: no mount, runc container or cgroup of a seen environment left
        after = system_snapshot(home)
        for kind in ("mounts", "loops"):
            assert not set(after[kind]) - set(before[kind]), f"leaked {kind}"


@pytest.fixture(scope="module")
def sbx(daemon):
    """One sandbox shared by the read-only and file tests of this module."""
    s = Sandbox.create(TEMPLATE, timeout=600, envs={"SANDBOX_VAR": "from-create"}, metadata={"suite": "e2b"})
    yield s
    s.kill()


# --- lifecycle ------------------------------------------------------------------------------
def test_create_list_connect_set_timeout_kill(daemon):
    s = Sandbox.create(TEMPLATE, timeout=120, metadata={"who": "lifecycle"})
    try:
        assert s.is_running()
        info = s.get_info()
        assert info.sandbox_id == s.sandbox_id and info.template_id == TEMPLATE
        assert info.metadata == {"who": "lifecycle"}
        assert 100 < (info.end_at - info.started_at).total_seconds() <= 121

        listed = Sandbox.list().next_items()
        assert s.sandbox_id in [i.sandbox_id for i in listed]
        from e2b import SandboxQuery

        only = Sandbox.list(query=SandboxQuery(metadata={"who": "lifecycle"})).next_items()
        assert [i.sandbox_id for i in only] == [s.sandbox_id]
        assert Sandbox.list(query=SandboxQuery(metadata={"who": "nobody"})).next_items() == []

        s.set_timeout(3000)
        end = s.get_info().end_at
        assert 2990 < (end - s.get_info().started_at).total_seconds() < 3100

        same = Sandbox.connect(s.sandbox_id)
        assert same.sandbox_id == s.sandbox_id
        assert same.commands.run("echo connected").stdout == "connected\n"
    finally:
        assert s.kill() is True
    assert not s.is_running()
    assert Sandbox.kill(s.sandbox_id) is False  # already gone
    with pytest.raises(NotFoundException):
        Sandbox.connect(s.sandbox_id)


def test_metrics(sbx):
    """``get_metrics``: the provisioner's history of CPU and memory, and the disk the sandbox wrote."""
    sbx.commands.run(
        "head -c 3000000 /dev/urandom > /tmp/written && "
        "python3 -c 'import time\nt = time.time()\nwhile time.time() - t < 2: pass'"
    )
    deadline = time.monotonic() + 20
    while not (metrics := sbx.get_metrics()) or metrics[-1].disk_used < 3_000_000:
        assert time.monotonic() < deadline, metrics
        time.sleep(0.5)
    last = metrics[-1]
    assert last.cpu_count >= 1 and 0 <= last.cpu_used_pct <= 100 * last.cpu_count
    assert 0 < last.mem_used <= last.mem_total and last.disk_used < last.disk_total
    assert max(m.cpu_used_pct for m in metrics) > 10  # the busy loop showed
    stamps = [m.timestamp for m in metrics]
    assert stamps == sorted(stamps) and (stamps[-1] - stamps[0]).total_seconds() >= 0
    since = sbx.get_metrics(start=stamps[-1])
    assert 1 <= len(since) <= 3


def test_timeout_reaps_sandbox(daemon):
    s = Sandbox.create(TEMPLATE, timeout=300)
    s.set_timeout(1)
    deadline = time.monotonic() + 30
    while s.sandbox_id in daemon.environment_ids():
        assert time.monotonic() < deadline, "the sandbox outlived its timeout"
        time.sleep(0.2)
    assert not s.is_running()


def test_authentication_failures(daemon):
    with pytest.raises(AuthenticationException):
        Sandbox.create(TEMPLATE, api_key="e2b_" + "0" * 40)
    with pytest.raises(AuthenticationException):
        Sandbox.list(api_key=daemon.key[4:]).next_items()  # the bare hex spelling is weenv's, not E2B's
    with pytest.raises(ValueError):
        create_e2b_app(None, api_keys=["not-an-e2b-key"])
    r = httpx.get(f"{daemon.api_url}/v2/sandboxes")
    assert r.status_code == 401 and r.json()["code"] == 401
    r = httpx.get(f"{daemon.api_url}/v2/sandboxes", headers={"X-API-Key": daemon.key})
    assert r.status_code == 200


def test_bad_requests(daemon):
    h = {"X-API-Key": daemon.key}
    r = httpx.post(f"{daemon.api_url}/v2/sandboxes", headers=h, json={"templateID": "no-such-template"})
    assert r.status_code == 404 and "no-such-template" in r.json()["message"]
    r = httpx.post(f"{daemon.api_url}/v2/sandboxes", headers=h, json={"templateID": TEMPLATE, "timeout": -1})
    assert r.status_code == 400
    r = httpx.post(f"{daemon.api_url}/v2/sandboxes", headers={**h, "Content-Type": "application/json"}, content=b"{")
    assert r.status_code == 400
    with pytest.raises(SandboxException):
        Sandbox.create("no-such-template")


# --- commands -------------------------------------------------------------------------------
def test_run_foreground(sbx):
    r = sbx.commands.run("echo out; echo err >&2")
    assert (r.exit_code, r.stdout, r.stderr) == (0, "out\n", "err\n")
    with pytest.raises(CommandExitException) as exc:
        sbx.commands.run("echo partial; exit 3")
    assert exc.value.exit_code == 3 and exc.value.stdout == "partial\n"


def test_run_env_cwd_and_streaming(sbx):
    r = sbx.commands.run("echo $SANDBOX_VAR $CMD_VAR; pwd", envs={"CMD_VAR": "from-run"}, cwd="/tmp")
    assert r.stdout == "from-create from-run\n/tmp\n"
    assert sbx.commands.run("pwd").stdout == "/workspace\n"  # the template's working dir
    chunks: list[tuple[float, str]] = []
    sbx.commands.run("echo one; sleep 1; echo two", on_stdout=lambda s: chunks.append((time.monotonic(), s)))
    assert "".join(c for _, c in chunks) == "one\ntwo\n"
    assert len(chunks) == 2 and chunks[1][0] - chunks[0][0] > 0.5, "output was not streamed"
    with pytest.raises(SandboxException):
        sbx.commands.run("true", cwd="/no/such/dir")


def test_run_timeout(sbx):
    t0 = time.monotonic()
    with pytest.raises(TimeoutException):
        sbx.commands.run("sleep 30", timeout=1)
    assert time.monotonic() - t0 < 10
    assert "sleep 30" not in sbx.commands.run("ps -eo args || true").stdout


def test_background_list_connect_kill(sbx):
    h = sbx.commands.run("sleep 0.5; echo done-bg", background=True)
    assert h.pid > 0
    assert h.wait().stdout == "done-bg\n"

    long = sbx.commands.run("echo started; sleep 60", background=True, timeout=0)
    assert long.pid in [p.pid for p in sbx.commands.list()]
    again = sbx.commands.connect(long.pid)
    assert again.pid == long.pid
    assert sbx.commands.kill(long.pid) is True
    with pytest.raises(CommandExitException):
        long.wait()
    assert long.pid not in [p.pid for p in sbx.commands.list()]
    assert sbx.commands.kill(long.pid) is False


def test_stdin(sbx):
    h = sbx.commands.run("cat", background=True, stdin=True)
    h.send_stdin("hello ")
    h.send_stdin(b"stdin")
    h.close_stdin()
    assert h.wait().stdout == "hello stdin"


# --- files ----------------------------------------------------------------------------------
def test_files_text_and_binary(sbx):
    info = sbx.files.write("/tmp/e2b/hello.txt", "héllo\n")
    assert info.path == "/tmp/e2b/hello.txt" and info.name == "hello.txt"
    assert sbx.files.read("/tmp/e2b/hello.txt") == "héllo\n"
    blob = os.urandom(3 << 20)
    sbx.files.write("/tmp/e2b/blob.bin", blob)
    assert bytes(sbx.files.read("/tmp/e2b/blob.bin", format="bytes")) == blob
    assert sbx.commands.run("cat /tmp/e2b/hello.txt").stdout == "héllo\n"
    sbx.files.write("rel.txt", "relative")  # from the working dir
    assert sbx.commands.run("cat /workspace/rel.txt").stdout == "relative"
    with pytest.raises(FileNotFoundException):
        sbx.files.read("/tmp/e2b/missing.txt")
    sbx.files.write("/tmp/e2b/oct.bin", b"\x00\x01", use_octet_stream=True)
    assert bytes(sbx.files.read("/tmp/e2b/oct.bin", format="bytes")) == b"\x00\x01"


def test_files_list_exists_remove_rename_make_dir(sbx):
    assert sbx.files.make_dir("/tmp/tree/a/b") is True
    assert sbx.files.make_dir("/tmp/tree/a/b") is False
    sbx.files.write("/tmp/tree/a/f.txt", "12345")
    sbx.commands.run("ln -s f.txt /tmp/tree/a/link")
    entries = {e.name: e for e in sbx.files.list("/tmp/tree/a")}
    assert set(entries) == {"b", "f.txt", "link"}
    assert entries["b"].type.value == "dir" and entries["f.txt"].type.value == "file"
    assert entries["f.txt"].size == 5 and entries["f.txt"].path == "/tmp/tree/a/f.txt"
    assert (
        entries["link"].type.value == "file" and entries["link"].symlink_target == "/tmp/tree/a/f.txt"
    )  # envd: the target's type; resolved, absolute
    deep = [e.path for e in sbx.files.list("/tmp/tree", depth=3)]
    assert "/tmp/tree/a/b" in deep and "/tmp/tree/a/f.txt" in deep

    assert sbx.files.exists("/tmp/tree/a/f.txt") and not sbx.files.exists("/tmp/tree/nope")
    moved = sbx.files.rename("/tmp/tree/a/f.txt", "/tmp/tree/new/g.txt")
    assert moved.path == "/tmp/tree/new/g.txt" and moved.size == 5
    assert not sbx.files.exists("/tmp/tree/a/f.txt")
    assert sbx.files.get_info("/tmp/tree/new/g.txt").type.value == "file"
    sbx.files.remove("/tmp/tree")
    assert not sbx.files.exists("/tmp/tree")
    sbx.files.remove("/tmp/tree")  # nothing there: fine, as envd
    with pytest.raises(FileNotFoundException):
        sbx.files.list("/tmp/tree")


def test_paths_stay_inside_the_sandbox(sbx, tmp_path):
    outside = tmp_path / "host-secret"
    outside.write_text("host")
    sbx.commands.run(f"ln -sf {outside} /tmp/escape")
    with pytest.raises(FileNotFoundException):
        sbx.files.read(f"/../../../..{outside}")
    with pytest.raises(FileNotFoundException):
        sbx.files.read("/tmp/escape")
    assert outside.read_text() == "host"


def test_envd_routing_and_token(daemon, sbx):
    base = daemon.sandbox_url
    token = {"X-Access-Token": sbx._envd_access_token}
    assert httpx.get(f"{base}/health", headers={"E2b-Sandbox-Id": sbx.sandbox_id, **token}).status_code == 204
    r = httpx.get(f"{base}/files", params={"path": "/etc/hostname"}, headers={"E2b-Sandbox-Id": sbx.sandbox_id})
    assert r.status_code == 401
    with pytest.raises(AuthenticationException):
        Sandbox(
            sandbox_id=sbx.sandbox_id,
            sandbox_domain=None,
            envd_version=sbx._envd_version,
            envd_access_token="wrong",
            connection_config=_config(sbx, "wrong"),
        ).files.list("/")


def test_envd_is_no_existence_oracle(daemon, sbx):
    """Without a sandbox's token, a live sandbox and an unknown id get the same
    answer (status and body) in about the same time; with the token of a sandbox
    that is gone, the SDK learns it is not running."""
    base = daemon.sandbox_url
    probes = [
        ("GET", "/health", None),
        ("GET", "/files?path=/etc/hostname", None),
        ("POST", "/filesystem.Filesystem/ListDir", {"path": "/"}),
    ]

    def answers(sid: str, headers: dict) -> list[tuple[int, str]]:
        out = []
        for method, path, body in probes:
            r = httpx.request(method, base + path, json=body, headers={"E2b-Sandbox-Id": sid, **headers})
            out.append((r.status_code, r.text.replace(sid, "ID")))
        return out

    for headers in ({}, {"X-Access-Token": "0" * 32}, {"X-Access-Token": sbx._envd_access_token[:-1]}):
        live, unknown = answers(sbx.sandbox_id, headers), answers("0123456789ab", headers)
        assert live == unknown and {status for status, _ in live} == {401}, (live, unknown)

    def median_ms(sid: str) -> float:
        with httpx.Client(headers={"E2b-Sandbox-Id": sid}) as c:
            times = []
            for _ in range(40):
                t = time.perf_counter()
                c.get(f"{base}/health")
                times.append(time.perf_counter() - t)
        return sorted(times)[len(times) // 2] * 1000

    live_ms, unknown_ms = median_ms(sbx.sandbox_id), median_ms("0123456789ab")
    assert abs(live_ms - unknown_ms) < 2.0, (live_ms, unknown_ms)

    gone = Sandbox.create(TEMPLATE, timeout=60)
    gone_token = {"X-Access-Token": gone._envd_access_token}
    gone.kill()
    r = httpx.get(f"{base}/health", headers={"E2b-Sandbox-Id": gone.sandbox_id, **gone_token})
    assert r.status_code == 502 and "was not found" in r.json()["message"]
    assert gone.is_running() is False


def _config(sbx, token):
    from e2b.connection_config import ConnectionConfig

    return ConnectionConfig(extra_sandbox_headers={"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": token})


def test_large_file_round_trip(sbx):
    """100 MB up (multipart, as the SDK sends bytes) and down (streamed)."""
    blob = os.urandom(1 << 20) * 100
    sbx.files.write("/tmp/large.bin", blob)
    assert sbx.commands.run("stat -c %s /tmp/large.bin").stdout == f"{len(blob)}\n"
    back = sbx.files.read("/tmp/large.bin", format="bytes")
    assert len(back) == len(blob) and bytes(back) == blob
    sbx.files.remove("/tmp/large.bin")


def test_a_gzip_bomb_upload_inflates_in_small_pieces(daemon, sbx):
    """A gzipped octet-stream upload of 256 MiB of zeros (about 256 KB on the
    wire, each 64 KiB of it 64 MiB inflated) is written whole while the
    daemon's peak memory grows by less than 32 MiB (issue 13, #9)."""
    import zlib

    size = 256 << 20
    deflate = zlib.compressobj(9, zlib.DEFLATED, 31)
    body = deflate.compress(bytes(size)) + deflate.flush()
    pid = daemon.daemon.proc.pid
    Path(f"/proc/{pid}/clear_refs").write_text("5\n")  # reset the peak (VmHWM) to the current RSS
    before = daemon.daemon.rss_peak_kib()
    r = httpx.post(
        f"{daemon.sandbox_url}/files",
        params={"path": "/tmp/bomb.bin"},
        content=body,
        timeout=60,
        headers={
            "E2b-Sandbox-Id": sbx.sandbox_id,
            "X-Access-Token": sbx._envd_access_token,
            "Content-Type": "application/octet-stream",
            "Content-Encoding": "gzip",
        },
    )
    grown = daemon.daemon.rss_peak_kib() - before
    assert r.status_code == 200, r.text
    assert sbx.commands.run("stat -c %s /tmp/bomb.bin").stdout == f"{size}\n"
    sbx.files.remove("/tmp/bomb.bin")
    assert grown < 32 << 10, f"the daemon's peak grew {grown >> 10} MiB"


def test_a_multipart_upload_of_many_files_is_streamed_into_the_sandbox(daemon, sbx):
    """200 file parts of 1 MiB in one multipart upload (as ``write_files``
    sends them) are written with the daemon's peak memory growing by less than
    48 MiB: each part streamed to its file, none kept whole until the body ends
    (starlette's form parser kept each part, up to 1 MiB, in memory)."""
    count = 200
    parts = [("file", (f"/tmp/many/{i}.bin", bytes([i % 256]) * (1 << 20))) for i in range(count)]
    parts.insert(1, ("note", (None, b"a field, not a file: dropped")))
    pid = daemon.daemon.proc.pid
    Path(f"/proc/{pid}/clear_refs").write_text("5\n")  # reset the peak (VmHWM) to the current RSS
    before = daemon.daemon.rss_peak_kib()
    r = httpx.post(
        f"{daemon.sandbox_url}/files",
        files=parts,
        timeout=120,
        headers={"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": sbx._envd_access_token},
    )
    grown = daemon.daemon.rss_peak_kib() - before
    assert r.status_code == 200, r.text
    assert [e["path"] for e in r.json()] == [f"/tmp/many/{i}.bin" for i in range(count)]
    sums = sbx.commands.run("cd /tmp/many && for i in 0 7 199; do od -An -tu1 -N1 $i.bin; stat -c %s $i.bin; done")
    assert sums.stdout.split() == ["0", str(1 << 20), "7", str(1 << 20), "199", str(1 << 20)]
    sbx.commands.run("rm -rf /tmp/many")
    assert grown < 48 << 10, f"the daemon's peak grew {grown >> 10} MiB"
    # one path and two files, and a body cut short: 400
    h = {"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": sbx._envd_access_token}
    r = httpx.post(f"{daemon.sandbox_url}/files", params={"path": "/tmp/one"}, files=parts[:3], headers=h)
    assert r.status_code == 400 and "several files" in r.json()["message"]
    req = httpx.Request("POST", f"{daemon.sandbox_url}/files", files=parts[:1], headers=h)
    r = httpx.post(
        f"{daemon.sandbox_url}/files",
        content=req.read()[:-200],
        timeout=30,
        headers={**h, "content-type": req.headers["content-type"]},
    )
    assert r.status_code == 400 and "closing boundary" in r.json()["message"], r.text


def test_an_upload_past_the_disk_limit_is_507(daemon):
    """envd answers a write past the sandbox's disk limit 507 ("not enough disk
    space", as E2B's envd), multipart or not."""
    with daemon.daemon.http() as c:
        r = c.post("/environments", json={"template": TEMPLATE, "timeout": 120, "resources": {"disk_bytes": 64 << 20}})
        assert r.status_code == 201, r.text
        env = r.json()["id"]
        try:
            token = httpx.get(f"{daemon.api_url}/sandboxes/{env}", headers={"X-API-Key": daemon.key}).json()
            h = {"E2b-Sandbox-Id": env, "X-Access-Token": token["envdAccessToken"]}
            blob = b"x" * (100 << 20)
            r = httpx.post(f"{daemon.sandbox_url}/files", files={"file": ("/tmp/big", blob)}, headers=h, timeout=60)
            assert r.status_code == 507 and "disk" in r.json()["message"], r.text
            r = httpx.post(
                f"{daemon.sandbox_url}/files", params={"path": "/tmp/big2"}, content=blob, headers=h, timeout=60
            )
            assert r.status_code == 507, r.text
        finally:
            assert c.delete(f"/environments/{env}").status_code == 204


def test_connect_protocol_details(daemon, sbx):
    """Binary protobuf requests, an unknown method, a bad body and a stream's end message."""
    from weenv.server.e2b.proto import filesystem_pb, process_pb

    h = {"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": sbx._envd_access_token}
    url = daemon.sandbox_url
    req = filesystem_pb.StatRequest(path="/workspace/hello.py").SerializeToString()
    r = httpx.post(f"{url}/filesystem.Filesystem/Stat", content=req, headers={**h, "Content-Type": "application/proto"})
    assert r.status_code == 200 and r.headers["content-type"] == "application/proto"
    entry = filesystem_pb.StatResponse.FromString(r.content).entry
    assert entry.name == "hello.py" and entry.size == len("print('hello from the task')\n")

    r = httpx.post(f"{url}/process.Process/NoSuchMethod", json={}, headers=h)
    assert r.status_code == 501 and r.json()["code"] == "unimplemented"
    r = httpx.post(f"{url}/filesystem.Filesystem/WatchDir", json={}, headers=h)  # served, as a stream only
    assert r.status_code == 415
    r = httpx.post(
        f"{url}/filesystem.Filesystem/Stat", content=b"{not json", headers={**h, "Content-Type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["code"] == "invalid_argument"

    start = process_pb.StartRequest()
    start.process.cmd = "/bin/sh"
    start.process.args.extend(["-c", "printf abc; exit 4"])
    payload = start.SerializeToString()
    body = bytes([0]) + len(payload).to_bytes(4, "big") + payload
    r = httpx.post(
        f"{url}/process.Process/Start", content=body, headers={**h, "Content-Type": "application/connect+proto"}
    )
    assert r.status_code == 200
    frames, data = [], r.content
    while data:
        flags, size = data[0], int.from_bytes(data[1:5], "big")
        frames.append((flags, data[5 : 5 + size]))
        data = data[5 + size :]
    events = [process_pb.StartResponse.FromString(p).event for f, p in frames if f == 0]
    assert events[0].WhichOneof("event") == "start" and events[0].start.pid > 0
    assert b"".join(e.data.stdout for e in events if e.WhichOneof("event") == "data") == b"abc"
    assert events[-1].end.exit_code == 4 and events[-1].end.exited
    assert frames[-1] == (2, b"{}")


def test_async_sdk(daemon):
    import asyncio

    from e2b import AsyncSandbox

    async def main():
        s = await AsyncSandbox.create(TEMPLATE, timeout=120)
        try:
            r = await s.commands.run("echo async; echo e >&2")
            assert (r.stdout, r.stderr) == ("async\n", "e\n")
            await s.files.write("/tmp/a.txt", "x")
            assert await s.files.read("/tmp/a.txt") == "x"
            assert [e.name for e in await s.files.list("/tmp") if e.name == "a.txt"] == ["a.txt"]
        finally:
            await s.kill()

    asyncio.run(main())


def test_a_name_that_is_not_utf8_leaves_its_directory_listable(sbx):
    sbx.commands.run("mkdir -p /tmp/bad && touch \"$(printf '/tmp/bad/\\377x')\" /tmp/bad/ok")
    names = sorted(e.name for e in sbx.files.list("/tmp/bad"))
    assert names == ["ok", "\ufffdx"]  # protobuf strings are UTF-8: the byte 0xFF as U+FFFD
    sbx.commands.run("rm -rf /tmp/bad")
