"""Commands and files as the user a caller names (weenv.node.runtime.users, the exec
agent's identities, envd's ``user``), through the node, weenv's own API and the
real ``e2b`` SDK against ``weenv serve``.

The templates here are the shared Debian base plus a group ``accounts`` whose
``/etc/passwd`` and ``/etc/group`` add ``user`` (1000, home ``/home/user``,
also in ``tools``) and ``worker``: ``accounts`` runs as ``user`` by default,
``accounts-root`` as root.
"""

from __future__ import annotations

import os
import shutil

import pytest

from conftest import system_snapshot
from daemon_fixture import environ, start_daemon
from weenv.errors import UnknownUserError
from weenv.formats.manifest import RuntimeConfig
from weenv.node.node import Node
from weenv.node.runtime.bundle import cap_mask
from weenv.packaging.group import build_group
from weenv.packaging.template import create_template
from weenv.store.file import FileStore

ENV_CAPS = 0x20000420  # runc's default set: AUDIT_WRITE, KILL, NET_BIND_SERVICE (no SETUID/SETGID/SETPCAP)


@pytest.fixture(scope="module")
def accounts_store(tmp_path_factory, shared_store, debian_root):
    """The shared store's groups (hard links) plus group ``accounts`` and its two templates."""
    root = tmp_path_factory.mktemp("accounts")
    shutil.copytree(shared_store.root, root / "store", copy_function=os.link)
    store = FileStore(root / "store")
    src = root / "accounts"
    (src / "etc").mkdir(parents=True)
    passwd = (debian_root / "etc" / "passwd").read_text()
    group = (debian_root / "etc" / "group").read_text()
    (src / "etc" / "passwd").write_text(
        passwd + "user:x:1000:1000::/home/user:/bin/sh\nworker:x:1001:1001::/home/worker:/bin/sh\n"
    )
    (src / "etc" / "group").write_text(group + "user:x:1000:\nworker:x:1001:\ntools:x:2000:worker,user\n")
    for name, uid in (("user", 1000), ("worker", 1001)):
        (src / "home" / name).mkdir(parents=True)
        os.chown(src / "home" / name, uid, uid)
        os.chmod(src / "home" / name, 0o750)
    (src / "srv").mkdir()
    (src / "srv" / "secret").write_text("root only\n")
    os.chmod(src / "srv" / "secret", 0o600)
    build_group(src, store, name="accounts")
    create_template(store, "accounts", ["base", "accounts"], runtime=RuntimeConfig(user="1000:1000"))
    create_template(store, "accounts-root", ["base", "accounts"], runtime=RuntimeConfig(working_dir="/srv"))
    return store


ID = "echo $(id -u) $(id -g) $(id -G) $HOME $USER; grep -E '^Cap(Eff|Prm|Bnd)' /proc/self/status"


def _who(out: bytes) -> tuple[str, dict[str, int]]:
    lines = out.decode().splitlines()
    caps = {line.split(":")[0]: int(line.split()[1], 16) for line in lines[1:]}
    return lines[0], caps


@pytest.mark.parametrize("exec_agent", [True, False], ids=["agent", "runc"])
def test_commands_run_as_the_named_user(paths, accounts_store, leak_check, exec_agent):
    with Node(paths, store=accounts_store, exec_agent=exec_agent, pool_size=0) as node:
        env = node.create("accounts").id
        env_caps = cap_mask(node.containers.default_capabilities())  # runc's three, Docker's with WEENV_USERNS
        if not node.containers.userns_all:
            assert env_caps == ENV_CAPS
        who, caps = _who(node.exec(env, ID).stdout)  # the template's user: 1000, its groups from /etc/group
        assert who == "1000 1000 1000 2000 /home/user user"
        assert caps["CapEff"] == caps["CapPrm"] == 0 and caps["CapBnd"] == env_caps
        who, caps = _who(node.exec(env, ID, user="root").stdout)
        assert who == "0 0 0 /root root"
        # root holds the environment's set, never the three the agent keeps to switch users
        assert caps["CapEff"] == caps["CapPrm"] == caps["CapBnd"] == env_caps
        assert (
            node.exec(env, ID, user="worker").stdout.decode().splitlines()[0]
            == "1001 1001 1001 2000 /home/worker worker"
        )
        assert node.exec(env, "id -u; id -g; echo $HOME", user="4242:7").stdout == b"4242\n7\n/\n"
        assert node.exec(env, "cat /srv/secret", user="root").stdout == b"root only\n"
        denied = node.exec(env, "cat /srv/secret")  # mode bits hold for the user
        assert denied.exit_code == 1 and b"Permission denied" in denied.stderr
        assert node.exec(env, "touch /home/user/mine && stat -c %u:%g /home/user/mine").stdout == b"1000:1000\n"
        assert node.exec(env, "touch /home/worker/x", user="user").exit_code == 1  # 0750 worker's
        assert node.exec(env, "echo $HOME", user="root", env={"HOME": "/tmp"}).stdout == b"/tmp\n"  # the call's win
        with pytest.raises(UnknownUserError, match="nobody-here"):
            node.exec(env, "true", user="nobody-here")
        # the template's own command runs as its user (pid 1 is its init, the agent became 1000 first)
        assert node.exec(env, "stat -c %u /proc/1", user="root").stdout == b"1000\n"
        stats = node.stats()
        assert (stats.exec_runc if exec_agent else stats.exec_agent) == 0  # each launcher alone did it all


