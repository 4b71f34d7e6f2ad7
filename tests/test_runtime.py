"""The OCI runtime side of one environment: bundle, runc, confined file access.

Real runc containers on an overlay over the cached Debian tree; no mocks.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import signal
import statistics
import subprocess
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from weenv.errors import InvalidInputError, NotFoundError, RuntimeFailedError, ToolMissingError
from weenv.formats.manifest import Resources, RuntimeConfig
from weenv.host.mounts import MountSpec, mount, overlay_spec, umount
from weenv.host.rootfs import RootFS
from weenv.node.cgroups import open_cgroups
from weenv.node.runtime.bundle import (
    MASKED_PATHS,
    RUNC_DEFAULT_CAPS,
    write_bundle,
)
from weenv.node.runtime.runc import INIT_PID_FILE, MEMFD_SEALS, Runc
from weenv.node.runtime.runtime import Crun, crun_refusal

pytestmark = pytest.mark.usefixtures("leak_check")

RUNC = shutil.which("runc") or "/usr/sbin/runc"
CGROUP = Path("/sys/fs/cgroup")
CAP_BITS = {"CAP_KILL": 5, "CAP_NET_BIND_SERVICE": 10, "CAP_AUDIT_WRITE": 29}
TINI = Path("/usr/bin/tini-static")
LIMITS = Resources(cpus=0.5, memory_bytes=256 << 20, pids=200)


@dataclass
class Env:
    runc: Runc
    id: str
    rootfs: Path
    bundle: Path

    @property
    def cgroup_name(self) -> str:
        return f"weenv-{self.id}"

    def init_pid(self) -> int:
        return self.runc.state(self.id)["pid"]

    def sh(self, script: str, **kw):
        return self.runc.exec(self.id, script, **kw)


def new_id() -> str:
    return "t" + uuid.uuid4().hex[:12]


def start(runc: Runc, rootfs: Path, bundle: Path, runtime: RuntimeConfig | None = None, init=None) -> Env:
    cid = new_id()
    bundle.mkdir(exist_ok=True)
    write_bundle(
        bundle,
        rootfs,
        runtime or RuntimeConfig(),
        hostname="box-" + cid,
        cgroups_path=f"/weenv-{cid}",
        resources=LIMITS,
        init=init,
    )
    runc.run_detached(cid, bundle)
    return Env(runc, cid, rootfs, bundle)


@pytest.fixture
def overlay_root(tmp_path, debian_root):
    """A writable overlay over the cached Debian tree (which stays untouched)."""
    upper, work, root = tmp_path / "upper", tmp_path / "work", tmp_path / "rootfs"
    for d in (upper, work, root):
        d.mkdir()
    mount(overlay_spec([debian_root], upper, work, root))
    yield root
    umount(root)


@pytest.fixture(params=["runc", "crun"])
def runc(request, tmp_path):
    """The OCI runtime under test: each test of this module runs against runc and crun."""
    if request.param == "crun" and (why := crun_refusal()) is not None:
        pytest.skip(f"crun cannot run here: {why}")
    r = Runc(tmp_path / "runc-state", RUNC) if request.param == "runc" else Crun(tmp_path / "crun-state")
    yield r
    r.close()


def runc_only(runtime: Runc) -> None:
    """Skip a test of what only runc does (its exec FIFO, its sealed binary)."""
    if runtime.name != "runc":
        pytest.skip(f"runc's own mechanism, not {runtime.name}'s")


@pytest.fixture
def env(runc, overlay_root, tmp_path):
    e = start(runc, overlay_root, tmp_path / "bundle")
    yield e
    runc.delete(e.id, force=True)
    assert runc.list() == []


@pytest.fixture
def env_init(runc, overlay_root, tmp_path):
    """An environment whose pid 1 is tini (reaps orphans), the command its child."""
    if not TINI.exists():
        pytest.skip(f"{TINI} is missing (Debian package tini)")
    e = start(runc, overlay_root, tmp_path / "bundle", init=TINI)
    yield e
    runc.delete(e.id, force=True)
    assert runc.list() == []


def cgroup_dirs(name: str) -> list[Path]:
    return [p for p in CGROUP.glob(f"*/{name}") if p.is_dir()]


def cgroup_procs(name: str) -> set[int]:
    pids: set[int] = set()
    for d in cgroup_dirs(name):
        pids |= {int(x) for x in (d / "cgroup.procs").read_text().split()}
    return pids


def host_cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def proc_state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


# --- runc: commands -----------------------------------------------------------------------
def test_exec_basics(env):
    r = env.runc.exec(env.id, ["true"])
    assert (r.exit_code, r.stdout, r.stderr, r.timed_out) == (0, b"", b"", False) and r.duration_s > 0
    assert env.runc.exec(env.id, ["echo", "hello", "world"]).stdout == b"hello world\n"
    assert env.runc.exec(env.id, ["false"]).exit_code == 1
    assert env.sh("exit 42").exit_code == 42
    r = env.sh("echo out; echo err >&2; exit 3")
    assert (r.exit_code, r.stdout, r.stderr) == (3, b"out\n", b"err\n")
    r = env.sh("echo $FOO-$PATH; pwd", env={"FOO": "bar"}, cwd="/tmp")
    assert r.stdout == b"bar-/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\n/tmp\n"
    assert env.sh("echo a b c | wc -w && echo $((6*7))").stdout == b"3\n42\n"
    assert env.runc.exec(env.id, ["cat"], stdin=b"from stdin").stdout == b"from stdin"
    assert env.runc.exec(env.id, ["cat"]).stdout == b""  # no stdin: /dev/null
    assert env.sh("id -u; id -g", user="1000:1001").stdout == b"1000\n1001\n"
    assert env.sh("kill -TERM $$").exit_code == 128 + 15
    assert env.sh("kill -KILL $$").exit_code == 137


def test_exec_starts_from_the_containers_process(runc, overlay_root, tmp_path):
    """A command gets the container's user, working dir and variables unless
    it names its own; its variables override the container's by name."""
    config = RuntimeConfig(user="1000:1000", working_dir="/tmp", env={"FOO": "bar", "PATH": "/usr/bin:/bin"})
    e = start(runc, overlay_root, tmp_path / "bundle", config)
    try:
        script = "id -u; pwd; echo $FOO $PATH; grep NoNewPrivs /proc/self/status"
        assert e.sh(script).stdout == b"1000\n/tmp\nbar /usr/bin:/bin\nNoNewPrivs:\t1\n"
        r = e.sh(script, user="0:0", cwd="/", env={"FOO": "baz"})
        assert r.stdout == b"0\n/\nbaz /usr/bin:/bin\nNoNewPrivs:\t1\n"
    finally:
        runc.delete(e.id, force=True)


