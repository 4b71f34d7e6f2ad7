"""E2B's template API driven by the real ``e2b`` SDK (``Template``) against a
real ``weenv serve``: builds from an image in a loopback registry, steps as
cached layer groups, start and ready commands, and bad input.

One daemon per module (its own home and store); the base image (the
session's Debian tree as one layer) is pushed to the session's loopback
registry once and imported by the first build (later builds find it cached).
"""

from __future__ import annotations

import io
import os
import re
import socket
import tarfile
import time
import zlib
from pathlib import Path

import httpx
import pytest

e2b = pytest.importorskip("e2b")

from e2b import AsyncTemplate, Sandbox, Template, wait_for_file
from e2b.exceptions import BuildException

from e2b_fixture import E2B, e2b_daemon
from oci_push import e2b_base_image  # noqa: F401 - a fixture
from registry_fixture import oci_registry  # noqa: F401 - a fixture

READY_TIMEOUT_S = 4


@pytest.fixture(scope="module")
def base_image(e2b_base_image):
    return e2b_base_image


@pytest.fixture(scope="module")
def e2bd(tmp_path_factory, oci_registry):  # noqa: F811
    with e2b_daemon(
        tmp_path_factory.mktemp("e2b-templates"), oci_registry, WEENV_E2B_READY_TIMEOUT_S=str(READY_TIMEOUT_S)
    ) as d:
        yield d


def _quiet_nothing_left(d: E2B) -> None:
    left = d.leftovers()
    assert left == {"mounts": [], "work": [], "environments": [], "cgroups": left["cgroups"]}, left
    assert not [c for c in left["cgroups"] if any(i in c for i in d.environment_ids())]


def _runs(logs: list) -> list[str]:
    """The steps a build ran (not from the cache): their ``[builder N/M] TYPE ...`` lines."""
    return [
        m
        for m in (e.message for e in logs)
        if re.match(r"^\[builder \d+/\d+\] (RUN|COPY|WORKDIR|USER) ", m) and ": done in" not in m
    ]


# --- builds ---------------------------------------------------------------------------------
def test_build_from_image_with_every_step_kind(e2bd, base_image, tmp_path):
    ctx = tmp_path / "ctx"
    (ctx / "app").mkdir(parents=True)
    (ctx / "app" / "hello.txt").write_text("hello from COPY\n")
    (ctx / "run.sh").write_text("#!/bin/sh\necho run.sh ran\n")
    tpl = (
        Template(file_context_path=str(ctx))
        .from_image(base_image)
        .run_cmd("id -un > /tmp/build-user && echo $HOME > /tmp/build-home")
        .copy("app", "/opt/app/")
        .copy("run.sh", "/usr/local/bin/run-it", user="root", mode=0o755)
        .set_envs({"GREETING": "hi", "BOTH": "${GREETING}-there"})
        .run_cmd("mkdir -p /srv/data && echo $BOTH > /srv/data/env.txt", user="root")
        .set_workdir("/srv/work")
        .run_cmd("pwd > marker && id -u >> marker")
    )
    logs: list = []
    info = Template.build(tpl, "t-kinds", on_build_logs=logs.append)
    assert info.template_id and info.build_id and info.name == "t-kinds"
    assert not list((e2bd.daemon.home / "e2b" / "files").iterdir())  # the build's uploads went at its end
    assert Template.exists("t-kinds") and Template.alias_exists("t-kinds")
    assert not Template.exists("t-absent")
    text = "\n".join(e.message for e in logs)
    assert "created user user (uid 1000, home /home/user)" in text, text

    sb = Sandbox.create("t-kinds", timeout=120)
    try:
        r = sb.commands.run(
            "id; echo $HOME; pwd; cat /tmp/build-user /tmp/build-home /srv/data/env.txt /srv/work/marker; "
            "cat /opt/app/hello.txt; run-it; stat -c '%U %a' /opt/app/hello.txt /usr/local/bin/run-it /srv/work; "
            "grep '^user:' /etc/passwd; echo GREETING=$GREETING"
        )
        out = r.stdout.splitlines()
        assert out[0].startswith("uid=1000(user) gid=1000(user)"), out
        assert out[1:3] == ["/home/user", "/srv/work"], out  # E2B's default user; the last WORKDIR
        assert out[3:8] == ["user", "/home/user", "hi-there", "/srv/work", "1000"], out
        assert out[8:10] == ["hello from COPY", "run.sh ran"], out
        assert out[10:13] == ["user 644", "root 755", "user 755"], out
        assert out[13].startswith("user:x:1000:1000::/home/user:/bin/bash"), out
        assert out[14] == "GREETING=hi", out
    finally:
        sb.kill()
    _quiet_nothing_left(e2bd)