def test_e2b_sdk_user_on_commands_and_files(tmp_path_factory, accounts_store):
    pytest.importorskip("e2b")
    from e2b import CommandExitException, Sandbox
    from e2b.exceptions import AuthenticationException

    home = tmp_path_factory.mktemp("users-e2b-home")
    before = system_snapshot(home)
    daemon = start_daemon(home, accounts_store.url)
    try:
        with pytest.MonkeyPatch.context() as mp:
            for key, value in (
                ("E2B_API_URL", daemon.url + "/e2b"),
                ("E2B_SANDBOX_URL", daemon.url + "/e2b/envd"),
                ("E2B_API_KEY", "e2b_" + daemon.key),
            ):
                mp.setenv(key, value)
            _e2b_user_calls(Sandbox, CommandExitException, AuthenticationException)
    finally:
        daemon.stop()
    after = system_snapshot(home)
    for kind in after:
        assert not set(after[kind]) - set(before[kind]), f"leaked {kind}"


def _e2b_user_calls(Sandbox, CommandExitException, AuthenticationException) -> None:
    """``user=`` on the SDK's commands and files; an unknown user as envd answers it."""
    sbx = Sandbox.create("accounts", timeout=120)
    try:
        assert sbx.commands.run("id -u", user="root").stdout == "0\n"
        assert (
            sbx.commands.run("id -un; pwd; echo $HOME $USER $LOGNAME", user="user").stdout
            == "user\n/home/user\n/home/user user user\n"
        )  # working dir /: the user's home, as envd
        assert sbx.commands.run("id -u").stdout == "1000\n"  # no user: the template's
        assert sbx.commands.run("pwd", user="root").stdout == "/root\n"
        with pytest.raises(AuthenticationException, match="invalid username: 'ghost'"):
            sbx.commands.run("true", user="ghost")
        with pytest.raises(CommandExitException):
            sbx.commands.run("cat /srv/secret", user="user")

        sbx.files.write("notes/a.txt", "mine", user="user")  # relative: the user's home
        assert (
            sbx.commands.run("stat -c '%U:%G %n' /home/user/notes /home/user/notes/a.txt", user="user").stdout
            == "user:user /home/user/notes\nuser:user /home/user/notes/a.txt\n"
        )
        sbx.files.write("/opt/tool/conf", "root's", user="root")
        assert sbx.commands.run("stat -c %u /opt/tool/conf").stdout == "0\n"
        assert sbx.files.read("~/notes/a.txt", user="user") == "mine"
        assert sbx.files.read("/srv/secret", user="root") == "root only\n"
        # as envd (which writes as root and chowns): mode bits do not limit file calls, whoever is named
        assert sbx.files.read("/srv/secret", user="user") == "root only\n"
        sbx.files.make_dir("/srv/made", user="worker")
        entry = [e for e in sbx.files.list("/srv", user="root") if e.name == "made"][0]
        assert entry.owner == "worker" and entry.group == "worker"
        with pytest.raises(AuthenticationException, match="unknown user ghost"):
            sbx.files.read("/srv/secret", user="ghost")
        with pytest.raises(AuthenticationException, match="unknown user ghost"):
            sbx.files.write("/tmp/x", "x", user="ghost")
        with pytest.raises(AuthenticationException, match="invalid username: 'ghost'"):
            sbx.files.list("/", user="ghost")
    finally:
        sbx.kill()


def test_weenv_api_user_fields(tmp_path_factory, accounts_store):
    from weenv.sdk import Sandbox

    home = tmp_path_factory.mktemp("users-weenv-home")
    daemon = start_daemon(home, accounts_store.url)
    try:
        with Sandbox.create("accounts-root", api_url=daemon.url, api_key=daemon.key) as sbx:
            assert sbx.commands.run("id -un; pwd").stdout == "root\n/srv\n"
            assert sbx.commands.run("id -un; echo $HOME", user="user").stdout == "user\n/home/user\n"
            sbx.files.write("/srv/deep/file", "x", user="worker")
            sbx.files.make_dir("/srv/dir", user="1000")
            out = sbx.commands.run("stat -c '%u:%g' /srv/deep /srv/deep/file /srv/dir").stdout
            assert out == "1001:1001\n1001:1001\n1000:1000\n"
            with pytest.raises(UnknownUserError, match="ghost"):
                sbx.commands.run("true", user="ghost")
            with pytest.raises(UnknownUserError):
                sbx.files.write("/srv/y", "y", user="ghost")
    finally:
        daemon.stop()