def test_exec_start_failures(env, runc):
    r = env.runc.exec(env.id, ["no-such-command"])
    assert r.exit_code == 127 and re.search(rb"executable file .*not found", r.stderr)
    assert env.runc.exec(env.id, ["/no/such/file"]).exit_code == 127
    assert env.runc.exec(env.id, ["/etc/passwd"]).exit_code == 126
    r = env.runc.exec(env.id, ["true"], cwd="/no/such/dir")
    assert r.exit_code == 126 and b"chdir" in r.stderr
    assert env.sh("no-such-command").exit_code == 127  # the shell's own answer
    for bad in (
        dict(argv=[]),
        dict(argv=["true"], user="root"),
        dict(argv=["true"], cwd="rel"),
        dict(argv=["true"], env={"A=B": "1"}),
    ):
        with pytest.raises(InvalidInputError):
            env.runc.exec(env.id, **bad)
    with pytest.raises(NotFoundError):
        runc.exec("no-such-container", ["true"])


def test_exec_big_output(env):
    script = (
        "import sys; sys.stderr.buffer.write(b'e' * (1 << 20)); sys.stdout.buffer.write(bytes(range(256)) * 204800)"
    )
    r = env.runc.exec(env.id, ["python3", "-c", script])
    assert r.exit_code == 0
    assert len(r.stdout) == 50 << 20 and r.stdout == bytes(range(256)) * 204800
    assert r.stderr == b"e" * (1 << 20)


def test_exec_background_process_does_not_hold_exec(env):
    t = time.monotonic()
    r = env.sh("sleep 30 & echo started")
    assert r.exit_code == 0 and r.stdout == b"started\n" and time.monotonic() - t < 5


