"""The launcher seam (weenv.node.runtime.launcher): the exec agent and ``runc exec``
start a command the same way.  One suite, run against each backend alone (no
fallback), on real environments of a started Node."""

from __future__ import annotations

import re

import pytest

from weenv.node.runtime.commands import collect

BACKENDS = ["agent", "runc"]


@pytest.fixture(params=BACKENDS)
def launched(request, node):
    """``start(command, **kw)``: a Process started in a fresh ``task``
    environment through one backend; checks the backend alone started them."""
    info = node.create("task")
    e = node._env(info.id)
    launcher = getattr(node.launchers, request.param)
    before = dict(node.exec_counts)
    started = []

    def start(command, **kw):
        p = node.commands.start(e, command, launcher=launcher, primary_reader=True, **kw)
        started.append(p)
        return p

    yield start
    other = "runc" if request.param == "agent" else "agent"
    for p in started:
        p.kill()
        assert p.wait(30)
    assert node.exec_counts[request.param] == before[request.param] + len(started)
    assert node.exec_counts[other] == before[other]


def test_exit_code_and_streams_apart(launched):
    r = collect(launched(["sh", "-c", "echo out; echo err >&2; exit 3"]))
    assert (r.exit_code, r.stdout, r.stderr) == (3, b"out\n", b"err\n")


def test_variables_working_dir_and_user(launched):
    r = collect(launched(["sh", "-c", 'echo "$GREETING"; pwd; id -u'], env={"GREETING": "hi"}))
    assert r.stdout == b"hi\n/workspace\n0\n"
    assert collect(launched(["pwd"], cwd="/tmp")).stdout == b"/tmp\n"


def test_stdin_bytes_and_pipe(launched):
    assert collect(launched(["cat"], stdin=b"given")).stdout == b"given"
    p = launched(["cat"], stdin_open=True)
    p.write_stdin(b"streamed", eof=True)
    assert collect(p).stdout == b"streamed"


def test_start_failure_is_127(launched):
    p = launched(["no-such-command"])
    r = collect(p)
    assert p.pid == 0 and r.exit_code == 127 and b"no-such-command" in r.stderr


def test_in_the_environment_cgroup_and_namespaces(launched):
    script = "cat /proc/self/cgroup; echo --; cat /proc/1/cgroup; readlink /proc/self/ns/pid /proc/1/ns/pid"
    mine, init = collect(launched(["sh", "-c", script])).stdout.decode().split("--\n")
    pid_ns = init.splitlines()[-2:]
    init = "\n".join(init.splitlines()[:-2]) + "\n"
    assert re.sub(r"/cmd-[0-9a-f]+$", "", mine, flags=re.M) == init  # its cgroup, or a command group below it
    assert pid_ns[0] == pid_ns[1]  # the environment's pid namespace


def test_timeout_and_kill_reach_the_tree(launched):
    r = collect(launched(["sh", "-c", "sleep 100 & sleep 100"], timeout=0.5))
    assert r.timed_out
    p = launched(["sh", "-c", "setsid sleep 100 & sleep 100"])
    p.kill()
    assert p.wait(10)
    left = collect(launched(["sh", "-c", "for c in /proc/[0-9]*/cmdline; do tr '\\0' ' ' < $c; echo; done"]))
    assert b"sleep 100" not in left.stdout
