"""E2B parity (issue 17) driven by the official ``e2b`` SDK against a real ``weenv serve``:
listing order and time filters, symbolic link targets, a sandbox killed while a
command runs, the files API seeing the sandbox's mounts, and 501 for routes
weenv does not serve.  The daemon fixture is test_e2b's (one per module)."""

from __future__ import annotations

import datetime
import threading
import time

import httpx
import pytest

e2b = pytest.importorskip("e2b")

from e2b import Sandbox, SandboxQuery
from e2b.exceptions import SandboxException, SandboxNotRunningException

from test_e2b import TEMPLATE, daemon  # noqa: F401  (the module's daemon fixture)


def _api(daemon, method: str, path: str, **kw) -> httpx.Response:
    with httpx.Client(base_url=daemon.api_url, headers={"X-API-Key": daemon.key}, timeout=30) as c:
        return c.request(method, path, **kw)


@pytest.fixture(scope="module")
def two(daemon):  # noqa: F811
    """Two sandboxes, the second started after the first."""
    a = Sandbox.create(TEMPLATE, timeout=300, metadata={"suite": "parity"})
    time.sleep(1.1)
    b = Sandbox.create(TEMPLATE, timeout=300, metadata={"suite": "parity"})
    yield a, b
    a.kill()
    b.kill()


def test_list_is_newest_first_and_filters_by_start_time(daemon, two):  # noqa: F811
    a, b = two
    ids = [i.sandbox_id for i in Sandbox.list(query=SandboxQuery(metadata={"suite": "parity"})).next_items()]
    assert ids == [b.sandbox_id, a.sandbox_id]
    r = _api(daemon, "GET", "/v2/sandboxes", params={"metadata": "suite=parity", "order": "asc"})
    assert [s["sandboxID"] for s in r.json()] == [a.sandbox_id, b.sandbox_id]

    b_start = b.get_info().started_at
    after = Sandbox.list(query=SandboxQuery(metadata={"suite": "parity"}, started_after=b_start)).next_items()
    assert [i.sandbox_id for i in after] == [b.sandbox_id]
    future = datetime.datetime(2099, 1, 1, tzinfo=datetime.UTC)
    assert Sandbox.list(query=SandboxQuery(started_after=future)).next_items() == []
    r = _api(
        daemon,
        "GET",
        "/v2/sandboxes",
        params={"startedBefore": (b_start - datetime.timedelta(seconds=0.5)).isoformat(), "metadata": "suite=parity"},
    )
    assert [s["sandboxID"] for s in r.json()] == [a.sandbox_id]

    for params in ({"startedAfter": "yesterday"}, {"startedBefore": "2024-01-01T00:00:00"}, {"order": "newest"}):
        r = _api(daemon, "GET", "/v2/sandboxes", params=params)
        assert r.status_code == 400, (params, r.text)
        assert list(params)[0] in r.json()["message"] or "order" in r.json()["message"]


def test_symlink_target_is_the_resolved_absolute_path(two):
    s = two[0]
    s.commands.run(
        "mkdir -p /tmp/d/sub && echo hi > /tmp/d/sub/test.txt && cd /tmp/d && ln -sf sub/test.txt link "
        "&& ln -sfn sub subdir && ln -sf subdir/test.txt chained && ln -sf nowhere dangling"
    )
    info = s.files.get_info("/tmp/d/link")
    assert info.symlink_target == "/tmp/d/sub/test.txt"
    assert s.files.get_info("/tmp/d/chained").symlink_target == "/tmp/d/sub/test.txt"
    listed = {e.name: e for e in s.files.list("/tmp/d")}
    assert listed["link"].symlink_target == "/tmp/d/sub/test.txt"
    assert listed["dangling"].symlink_target == "/tmp/d/nowhere"
    assert listed["subdir"].symlink_target == "/tmp/d/sub"


