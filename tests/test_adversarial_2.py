"""Bad input and hostile conditions against the features of the restart, priority,
elastic admission, E2B metrics and rollout-benchmark work.

Each test reproduces one problem found by trying to break them (it failed
before its fix): what a user must see is a clear weenv error (one line from
the CLI), state that survives a daemon restart, nothing leaked.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from test_restart import restart_home  # noqa: F401  (fixture)
from weenv.errors import InvalidInputError

# --- weenv bench rollout options ------------------------------------------------------------


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_bench_rollout_non_finite_think_scale_is_one_line(paths, value):
    """``--think-scale nan`` passed the ``think_scale < 0`` check and the benchmark
    started (downloads, builds) to sleep NaN seconds later."""
    env = dict(os.environ, WEENV_HOME=str(paths.home), WEENV_CACHE=str(paths.cache), WEENV_STORE=paths.store_url)
    proc = subprocess.run(
        [sys.executable, "-m", "weenv", "bench", "rollout", "--quick", "--think-scale", value],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().startswith("weenv: error:") and "think_scale" in proc.stderr, proc.stderr[-2000:]


# --- E2B metrics: disk usage of the upper dir ----------------------------------------------


def test_very_deep_upper_dir_is_measured_and_destroyed(node):
    """os.walk and shutil.rmtree recurse once per directory level: an environment
    that made a tree 1100 levels deep made ``disk_usage`` (E2B get_metrics) a
    RecursionError, and its destroy too (its directory left on the host)."""
    env_id = node.create("task").id
    env_dir = node._env(env_id).dir
    try:
        deep = "/tmp/" + "/".join(["d"] * 1100)
        r = node.exec(env_id, ["sh", "-c", f"mkdir -p {deep} && head -c 9000 /dev/zero > {deep}/f"])
        assert r.exit_code == 0, r.stderr
        os.symlink(".", node._env(env_id).upper / "tmp" / "loop")  # a symlink loop: not followed
        node.exec(env_id, ["sync"])  # the disk's quota counts metadata once committed (btrfs: 30 s at most)
        used, total = node.disk_usage(env_id)
        assert 1100 * 200 < used < total, used
    finally:
        node.destroy(env_id)
    assert not env_dir.exists()


# --- priority and timeout across a daemon restart ------------------------------------------


def test_priority_and_timeout_survive_a_daemon_restart(restart_home):  # noqa: F811
    """A recovered environment came back with the priority and expiry it had at
    create (env.json was written once): a timeout extended before the kill let
    the reaper destroy it early, and its provisioner priority was reset to 0."""
    home = restart_home
    client = home.start()
    env_id = home.create(client)
    client.set_priority(env_id, 7)
    expires = client.set_timeout(env_id, 3600).expires_at
    home.kill(home.daemon_pid())
    client.close()

    client = home.start()
    try:
        info = client.get(env_id)
        assert info.priority == 7
        assert abs(info.expires_at - expires) < 1
        assert client.provision_stats(env_id).environments[0].priority == 7
    finally:
        client.destroy(env_id)
        client.close()


def test_node_refuses_a_priority_out_of_range(node):
    """The HTTP API bounds priority to [-1000, 1000]; Node (the Python API) took anything."""
    env_id = node.create("task").id
    try:
        for bad in (10**9, -1001, 1.5, "high", None):
            with pytest.raises(InvalidInputError):
                node.set_priority(env_id, bad)
        assert node.set_priority(env_id, 1000).priority == 1000
    finally:
        node.destroy(env_id)
    with pytest.raises(InvalidInputError):
        node.create("task", priority=5000)
    assert node.list() == []


# --- FUSE holder -----------------------------------------------------------------------------


def test_holder_pid_file_naming_another_homes_holder(tmp_path):
    """A damaged (or stale, pid reused) holder pid file naming another home's
    holder: ``release`` (``weenv stop``, a daemon start) could not reach it by
    its socket and SIGKILLed it, cutting the other home's FUSE connection."""
    from weenv.node.data.fuse import holder

    a, b = tmp_path / "a" / "run", tmp_path / "b" / "run"
    a.mkdir(parents=True)
    b.mkdir(parents=True)
    r, w = os.pipe()  # the "connection" b's holder keeps: gone when w closes
    try:
        other = holder.spawn(b, r, {"home": "b"})
        try:
            (a / holder.PIDFILE_NAME).write_text(f"{other.pid}\n")
            assert holder.pid_of(a) is None
            assert holder.release(a) is False
            assert other.poll() is None, "another home's holder was killed"
            assert holder.pid_of(b) == other.pid
        finally:
            assert holder.release(b)
            other.wait(10)
    finally:
        os.close(r)
        os.close(w)
