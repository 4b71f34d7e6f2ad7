"""The Python SDK (weenv.Sandbox, weenv.AsyncSandbox) against a real ``weenv serve``
on loopback, reached by WEENV_API_URL + WEENV_API_KEY, and by the Unix socket."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from daemon_fixture import point_sdk_at, start_daemon
from weenv import AsyncSandbox, Sandbox
from weenv.sdk import (
    AuthenticationError,
    CapacityError,
    CommandTimeoutError,
    DaemonError,
    InvalidInputError,
    NotFoundError,
)

SMALL = {"cpus": 0.05, "memory_bytes": 64 << 20, "pids": 128}


@pytest.fixture(scope="module")
def daemon(shared_store, tmp_path_factory):
    d = start_daemon(tmp_path_factory.mktemp("sdk") / "home", shared_store.url)
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture
def remote(daemon, monkeypatch):
    """The SDK pointed at the daemon over TCP by the environment variables."""
    return point_sdk_at(daemon, monkeypatch)


def test_lifecycle_commands_and_files(remote):
    with Sandbox.create("task", timeout=120, envs={"EPISODE": "9"}, metadata={"run": "a"}) as sb:
        remote.track(sb.id)
        assert sb.info.metadata == {"run": "a"} and sb.info.template == "task"
        out, err, order = [], [], []
        r = sb.commands.run(
            "echo one; sleep 0.3; echo two >&2; sleep 0.3; echo $EPISODE; exit 4",
            on_stdout=lambda s: (out.append(s), order.append("out")),
            on_stderr=lambda s: (err.append(s), order.append("err")),
        )
        assert (r.exit_code, r.stdout, r.stderr) == (4, "one\n9\n", "two\n")
        assert order == ["out", "err", "out"] and "".join(out) == "one\n9\n"
        r = sb.commands.run(["pwd"], cwd="/tmp", envs={"X": "1"})
        assert r.stdout == "/tmp\n" and r.exit_code == 0
        assert sb.commands.run("cat", stdin="fed").stdout == "fed"
        with pytest.raises(CommandTimeoutError) as exc:
            sb.commands.run("echo partial; sleep 30", timeout=0.5)
        assert exc.value.result.stdout == "partial\n" and exc.value.result.exit_code == 137

        h = sb.commands.run("for i in 1 2 3; do echo $i; sleep 0.1; done", background=True)
        assert h.pid > 1
        assert h.wait().stdout == "1\n2\n3\n"
        slow = sb.commands.run("sleep 300", background=True, tag="slow")
        assert slow.pid in [p.pid for p in sb.commands.list()]
        assert slow.kill() is True
        assert slow.wait().exit_code == 137
        cat = sb.commands.run(["cat"], background=True, stdin_open=True)
        cat.send_stdin("abc")
        sb.commands.send_stdin(cat.pid, b"def", eof=True)
        assert sb.commands.connect(cat.pid).wait().stdout == "abcdef"

        f = sb.files
        assert f.write("/workspace/t.txt", "héllo").size == 6
        assert f.read("/workspace/t.txt") == "héllo"
        f.write("/workspace/b.bin", b"\x00\xff" * 1000)
        assert f.read("/workspace/b.bin", format="bytes") == b"\x00\xff" * 1000
        assert f.exists("/workspace/t.txt") and not f.exists("/workspace/nope")
        f.make_dir("/workspace/d/e")
        f.rename("/workspace/t.txt", "/workspace/d/e/t.txt")
        assert [e.name for e in f.list("/workspace/d/e")] == ["t.txt"]
        f.remove("/workspace/d")
        assert not f.exists("/workspace/d")
        with pytest.raises(NotFoundError):
            f.read("/workspace/nope")
        with pytest.raises(InvalidInputError):
            f.read("/workspace")  # a directory

        sb.set_timeout(600)
        assert sb.info.expires_at - time.time() > 500
        again = Sandbox.connect(sb.id)
        assert again.commands.run("cat /workspace/b.bin | wc -c").stdout == "2000\n"
        again.close()
        assert sb.id in [e.id for e in Sandbox.list()]
        assert [t.name for t in Sandbox.templates()] == ["task"]
    with pytest.raises(NotFoundError):
        Sandbox.connect(sb.id)


def test_large_file_upload_download(remote, tmp_path):
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(1 << 20) * 100)
    with Sandbox.create("task", timeout=120, resources=SMALL) as sb:
        remote.track(sb.id)
        assert sb.files.upload(src, "/root/big").size == 100 << 20
        dst = tmp_path / "dst.bin"
        assert sb.files.download("/root/big", dst) == 100 << 20
        assert dst.read_bytes() == src.read_bytes()


def test_create_many(remote):
    ready = []
    sbs = Sandbox.create_many(
        "task", count=6, timeout=120, resources=SMALL, metadata={"batch": "1"}, on_ready=lambda i, sb: ready.append(i)
    )
    try:
        remote.track(*(s.id for s in sbs))
        assert len({s.id for s in sbs}) == 6 and sorted(ready) == list(range(6))
        assert all(s.info.metadata == {"batch": "1"} for s in sbs)
        assert all(s.commands.run("true").exit_code == 0 for s in sbs)
    finally:
        for s in sbs:
            s.kill()
    # one bad template: the rest are killed and the error raised ...
    before = {e.id for e in Sandbox.list()}
    with pytest.raises(NotFoundError):
        Sandbox.create_many(["task", "no-such-template", "task"], resources=SMALL)
    assert {e.id for e in Sandbox.list()} == before
    # ... or, asked, returned in its place
    mixed = Sandbox.create_many(["task", "no-such-template"], resources=SMALL, return_exceptions=True)
    assert isinstance(mixed[0], Sandbox) and isinstance(mixed[1], NotFoundError)
    remote.track(mixed[0].id)
    mixed[0].kill()


def test_typed_errors(remote, monkeypatch):
    with pytest.raises(NotFoundError):
        Sandbox.create("no-such-template")
    with pytest.raises(InvalidInputError):
        Sandbox.create("task", timeout=-1)
    with pytest.raises(AuthenticationError):
        Sandbox.create("task", api_key="0" * 40)
    monkeypatch.delenv("WEENV_API_KEY")
    with pytest.raises(AuthenticationError):
        Sandbox.list()
    with pytest.raises(DaemonError):
        Sandbox.list(api_url="http://127.0.0.1:9")  # nothing listens on the discard port
    assert issubclass(CommandTimeoutError, TimeoutError) and issubclass(NotFoundError, LookupError)


def test_priority_at_create_and_later(remote):
    """The priority elastic provisioning uses goes through the API and reaches the provisioner."""
    import httpx

    def provisioned(env_id):
        r = httpx.get(
            f"{remote.url}/v1/stats/provision",
            params={"env": env_id},
            headers={"Authorization": f"Bearer {remote.key}"},
        )
        return r.json()["environments"][0]["priority"]

    with Sandbox.create("task", timeout=60, resources=SMALL, priority=5) as sb:
        remote.track(sb.id)
        assert sb.info.priority == 5 and provisioned(sb.id) == 5
        sb.set_priority(-3)
        assert sb.info.priority == -3 and provisioned(sb.id) == -3
        assert Sandbox.connect(sb.id).info.priority == -3
        with pytest.raises(InvalidInputError):
            sb.set_priority(5000)
    with pytest.raises(InvalidInputError):
        Sandbox.create("task", priority=1001)


def test_capacity_error(shared_store, tmp_path):
    d = start_daemon(tmp_path / "home", shared_store.url, "--max-environments", "1")
    try:
        kw = dict(api_url=d.url, api_key=d.key)
        with Sandbox.create("task", timeout=60, **kw) as sb:
            d.track(sb.id)
            with pytest.raises(CapacityError):
                Sandbox.create("task", **kw)
    finally:
        d.stop()


def test_unix_socket_by_default(daemon, monkeypatch):
    monkeypatch.delenv("WEENV_API_URL", raising=False)
    monkeypatch.delenv("WEENV_API_KEY", raising=False)
    monkeypatch.setenv("WEENV_HOME", str(daemon.home))
    with Sandbox.create("task", timeout=60) as sb:
        daemon.track(sb.id)
        assert sb.commands.run("echo via-socket").stdout == "via-socket\n"


def test_async_face(remote):
    async def main():
        async with await AsyncSandbox.create("task", timeout=120, resources=SMALL) as sb:
            remote.track(sb.id)
            seen = []

            async def on_out(text):
                seen.append(text)

            r = await sb.commands.run("echo a; sleep 0.2; echo b", on_stdout=on_out)
            assert r.stdout == "a\nb\n" and "".join(seen) == "a\nb\n"
            h = await sb.commands.run("sleep 0.2; echo bg", background=True)
            assert (await h.wait()).stdout == "bg\n"
            await sb.files.write("/root/x", b"async")
            assert await sb.files.read("/root/x") == "async" and await sb.files.exists("/root/x")
            with pytest.raises(CommandTimeoutError):
                await sb.commands.run("sleep 30", timeout=0.3)
            # concurrent commands on one sandbox
            results = await asyncio.gather(*(sb.commands.run(f"echo {i}") for i in range(5)))
            assert [r.stdout for r in results] == [f"{i}\n" for i in range(5)]
        many = await AsyncSandbox.create_many("task", count=3, resources=SMALL, timeout=60)
        remote.track(*(s.id for s in many))
        for s in many:
            assert (await s.commands.run("true")).exit_code == 0
            await s.kill()
        with pytest.raises(NotFoundError):
            await AsyncSandbox.connect(sb.id)

    asyncio.run(main())


def test_output_past_the_cap_is_an_error_the_command_killed_the_client_bounded(remote, tmp_path):
    """256 MiB of stdout through ``commands.run``: the client keeps at most 64 MiB
    (its peak RSS stays far below the output), raises OutputLimitError, and the
    command is killed.  Run in a subprocess to measure that client alone."""
    import subprocess
    import sys

    script = tmp_path / "client.py"
    script.write_text(
        "import resource, sys, time, weenv\n"
        "from weenv.sdk import OutputLimitError\n"
        "sb = weenv.Sandbox.create('task', timeout=120)\n"
        "print(sb.id, flush=True)\n"
        "print('rss0', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n"
        "import tracemalloc; tracemalloc.start()\n"
        "t = time.monotonic()\n"
        "try:\n"
        "    sb.commands.run('head -c 268435456 /dev/zero; sleep 30; touch /tmp/survived')\n"
        "    print('no error')\n"
        "except OutputLimitError as exc:\n"
        "    print('limit', time.monotonic() - t, str(exc))\n"
        "print('traced', tracemalloc.get_traced_memory()[1]); tracemalloc.stop()\n"
        "time.sleep(0.5)\n"
        "r = sb.commands.run('ps -eo args | grep -c \"^head\\\\|^sleep 30\" || true')\n"
        "print('left', r.stdout.strip())\n"
        "print('rss', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n"
        "sb.kill()\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines()[1:])
    remote.track(out.stdout.split()[0])
    assert "limit" in lines, out.stdout
    assert "67108864 bytes" in lines["limit"]
    assert lines["left"] == "0", out.stdout  # neither head nor the sleep after it runs on
    traced_mib = int(lines["traced"]) / 2**20
    grown_mib = (int(lines["rss"]) - int(lines["rss0"])) / 1024
    print(
        f"client: Python allocations peak {traced_mib:.0f} MiB, peak RSS grew {grown_mib:.0f} MiB "
        f"during the run; error after {lines['limit'].split()[0]} s"
    )
    assert traced_mib < 64 + 32, traced_mib  # the 64 MiB kept and a few chunks in flight
    assert grown_mib < 64 + 64, grown_mib


def test_names_that_are_not_utf8_round_trip_through_the_sdk(remote):
    with Sandbox.create("task", timeout=120) as sb:
        remote.track(sb.id)
        assert sb.commands.run("mkdir -p /tmp/n && printf old > \"$(printf '/tmp/n/\\377x')\"").exit_code == 0
        [entry] = sb.files.list("/tmp/n")
        assert entry.name == "\udcffx" == os.fsdecode(b"\xffx")
        path = "/tmp/n/" + entry.name
        assert sb.files.read(path) == "old" and sb.files.stat(path).size == 3
        sb.files.write(path, "new")
        assert sb.commands.run("cat \"$(printf '/tmp/n/\\377x')\"").stdout == "new"
        sb.files.rename(path, "/tmp/n/\udcfey")
        assert sb.files.exists("/tmp/n/\udcfey") and not sb.files.exists(path)
        with pytest.raises(NotFoundError) as exc:
            sb.files.read(path)
        assert "x" in str(exc.value)
        sb.files.remove("/tmp/n/\udcfey")
        assert sb.files.list("/tmp/n") == []
