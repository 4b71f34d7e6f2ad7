"""Users of an environment from its own /etc/passwd and /etc/group (weenv.node.runtime.users)."""

from __future__ import annotations

import os

import pytest

from weenv.errors import InvalidInputError, UnknownUserError
from weenv.host.rootfs import RootFS
from weenv.node.runtime import users

PASSWD = """root:x:0:0:root:/root:/bin/bash
# a comment
daemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin
broken line
user:x:1000:1000::/home/user:/bin/bash
user:x:1001:1001::/elsewhere:/bin/sh
big:x:99999999999:1::/:/bin/sh
nohome:x:1002:1002::relative:/bin/sh
"""
GROUP = """root:x:0:
user:x:1000:
tools:x:2000:user,daemon
docker:x:2001:nobody, user
tools-again:x:2000:user
"""


def _root(tmp_path, passwd=PASSWD, group=GROUP):
    (tmp_path / "etc").mkdir(exist_ok=True)
    (tmp_path / "etc" / "passwd").write_text(passwd)
    (tmp_path / "etc" / "group").write_text(group)
    return RootFS(tmp_path)


def test_names_numbers_groups_and_homes(tmp_path):
    fs = _root(tmp_path)
    who = users.lookup(fs, "user")  # the first entry of a name wins, as getpwnam
    assert (who.uid, who.gid, who.home, who.name) == (1000, 1000, "/home/user", "user")
    assert who.groups == (1000, 2000, 2001)  # primary first, then each listing group once, in file order
    assert who.env() == {"HOME": "/home/user", "USER": "user", "LOGNAME": "user"}
    root = users.lookup(fs, "root")
    assert (root.uid, root.gid, root.groups, root.home) == (0, 0, (0,), "/root")
    assert users.lookup(fs, "0").name == "root"
    numeric = users.lookup(fs, "1000:5")  # the gid given wins, name and home from the uid's entry
    assert (numeric.uid, numeric.gid, numeric.home, numeric.groups[0]) == (1000, 5, "/home/user", 5)
    stranger = users.lookup(fs, "4242")  # no entry: gid = uid, home /, no name
    assert (stranger.gid, stranger.home, stranger.name, stranger.env()) == (4242, "/", None, {"HOME": "/"})
    assert users.lookup(fs, "nohome").home == "/"  # a relative home is no home
    assert users.lookup(fs, "daemon").groups == (1, 2000)


@pytest.mark.parametrize("name", ["nobody", "big", "broken line", "Root"])
def test_unknown_users_are_a_clear_error(tmp_path, name):
    with pytest.raises(UnknownUserError, match="unknown user") as caught:
        users.lookup(_root(tmp_path), name)
    assert isinstance(caught.value, InvalidInputError) and caught.value.kind == "unknown_user"


@pytest.mark.parametrize("bad", ["", "a:b", "x" * 300, "a\0b", "../etc", "1:2:3", "99999999999"])
def test_bad_user_names_are_refused(tmp_path, bad):
    with pytest.raises(InvalidInputError):
        users.lookup(_root(tmp_path), bad)


def test_missing_files_are_empty_and_oversized_ones_refused(tmp_path):
    fs = RootFS(tmp_path)  # no /etc at all
    assert users.lookup(fs, "0").home == "/"
    with pytest.raises(UnknownUserError):
        users.lookup(fs, "root")
    (tmp_path / "etc").mkdir()
    with open(tmp_path / "etc" / "passwd", "wb") as f:  # sparse: refused by its size, before it is read
        f.truncate(users.MAX_FILE_BYTES + 1)
    with pytest.raises(InvalidInputError, match="at most"):
        users.lookup(fs, "root")


def test_a_long_line_is_skipped(tmp_path):
    fs = _root(tmp_path, passwd="x" * (users.MAX_LINE + 1) + ":x:5:5::/:/bin/sh\n" + PASSWD)
    assert users.lookup(fs, "user").uid == 1000


def test_a_symlinked_passwd_resolves_inside_the_root(tmp_path):
    host = tmp_path / "host"
    host.mkdir()
    (host / "passwd").write_text("root:x:0:0:root:/host-root:/bin/sh\n")
    root = tmp_path / "env"
    (root / "etc").mkdir(parents=True)
    (root / "data").mkdir()
    (root / "data" / "passwd").write_text("root:x:0:0:root:/env-root:/bin/sh\n")
    os.symlink("../../host/passwd", root / "etc" / "passwd")  # escapes on the host, not inside
    with pytest.raises(UnknownUserError):  # "/../../host/passwd" inside the root is /host/passwd: absent
        users.lookup(RootFS(root), "root")
    os.unlink(root / "etc" / "passwd")
    os.symlink("/data/passwd", root / "etc" / "passwd")  # absolute: the environment's /data, not the host's
    assert users.lookup(RootFS(root), "root").home == "/env-root"


def test_the_cache_follows_changes(tmp_path):
    fs = _root(tmp_path)
    cache = users.Users()
    assert cache.lookup(fs, "user").home == "/home/user"
    (tmp_path / "etc" / "passwd").write_text("user:x:1000:1000::/new/home:/bin/sh\n")
    assert cache.lookup(fs, "user").home == "/new/home"
    cache.forget(fs)
    assert cache.lookup(fs, "user").home == "/new/home"
