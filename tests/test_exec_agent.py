"""The exec agent (weenv.node.runtime.agent): commands in a started environment without
``runc exec``, with the first process's isolation, and the fallback to runc.

Real environments on a started Node (the ``node`` fixture); isolation is read
from /proc inside the environment.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from weenv.errors import InvalidInputError, OutputLimitError, RuntimeFailedError
from weenv.formats.manifest import RuntimeConfig
from weenv.node.node import Node
from weenv.node.runtime import agent, idmap
from weenv.node.runtime.bundle import AGENT_PATH, INIT_PATH, build_config, cap_mask
from weenv.node.runtime.commands import collect
from weenv.node.runtime.runc import children
from weenv.node.table import AGENT_SOCKET

# Prints, for this process, pid 1 and the environment's command (pid 1's child that
# is not the agent; pid 1 itself when the agent holds the environment, as for the
# default ``sleep infinity``): namespaces, cgroups, capabilities, seccomp, no_new_privs.
PROBE = r"""
import json, os
FIELDS = ("CapEff", "CapBnd", "CapPrm", "CapInh", "CapAmb", "Seccomp", "Seccomp_filters", "NoNewPrivs", "Uid", "Gid")
def probe(pid):
    status = dict(l.split(":\t", 1) for l in open(f"/proc/{pid}/status").read().splitlines() if ":\t" in l)
    return {
        "ns": {n: os.readlink(f"/proc/{pid}/ns/{n}") for n in ("pid", "mnt", "ipc", "uts", "net", "cgroup")},
        "cgroup": open(f"/proc/{pid}/cgroup").read(),
        "status": {k: status[k].strip() for k in FIELDS},
        "limits": open(f"/proc/{pid}/limits").read(),
        "ppid": int(status["PPid"]),
    }