def test_exec_timeout_kills_command_and_children(env):
    t = time.monotonic()
    r = env.sh("sleep 100 & sleep 100", timeout=1)
    assert r.timed_out and r.exit_code == 137
    assert 1 <= r.duration_s < 5 and time.monotonic() - t < 6
    init = env.init_pid()
    assert cgroup_procs(env.cgroup_name) == {init}
    live = [
        p
        for p in map(int, filter(str.isdigit, os.listdir("/proc")))
        if host_cmdline(p) == b"sleep\x00100\x00"
        and proc_state(p) not in ("Z", "")
        and env.cgroup_name in Path(f"/proc/{p}/cgroup").read_text()
    ]
    assert live == []
    assert env.runc.exec(env.id, ["true"], timeout=5).exit_code == 0
    # pid 1 here is `sleep infinity`, which never reaps: the killed processes stay
    # zombies under it (see test_init_reaps_orphans for the fix).
    assert all(proc_state(p) == "Z" for p in children_of(init))


def children_of(pid: int) -> list[int]:
    return [
        int(c)
        for t in os.listdir(f"/proc/{pid}/task")
        for c in Path(f"/proc/{pid}/task/{t}/children").read_text().split()
    ]


def test_init_reaps_orphans(env_init):
    e = env_init
    assert e.runc.exec(e.id, ["cat", "/proc/1/cmdline"]).stdout == b"/dev/weenv-init\x00--\x00sleep\x00infinity\x00"
    (child,) = e.runc.exec(e.id, ["cat", "/proc/1/task/1/children"]).stdout.split()
    assert e.runc.exec(e.id, ["cat", f"/proc/{child.decode()}/cmdline"]).stdout == b"sleep\x00infinity\x00"
    r = e.sh("sleep 100 & sleep 100", timeout=1)
    assert r.timed_out and r.exit_code == 137
    e.sh("sleep 0.2 &")  # orphaned, exits later
    time.sleep(0.5)
    init = e.init_pid()
    assert [host_cmdline(p) for p in children_of(init)] == [b"sleep\x00infinity\x00"]
    # Exhaust the pids limit with short-lived orphans: once they exit, the environment recovers.
    e.sh("for i in $(seq 250); do sleep 1 & done 2>/dev/null; exit 0")
    time.sleep(2)
    assert e.runc.exec(e.id, ["true"], timeout=10).exit_code == 0
    assert cgroup_procs(e.cgroup_name) == {init, *children_of(init)}


def test_exec_with_timeout_returns_promptly(env):
    r = env.sh("sleep 0.3; echo done", timeout=30)
    assert r.stdout == b"done\n" and not r.timed_out and r.duration_s < 0.3 + 0.15


def test_exec_from_threads(env):
    def run(i: int):
        return env.sh(f"echo {i}; exit {i % 7}")

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(run, range(24)))
    assert [(r.stdout, r.exit_code) for r in results] == [(f"{i}\n".encode(), i % 7) for i in range(24)]


def test_exec_latency(env):
    env.runc.exec(env.id, ["true"])
    times = [env.runc.exec(env.id, ["true"]).duration_s for _ in range(50)]
    p50 = statistics.median(times)
    print(f"\nrunc exec true: p50 {p50 * 1000:.1f} ms, max {max(times) * 1000:.1f} ms")
    assert p50 < 1.0


# --- runc: isolation ----------------------------------------------------------------------
def test_isolation(env):
    assert env.runc.exec(env.id, ["cat", "/proc/1/cmdline"]).stdout == b"sleep\x00infinity\x00"
    assert int(env.sh("echo $$").stdout) < 100
    lines = env.runc.exec(env.id, ["cat", "/proc/net/dev"]).stdout.decode().splitlines()[2:]
    assert [line.split(":")[0].strip() for line in lines] == ["lo"]
    assert env.runc.exec(env.id, ["cat", "/proc/sys/kernel/hostname"]).stdout == f"box-{env.id}\n".encode()

    status = dict(
        line.split(":\t", 1)
        for line in env.runc.exec(env.id, ["cat", "/proc/self/status"]).stdout.decode().splitlines()
    )
    want = sum(1 << CAP_BITS[c] for c in RUNC_DEFAULT_CAPS)
    assert int(status["CapEff"], 16) == want == 0x20000420
    assert int(status["CapBnd"], 16) == want
    assert status["NoNewPrivs"].strip() == "1" and status["Seccomp"].strip() == "2"
    user = dict(
        line.split(":\t", 1) for line in env.sh("cat /proc/self/status", user="1000:1000").stdout.decode().splitlines()
    )
    assert int(user["CapEff"], 16) == 0

    masked = [p for p in MASKED_PATHS if os.path.exists(p)]  # which exist depends on the kernel
    assert "/sys/firmware" in masked and "/proc/timer_list" in masked
    for path in masked:
        probe = f"ls -A {path} | wc -l" if os.path.isdir(path) else f"wc -c < {path}"
        assert env.sh(probe).stdout == b"0\n", path
    assert env.sh("echo x > /proc/sys/kernel/domainname").exit_code != 0
    assert env.sh("touch /sys/x").exit_code != 0
    assert env.sh("test -c /dev/null && test -c /dev/urandom && test -d /dev/shm").exit_code == 0
    # seccomp: no user namespaces; threads and subprocesses still work (clone3 -> clone).
    r = env.runc.exec(env.id, ["unshare", "-Ur", "true"])
    assert r.exit_code != 0 and b"Operation not permitted" in r.stderr
    py = "import threading, subprocess; t = threading.Thread(target=print, args=('thread',)); t.start(); t.join(); print(subprocess.run(['true']).returncode)"
    assert env.runc.exec(env.id, ["python3", "-c", py]).stdout == b"thread\n0\n"


