"""E2B build steps as pure logic: validation, the context they carry, cache keys,
image references, COPY sources, accounts in a tree (a plain directory here)."""

from __future__ import annotations

import io
import os
import tarfile

import pytest

from weenv.build.stepbuild import docker_reference, step_key
from weenv.errors import InvalidInputError
from weenv.host.rootfs import RootFS
from weenv.packaging.steps import (
    MAX_ENV_BYTES,
    MAX_ENV_VALUE_BYTES,
    Account,
    Context,
    Step,
    advance,
    check_steps,
    copy_archive,
    copy_source,
    create_account,
    find_account,
    unpack_upload,
)


def test_steps_are_checked():
    assert Step.model_validate({"type": "run", "args": ["make"]}).check().type == "RUN"
    for bad in (
        {"type": "RUN", "args": []},
        {"type": "ENV", "args": ["A"]},
        {"type": "WORKDIR", "args": []},
        {"type": "COPY", "args": ["a", "/b"]},
        {"type": "COPY", "args": ["a", "/b", "", "9z"], "filesHash": "0" * 64},
    ):
        with pytest.raises(InvalidInputError):
            Step.model_validate(bad).check()
    with pytest.raises(ValueError):
        Step.model_validate({"type": "EXPOSE", "args": ["80"]})
    with pytest.raises(ValueError):
        Step.model_validate({"type": "COPY", "args": ["a", "/b"], "filesHash": "not-hex"})


def test_context_follows_the_steps():
    ctx = Context()
    for s in (
        Step(type="USER", args=["user"]),
        Step(type="WORKDIR", args=["/srv"]),
        Step(type="WORKDIR", args=["app"]),
        Step(type="ENV", args=["A", "1", "B", "${A}-$A-$UNSET."]),
        Step(type="RUN", args=["true"]),
    ):
        ctx = advance(ctx, s)
    assert ctx == Context(user="user", workdir="/srv/app", env={"A": "1", "B": "1-1-."})