kids = open("/proc/1/task/1/children").read().split()
command = [int(k) for k in kids if open(f"/proc/{k}/comm").read().strip() != "weenv-agent"]
me = probe("self")
me["parent"] = open(f"/proc/{me['ppid']}/comm").read().strip() if me["ppid"] else ""
print(json.dumps({"self": me, "init": probe(1), "command": probe(command[0] if command else 1)}))
"""


def _probe(node: Node, env_id: str) -> dict:
    r = node.exec(env_id, ["python3", "-c", PROBE])
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)


def _isolation(p: dict) -> dict:
    """What must be the environment's own.  A command's cgroup is the
    environment's, or on one hierarchy (v1 freezer, v2) a command group below
    it (:mod:`weenv.node.cgroups.commands`): compared without that last step."""
    cgroup = re.sub(r"/cmd-[0-9a-f]+$", "", p["cgroup"], flags=re.M)
    return {"ns": p["ns"], "cgroup": cgroup, "status": p["status"], "limits": p["limits"]}


def test_fast_path_has_the_first_process_isolation(node):
    info = node.create("task")
    before = node.stats()
    seen = _probe(node, info.id)
    assert node.stats().exec_agent == before.exec_agent + 1 and node.stats().exec_runc == before.exec_runc
    assert seen["self"]["parent"] == "weenv-exec"  # started by the agent's handler, not by runc
    assert _isolation(seen["self"]) == _isolation(seen["init"]) == _isolation(seen["command"])
    status = seen["self"]["status"]
    # noNewPrivileges only outside a user namespace (in one, setuid sudo works as under Docker)
    userns = idmap.range_of(node.snapshotter.dir(info.id)) is not None
    assert status["Seccomp"] == "2" and int(status["Seccomp_filters"]) >= 1
    assert status["NoNewPrivs"] == ("0" if userns else "1")
    default = f"{cap_mask(node.containers.default_capabilities()):016x}"  # Docker's set, runc's without userns
    assert status["CapEff"] == status["CapBnd"] == default

    # and the same as a command started by runc exec (the fallback: the environment's set, not the
    # first process's, which also holds the agent's CAP_SETUID, CAP_SETGID and CAP_SETPCAP)
    e = node._env(info.id)
    via_runc = collect(
        node.commands.start(e, ["python3", "-c", PROBE], launcher=node.launchers.runc, primary_reader=True)
    )
    assert via_runc.exit_code == 0, via_runc.stderr
    runc_self = json.loads(via_runc.stdout)["self"]
    assert _isolation(runc_self) == _isolation(seen["self"])


def test_commands_through_the_agent(node):
    info = node.create("task", envs={"FROM_CREATE": "c"})
    r = node.exec(info.id, "echo out; echo err >&2; exit 3")
    assert (r.exit_code, r.stdout, r.stderr, r.timed_out) == (3, b"out\n", b"err\n", False)
    r = node.exec(info.id, 'echo "$FOO $FROM_CREATE $HOME $PATH"; pwd', env={"FOO": "b a r"}, cwd="/tmp")
    assert r.stdout == b"b a r c /root /usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\n/tmp\n"
    assert node.exec(info.id, ["pwd"]).stdout == b"/workspace\n"  # the template's working dir
    assert node.exec(info.id, ["sh", "-c", 'printf %s "$1"', "sh", "a'; rm -rf / #"]).stdout == b"a'; rm -rf / #"
    assert node.exec(info.id, ["cat"], stdin=b"from stdin").stdout == b"from stdin"
    assert node.exec(info.id, ["cat"]).stdout == b""  # no stdin: /dev/null
    assert node.exec(info.id, "kill -TERM $$").exit_code == 128 + 15
    assert node.exec(info.id, "kill -KILL $$").exit_code == 137
    big = node.exec(info.id, ["head", "-c", str(20 << 20), "/dev/zero"])
    assert big.stdout == bytes(20 << 20)
    # descriptors: the command has its three and nothing of the agent's or the node's
    fds = node.exec(info.id, ["python3", "-c", "import os; print(sorted(os.listdir('/proc/self/fd')))"])
    assert fds.stdout == b"['0', '1', '2', '3']\n"  # 3: the listing's own
    r = node.exec(info.id, "ls /proc/1/fd; for p in /proc/[0-9]*; do cat $p/comm; done")
    assert r.exit_code == 0

    cat = node.spawn(info.id, ["cat"], stdin_open=True, stdin=b"first ")
    assert cat.stdin_open
    cat.write_stdin(b"second", eof=True)
    assert cat.wait(10) and cat.result().stdout == b"first second"
    for _ in range(20):  # a silent command: spawn returns once it runs, not when it speaks or ends
        t = time.monotonic()
        term = node.spawn(info.id, ["sleep", "60"])
        assert term.pid and time.monotonic() - t < 10
        term.kill("TERM")
        assert term.wait(10) and term.exit_code == 128 + 15
    # (a command the agent cannot fork, e.g. while the provisioner squeezes the
    # memory limit, goes through runc exec instead: allow one)
    assert node.stats().exec_runc <= 1 and node.stats().exec_agent >= 30


def test_start_failures_are_clear(node):
    info = node.create("task")
    r = node.exec(info.id, ["no-such-command"])
    assert r.exit_code == 127 and b'exec: "no-such-command": executable file not found in $PATH' in r.stderr
    assert node.exec(info.id, ["/no/such/file"]).exit_code == 127
    assert node.exec(info.id, ["/etc/passwd"]).exit_code == 126
    r = node.exec(info.id, ["true"], cwd="/no/such/dir")
    assert r.exit_code == 126 and b"chdir" in r.stderr
    p = node.spawn(info.id, ["no-such-command"])
    assert p.pid == 0 and p.wait(10) and p.exit_code == 127
    for bad in (
        dict(command=[]),
        dict(command=["true"], cwd="rel"),
        dict(command=["true"], env={"A=B": "1"}),
        dict(command=["a\0b"]),
    ):
        with pytest.raises(InvalidInputError):
            node.exec(info.id, **bad)


def _cmdlines(node: Node, env_id: str) -> list[str]:
    r = node.exec(
        env_id,
        [
            "python3",
            "-c",
            "import glob\nfor f in glob.glob('/proc/[0-9]*/cmdline'):\n"
            "  try: print(open(f).read().replace(chr(0), ' ').strip())\n  except OSError: pass",
        ],
    )
    return r.stdout.decode().splitlines()


def test_timeout_kills_the_whole_tree(node):
    info = node.create("task")
    # a background child, one in its own session (escapes the process group), and the foreground
    r = node.exec(info.id, "sleep 101 & setsid sleep 102 & sleep 103; echo never", timeout=1)
    assert r.timed_out and r.exit_code == 137 and b"never" not in r.stdout and r.duration_s < 10
    time.sleep(0.2)
    assert not [c for c in _cmdlines(node, info.id) if c.startswith("sleep 10")]
    with pytest.raises(OutputLimitError):
        node.run(info.id, "yes", max_output=1 << 20)
    assert not [c for c in _cmdlines(node, info.id) if c == "yes"]
    # background commands outlive the command that started them
    r = node.exec(info.id, "sleep 30 & echo started")
    assert r.stdout == b"started\n" and r.duration_s < 5
    assert "sleep 30" in _cmdlines(node, info.id)


def test_hanging_up_kills_the_command(node):
    info = node.create("task")
    e = node._env(info.id)
    s = agent.spawn(e.agent_socket, ["sleep", "77"], env={}, cwd="/")
    try:
        deadline = time.monotonic() + 10
        while s.started() is None and time.monotonic() < deadline:
            s.update()
            time.sleep(0.01)
        assert s.started() and s.handler_pid and "sleep 77" in _cmdlines(node, info.id)
    finally:
        s.close()
        s.stdout.close()
        s.stderr.close()
    deadline = time.monotonic() + 10
    while "sleep 77" in _cmdlines(node, info.id) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "sleep 77" not in _cmdlines(node, info.id)


def _agent_pids(node: Node, env_id: str, comm: str) -> list[int]:
    """Host pids of the environment's processes named ``comm``."""
    init = node.runc.state(node._env(env_id).container_id)["pid"]
    found, todo = [], [init]
    while todo:
        pid = todo.pop()
        kids = children(pid)
        todo += kids
        for k in kids:
            try:
                if Path(f"/proc/{k}/comm").read_text().strip() == comm:
                    found.append(k)
            except OSError:
                pass
    return found


