"""The ``weenv`` command as a user runs it: separate processes, the daemon
started on demand, reached again by later commands, stopped cleanly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from weenv.host import mounts


def weenv(paths, *args, check=True, input=None, timeout=300):
    env = dict(os.environ, WEENV_HOME=str(paths.home))
    proc = subprocess.run(
        [sys.executable, "-m", "weenv", *args],
        capture_output=True,
        text=True,
        env=env,
        input=input,
        timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"weenv {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture
def cli_home(paths, debian_root, tmp_path, leak_check):
    """A home with groups built through the CLI; the daemon stopped at the end."""
    task = tmp_path / "task" / "workspace"
    task.mkdir(parents=True)
    (task / "hello.py").write_text("print('hi from the cli task')\n")
    weenv(paths, "group", "build", str(debian_root), "--name", "base")
    weenv(paths, "group", "build", str(tmp_path / "task"), "--name", "task")
    weenv(paths, "template", "create", "t", "base", "task", "--workdir", "/workspace", "--memory", "1G")
    yield paths
    weenv(paths, "stop", check=False)


def _daemon_pid(paths):
    try:
        return int(paths.pidfile.read_text())
    except FileNotFoundError:
        return None


def _running(pid):
    """Whether ``pid`` runs (a zombie awaiting its reaper does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_run_create_exec_ps_rm_stop(cli_home):
    paths = cli_home
    assert weenv(paths, "group", "ls").stdout.count("sha256:") == 2
    assert weenv(paths, "template", "ls").stdout.startswith("t\tsha256:")

    r = weenv(paths, "run", "t", "--", "python3", "hello.py")
    assert r.stdout == "hi from the cli task\n"
    assert weenv(paths, "run", "t", "--", "sh", "-c", "exit 7", check=False).returncode == 7

    created = weenv(paths, "create", "t")
    env_id = created.stdout.strip()
    assert "runtime create/start" in created.stderr and "fetched" in created.stderr
    pid = _daemon_pid(paths)
    assert pid is not None

    # a later process reaches the same environment through the daemon
    assert weenv(paths, "exec", env_id, "--", "sh -c 'echo one > /root/f'").returncode == 0
    assert weenv(paths, "exec", env_id, "--", "cat", "/root/f").stdout == "one\n"
    r = weenv(paths, "exec", env_id, "--timeout", "1", "--", "sleep", "30", check=False)
    assert r.returncode == 137 and "timed out" in r.stderr
    assert env_id in weenv(paths, "ps").stdout
    weenv(paths, "rm", env_id)
    assert env_id not in weenv(paths, "ps").stdout

    weenv(paths, "create", "t")  # left running: stop must clean it up
    assert "stopped" in weenv(paths, "stop").stderr
    assert not _running(pid)
    assert mounts.mounts_under(paths.home) == []
    assert not paths.socket.exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["run", "no-such-template", "--", "true"], "no template named"),
        (["group", "build", "/no/such/dir", "--name", "x"], "/no/such/dir"),
        (["group", "build", "/etc/hostname", "--name", "x"], "not a directory"),
        (["group", "build", "/tmp", "--name", "Bad Name"], "bad name"),
        (["template", "create", "t2", "sha256:" + "0" * 64], "no manifest"),
        (["template", "create", "t2", "sha256:zz"], "not a sha256 digest"),
        (["exec", "nosuchenv", "--", "true"], "no environment"),
        (["create", "t", "--memory", "lots"], "not a size"),
        (["rm", "../../etc"], "bad environment id"),
    ],
)
def test_user_mistakes_are_one_clear_line(cli_home, args, message):
    r = weenv(cli_home, *args, check=False)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    assert message in r.stderr, r.stderr
    assert r.stderr.strip().startswith("weenv: error:") or "Usage" in r.stderr