def test_cgroup_limits(env):
    name = env.cgroup_name
    if (CGROUP / "cgroup.controllers").exists():  # pure cgroup v2
        assert (CGROUP / name / "memory.max").read_text().strip() == str(256 << 20)
        assert (CGROUP / name / "pids.max").read_text().strip() == "200"
        assert (CGROUP / name / "cpu.max").read_text().split() == ["50000", "100000"]
    else:
        assert (CGROUP / "memory" / name / "memory.limit_in_bytes").read_text().strip() == str(256 << 20)
        assert (CGROUP / "pids" / name / "pids.max").read_text().strip() == "200"
        assert (CGROUP / "cpu" / name / "cpu.cfs_quota_us").read_text().strip() == "50000"
        assert (CGROUP / "cpu" / name / "cpu.cfs_period_us").read_text().strip() == "100000"
    assert cgroup_procs(name) == {env.init_pid()}
    # The limits as the environment sees them (its own cgroup, read-only).
    assert env.sh("cat /sys/fs/cgroup/pids/pids.max 2>/dev/null || cat /sys/fs/cgroup/pids.max").stdout == b"200\n"
    r = env.sh('python3 -c \'import os; [os.fork() or os.execvp("sleep", ["sleep", "2"]) for _ in range(300)]\'')
    assert r.exit_code != 0 and b"BlockingIOError" in r.stderr  # fork fails at the pids limit


# --- runc: lifecycle ----------------------------------------------------------------------
def test_kill_delete_leaves_nothing(runc, overlay_root, tmp_path):
    e = start(runc, overlay_root, tmp_path / "bundle")
    st = runc.state(e.id)
    assert st["status"] == "running" and st["id"] == e.id
    assert [c["id"] for c in runc.list()] == [e.id]
    init = st["pid"]
    assert len(cgroup_dirs(e.cgroup_name)) >= 5
    e.sh("sleep 1000 &")
    runc.kill(e.id, "KILL", all=True)
    for _ in range(200):
        if runc.state(e.id)["status"] == "stopped":
            break
        time.sleep(0.01)
    assert runc.state(e.id)["status"] == "stopped"
    runc.delete(e.id)
    assert runc.state(e.id) is None and runc.list() == []
    assert cgroup_dirs(e.cgroup_name) == []
    assert not [p for p in CGROUP.glob("*/*") if p.name.startswith("weenv-" + e.id)]
    assert proc_state(init) == "" or host_cmdline(init) != b"sleep\x00infinity\x00"
    runc.delete(e.id)  # idempotent
    with pytest.raises(NotFoundError):
        runc.kill(e.id)