STAT = "stat -c '%U:%G %a %n'"


def test_files_owners_in_a_user_namespace(tmp_path_factory, accounts_store):
    """With ``WEENV_USERNS=on``, files written through the files APIs belong,
    as ``stat`` shows them inside, to the user the call names, and so do the
    directories made on the way: through the ``e2b`` SDK (no user: the
    template's, E2B's ``user``; a file it replaces becomes theirs, as envd
    chowns it) and weenv's SDK (no user: root's)."""
    pytest.importorskip("e2b")
    from e2b import Sandbox as E2BSandbox
    from e2b.exceptions import AuthenticationException

    from weenv.sdk import Sandbox

    home = tmp_path_factory.mktemp("users-userns-home")
    before = system_snapshot(home)
    with environ(WEENV_USERNS="on"):
        daemon = start_daemon(home, accounts_store.url)
    try:
        e2b_env = {
            "E2B_API_URL": daemon.url + "/e2b",
            "E2B_SANDBOX_URL": daemon.url + "/e2b/envd",
            "E2B_API_KEY": "e2b_" + daemon.key,
        }
        with environ(**e2b_env):
            sbx = E2BSandbox.create("accounts", timeout=120)
            try:
                assert sbx.commands.run("cat /proc/self/uid_map").stdout.split()[:2] != ["0", "0"]  # its own range
                sbx.commands.run(
                    "mkdir /srv/up && echo old > /srv/up/replaced && chmod 600 /srv/up/replaced", user="root"
                )
                sbx.files.write("/srv/up/new/deep/f", "x")
                sbx.files.write("/srv/up/replaced", "new")
                sbx.files.write("/srv/up/new/root", "r", user="root")
                sbx.files.write("/srv/up/new/worker", "w", user="worker")
                sbx.files.write_files([{"path": "/srv/up/multi/a", "data": "a"}])
                sbx.files.make_dir("/srv/up/made")
                paths = "/srv/up /srv/up/new /srv/up/new/deep /srv/up/new/deep/f /srv/up/replaced /srv/up/new/root"
                out = sbx.commands.run(f"{STAT} {paths} /srv/up/new/worker /srv/up/multi /srv/up/multi/a /srv/up/made")
                assert out.stdout.splitlines() == [
                    "root:root 755 /srv/up",
                    "user:user 755 /srv/up/new",
                    "user:user 755 /srv/up/new/deep",
                    "user:user 644 /srv/up/new/deep/f",
                    "user:user 600 /srv/up/replaced",
                    "root:root 644 /srv/up/new/root",
                    "worker:worker 644 /srv/up/new/worker",
                    "user:user 755 /srv/up/multi",
                    "user:user 644 /srv/up/multi/a",
                    "user:user 755 /srv/up/made",
                ]
                assert sbx.files.read("/srv/up/replaced") == "new"
                with pytest.raises(AuthenticationException, match="unknown user ghost"):
                    sbx.files.write("/srv/up/ghost", "g", user="ghost")
            finally:
                sbx.kill()
        with Sandbox.create("accounts", api_url=daemon.url, api_key=daemon.key) as s:
            s.commands.run("mkdir /srv/w && echo old > /srv/w/replaced && echo old > /srv/w/kept", user="root")
            s.files.write("/srv/w/root/f", "x")
            s.files.write("/srv/w/user/deep/f", "x", user="user")
            s.files.write("/srv/w/replaced", "new", user="user")
            s.files.write("/srv/w/kept", "new")
            s.files.make_dir("/srv/w/made", user="worker")
            out = s.commands.run(
                f"{STAT} /srv/w/root /srv/w/root/f /srv/w/user /srv/w/user/deep/f /srv/w/replaced "
                "/srv/w/kept /srv/w/made"
            ).stdout
            assert out.splitlines() == [
                "root:root 755 /srv/w/root",
                "root:root 644 /srv/w/root/f",
                "user:user 755 /srv/w/user",
                "user:user 644 /srv/w/user/deep/f",
                "user:user 644 /srv/w/replaced",
                "root:root 644 /srv/w/kept",
                "worker:worker 755 /srv/w/made",
            ]
            with pytest.raises(UnknownUserError, match="ghost"):
                s.files.write("/srv/w/ghost", "g", user="ghost")
    finally:
        daemon.stop()
    after = system_snapshot(home)
    for kind in after:
        assert not set(after[kind]) - set(before[kind]), f"leaked {kind}"