def test_files_see_the_sandboxs_mounts(two):
    s = two[0]
    s.commands.run("echo shm > /dev/shm/x")
    assert s.files.read("/dev/shm/x") == "shm\n"
    s.files.write("/dev/shm/y", "from files")
    assert s.commands.run("cat /dev/shm/y").stdout == "from files"
    assert "shm" in [e.name for e in s.files.list("/dev")]
    assert "proc" in [e.name for e in s.files.list("/")] and "1" in [e.name for e in s.files.list("/proc")]
    with pytest.raises(SandboxException):  # nothing is written into procfs from outside
        s.files.write("/proc/1/oom_score_adj", "-1000")
    assert s.commands.run("cat /proc/1/oom_score_adj").stdout.strip() != "-1000"
    with pytest.raises(SandboxException):  # the mounts' read-only flags hold
        s.files.write("/sys/kernel/x", "no")
    s.commands.run("ln -sf /proc/self/root/etc/hostname /tmp/magic")
    with pytest.raises(SandboxException):  # no magic link leads out
        s.files.read("/tmp/magic")


def test_pseudo_files_are_read_inside_with_the_sandboxs_rights(two):
    """The daemon reads and writes as root with the host's capabilities: a
    link planted inside pointing at ``/proc/kallsyms`` read the host kernel's
    symbol addresses, one at ``/proc/kmsg`` hung the read (it blocks) and
    drained the host's kernel log.  A file on a kernel pseudo file system is
    never opened by the daemon: a read is made by a process inside the
    sandbox, as the caller's user (E2B's envd reads inside), so it gets what a
    process there gets (kmsg: refused at once, nothing inside holds
    CAP_SYSLOG); a write is refused (400, naming the kind)."""
    import base64
    import hashlib

    from e2b.exceptions import InvalidArgumentException

    s = two[0]
    s.commands.run(
        "ln -sf /proc/kallsyms /tmp/k && ln -sf /proc/kmsg /tmp/kmsg && ln -sf /sys/kernel/notes /tmp/n "
        "&& ln -sf ../proc/1/status /tmp/status && ln -sf /proc/sys/kernel/random/boot_id /tmp/boot"
    )
    cgroup_file = s.commands.run(
        "ls /sys/fs/cgroup/cgroup.procs /sys/fs/cgroup/*/cgroup.procs 2>/dev/null | head -1",
    ).stdout.strip()
    assert cgroup_file
    for path in ("/tmp/kmsg", "/proc/kmsg"):
        t = time.monotonic()
        # refused at once: EPERM outside a user namespace, EACCES inside one
        with pytest.raises(SandboxException, match="not permitted|Permission denied"):
            s.files.read(path, format="bytes", request_timeout=10)
        assert time.monotonic() - t < 5, path
    for path, inside in [("/tmp/n", "/sys/kernel/notes"), ("/tmp/boot", "/proc/sys/kernel/random/boot_id")]:
        got = s.files.read(path, format="bytes", request_timeout=30)
        assert bytes(got) == base64.b64decode(s.commands.run(f"base64 -w0 {inside}").stdout), path
    kallsyms = s.files.read("/tmp/k", format="bytes", request_timeout=30)  # as the sandbox's own process sees it
    assert hashlib.sha256(bytes(kallsyms)).hexdigest() == s.commands.run("sha256sum /proc/kallsyms").stdout.split()[0]
    status = s.files.read("/tmp/status").splitlines()
    assert status[0] == s.commands.run("head -1 /proc/1/status").stdout.strip()
    assert "Pid:\t1" in status  # the sandbox's pid namespace
    procs = s.files.read(cgroup_file).split()  # the sandbox's cgroup, with the reader in it
    assert "1" in procs and len(procs) >= 3
    with pytest.raises(InvalidArgumentException, match="procfs"):  # writes are refused, through the link
        s.files.write("/tmp/status", "x", request_timeout=10)
    assert s.commands.run("readlink /tmp/status").stdout.strip() == "../proc/1/status"  # the link is left
    s.files.write("/tmp/regular", "fine")  # files elsewhere read and write as before
    assert s.files.read("/tmp/regular") == "fine"


