"""Streamed and background commands on one node (Node.spawn/run, weenv.node.runtime.process),
lifetimes (timeouts, the reaper) and capacity, without the HTTP server."""

from __future__ import annotations

import time

import pytest

from weenv.api.models import ProcessEvent
from weenv.errors import CapacityError, InvalidInputError, NotFoundError, OutputLimitError
from weenv.formats.manifest import Resources
from weenv.node.cgroups import open_cgroups
from weenv.node.node import CONTAINER_PREFIX, Node


def _events(p):
    """The events of ``p``, consecutive chunks of one stream joined."""
    out = []
    for e in p.log.follow(p.primary):
        if out and e.type in ("stdout", "stderr") and out[-1].type == e.type:
            out[-1] = ProcessEvent(type=e.type, data=out[-1].data + e.data)
        else:
            out.append(e)
    return out


def test_spawn_streams_in_order_with_pid_and_exit(node):
    info = node.create("task", envs={"FROM_CREATE": "c"})
    p = node.spawn(
        info.id, "echo o1; sleep 0.2; echo e1 >&2; sleep 0.2; echo o2; echo $FROM_CREATE; exit 3", primary_reader=True
    )
    assert p.pid and p.pid > 1
    evs = _events(p)
    assert [e.type for e in evs] == ["start", "stdout", "stderr", "stdout", "end"]
    assert evs[0].pid == p.pid
    assert (evs[1].data, evs[2].data, evs[3].data) == (b"o1\n", b"e1\n", b"o2\nc\n")
    assert evs[-1].exit_code == 3 and not evs[-1].timed_out
    assert node.process(info.id, p.pid).info().exit_code == 3
    assert [i.pid for i in node.processes(info.id)] == [p.pid]


def test_spawn_start_failure_is_127_with_runc_message(node):
    info = node.create("task")
    p = node.spawn(info.id, ["no-such-command"], primary_reader=True)
    evs = _events(p)
    assert p.pid == 0 and evs[-1].exit_code == 127
    assert b"executable file not found" in b"".join(e.data or b"" for e in evs if e.type == "stderr")
    with pytest.raises(InvalidInputError):
        node.spawn(info.id, "true", cwd="relative")


def test_background_kill_timeout_and_stdin(node):
    info = node.create("task")
    bg = node.spawn(info.id, "while true; do echo tick; sleep 0.05; done", tag="ticker")
    time.sleep(0.3)
    assert bg.running and bg.info().tag == "ticker"
    bg.kill()
    assert bg.wait(10) and bg.exit_code == 137
    ticks = bg.result().stdout
    assert ticks.startswith(b"tick\n")

    t = node.spawn(info.id, "sleep 100 & sleep 100", timeout=0.5)
    assert t.wait(10) and t.timed_out and t.exit_code == 137

    cat = node.spawn(info.id, ["cat"], stdin_open=True, stdin=b"first ")
    cat.write_stdin(b"second", eof=True)
    assert cat.wait(10) and cat.result().stdout == b"first second"
    with pytest.raises(InvalidInputError):
        cat.write_stdin(b"more")
    # TERM only to the command
    term = node.spawn(info.id, ["sleep", "60"])
    term.kill("TERM")
    assert term.wait(10) and term.exit_code == 128 + 15
    with pytest.raises(InvalidInputError):
        term.kill("NOPE")


def test_background_children_keep_running_after_the_command(node):
    info = node.create("task")
    # the command exits at once; its background child keeps writing to the same stdout
    r = node.run(info.id, "(for i in $(seq 50); do echo bg; sleep 0.02; done) & echo fg")
    assert r.exit_code == 0 and r.stdout.startswith(b"fg\n") and r.duration_s < 5
    time.sleep(1.5)
    # the child was not killed by SIGPIPE: it ran its 50 iterations
    ps = node.exec(info.id, "ps -e -o comm= 2>/dev/null | grep -c sleep || true")
    assert ps.exit_code == 0


def test_run_output_limit_kills_and_raises(node):
    info = node.create("task")
    with pytest.raises(OutputLimitError):
        node.run(info.id, "yes", max_output=1 << 20)
    r = node.run(info.id, ["head", "-c", "300000", "/dev/zero"], max_output=1 << 20)
    assert len(r.stdout) == 300000
    assert node.run(info.id, "true").exit_code == 0  # still usable