def test_agent_killed_inside_falls_back_to_runc(node):
    info = node.create("task")
    running = node.spawn(info.id, ["sleep", "60"])
    (handler,) = _agent_pids(node, info.id, "weenv-exec")
    os.kill(handler, signal.SIGKILL)  # the command's handler dies: a clear error, no hang
    assert running.wait(10)
    assert isinstance(running.error, RuntimeFailedError) and "exec agent" in str(running.error)
    r = node.exec(
        info.id, 'for p in /proc/[0-9]*; do [ "$(cat $p/comm)" = weenv-agent ] && kill -9 ${p#/proc/}; done; true'
    )
    assert r.exit_code == 0
    time.sleep(0.2)
    before = node.stats()
    t = time.monotonic()
    r = node.exec(info.id, ["echo", "still here"])
    assert r.stdout == b"still here\n" and time.monotonic() - t < 10
    after = node.stats()
    assert after.exec_runc == before.exec_runc + 1 and after.exec_agent == before.exec_agent
    assert not node._env(info.id).agent_socket.exists()
    assert node.exec(info.id, ["true"]).exit_code == 0


def _fds() -> dict[str, str]:
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return out


def test_destroy_leaves_no_process_descriptor_or_file(node, paths):
    node.destroy(node.create("task").id)  # the groups stay mounted (and their files open)
    fds_before = _fds()
    info = node.create("task")
    env_dir = node._env(info.id).dir
    assert (env_dir / AGENT_SOCKET).exists()
    node.exec(info.id, "sleep 300 > /dev/null 2>&1 & (while true; do echo tick; sleep 0.05; done) & echo bg")
    bg = node.spawn(info.id, ["sleep", "300"])
    agents = _agent_pids(node, info.id, "weenv-agent") + _agent_pids(node, info.id, "weenv-exec")
    assert len(agents) >= 2
    node.destroy(info.id)
    assert bg.wait(15) and not bg.running
    assert not env_dir.exists()
    assert not [p for p in agents if Path(f"/proc/{p}").exists()]
    deadline = time.monotonic() + 10  # the pipe sink lets go of pipes once their writers died
    while _fds().items() - fds_before.items() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _fds().items() - fds_before.items()