def test_variables_are_bounded_as_they_expand():
    """``ENV A=$A$A`` doubled A per step (40 steps: a terabyte), and one step of
    250,000 ``$A`` over a 500 KB A asked 125 GB of the daemon: each value is
    bounded as it is expanded, all of them together too, before any is built."""
    doubling = [Step(type="ENV", args=["A", "x" * 1000])] + [Step(type="ENV", args=["A", "$A$A"])] * 40
    with pytest.raises(InvalidInputError, match=rf"step 9: .*{MAX_ENV_VALUE_BYTES} bytes"):
        check_steps(doubling)
    one_step = [Step(type="ENV", args=["A", "x" * 100_000]), Step(type="ENV", args=["B", "${A}" * 250_000])]
    with pytest.raises(InvalidInputError, match="step 2: .*once expanded"):
        check_steps(one_step)
    many = [
        Step(type="ENV", args=[f"V{i}", "y" * MAX_ENV_VALUE_BYTES])
        for i in range(MAX_ENV_BYTES // MAX_ENV_VALUE_BYTES + 1)
    ]
    with pytest.raises(InvalidInputError, match=rf"more than {MAX_ENV_BYTES} bytes"):
        check_steps(many)
    fits = check_steps([Step(type="ENV", args=["A", "é" * 1000]), Step(type="ENV", args=["B", "$A" * 60])])
    assert fits.env["B"] == "é" * 60_000  # 120,000 bytes: under the bound
    with pytest.raises(InvalidInputError, match="once expanded"):  # 131,072+ bytes counted as UTF-8
        check_steps([Step(type="ENV", args=["A", "é" * 1000]), Step(type="ENV", args=["B", "$A" * 66])])
    for name in ("", "A=B"):
        with pytest.raises(InvalidInputError, match="ENV variable name"):
            check_steps([Step(type="ENV", args=[name, "1"])])


def test_cache_keys_chain():
    a, b = Step(type="RUN", args=["a"]), Step(type="RUN", args=["b"])
    k1 = step_key("base", a)
    assert step_key(k1, b) != step_key(step_key("base", b), b)  # a key depends on every step before it
    assert step_key("base", a) == k1 and len(k1) == 64
    copy = Step(type="COPY", args=["x", "/x"], filesHash="1" * 64)
    assert step_key(k1, copy) != step_key(k1, copy.model_copy(update={"files_hash": "2" * 64}))


def test_image_references(monkeypatch):
    monkeypatch.delenv("WEENV_E2B_REGISTRY", raising=False)
    assert docker_reference("127.0.0.1:5000/repo/x:1") == "127.0.0.1:5000/repo/x:1"
    assert docker_reference("localhost/x") == "localhost/x:latest"
    assert docker_reference("ubuntu:22.04") == "docker.io/library/ubuntu:22.04"
    assert docker_reference("org/img") == "docker.io/org/img:latest"
    monkeypatch.setenv("WEENV_E2B_REGISTRY", "127.0.0.1:5000")
    assert docker_reference("python:3") == "127.0.0.1:5000/python:3"
    for bad in ("", "a b", "../x"):
        with pytest.raises(InvalidInputError):
            docker_reference(bad)


def test_copy_sources():
    assert copy_source("app.py") == "app.py"
    assert copy_source("src/*.py") == "src"
    assert copy_source("./dir/sub/") == "dir/sub"
    assert copy_source("**/*.txt") == "."
    with pytest.raises(InvalidInputError):
        copy_source("../secret")


def test_accounts(tmp_path):
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\nfirst:x:1000:1000::/home/first:/bin/sh\n")
    (tmp_path / "etc" / "group").write_text("root:x:0:\nfirst:x:1000:\nstaff:x:50:\n")
    fs = RootFS(tmp_path)
    assert find_account(fs, "first").ids == "1000:1000"
    assert find_account(fs, "first:staff").ids == "1000:50"
    assert find_account(fs, "4242").ids == "4242:4242"
    assert find_account(fs, "nobody") is None
    if os.geteuid() != 0:
        return  # the rest chowns: root only
    made = create_account(fs, "user")
    assert (made.uid, made.gid, made.home) == (1001, 1001, "/home/user")
    assert find_account(fs, "user") == made
    assert (tmp_path / "home" / "user").stat().st_uid == 1001
    with pytest.raises(InvalidInputError):
        create_account(fs, "Bad Name")


def _tar(entries) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for info, data in entries:
            tar.addfile(info, io.BytesIO(data) if data else None)
    return buf.getvalue()


def test_uploads_stay_inside(tmp_path):
    good = tarfile.TarInfo("app/a.txt")
    good.size = 2
    (tmp_path / "ok.tar").write_bytes(_tar([(good, b"hi")]))
    (tmp_path / "out").mkdir()
    unpack_upload(tmp_path / "ok.tar", tmp_path / "out")
    assert (tmp_path / "out" / "app" / "a.txt").read_text() == "hi"
    evil = tarfile.TarInfo("../escape")
    evil.size = 1
    (tmp_path / "evil.tar").write_bytes(_tar([(evil, b"x")]))
    (tmp_path / "out2").mkdir()
    with pytest.raises(InvalidInputError):
        unpack_upload(tmp_path / "evil.tar", tmp_path / "out2")
    assert not (tmp_path / "escape").exists()
    (tmp_path / "junk.tar").write_bytes(b"not a tar")
    with pytest.raises(InvalidInputError):
        unpack_upload(tmp_path / "junk.tar", tmp_path / "out2")


def test_an_upload_cannot_link_to_a_host_file_and_write_through_it(tmp_path):
    """A hard link to a host file, then a regular file of the same name: with
    the ``tar`` filter the daemon (root) linked the host file into the stage and
    wrote the upload's bytes into it.  Refused; the host file is untouched."""
    victim = tmp_path / "host-secret"
    victim.write_text("secret\n")
    victim.chmod(0o600)
    link = tarfile.TarInfo("h")
    link.type, link.linkname, link.mode = tarfile.LNKTYPE, str(victim), 0o755
    body = tarfile.TarInfo("h")
    body.size = 6
    (tmp_path / "evil.tar").write_bytes(_tar([(link, None), (body, b"PWNED\n")]))
    (tmp_path / "stage").mkdir()
    with pytest.raises(InvalidInputError, match="leaves its directory"):
        unpack_upload(tmp_path / "evil.tar", tmp_path / "stage")
    assert victim.read_text() == "secret\n" and victim.stat().st_mode & 0o777 == 0o600


def test_a_copy_through_a_link_out_of_the_upload_is_refused(tmp_path):
    """An upload holding ``l -> /`` (a symlink is allowed, it resolves inside
    the environment) and ``COPY l/etc/hostname``: the daemon read the host's
    file through the link.  Refused; links themselves are still copied."""
    sym = tarfile.TarInfo("l")
    sym.type, sym.linkname = tarfile.SYMTYPE, "/"
    mine = tarfile.TarInfo("d/a.txt")
    mine.size = 2
    (tmp_path / "up.tar").write_bytes(_tar([(sym, None), (mine, b"hi")]))
    stage = tmp_path / "stage"
    stage.mkdir()
    unpack_upload(tmp_path / "up.tar", stage)
    owner = Account(name="user", uid=1000, gid=1000, home="/home/user")
    with pytest.raises(InvalidInputError, match="symbolic link out of the upload"):
        copy_archive(
            stage,
            Step(type="COPY", args=["l/etc/hostname", "/x"], filesHash="1" * 64),
            Context(),
            owner,
            "/home/user",
            tmp_path / "out.tar",
        )
    copy_archive(
        stage,
        Step(type="COPY", args=["l", "/x"], filesHash="1" * 64),
        Context(),
        owner,
        "/home/user",
        tmp_path / "link.tar",
    )
    with tarfile.open(tmp_path / "link.tar") as t:
        assert [(m.name, m.issym(), m.linkname) for m in t.getmembers()] == [("x", True, "/")]
    copy_archive(
        stage,
        Step(type="COPY", args=["d/a.txt", "/srv/"], filesHash="1" * 64),
        Context(),
        owner,
        "/home/user",
        tmp_path / "file.tar",
    )
    with tarfile.open(tmp_path / "file.tar") as t:
        assert [(m.name, m.uid, t.extractfile(m).read()) for m in t.getmembers()] == [("a.txt", 1000, b"hi")]


def test_an_upload_cannot_write_through_its_own_link_out(tmp_path):
    """``l -> /`` then a member ``l/etc/x``: refused (the name resolves out of the stage)."""
    sym = tarfile.TarInfo("l")
    sym.type, sym.linkname = tarfile.SYMTYPE, str(tmp_path)
    through = tarfile.TarInfo("l/written-through")
    through.size = 1
    (tmp_path / "evil.tar").write_bytes(_tar([(sym, None), (through, b"x")]))
    (tmp_path / "stage").mkdir()
    with pytest.raises(InvalidInputError, match="leaves its directory"):
        unpack_upload(tmp_path / "evil.tar", tmp_path / "stage")
    assert not (tmp_path / "written-through").exists()