def test_start_reads_the_exec_fifo_as_runc_start_does(runc, overlay_root, tmp_path):
    """start of a created container goes through its exec FIFO in this process
    (runc: read, crun: written): its first process runs (the runtime says
    running, the FIFO is gone); a second start, and a start of a container whose
    first process died, get the runtime's own answers; nothing is left after delete."""
    cid = new_id()
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    write_bundle(bundle, overlay_root, RuntimeConfig(), hostname="box", cgroups_path=f"/weenv-{cid}", resources=LIMITS)
    runc.create(cid, bundle)
    assert runc.state(cid)["status"] == "created" and (runc.root / cid / "exec.fifo").exists()
    t, fifo_starts = time.perf_counter(), runc.fifo_starts
    runc.start(cid, timeout=10)
    took = time.perf_counter() - t
    assert runc.fifo_starts == fifo_starts + 1
    assert runc.state(cid)["status"] == "running" and not (runc.root / cid / "exec.fifo").exists()
    assert runc.exec(cid, "echo up").stdout == b"up\n"
    print(f"\nstart: {took * 1000:.2f} ms")
    with pytest.raises(RuntimeFailedError, match="cannot start|cannot open"):
        runc.start(cid)  # the runtime's answer: it runs already
    runc.delete(cid, force=True)
    other = new_id()
    (tmp_path / "b2").mkdir()
    write_bundle(
        tmp_path / "b2", overlay_root, RuntimeConfig(), hostname="box", cgroups_path=f"/weenv-{other}", resources=LIMITS
    )
    runc.create(other, tmp_path / "b2")
    os.kill(runc.state(other)["pid"], signal.SIGKILL)  # its runc init dies waiting
    deadline = time.monotonic() + 5
    while runc.state(other)["status"] != "stopped" and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(RuntimeFailedError):
        runc.start(other, timeout=10)
    runc.delete(other, force=True)
    assert runc.list() == [] and cgroup_dirs(f"weenv-{cid}") == [] and cgroup_dirs(f"weenv-{other}") == []


def test_delete_force_running(runc, overlay_root, tmp_path):
    e = start(runc, overlay_root, tmp_path / "bundle")
    e.sh("sleep 1000 & sleep 1000 &")
    runc.delete(e.id, force=True)
    assert runc.list() == [] and cgroup_dirs(e.cgroup_name) == []


def test_delete_with_bundle_kills_through_the_init_pid(runc, overlay_root, tmp_path):
    """delete(force, bundle=) kills the first process itself (the kernel takes the
    rest of its pid namespace) and leaves nothing, background processes included."""
    e = start(runc, overlay_root, tmp_path / "bundle")
    e.sh("sleep 1000 & sleep 1000 &")
    init = runc.state(e.id)["pid"]
    assert int((e.bundle / INIT_PID_FILE).read_text()) == init
    members = cgroup_procs(e.cgroup_name)
    assert len(members) >= 3
    runc.delete(e.id, force=True, bundle=e.bundle)
    assert runc.list() == [] and cgroup_dirs(e.cgroup_name) == []
    assert all(proc_state(p) in ("", "Z") for p in members)


def test_stop_refuses_a_pid_outside_the_container(runc, overlay_root, tmp_path):
    """A pid file naming a process of another cgroup (a reused pid) is not signalled."""
    e = start(runc, overlay_root, tmp_path / "bundle")
    stranger = subprocess.Popen(["sleep", "1000"])
    try:
        (e.bundle / INIT_PID_FILE).write_text(str(stranger.pid))
        assert runc.stop(e.id, e.bundle) is False
        assert stranger.poll() is None  # still alive
        assert runc.state(e.id)["status"] == "running"
        runc.delete(e.id, force=True, bundle=e.bundle)  # falls back to runc's own kill
        assert runc.list() == [] and stranger.poll() is None
    finally:
        stranger.kill()
        stranger.wait()


def test_delete_of_a_frozen_container(runc, overlay_root, tmp_path):
    """A frozen container ignores SIGKILL until thawed: stop() gives up after its
    short timeout (it waited 10 s before) and delete(force) still removes it all."""
    e = start(runc, overlay_root, tmp_path / "bundle")
    e.sh("sleep 1000 &")
    open_cgroups(f"/{e.cgroup_name}").freeze()
    t = time.monotonic()
    assert runc.stop(e.id, e.bundle) is False  # frozen: not dead yet
    assert time.monotonic() - t < 5
    runc.delete(e.id, force=True, bundle=e.bundle)
    assert runc.list() == [] and cgroup_dirs(e.cgroup_name) == []


def test_runc_failures(runc, tmp_path):
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    write_bundle(bundle, tmp_path / "missing-rootfs", RuntimeConfig(), hostname="h", cgroups_path="/weenv-fail")
    with pytest.raises(RuntimeFailedError, match="missing-rootfs"):
        runc.run_detached("fail1", bundle)
    assert runc.state("fail1") is None and runc.list() == [] and cgroup_dirs("weenv-fail") == []
    with pytest.raises(InvalidInputError):
        runc.create("bad id!", bundle)
    with pytest.raises(NotFoundError):
        runc.create("x", tmp_path / "nobundle")
    with pytest.raises(NotFoundError):
        runc.start("nope")