def test_node_without_agent_uses_runc(paths, shared_store, leak_check):
    with Node(paths, store=shared_store, exec_agent=False) as node:
        info = node.create("task")
        r = node.exec(info.id, "echo $$; cat /proc/1/cmdline")
        assert r.exit_code == 0 and INIT_PATH.encode() in r.stdout and AGENT_PATH.encode() not in r.stdout
        stats = node.stats()
        assert stats.exec_agent == 0 and stats.exec_runc == 2 and stats.exec_agent_error == "disabled"


def test_bundle_and_build(tmp_path):
    config = build_config(
        tmp_path,
        RuntimeConfig(command=["sleep", "1"]),
        hostname="h",
        cgroups_path="/x",
        init=Path("/usr/bin/tini-static"),
        agent=tmp_path / "agent",
    )
    # the agent runs as root with the set and the three it needs to switch users, and becomes 0:0 (the template's)
    assert config["process"]["args"] == [AGENT_PATH, "-u", "0:0", "-c", "20000420", "--", INIT_PATH, "--", "sleep", "1"]
    assert config["process"]["user"] == {"uid": 0, "gid": 0}
    assert set(config["process"]["capabilities"]["permitted"]) == {
        "CAP_AUDIT_WRITE",
        "CAP_KILL",
        "CAP_NET_BIND_SERVICE",
        "CAP_SETUID",
        "CAP_SETGID",
        "CAP_SETPCAP",
    }
    (m,) = [m for m in config["mounts"] if m["destination"] == AGENT_PATH]
    assert m["source"] == str(tmp_path / "agent") and "ro" in m["options"] and "nosuid" in m["options"]
    first = agent.build_agent(tmp_path / "cache")
    assert agent.build_agent(tmp_path / "cache") == first and os.access(first, os.X_OK)
    assert agent.build.source_digest()[:32] == first.parent.name
    missing = agent.AgentBinary(tmp_path / "cache2", cc="no-such-cc")
    assert missing.get() is None and "no C compiler" in (missing.error or "")


def test_the_agent_holds_and_reaps_as_pid_1(node):
    """The default command is never the image's ``sleep``: pid 1 is the agent
    (named weenv-init), with the environment's identity and capability set;
    an orphan that exits is reaped, not left a zombie."""
    info = node.create("task")
    r = node.exec(info.id, "tr '\\0' ' ' < /proc/1/cmdline; echo; cat /proc/1/comm; grep CapEff /proc/1/status")
    cmdline, comm, caps = r.stdout.decode().splitlines()
    mask = cap_mask(node.containers.default_capabilities())  # the environment's set
    assert cmdline.split() == [AGENT_PATH, "-u", "0:0:0", "-c", f"{mask:x}", "--"]  # root, its groups: 0
    assert comm == "weenv-init" and caps.split()[1] == f"{mask:016x}"
    assert node.exec(info.id, "sleep 0.2 > /dev/null 2>&1 & echo $!").exit_code == 0
    time.sleep(0.6)
    states = node.exec(info.id, "cat /proc/[0-9]*/stat | awk '{print $3}'").stdout.split()
    assert b"Z" not in states
    node.destroy(info.id)