def test_rebuild_after_changing_the_last_line_runs_only_it(e2bd, base_image, tmp_path):
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "data.txt").write_text("data\n")
    lines = [
        f"FROM {base_image}",
        "USER root",
        "RUN echo one > /one",
        "COPY data.txt /opt/data.txt",
        "WORKDIR /opt",
        "ENV STAGE=two",
        "RUN echo $STAGE > /two",
    ]

    def build(name: str, last: str) -> tuple[list[str], list]:
        logs: list = []
        tpl = Template(file_context_path=str(ctx)).from_dockerfile("\n".join([*lines, last]))
        Template.build(tpl, name, on_build_logs=logs.append)
        return _runs(logs), logs

    first, _ = build("t-layers", "RUN echo three > /three")
    assert sum(m.startswith("[builder") and " RUN " in m for m in first) == 3, first
    again, logs = build("t-layers", "RUN echo THREE > /three")
    assert again == ["[builder 9/9] RUN echo THREE > /three"], "\n".join(e.message for e in logs)
    same, _ = build("t-layers", "RUN echo THREE > /three")
    assert same == []
    with e2bd.daemon.http() as c:
        a = c.get("/templates/t-layers").json()["groups"]
    other, _ = build("t-layers-2", "RUN echo four > /four")
    assert other == ["[builder 9/9] RUN echo four > /four"]
    with e2bd.daemon.http() as c:
        b = c.get("/templates/t-layers-2").json()["groups"]
    assert a[:-1] == b[:-1] and a[-1] != b[-1]  # the shared first steps are the same groups

    sb = Sandbox.create("t-layers", timeout=60)
    try:
        r = sb.commands.run("cat /one /two /three /opt/data.txt; pwd; id -un")
        assert r.stdout.splitlines() == ["one", "two", "THREE", "data", "/opt", "root"]
    finally:
        sb.kill()


def test_a_rebuild_taken_whole_from_the_cache_starts_no_build_environment(e2bd, base_image):
    """The sudo question (README's "Security model") is answered once per tree:
    a build whose steps all come from the cache needs no build environment."""
    token = os.urandom(6).hex()

    def build() -> str:
        logs: list = []
        tpl = Template().from_image(base_image).run_cmd(f"echo {token} > /tmp/token")
        Template.build(tpl, f"t-cached-{token}", on_build_logs=logs.append)
        [final] = [e.message for e in logs if e.message.startswith("[builder finalize]")]
        return final

    first = build()
    assert " 0 build environments" not in first, first
    again = build()
    assert "0 steps run" in again and " 0 build environments" in again, again
    sb = Sandbox.create(f"t-cached-{token}", timeout=60)
    try:
        assert sb.commands.run("cat /tmp/token; id -un").stdout.split() == [token, "user"]
    finally:
        sb.kill()
    _quiet_nothing_left(e2bd)