def test_runc_runs_from_a_sealed_copy_of_its_binary(env, runc):
    """Every runc call runs a memfd copy sealed as runc's own check wants it
    (all four seals: else each runc init copies its binary again), holding the
    binary's bytes, unwritable; closing frees it, and a missing binary still
    gives ToolMissingError."""
    runc_only(runc)
    path = runc.executable.path()
    fd = os.open(path, os.O_RDONLY)
    try:
        assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) == MEMFD_SEALS
        assert os.readlink(path).startswith("/memfd:")
        with open(RUNC, "rb") as f:
            assert hashlib.sha256(f.read()).digest() == hashlib.sha256(os.read(fd, 64 << 20)).digest()
    finally:
        os.close(fd)
    fd = os.open(path, os.O_WRONLY)
    try:
        with pytest.raises(PermissionError):  # F_SEAL_WRITE
            os.write(fd, b"x")
    finally:
        os.close(fd)
    assert env.sh("echo ok").stdout == b"ok\n"  # run and exec went through it
    runc.close()
    assert not os.path.exists(path)
    assert runc.state(env.id)["status"] == "running"  # made again on the next call
    missing = Runc(runc.root, "weenv-no-such-runc")
    with pytest.raises(ToolMissingError):
        missing.list()


def test_runc_follows_a_changed_binary(runc, tmp_path):
    """Setting ``binary``, or replacing the file it names, makes the next call
    run a copy of the new file; the copy replaced stays open (a call handed its
    path may not have run it yet) until close; a binary set to a missing
    file fails as that file would."""
    runc_only(runc)
    own = tmp_path / "bin" / "runc"
    own.parent.mkdir()
    shutil.copy2(RUNC, own)
    runc.binary = str(own)
    first = runc.executable.path()
    assert runc.list() == []
    script = b"#!/bin/sh\nexec " + RUNC.encode() + b' "$@"\n'
    tmp = own.with_name("runc.new")
    tmp.write_bytes(script)
    tmp.chmod(0o755)
    os.replace(tmp, own)  # upgraded in place: another inode
    second = runc.executable.path()
    assert second != first
    with open(second, "rb") as f:
        assert f.read() == script
    assert runc.list() == []  # ran through the script's copy
    assert os.path.exists(first)  # still open
    runc.binary = str(tmp_path / "no-runc")
    with pytest.raises(ToolMissingError):
        runc.list()
    runc.binary = RUNC
    assert runc.list() == []
    third = runc.executable.path()
    runc.close()
    assert not any(os.path.exists(p) for p in (first, second, third))  # every copy freed


# --- rootfs in a running environment ------------------------------------------------------
def test_rootfs_files_shared_with_container(env, debian_root):
    fs = RootFS(env.rootfs)
    fs.write_file("/work/from-host.txt", b"host says hi\n")
    assert env.runc.exec(env.id, ["cat", "/work/from-host.txt"]).stdout == b"host says hi\n"
    env.sh("mkdir -p /srv/d && echo inside > /srv/d/f && ln -s /etc/hostname /srv/link")
    assert fs.read_file("/srv/d/f") == b"inside\n"
    assert fs.read_file("/srv/link") == (env.rootfs / "etc/hostname").read_bytes()
    assert [e.name for e in fs.list_dir("/srv")] == ["d", "link"]
    assert not (debian_root / "work").exists() and not (debian_root / "srv/d").exists()
    # Files of the lower layer: overwritten (copied up), removed (whited out); the lower tree keeps them.
    lower_motd = (debian_root / "etc/motd").read_bytes()
    fs.write_file("/etc/motd", b"new motd\n")
    assert env.runc.exec(env.id, ["cat", "/etc/motd"]).stdout == b"new motd\n"
    fs.remove("/etc/apt")
    assert env.sh("test -e /etc/apt").exit_code == 1
    assert (debian_root / "etc/motd").read_bytes() == lower_motd and (debian_root / "etc/apt").is_dir()
    fs.rename("/etc/motd", "/etc/motd.old")  # a copied-up file renames fine
    try:  # a lower-layer directory: overlayfs without redirect_dir answers EXDEV
        fs.rename("/usr/share/doc", "/usr/share/doc2")
    except InvalidInputError as exc:
        assert "lower layer" in str(exc)


# --- rootfs: confined file access ---------------------------------------------------------
@pytest.fixture
def tree(tmp_path):
    """A root with its own /etc files, and a host directory beside it holding a secret."""
    root, host = tmp_path / "root", tmp_path / "host"
    (root / "etc").mkdir(parents=True)
    (root / "etc/hostname").write_bytes(b"inside\n")
    (root / "etc/passwd").write_bytes(b"root-passwd\n")
    host.mkdir()
    (host / "secret").write_bytes(b"HOST")
    return root, host


