"""What an environment makes cannot act on the host (issue 13, findings 1 and 2).

- A setuid file or a device node made inside is neither on the host: the
  environment's mounts are ``nosuid,nodev`` on the host side, and the home's
  ``node/`` and ``run/`` are closed to other users (0700).
- An environment with ``network: true`` has its own network namespace, linked
  to the host by a veth pair and NATed out; it cannot reach the host (its
  loopback, its veth address, its abstract Unix sockets) nor bind a host port.
"""

from __future__ import annotations

import contextlib
import os
import stat
import subprocess
from pathlib import Path

import pytest

from weenv.node.bundle import DOCKER_DEFAULT_CAPS

AS_NOBODY = ["runuser", "-u", "nobody", "--"]
"""An unprivileged host user (setpriv --reuid keeps its capabilities until the execve, which then finds
the program with CAP_DAC_OVERRIDE)."""


@contextlib.contextmanager
def traversable_ancestors(path: Path):
    """Let other users traverse every directory above ``path`` (pytest's own
    temporary directories are 0700), as they can above ``/var/lib/weenv``;
    restores the modes after."""
    saved = []
    for d in reversed(path.parents):
        mode = stat.S_IMODE(d.stat().st_mode)
        if mode & 0o001 == 0:
            saved.append((d, mode))
            os.chmod(d, mode | 0o011)
    try:
        yield
    finally:
        for d, mode in reversed(saved):
            os.chmod(d, mode)


def run_as_nobody(program: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*AS_NOBODY, str(program), "-c", "import os; print(os.geteuid())"],
                          capture_output=True, text=True, timeout=30)  # fmt: skip


# --- finding 1: setuid files and device nodes ---------------------------------------------------


def test_setuid_file_made_inside_is_not_root_on_the_host(node, paths):
    """The issue's reproduction: a setuid copy of python3 made inside printed
    euid 0 when `nobody` on the host ran it through rootfs/ or upper/."""
    env = node.create("task")
    r = node.exec(env.id, "cp /usr/bin/python3 /tmp/p && chmod 4755 /tmp/p && stat -c %a:%u /tmp/p")
    assert r.exit_code == 0 and r.stdout == b"4755:0\n", r
    env_dir = paths.environments / env.id
    with traversable_ancestors(paths.home):
        for program in (env_dir / "rootfs/tmp/p", env_dir / "upper/tmp/p"):
            r = run_as_nobody(program)
            assert r.returncode != 0 and "Permission denied" in r.stderr, (program, r)
        for d in (paths.node, paths.run):
            assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
        # A home opened by hand (or a path reached another way) still gives no setuid root:
        # the overlay is mounted nosuid on the host.
        opened = [paths.node, paths.environments, env_dir]
        modes = [stat.S_IMODE(d.stat().st_mode) for d in opened]
        try:
            for d in opened:
                os.chmod(d, 0o755)
            r = run_as_nobody(env_dir / "rootfs/tmp/p")
            assert r.returncode == 0 and r.stdout == "65534\n", r
        finally:
            for d, mode in zip(opened, modes):
                os.chmod(d, mode)


def test_group_and_overlay_mounts_are_nosuid_nodev(node, paths):
    env = node.create("task")
    options = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if fields[4].startswith(str(paths.node)):
                options[fields[4]] = set(fields[5].split(","))
    rootfs = str(paths.environments / env.id / "rootfs")
    assert rootfs in options and any("/groups/" in p for p in options), options
    for point, opts in options.items():
        if point == rootfs or "/groups/" in point:
            assert {"nosuid", "nodev"} <= opts, (point, opts)


def test_device_node_made_inside_cannot_be_opened_from_the_host(node, paths):
    """With Docker's capabilities (CAP_MKNOD) an environment makes a device node
    the device cgroup allows (/dev/zero's 1:5); root on the host opened it
    through rootfs/ before the overlay was nodev."""
    env = node.create("task", capabilities=DOCKER_DEFAULT_CAPS)
    r = node.exec(env.id, "mknod /tmp/z c 1 5 && stat -c %t:%T /tmp/z")
    assert r.exit_code == 0 and r.stdout == b"1:5\n", r
    with pytest.raises(PermissionError):
        open(paths.environments / env.id / "rootfs/tmp/z", "rb").close()