def test_a_build_whose_cached_step_a_gc_deletes_meanwhile_runs_it_again(e2bd, base_image, tmp_path):
    """A build finds a step's group in the build cache while a gc (another
    process) that already read the write leases is about to delete that
    group, no template naming it: the build waits for that delete, then must
    run the step again, not publish a template naming what the gc deleted.
    (Before, it took the cached group with no lease and never looked again.)"""
    import subprocess
    import sys
    import threading

    from test_store_faults import _DELETER, _finish, _wait_for_lease
    from weenv.packaging.group import load_group
    from weenv.packaging.template import load_template
    from weenv.store.file import FileStore

    token = os.urandom(6).hex()
    tpl = Template().from_image(base_image).run_cmd(f"echo {token} > /tmp/token")
    Template.build(tpl, f"t-gc-a-{token}")
    store = FileStore(e2bd.daemon.home.parent / "store")
    template, manifest = load_template(store, f"t-gc-a-{token}")
    group = manifest.groups[-1]  # the RUN step's
    with e2bd.api() as c:
        [tid] = [t["templateID"] for t in c.get("/templates").json() if t["names"][0] == f"t-gc-a-{token}"]
        assert c.delete(f"/templates/{tid}").status_code == 204  # the step's group is garbage now
    go = tmp_path / "go"
    deleter = subprocess.Popen(
        [sys.executable, "-c", _DELETER, store.url, str(go), template, group],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    logs: list = []
    errors: list = []

    def build() -> None:
        try:
            Template.build(tpl, f"t-gc-b-{token}", on_build_logs=logs.append)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    builder = threading.Thread(target=build)
    try:
        _wait_for_lease(store, "delete", deleter)
        builder.start()
        deadline = time.monotonic() + 60
        while builder.is_alive() and not any(n.startswith("write-") for n in store.list_refs("leases")):
            assert time.monotonic() < deadline, "the build took no write lease"
            time.sleep(0.02)
        time.sleep(1.0)  # it finds the step cached, names its group and waits for the delete
    finally:
        go.touch()
    code, out = _finish(deleter)
    assert code == 0 and "removed=[" in out and group in out, out
    builder.join(300)
    assert not errors, errors
    _, built = load_template(store, f"t-gc-b-{token}")
    assert all(store.has_chunk(c.digest) for g in built.groups for c in load_group(store, g).chunks)
    assert _runs(logs), [e.message for e in logs]  # the step ran again
    sb = Sandbox.create(f"t-gc-b-{token}", timeout=60)
    try:
        assert sb.commands.run("cat /tmp/token").stdout.split() == [token]
    finally:
        sb.kill()
    _quiet_nothing_left(e2bd)


def test_from_template_and_async_build(e2bd, base_image):
    import asyncio

    Template.build(Template().from_image(base_image).run_cmd("echo base > /tmp/base-marker"), "t-parent")

    async def main():
        tpl = AsyncTemplate().from_template("t-parent").run_cmd("cat /tmp/base-marker > /tmp/child-marker")
        await AsyncTemplate.build(tpl, "t-child")
        return await AsyncTemplate.exists("t-child")

    assert asyncio.run(main())
    sb = Sandbox.create("t-child", timeout=60)
    try:
        assert sb.commands.run("cat /tmp/child-marker; id -un").stdout.split() == ["base", "user"]
    finally:
        sb.kill()


def test_start_and_ready_commands(e2bd, base_image):
    tpl = (
        Template()
        .from_image(base_image)
        .set_start_cmd("sleep 1; echo up > /tmp/ready; exec sleep infinity", wait_for_file("/tmp/ready"))
    )
    Template.build(tpl, "t-ready")
    t0 = time.monotonic()
    sb = Sandbox.create("t-ready", timeout=60)
    try:
        assert time.monotonic() - t0 >= 1.0
        assert sb.commands.run("cat /tmp/ready").stdout == "up\n"
        assert any("sleep 1" in " ".join([p.cmd, *p.args]) for p in sb.commands.list())
    finally:
        sb.kill()

    Template.build(Template().from_image(base_image).set_start_cmd("sleep infinity", "test -f /never"), "t-never")
    before = e2bd.environment_ids()
    t0 = time.monotonic()
    with pytest.raises(Exception, match="ready command `test -f /never` did not succeed within 4 s"):
        Sandbox.create("t-never", timeout=60)
    assert time.monotonic() - t0 < READY_TIMEOUT_S + 10
    assert e2bd.environment_ids() == before


def test_list_get_tags_delete(e2bd, base_image):
    Template.build(Template().from_image(base_image), "t-list:v1", tags=["stable"])
    with e2bd.api() as c:
        listed = {t["names"][0]: t for t in c.get("/templates").json()}
        t = listed["t-list"]
        assert t["buildStatus"] == "ready" and t["aliases"] == ["t-list"] and t["public"] is False
        got = c.get(f"/templates/{t['templateID']}").json()
        assert [b["status"] for b in got["builds"]] == ["ready"]
        assert c.get("/templates/aliases/t-list").json() == {"templateID": t["templateID"], "public": False}
    tags = {x.tag for x in Template.get_tags("t-list")}
    assert tags == {"v1", "stable"}
    sb = Sandbox.create("t-list:stable", timeout=30)
    sb.kill()
    with e2bd.api() as c:
        assert c.delete(f"/templates/{t['templateID']}").status_code == 204
        assert c.get(f"/templates/{t['templateID']}").status_code == 404
    assert not Template.exists("t-list")


# --- bad input --------------------------------------------------------------------------------
def test_a_failing_step_is_named_with_its_log(e2bd, base_image):
    tpl = Template().from_image(base_image).run_cmd("echo fine").run_cmd("echo about to fail >&2; exit 3")
    with pytest.raises(BuildException, match=r"step 2 \(RUN echo about to fail >&2; exit 3\) exited 3"):
        Template.build(tpl, "t-fails")
    with e2bd.api() as c:
        t = c.get("/templates/t-fails").json()
        build_id = t["builds"][0]["buildID"]
        status = c.get(f"/templates/{t['templateID']}/builds/{build_id}/status").json()
    assert status["status"] == "error" and status["reason"]["step"] == "2"
    assert "about to fail" in status["reason"]["message"]
    assert any(e["message"] == "about to fail" for e in status["reason"]["logEntries"])
    # as E2B: the name was taken when the build was requested, so the template exists (with its failed
    # build), but nothing starts from it, by name, tag or id
    assert Template.exists("t-fails")
    before = e2bd.environment_ids()
    for ref in ("t-fails", "t-fails:default", t["templateID"]):
        with pytest.raises(Exception, match="tag 'default' does not exist for template 't-fails'"):
            Sandbox.create(ref, timeout=30)
    assert e2bd.environment_ids() == before
    _quiet_nothing_left(e2bd)


def test_an_image_that_does_not_exist(e2bd):
    absent = f"{e2bd.registry.address}/weenv/absent:1"
    with pytest.raises(BuildException, match="no such image in its registry"):
        Template.build(Template().from_image(absent), "t-noimage")
    _quiet_nothing_left(e2bd)


def _request(c: httpx.Client, name: str) -> tuple[str, str]:
    r = c.post("/v3/templates", json={"name": name})
    assert r.status_code == 202, r.text
    return r.json()["templateID"], r.json()["buildID"]


def _wait(c: httpx.Client, tid: str, bid: str, done=("ready", "error"), timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = c.get(f"/templates/{tid}/builds/{bid}/status", params={"logsOffset": 0, "limit": 100}).json()
        if s["status"] in done:
            return s
        time.sleep(0.2)
    raise AssertionError(f"build {bid} still {s['status']}")


def test_a_copy_whose_upload_never_arrived(e2bd, base_image):
    with e2bd.api() as c:
        tid, bid = _request(c, "t-noupload")
        step = {"type": "COPY", "args": ["app.py", "/app/"], "filesHash": "ab" * 32, "force": False}
        r = c.post(f"/v2/templates/{tid}/builds/{bid}", json={"fromImage": base_image, "steps": [step]})
        assert r.status_code == 202, r.text
        s = _wait(c, tid, bid)
    assert s["status"] == "error" and s["reason"]["step"] == "1"
    assert "were never uploaded" in s["reason"]["message"]
    _quiet_nothing_left(e2bd)


def test_bad_requests(e2bd, base_image):
    with e2bd.api() as c:
        assert c.post("/v3/templates", json={"name": "Bad Name"}).status_code == 400
        assert c.post("/v3/templates", json={}).status_code == 400
        assert c.get("/templates/aliases/nope").status_code == 404
        tid, bid = _request(c, "t-bad")
        both = {"fromImage": base_image, "fromTemplate": "x", "steps": []}
        assert c.post(f"/v2/templates/{tid}/builds/{bid}", json=both).status_code == 400
        bad_step = {"fromImage": base_image, "steps": [{"type": "EXPOSE", "args": ["80"]}]}
        assert c.post(f"/v2/templates/{tid}/builds/{bid}", json=bad_step).status_code == 400
        odd_env = {"fromImage": base_image, "steps": [{"type": "ENV", "args": ["A"]}]}
        assert c.post(f"/v2/templates/{tid}/builds/{bid}", json=odd_env).status_code == 400
        assert c.get(f"/templates/{tid}/builds/nope/status").status_code == 404
        assert c.get(f"/templates/{tid}/files/not-a-hash").status_code == 400
        link = c.get(f"/templates/{tid}/files/{'cd' * 32}")
        assert link.status_code == 201 and link.json()["present"] is False
        url, headers = link.json()["url"], link.json()["headers"]
        assert url.startswith(e2bd.api_url + "/templates/")
        assert httpx.put(url, content=b"x").status_code == 401  # the link needs its token
        token = headers["x-weenv-upload-token"]
        wrong = {"x-weenv-upload-token": token[:-1] + ("1" if token.endswith("0") else "0")}  # never the token itself
        assert httpx.put(url, content=b"x", headers=wrong).status_code == 401
        # a body announced past the limit is refused before any of it is kept
        host, port = e2bd.daemon.url.removeprefix("http://").split(":")
        path = url.removeprefix(e2bd.daemon.url)
        with socket.create_connection((host, int(port))) as s:
            s.sendall(
                f"PUT {path} HTTP/1.1\r\nhost: x\r\ncontent-length: {5 << 30}\r\n"
                f"x-weenv-upload-token: {headers['x-weenv-upload-token']}\r\n\r\n".encode()
            )
            assert s.recv(4096).startswith(b"HTTP/1.1 413")
        files = e2bd.daemon.home / "e2b" / "files"
        assert not list(files.glob(".*.part")) and not (files / f"{'cd' * 32}.tar").exists()
        bad = httpx.put(url, content=b"not a tar", headers=headers)
        assert bad.status_code == 400 and "not a tar" in bad.json()["message"], bad.text  # checked as it arrives
        assert c.get(f"/templates/{tid}/files/{'cd' * 32}").json()["present"] is False
        good = io.BytesIO()
        with tarfile.open(fileobj=good, mode="w:gz") as tar:
            tar.addfile(tarfile.TarInfo("empty"))
        assert httpx.put(url, content=good.getvalue(), headers=headers).status_code == 201
        assert c.get(f"/templates/{tid}/files/{'cd' * 32}").json() == {"present": True}


def test_deleting_a_template_cancels_its_build(e2bd, base_image):
    with e2bd.api() as c:
        tid, bid = _request(c, "t-cancel")
        steps = [{"type": "RUN", "args": ["echo started; sleep 300"]}]
        assert (
            c.post(f"/v2/templates/{tid}/builds/{bid}", json={"fromImage": base_image, "steps": steps}).status_code
            == 202
        )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            s = c.get(f"/templates/{tid}/builds/{bid}/status").json()
            if any(e["message"] == "started" for e in s["logEntries"]):
                break
            time.sleep(0.1)
        else:
            raise AssertionError(s)
        assert e2bd.leftovers()["mounts"]  # the build environment is up
        t0 = time.monotonic()
        assert c.delete(f"/templates/{tid}").status_code == 204
        assert time.monotonic() - t0 < 30
        assert c.get(f"/templates/{tid}/builds/{bid}/status").status_code == 404
    _quiet_nothing_left(e2bd)


# --- uploads and logs: bounded where they enter ------------------------------------------------
def _raw_put(d, url: str, headers: dict, length: int, body: bytes, wait: float = 30) -> bytes:
    """PUT ``body`` as the first bytes of a body announced ``length`` long; the
    answer the daemon gives before the rest is sent (a timeout if it waits for it)."""
    host, port = d.url.removeprefix("http://").split(":")
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    with socket.create_connection((host, int(port))) as s:
        s.settimeout(wait)
        s.sendall(
            f"PUT {url.removeprefix(d.url)} HTTP/1.1\r\nhost: x\r\ncontent-length: {length}\r\n{head}\r\n".encode()
            + body
        )
        answer = b""
        while b"}" not in answer:
            chunk = s.recv(65536)
            if not chunk:
                break
            answer += chunk
    return answer


def test_an_upload_declaring_a_huge_pax_header_is_refused_before_its_body(e2bd):
    """A 1 GiB PAX header (tarfile reads a header whole): refused on the first
    MiB sent of a 3 GiB body, nothing kept."""
    with e2bd.api() as c:
        tid, _ = _request(c, "t-paxbomb")
        link = c.get(f"/templates/{tid}/files/{'ef' * 32}").json()
    head = tarfile.TarInfo("pax")
    head.type, head.size = tarfile.XHDTYPE, 1 << 30
    z = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    first = z.compress(head.tobuf(format=tarfile.USTAR_FORMAT) + bytes(1 << 20)) + z.flush(zlib.Z_SYNC_FLUSH)
    answer = _raw_put(e2bd.daemon, link["url"], link["headers"], 3 << 30, first)
    assert answer.startswith(b"HTTP/1.1 400"), answer
    assert b"PAX extended header of 1073741824 bytes at offset 0" in answer, answer
    files = e2bd.daemon.home / "e2b" / "files"
    assert not list(files.glob(".*.part")) and not (files / f"{'ef' * 32}.tar").exists()


def test_a_copy_whose_upload_is_not_its_files_fails_and_the_upload_goes(e2bd, base_image, tmp_path):
    from e2b.template.utils import calculate_files_hash, tar_file_stream

    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "app.txt").write_text("the files hashed\n")
    files_hash = calculate_files_hash("app.txt", "/app/", str(ctx), [], False, None)
    (ctx / "app.txt").write_text("other files, same name\n")
    with tar_file_stream("app.txt", str(ctx), [], False, True) as f:
        body = f.read()
    with e2bd.api() as c:
        tid, bid = _request(c, "t-mismatch")
        link = c.get(f"/templates/{tid}/files/{files_hash}").json()
        assert httpx.put(link["url"], content=body, headers=link["headers"]).status_code == 201
        step = {"type": "COPY", "args": ["app.txt", "/app/"], "filesHash": files_hash, "force": False}
        r = c.post(f"/v2/templates/{tid}/builds/{bid}", json={"fromImage": base_image, "steps": [step]})
        assert r.status_code == 202, r.text
        s = _wait(c, tid, bid)
        assert s["status"] == "error" and s["reason"]["step"] == "1", s
        assert f"the upload of filesHash {files_hash} is not the files of COPY app.txt /app/" in s["reason"]["message"]
        assert not (e2bd.daemon.home / "e2b" / "files" / f"{files_hash}.tar").exists()  # gone with the build
    _quiet_nothing_left(e2bd)


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_a_build_printing_200_mb_keeps_a_bounded_log(e2bd, base_image):
    """200 MB printed in four long lines: the log the status route pages is a
    few MiB, ends with the step's last output, and the daemon does not grow."""
    before = _rss_kib(e2bd.daemon.proc.pid)
    spam = "for i in 1 2 3 4; do head -c 50000000 /dev/zero | tr '\\0' a; echo; done; echo last-line"
    logs: list = []
    Template.build(Template().from_image(base_image).run_cmd(spam), "t-spam", on_build_logs=logs.append)
    grown = _rss_kib(e2bd.daemon.proc.pid) - before
    with e2bd.api() as c:
        t = c.get("/templates/t-spam").json()
        tid, bid = t["templateID"], t["builds"][0]["buildID"]
        entries, size, offset = [], 0, 0
        while page := (r := c.get(f"/templates/{tid}/builds/{bid}/status", params={"logsOffset": offset})).json()[
            "logEntries"
        ]:
            entries += page
            size += len(r.content)
            offset += len(page)
    messages = [e["message"] for e in entries]
    assert size < 8 << 20, size
    assert "last-line" in messages and messages[-1] == "Build finished: ready", messages[-5:]
    assert any(m.endswith(" bytes cut]") and m.startswith("a" * 4096) for m in messages)
    assert grown < 64 << 10, f"the daemon grew {grown} KiB"
    assert "last-line" in [e.message for e in logs]  # what the SDK paged


def test_upload_tokens_expire_open_one_route_and_unbuilt_uploads_go(tmp_path_factory, oci_registry):  # noqa: F811
    """A node whose uploads live 3 s and hold at most 1 MiB together."""
    with (
        e2b_daemon(
            tmp_path_factory.mktemp("e2b-uploads"),
            oci_registry,
            WEENV_E2B_UPLOAD_TTL_S="3",
            WEENV_E2B_UPLOADS_MAX_BYTES=str(1 << 20),
        ) as d,
        d.api() as c,
    ):
        files = d.daemon.home / "e2b" / "files"
        tid, _ = _request(c, "t-up")
        first = c.get(f"/templates/{tid}/files/{'12' * 32}").json()
        # the token is no credential elsewhere: a keyless body past 64 KiB is refused, not read whole for a 401
        r = httpx.post(
            d.api_url + "/sandboxes",
            content=b"{" + b" " * (1 << 20) + b"}",
            headers={**first["headers"], "content-type": "application/json"},
        )
        assert r.status_code == 413 and "65536" in r.text, r.text
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as tar:
            info = tarfile.TarInfo("random")
            info.size = 700_000
            tar.addfile(info, io.BytesIO(os.urandom(info.size)))
        body = buf.getvalue()
        assert httpx.put(first["url"], content=body, headers=first["headers"]).status_code == 201
        second = c.get(f"/templates/{tid}/files/{'34' * 32}").json()
        r = httpx.put(second["url"], content=body, headers=second["headers"])
        assert r.status_code == 503 and "bytes of uploads" in r.json()["message"], r.text  # 1 MiB in all
        time.sleep(4)  # past the ttl: an upload no build started with is removed, its token expired
        assert not (files / f"{'12' * 32}.tar").exists()
        r = httpx.put(first["url"], content=b"x", headers=first["headers"])
        assert r.status_code == 401 and "expired" in r.json()["message"], r.text
        assert httpx.put(first["url"], content=body, headers=first["headers"]).status_code == 413  # no credential
        second = c.get(f"/templates/{tid}/files/{'34' * 32}").json()
        assert httpx.put(second["url"], content=body, headers=second["headers"]).status_code == 201  # room again


def test_list_v2_update_and_build_logs_through_the_sdks_client(e2bd, base_image):
    """``GET /v2/templates`` (paged by ``X-Next-Token``), ``PATCH /templates/{id}``
    and ``/v2/templates/{id}`` (``public``), ``GET .../builds/{id}/logs`` (paged by
    ``nextCursor``, filtered by level and time) and ``minFreeDiskMB`` (the
    sandboxes' disk quota), each called with the SDK's own generated client."""
    from e2b.api.client.api.templates import (
        get_templates_template_id_builds_build_id_logs as build_logs,
    )
    from e2b.api.client.api.templates import (
        get_v2_templates,
        patch_templates_template_id,
        patch_v_2_templates_template_id,
    )
    from e2b.api.client.models import LogLevel, LogsDirection, TemplateUpdateRequest
    from e2b.api.client_sync import get_api_client
    from e2b.connection_config import ConnectionConfig

    info = Template.build(
        Template().from_image(base_image).run_cmd("echo one; echo two"), "t-v2a", min_free_disk_mb=12 << 10
    )  # 12 GiB: above the 10 GiB default quota
    Template.build(Template().from_image(base_image), "t-v2b")
    client = get_api_client(ConnectionConfig())
    page = get_v2_templates.sync_detailed(client=client, limit=1)
    assert page.status_code == 200 and len(page.parsed) == 1, page.content
    names, token = [page.parsed[0].names[0]], page.headers.get("x-next-token")
    while token:
        page = get_v2_templates.sync_detailed(client=client, limit=1, next_token=token)
        names += [t.names[0] for t in page.parsed]
        token = page.headers.get("x-next-token")
    assert {"t-v2a", "t-v2b"} <= set(names) and len(names) == len(set(names))
    mine = next(t for t in get_v2_templates.sync(client=client) if t.names == ["t-v2a"])
    assert mine.public is False and mine.disk_size_mb == 12 << 10 and mine.build_status.value == "ready"

    r = patch_v_2_templates_template_id.sync_detailed(
        info.template_id, client=client, body=TemplateUpdateRequest(public=True)
    )
    assert r.status_code == 200 and r.parsed.names == ["t-v2a"], r.content
    assert next(t for t in get_v2_templates.sync(client=client) if t.names == ["t-v2a"]).public is True
    assert (
        patch_templates_template_id.sync_detailed(
            "t-v2a", client=client, body=TemplateUpdateRequest(public=False)
        ).status_code
        == 200
    )
    with e2bd.api() as c:
        assert c.get("/templates/aliases/t-v2a").json()["public"] is False
        assert c.patch("/v2/templates/t-absent", json={"public": True}).status_code == 404

    everything = build_logs.sync(info.template_id, info.build_id, client=client, limit=100).logs
    messages = [e.message for e in everything]
    assert "one" in messages and "two" in messages, messages
    paged, cursor = [], None
    while True:
        r = client.get_httpx_client().get(
            f"/templates/{info.template_id}/builds/{info.build_id}/logs",
            params={"limit": 2, **({"pageCursor": cursor} if cursor else {})},
        )
        paged += r.json()["logs"]
        if not (cursor := r.json().get("nextCursor")):
            break
    assert [e["message"] for e in paged] == messages and [e["id"] for e in paged] == [str(i) for i in range(len(paged))]
    backward = build_logs.sync(info.template_id, info.build_id, client=client, direction=LogsDirection.BACKWARD)
    assert [e.message for e in backward.logs] == messages[::-1]
    assert all(
        e.level.value in ("warn", "error")
        for e in build_logs.sync(info.template_id, info.build_id, client=client, level=LogLevel.WARN).logs
    )
    last_ms = int(everything[-1].timestamp.timestamp() * 1000)
    after = build_logs.sync(info.template_id, info.build_id, client=client, cursor=last_ms).logs
    assert after and after[-1].message == messages[-1] and len(after) < len(messages)

    sb = Sandbox.create("t-v2a", timeout=60)
    with e2bd.api() as c:  # the disk quota minFreeDiskMB asked (a sandbox's writable layer starts empty)
        try:
            assert c.get(f"/sandboxes/{sb.sandbox_id}").json()["diskSizeMB"] == 12 << 10
        finally:
            sb.kill()
        r = c.post("/v3/templates", json={"name": "t-v2-huge", "minFreeDiskMb": 1 << 39})
        assert r.status_code == 400 and "minFreeDiskMB" in r.json()["message"], r.text