def test_rootfs_basics(tree):
    root, _ = tree
    fs = RootFS(root)
    fs.write_file("/a/b/c.txt", b"data")
    assert fs.read_file("a/b/c.txt") == b"data" and (root / "a/b/c.txt").read_bytes() == b"data"
    assert fs.stat("/a/b/c.txt").model_dump() == {"name": "c.txt", "type": "file", "size": 4, "mode": 0o644}
    assert fs.stat("/a").type == "dir" and fs.stat("/").name == "/"
    fs.write_file("/a/run.sh", b"#!/bin/sh\n", mode=0o755)
    assert fs.stat("/a/run.sh").mode == 0o755
    fs.write_file("/a/run.sh", b"#!/bin/sh\ntrue\n")  # an existing file keeps its mode
    assert fs.stat("/a/run.sh").mode == 0o755 and fs.read_file("/a/run.sh") == b"#!/bin/sh\ntrue\n"
    fs.write_file("/a/owned", b"", owner=(1000, 1000))
    assert (root / "a/owned").stat().st_uid == 1000
    os.symlink("b/c.txt", root / "a/ln")
    assert [(e.name, e.type) for e in fs.list_dir("/a")] == [
        ("b", "dir"),
        ("ln", "symlink"),
        ("owned", "file"),
        ("run.sh", "file"),
    ]
    assert fs.stat("/a/ln").type == "file" and fs.stat("/a/ln", follow_symlinks=False).type == "symlink"
    assert fs.exists("/a/ln") and not fs.exists("/nope") and not fs.exists("/a/b/c.txt/x")
    fs.make_dir("/x/y/z")
    fs.make_dir("/x/y/z")  # exist_ok
    assert fs.stat("/x/y/z").type == "dir"
    with pytest.raises(InvalidInputError):
        fs.make_dir("/x/y/z", exist_ok=False)
    fs.rename("/a/b", "/x/moved")
    assert fs.read_file("/x/moved/c.txt") == b"data" and not fs.exists("/a/b")
    fs.remove("/a/ln")
    assert fs.exists("/x/moved/c.txt")
    fs.remove("/x")
    assert not (root / "x").exists()
    fs.remove("/a/run.sh")
    assert sorted(os.listdir(root / "a")) == ["owned"]


def test_rootfs_errors(tree):
    root, _ = tree
    fs = RootFS(root)
    os.mkfifo(root / "fifo")
    with pytest.raises(NotFoundError):
        fs.read_file("/missing")
    with pytest.raises(InvalidInputError, match="directory"):
        fs.read_file("/etc")
    with pytest.raises(InvalidInputError, match="regular"):
        fs.read_file("/fifo")  # never blocks
    with pytest.raises(InvalidInputError):
        fs.write_file("/fifo", b"x")
    with pytest.raises(InvalidInputError):
        fs.write_file("/etc", b"x")
    with pytest.raises(InvalidInputError):
        fs.list_dir("/etc/passwd")
    with pytest.raises(NotFoundError):
        fs.list_dir("/missing")
    with pytest.raises(InvalidInputError):
        fs.read_file("/etc/passwd/x")
    with pytest.raises(NotFoundError):
        fs.write_file("/new/dir/f", b"x", make_parents=False)
    with pytest.raises(InvalidInputError):
        fs.write_file("/etc/passwd/f", b"x")
    with pytest.raises(InvalidInputError):
        fs.make_dir("/etc/passwd")
    for bad in ("/", "", "/etc/..", "/etc/.", "a\0b"):
        with pytest.raises(InvalidInputError):
            fs.remove(bad)
    with pytest.raises(NotFoundError):
        fs.remove("/missing")
    with pytest.raises(NotFoundError):
        fs.rename("/missing", "/other")
    fs.make_dir("/full")
    fs.write_file("/full/f", b"")
    with pytest.raises(InvalidInputError):
        fs.rename("/etc", "/full")  # not empty