def test_timeouts_reap_and_capacity(paths, shared_store, leak_check):
    with Node(paths, store=shared_store, max_environments=2) as node:
        a = node.create("task", timeout=0.5, metadata={"k": "v"})
        b = node.create("task")
        assert a.metadata == {"k": "v"} and a.expires_at - a.created_at == pytest.approx(0.5, abs=30)
        with pytest.raises(CapacityError):
            node.create("task")
        for bad in (0, -1, float("nan"), float("inf"), 10**9):
            with pytest.raises(InvalidInputError):
                node.set_timeout(b.id, bad)
        node.set_timeout(b.id, 3600)
        time.sleep(0.6)
        assert node.reap_expired() == [a.id]
        assert [e.id for e in node.list()] == [b.id]
        with pytest.raises(NotFoundError):
            node.set_timeout(a.id, 10)
        node.create("task")  # room again


# --- a kill reaches every process the command started (issue 13, finding 8) ------------------
def _pids(env_id: str) -> int:
    return open_cgroups(f"/{CONTAINER_PREFIX}{env_id}").usage().pids_current


def _settles(env_id: str, bound: int, within: float = 2.0) -> bool:
    deadline = time.monotonic() + within
    while _pids(env_id) > bound:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_kill_of_a_fork_bomb_frees_its_pids(node):
    """A bomb whose first shell returns at once leaves its forks reparented to
    the environment's init: the kill must still reach them (its cgroup)."""
    info = node.create("task", resources=Resources(pids=256))
    baseline = _pids(info.id)
    bomb = node.spawn(info.id, ["bash", "-c", "f(){ f | f & }; f"])
    assert bomb.wait(10) and not bomb.running  # its first process is gone; its forks are not
    deadline = time.monotonic() + 10
    while _pids(info.id) < 200 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _pids(info.id) >= 200  # the bomb is at the limit
    bomb.kill()
    assert _settles(info.id, baseline + 2), f"{_pids(info.id)} pids 2 s after the kill (baseline {baseline})"
    assert node.exec(info.id, ["echo", "ok"]).stdout == b"ok\n"
    # a bomb still running is killed whole too, by a timeout as by a kill
    r = node.exec(info.id, ["bash", "-c", "f(){ f | f & }; f; sleep 60"], timeout=2)
    assert r.timed_out
    assert _settles(info.id, baseline + 2)


def _sleeps(node, env_id: str) -> list[str]:
    """The command lines of the ``sleep`` processes commands started, sorted."""
    r = node.exec(env_id, ["python3", "-c", _SLEEPS])
    return r.stdout.decode().splitlines()


_SLEEPS = """
import os
out = []
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\\0")[:-1]
    except OSError:
        continue
    if argv[:1] == [b"sleep"] and argv[1:2] != [b"infinity"]:  # not the environment's own
        out.append(b" ".join(argv).decode())
print("\\n".join(sorted(out)))
"""


def test_kill_reaches_setsid_and_double_forked_children_and_spares_other_commands(node):
    info = node.create("task")
    other = node.spawn(info.id, ["sleep", "1000"], tag="other")
    cmd = node.spawn(info.id, "setsid sleep 1001 & (sleep 1002 &) ; exec sleep 1003")
    deadline = time.monotonic() + 10

    def ps():
        return _sleeps(node, info.id)

    while time.monotonic() < deadline and len(ps()) < 4:
        time.sleep(0.05)
    assert ps() == ["sleep 1000", "sleep 1001", "sleep 1002", "sleep 1003"]
    cmd.kill()
    assert cmd.wait(10) and cmd.exit_code == 137
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline and ps() != ["sleep 1000"]:
        time.sleep(0.05)
    assert ps() == ["sleep 1000"]
    assert other.running
    # a command that returned at once: its setsid'd child is killed by a kill of the ended command
    gone = node.spawn(info.id, "setsid sleep 1004 &")
    assert gone.wait(10) and gone.exit_code == 0
    assert "sleep 1004" in ps()
    gone.kill()
    assert "sleep 1004" not in ps() and other.running