def test_kill_during_a_command_raises_sandbox_not_running(daemon):  # noqa: F811
    s = Sandbox.create(TEMPLATE, timeout=120)
    cmd = s.commands.run("sleep 60", background=True)
    threading.Timer(1.0, s.kill).start()
    t = time.monotonic()
    with pytest.raises(SandboxNotRunningException):
        cmd.wait()
    assert time.monotonic() - t < 30


def test_kill_during_a_command_async(daemon):  # noqa: F811
    import asyncio

    from e2b import AsyncSandbox

    async def main():
        s = await AsyncSandbox.create(TEMPLATE, timeout=120)
        cmd = await s.commands.run("sleep 60", background=True)
        killer = threading.Timer(1.0, lambda: Sandbox.kill(s.sandbox_id))
        killer.start()
        with pytest.raises(SandboxNotRunningException):
            await cmd.wait()
        killer.join()

    asyncio.run(main())


def test_unserved_routes_are_501_naming_the_feature(daemon, two):  # noqa: F811
    sid = two[0].sandbox_id
    for method, path, word in [
        ("GET", "/volumes", "volumes"),
        ("GET", f"/sandboxes/{sid}/logs", "logs"),
        ("GET", "/secrets", "secrets"),
        ("GET", "/default-templates", "default templates"),
        ("PUT", f"/sandboxes/{sid}/timeout", ""),
    ]:
        r = _api(daemon, method, path)
        assert r.status_code == 501, (path, r.status_code, r.text)
        assert r.json()["code"] == 501 and word in r.json()["message"] and "weenv does not serve" in r.json()["message"]
    r = httpx.get(daemon.sandbox_url + "/nothing-here", headers={"E2b-Sandbox-Id": sid})
    assert r.status_code == 501 and "envd" in r.json()["message"]
    # a sandbox that does not exist is still 404
    assert _api(daemon, "GET", "/sandboxes/nosuchsandbox").status_code == 404


def test_file_metadata_fields_as_the_sdk_reads_them(daemon, two):  # noqa: F811
    from e2b import FileType

    s = two[1]
    s.commands.run(
        "mkdir -p /tmp/m && printf 12345 > /tmp/m/f && chmod 640 /tmp/m/f && "
        "touch -d '2021-02-03 04:05:06Z' /tmp/m/f && ln -sf f /tmp/m/l",
        user="root",
    )
    owner = s.commands.run("stat -c '%U %G' /tmp/m/f", user="root").stdout.split()
    info = s.files.get_info("/tmp/m/f")
    assert (info.type, info.size, info.mode, info.permissions) == (FileType.FILE, 5, 0o640, "-rw-r-----")
    assert [info.owner, info.group] == owner
    assert info.modified_time == datetime.datetime(2021, 2, 3, 4, 5, 6, tzinfo=datetime.UTC)
    assert info.symlink_target is None and info.metadata is None
    link = s.files.get_info("/tmp/m/l")
    assert link.type == FileType.FILE and link.symlink_target == "/tmp/m/f"  # envd: the target's type
    d = s.files.get_info("/tmp/m")
    assert d.type == FileType.DIR and d.permissions.startswith("d")

    w = s.files.write("/tmp/m/tagged", "x", metadata={"Origin": "agent", "step": "3"})
    assert w.metadata == {"origin": "agent", "step": "3"}
    assert s.files.get_info("/tmp/m/tagged").metadata == {"origin": "agent", "step": "3"}
    assert {e.name: e.metadata for e in s.files.list("/tmp/m")}["tagged"] == {"origin": "agent", "step": "3"}
    assert "user.e2b.origin" in s.commands.run("python3 -c \"import os; print(os.listxattr('/tmp/m/tagged'))\"").stdout

    headers = {
        "E2b-Sandbox-Id": s.sandbox_id,
        "X-Access-Token": s._envd_access_token,
        "Content-Type": "application/octet-stream",
        **{f"X-Metadata-k{i}": "v" for i in range(65)},
    }
    r = httpx.post(daemon.sandbox_url + "/files", params={"path": "/tmp/m/many"}, headers=headers, content=b"x")
    assert r.status_code == 400 and "metadata" in r.json()["message"]
    assert not s.files.exists("/tmp/m/many")