def test_rootfs_escapes_are_confined(tree, tmp_path):
    root, host = tree
    fs = RootFS(root)
    host_hostname = Path("/etc/hostname").read_bytes() if Path("/etc/hostname").exists() else None
    os.symlink("/etc/hostname", root / "abs")  # absolute link: the root's /etc/hostname
    os.symlink(str(host / "secret"), root / "abs-host")  # absolute link to a host path
    (root / "a/b").mkdir(parents=True)
    os.symlink("../../../../../../../etc/hostname", root / "a/b/rel")  # climbs out
    os.symlink("../../host/secret", root / "a/rel-host")  # naive join: tmp_path/host/secret
    os.symlink(str(host), root / "hdir")  # symlinked parent, absolute
    os.symlink("../host", root / "hdir2")  # symlinked parent, relative (naive: the host dir)
    os.symlink("/proc/self/root/etc/passwd", root / "magic")

    assert fs.read_file("../../etc/passwd") == b"root-passwd\n"
    assert fs.read_file("/../../../../etc/passwd") == b"root-passwd\n"
    assert fs.read_file("/abs") == b"inside\n"
    assert fs.read_file("/a/b/rel") == b"inside\n"
    for path in ("../host/secret", "/abs-host", "/a/rel-host", "/hdir/secret", "/hdir2/secret", "/magic"):
        with pytest.raises(NotFoundError):
            fs.read_file(path)
    for path in ("/hdir", "/hdir2"):
        with pytest.raises(NotFoundError):
            fs.list_dir(path)
    assert not fs.exists("/hdir/secret")

    # Writes through links land inside the root or are refused; the host is untouched.
    fs.write_file("/abs", b"changed\n")
    assert (root / "etc/hostname").read_bytes() == b"changed\n"
    fs.write_file("/a/b/rel", b"again\n")
    assert (root / "etc/hostname").read_bytes() == b"again\n"
    if host_hostname is not None:
        assert Path("/etc/hostname").read_bytes() == host_hostname
    # Dangling links (to host paths) are written where they point inside the root.
    for path in ("/abs-host", "/a/rel-host", "/hdir/new", "/hdir2/new", "/hdir/secret"):
        fs.write_file(path, b"pwned")
    assert (root / str(host).lstrip("/") / "secret").read_bytes() == b"pwned"  # via /abs-host, /hdir
    assert (root / str(host).lstrip("/") / "new").read_bytes() == b"pwned"
    assert (root / "host/secret").read_bytes() == b"pwned"  # via ../../host/secret from /a
    assert (root / "host/new").read_bytes() == b"pwned"  # via /hdir2 -> ../host
    with pytest.raises(NotFoundError):
        fs.write_file("/nodir/x", b"", make_parents=False)
    os.symlink("loop2", root / "loop1")
    os.symlink("loop1", root / "loop2")
    with pytest.raises(InvalidInputError):
        fs.write_file("/loop1", b"x")
    host_passwd = Path("/etc/passwd").read_bytes()
    fs.write_file("/magic", b"pwned")  # no procfs inside this root: a plain path there
    assert (root / "proc/self/root/etc/passwd").read_bytes() == b"pwned"
    assert Path("/etc/passwd").read_bytes() == host_passwd
    fs.write_file("../escape", b"x")
    assert (root / "escape").exists() and not (tmp_path / "escape").exists()
    fs.make_dir("/hdir/sub")  # inside the root, where the link points
    assert (root / str(host).lstrip("/") / "sub").is_dir()
    fs.remove("/hdir/secret")  # the root's copy
    with pytest.raises(NotFoundError):
        fs.read_file("/hdir/secret")
    fs.rename("/hdir2/secret", "/stolen")
    assert sorted(os.listdir(host)) == ["secret"] and (host / "secret").read_bytes() == b"HOST"
    fs.remove("/hdir")  # the link, not its target
    assert not os.path.lexists(root / "hdir") and (host / "secret").exists()
    assert not (tmp_path / "etc").exists() and not Path("/magic").exists()


def test_rootfs_refuses_magic_links(tree):
    root, _ = tree
    (root / "proc").mkdir()
    mount(MountSpec("proc", "proc", str(root / "proc")))
    try:
        fs = RootFS(root)
        for path in ("/proc/self/root/etc/passwd", "/proc/self/cwd", "/proc/1/root/etc/hostname"):
            with pytest.raises((InvalidInputError, NotFoundError)):
                fs.read_file(path)
        with pytest.raises((InvalidInputError, NotFoundError)):
            fs.write_file("/proc/self/root/tmp/weenv-escape", b"x")
        assert not Path("/tmp/weenv-escape").exists()
        assert fs.read_file("/proc/self/comm")  # plain procfs files still read
    finally:
        umount(root / "proc")
