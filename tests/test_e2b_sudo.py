"""``sudo`` as ``user`` through the official ``e2b`` SDK against a real ``weenv serve`` (issue 17 item 5).

Template ``sudo`` (``runtime.sudo``) is the Debian base plus a layer holding
Debian's ``sudo`` package and a ``user`` account with ``NOPASSWD: ALL``
(:func:`test_userns.sudo_layer`, skipped when the package cannot be
downloaded); template ``plain`` is the same without ``runtime.sudo``.  Each
environment of ``sudo`` runs in a user namespace over a host id range of its
own (:mod:`weenv.node.runtime.idmap`); nothing of it may outlive it.  No mocks.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

e2b = pytest.importorskip("e2b")

from e2b import AsyncSandbox, CommandExitException, Sandbox  # noqa: E402

from daemon_fixture import environ, start_daemon  # noqa: E402
from e2b_fixture import e2b_daemon  # noqa: E402
from test_userns import range_processes as userns_processes  # noqa: E402
from test_userns import sudo_layer
from weenv.formats.manifest import RuntimeConfig  # noqa: E402
from weenv.node.runtime import idmap  # noqa: E402
from weenv.packaging.group import build_group  # noqa: E402
from weenv.packaging.template import create_template  # noqa: E402
from weenv.store.file import FileStore  # noqa: E402

USER_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/home/user",
    "USER": "user",
    "LANG": "C.UTF-8",
}


@pytest.fixture(scope="module")
def served(shared_store, debian_root):
    """A daemon over a hard-linked copy of the shared store with templates
    ``sudo`` and ``plain``, its home below a directory others may search
    (0711, as every parent of a sudo environment's rootfs must be)."""
    root = Path(tempfile.mkdtemp(prefix="weenv-sudo-"))
    os.chmod(root, 0o711)
    try:
        subprocess.run(["cp", "-al", str(shared_store.root), str(root / "store")], check=True)
        store = FileStore(root / "store")
        build_group(sudo_layer(debian_root), store, name="sudo-layer")
        for name, sudo in (("sudo", True), ("plain", False)):
            create_template(
                store,
                name,
                ["base", "sudo-layer"],
                runtime=RuntimeConfig(user="1000:1000", working_dir="/home/user", env=USER_ENV, sudo=sudo),
            )
        with e2b_daemon(root, None, store.url) as d:
            d.store_url = store.url
            yield d
        assert not [p for p in idmap.in_use().values() if str(p).startswith(str(root))], "ranges left held"
        deadline = time.monotonic() + 5  # SIGKILLed processes are reaped a moment after the daemon's stop returns
        while range_processes() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not range_processes(), "processes of a range outlived the daemon"
    finally:
        shutil.rmtree(root, ignore_errors=True)


def range_processes() -> list[int]:
    """Host pids whose real uid lies in any environment's range."""
    return userns_processes(idmap.RANGE_BASE, idmap.RANGE_SLOTS * idmap.ID_RANGE)


def test_sudo_as_user(served):
    sbx = Sandbox.create("sudo", timeout=120)
    try:
        r = sbx.commands.run("id -u; sudo id -u; sudo -n true && echo ok", user="user")
        assert r.stdout.split() == ["1000", "0", "ok"], (r.stdout, r.stderr)
        # root made by sudo writes root's files, and the files API shows them root's
        sbx.commands.run("sudo sh -c 'echo from-root > /etc/made-by-sudo'", user="user")
        info = sbx.files.get_info("/etc/made-by-sudo")
        assert (info.owner, info.group) == ("root", "root")
        # a file the files API writes as user is user's inside
        sbx.files.write("/home/user/note.txt", "hi", user="user")
        assert sbx.commands.run("stat -c %U:%G /home/user/note.txt", user="user").stdout.strip() == "user:user"
        assert sbx.files.get_info("/home/user/note.txt").owner == "user"
        # without sudo, user cannot write root's files
        with pytest.raises(CommandExitException):
            sbx.commands.run("echo x > /etc/passwd", user="user")
        # on the host, root inside is the range's first id, never host root
        host_id = next(h for h, p in idmap.in_use().items() if p.name == sbx.sandbox_id)
        sbx.commands.run("sudo sleep 31 >/dev/null 2>&1 &", user="user")
        sleeps = [p for p in range_processes() if Path(f"/proc/{p}/cmdline").read_bytes() == b"sleep\x0031\x00"]
        assert sleeps, range_processes()
        assert [int(Path(f"/proc/{p}/status").read_text().split("Uid:")[1].split()[1]) for p in sleeps] == [host_id]
    finally:
        sbx.kill()


def test_two_sudo_sandboxes_get_disjoint_ranges(served):
    a, b = Sandbox.create("sudo", timeout=120), Sandbox.create("sudo", timeout=120)
    try:
        mine = [h for h, p in idmap.in_use().items() if p.name in (a.sandbox_id, b.sandbox_id)]
        assert len(mine) == 2 and abs(mine[0] - mine[1]) >= idmap.ID_RANGE, idmap.in_use()
        for s in (a, b):
            assert s.commands.run("sudo id -u", user="user").stdout.strip() == "0"
    finally:
        a.kill()
        b.kill()
    assert not [h for h, p in idmap.in_use().items() if p.name in (a.sandbox_id, b.sandbox_id)]


def test_sudo_async(served):
    async def main():
        sbx = await AsyncSandbox.create("sudo", timeout=120)
        try:
            r = await sbx.commands.run("sudo id -u", user="user")
            return r.stdout.strip()
        finally:
            await sbx.kill()

    assert asyncio.run(main()) == "0"


def test_a_template_without_sudo_runs_sudo_as_under_docker(served):
    """Every sandbox has a user namespace of its own by default: a template without
    ``runtime.sudo`` runs setuid ``sudo`` too (root inside, the range's id outside)."""
    sbx = Sandbox.create("plain", timeout=120)
    try:
        assert sbx.commands.run("id -u; sudo id -u", user="user").stdout.split() == ["1000", "0"]
        assert sbx.sandbox_id in {p.name for p in idmap.in_use().values()}
    finally:
        sbx.kill()


def test_snapshot_of_a_sudo_sandbox_starts_with_its_owners_and_sudo(served):
    """A snapshot of a sudo sandbox (its files owned by its host id range) starts
    in another range with the same owners and modes inside, and sudo works there."""
    script = (
        "sudo sh -c 'mkdir -m 750 /srv/mine && chown user:user /srv/mine && touch /etc/by-root' && echo x > /srv/mine/f"
    )
    listing = "stat -c '%n %U %G %a' /srv/mine /srv/mine/f /etc/by-root /home/user"
    sbx = Sandbox.create("sudo", timeout=120)
    try:
        sbx.commands.run(script, user="user")
        want = sbx.commands.run(listing, user="user").stdout
        snap = sbx.create_snapshot()
        again = Sandbox.create(snap.snapshot_id, timeout=120)
        try:
            assert again.commands.run(listing, user="user").stdout == want
            assert again.commands.run("sudo id -u", user="user").stdout.strip() == "0"
        finally:
            again.kill()
        assert sbx.commands.run("sudo id -u", user="user").stdout.strip() == "0"  # it runs on
    finally:
        sbx.kill()


def test_resets_of_a_sudo_sandbox_start_the_container_made_ahead(served):
    """A sudo environment's reset (to its template) twice: the second starts the
    container made ahead over the same idmapped lowers (its id moves on); sudo
    works after each, what the episode wrote is gone, and its kill leaves no
    container or cgroup of it."""
    sbx = Sandbox.create("sudo", timeout=120)
    try:
        for n in range(3):
            sbx.commands.run("sudo sh -c 'echo episode > /etc/episode'", user="user")
            with served.daemon.http() as c:
                r = c.post(f"/environments/{sbx.sandbox_id}/reset", json={})
                assert r.status_code == 200, r.text
            r = sbx.commands.run("sudo id -u; test -e /etc/episode && echo yes || echo no", user="user")
            assert r.stdout.split() == ["0", "no"], r
            deadline = time.monotonic() + 10  # the next one made ahead, in the background
            while time.monotonic() < deadline and not _cgroup_names(sbx.sandbox_id) >= {
                f"weenv-{sbx.sandbox_id}.{n + 1}"
            }:
                time.sleep(0.05)
        # the first reset ran its container again (no spare yet), the next two started the one made ahead
        assert _cgroup_names(sbx.sandbox_id) == {f"weenv-{sbx.sandbox_id}.2", f"weenv-{sbx.sandbox_id}.3"}
    finally:
        sbx.kill()
    assert _cgroup_names(sbx.sandbox_id) == set()


def _cgroup_names(env_id: str) -> set[str]:
    return {p.name for p in Path("/sys/fs/cgroup").glob(f"*/weenv-{env_id}*") if p.is_dir()}


def test_without_the_setting_only_sudo_templates_get_a_user_namespace(served, tmp_path):
    """``WEENV_USERNS=off``: a template without sudo keeps ``noNewPrivileges`` (sudo is
    refused clearly); a sudo template below pytest's 0700 tmp dirs is refused naming
    the directory (runc's init, as the range's root, could not reach the rootfs:
    no /run alias without the setting), and leaves nothing."""
    with e2b_daemon(tmp_path, None, served.store_url, WEENV_USERNS="off") as d:
        with pytest.raises(Exception, match=r"o\+x.* is mode 700"):
            Sandbox.create("sudo", timeout=60)
        assert d.environment_ids() == []
        sbx = Sandbox.create("plain", timeout=60)  # a template without sudo starts there
        try:
            with pytest.raises(CommandExitException) as exc:
                sbx.commands.run("sudo id -u", user="user")
            assert "no new privileges" in exc.value.stderr, exc.value.stderr
            assert sbx.commands.run("id -u", user="user").stdout.strip() == "1000"
        finally:
            sbx.kill()


def test_sudo_sandbox_survives_a_killed_daemon(served):
    """SIGKILL of ``weenv serve``: the next daemon on the home adopts the sandbox
    with its range and idmapped lowers (found through ``idmapped/lowers.json``);
    sudo works on, and its kill gives the range back."""
    sbx = Sandbox.create("sudo", timeout=120)
    held = {p.name: h for h, p in idmap.in_use().items()}[sbx.sandbox_id]
    old = served.daemon
    old.proc.send_signal(signal.SIGKILL)
    old.proc.wait()
    served.daemon = new = start_daemon(old.home, served.store_url)
    with environ(E2B_API_URL=new.url + "/e2b", E2B_SANDBOX_URL=new.url + "/e2b/envd", E2B_API_KEY="e2b_" + new.key):
        again = Sandbox.connect(sbx.sandbox_id)
        assert again.commands.run("sudo id -u", user="user").stdout.strip() == "0"
        assert {p.name: h for h, p in idmap.in_use().items()}[sbx.sandbox_id] == held
        again.kill()
    assert sbx.sandbox_id not in {p.name for p in idmap.in_use().values()}
