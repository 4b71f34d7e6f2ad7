"""E2B's own SDK tests' expectations, through the official ``e2b`` SDK against a
real ``weenv serve``, over a ``base`` template like E2B's (Debian, user ``user``
with home and working directory ``/home/user``): a paused sandbox (paused
by a call or at its timeout) is not running, and its ports answer 502, until
a connect or resume; pseudo files (``/proc``, ``/sys``) are read
inside the sandbox with the caller's rights and nothing outside becomes
readable; ``Template.exists("base")``; a directory's size and a link's type and
target; a file written again keeps no metadata of before; an expired signed
URL's answer.  Each test mirrors one of E2B's (``packages/python-sdk/tests``)."""

from __future__ import annotations

import asyncio
import base64
import os
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

e2b = pytest.importorskip("e2b")

from e2b import AsyncSandbox, FileType, Sandbox, Template  # noqa: E402
from e2b.exceptions import SandboxException  # noqa: E402

from e2b_fixture import e2b_daemon  # noqa: E402
from weenv.formats.manifest import RuntimeConfig  # noqa: E402
from weenv.packaging.group import build_group  # noqa: E402
from weenv.packaging.template import create_template  # noqa: E402
from weenv.store.file import FileStore  # noqa: E402

USER_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/home/user",
    "USER": "user",
    "LANG": "C.UTF-8",
}


def user_layer(debian_root: Path, at: Path) -> Path:
    """A layer adding E2B's ``user`` account (uid 1000) and its home."""
    etc = at / "etc"
    etc.mkdir(parents=True)
    for name, line in (("passwd", "user:x:1000:1000::/home/user:/bin/bash\n"), ("group", "user:x:1000:\n")):
        (etc / name).write_text((debian_root / "etc" / name).read_text() + line)
    (at / "home/user").mkdir(parents=True)
    os.chown(at / "home/user", 1000, 1000)
    os.chmod(at / "home/user", 0o755)
    return at


@pytest.fixture(scope="module")
def served(shared_store, debian_root):
    """A daemon over a hard-linked copy of the shared store with template ``base``."""
    root = Path(tempfile.mkdtemp(prefix="weenv-e2b-sdk-"))
    try:
        subprocess.run(["cp", "-al", str(shared_store.root), str(root / "store")], check=True)
        store = FileStore(root / "store")
        build_group(user_layer(debian_root, root / "user-layer"), store, name="e2b-user")
        create_template(
            store,
            "base",
            ["base", "e2b-user"],
            runtime=RuntimeConfig(user="1000:1000", working_dir="/home/user", env=USER_ENV),
        )
        with e2b_daemon(root, None, store.url) as d:
            yield d
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def sandbox(served):
    s = Sandbox.create("base", timeout=300)
    yield s
    s.kill()


# --- pause: a paused sandbox is not running -------------------------------------------------
def test_paused_sandbox_is_not_running_until_connect(served):
    """E2B's test_connect_to_paused_sandbox_resumes and test_snapshot: envd of a
    paused sandbox answers 502, which the SDK reads as not running; a connect
    resumes it; ``Sandbox.resume`` too."""
    s = Sandbox.create("base", timeout=120)
    try:
        assert s.is_running()
        s.pause()
        assert not s.is_running()
        with pytest.raises(SandboxException):  # nothing of it answers while it is paused
            s.commands.run("true")
        resumed = Sandbox.connect(s.sandbox_id)
        assert resumed.is_running() and s.is_running()
        assert resumed.commands.run("echo back").stdout == "back\n"

        Sandbox.pause(s.sandbox_id)
        assert not s.is_running()
        with pytest.raises(SandboxException):
            s.files.read("/etc/hostname")
        s.connect()
        assert s.is_running() and s.files.read("/etc/hostname")
    finally:
        s.kill()


def test_a_paused_sandboxs_ports_answer_502_until_connect(served):
    """E2B's proxy answers 502 "was not found" for a port of a paused sandbox
    (without auto-resume), at once: the frozen server is not waited for."""
    import httpx

    s = Sandbox.create("base", timeout=120)
    try:
        s.commands.run("python3 -m http.server 8000 --bind 127.0.0.1 >/dev/null 2>&1", background=True)
        host = s.get_host(8000)

        def get() -> httpx.Response:
            return httpx.get(served.daemon.url + "/", headers={"Host": host}, timeout=20)

        deadline = time.monotonic() + 30
        while get().status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert get().status_code == 200
        s.pause()
        t = time.monotonic()
        r = get()
        assert r.status_code == 502 and "was not found" in r.json()["message"], r.text
        assert time.monotonic() - t < 10
        s.connect()
        assert get().status_code == 200
    finally:
        s.kill()


def test_paused_sandbox_is_not_running_async(served):
    async def main():
        s = await AsyncSandbox.create("base", timeout=120)
        try:
            assert await s.is_running()
            await s.pause()
            assert not await s.is_running()
            resumed = await AsyncSandbox.connect(s.sandbox_id)
            assert await resumed.is_running()
            assert (await resumed.commands.run("echo back")).stdout == "back\n"
        finally:
            await s.kill()

    asyncio.run(main())


def test_auto_paused_sandbox_is_not_running_until_connect(served):
    """E2B's test_auto_pause_without_auto_resume_requires_connect."""
    from e2b import SandboxState

    s = Sandbox.create("base", timeout=3, lifecycle={"on_timeout": "pause", "auto_resume": False})
    try:
        s.files.write("/home/user/marker.txt", "kept")
        deadline = time.monotonic() + 60
        while s.get_info().state != SandboxState.PAUSED and time.monotonic() < deadline:
            time.sleep(0.5)
        assert s.get_info().state == SandboxState.PAUSED
        assert not s.is_running()
        s.connect()
        assert s.get_info().state == SandboxState.RUNNING and s.is_running()
        assert s.files.read("/home/user/marker.txt") == "kept"
    finally:
        s.kill()


# --- pseudo files read inside ------------------------------------------------------------------
def test_pseudo_files_are_read_inside_with_the_callers_rights(sandbox):
    """E2B's pause tests read ``/proc/sys/kernel/random/boot_id`` through the
    files API: a pseudo file is read by a process inside the sandbox, as the
    user the call names, so it shows what that user sees there."""
    boot = sandbox.files.read("/proc/sys/kernel/random/boot_id")
    assert boot == sandbox.commands.run("cat /proc/sys/kernel/random/boot_id").stdout
    assert len(boot.strip()) == 36
    assert sandbox.files.read("/proc/sys/kernel/hostname") == sandbox.commands.run("hostname").stdout

    def uid_of(status: str) -> str:
        return next(line.split()[1] for line in status.splitlines() if line.startswith("Uid:"))

    assert uid_of(sandbox.files.read("/proc/self/status")) == "1000"  # the template's user
    assert uid_of(sandbox.files.read("/proc/self/status", user="root")) == "0"
    # the reader is a process of the sandbox: its pid namespace, its mounts
    assert sandbox.files.read("/proc/1/cmdline", format="bytes") == base64.b64decode(
        sandbox.commands.run("base64 -w0 /proc/1/cmdline").stdout
    )
    mounts = sandbox.files.read("/proc/self/mounts")
    assert mounts == sandbox.commands.run("cat /proc/self/mounts").stdout
    # through a link planted inside, as a process there would read it
    sandbox.commands.run("ln -sf /proc/sys/kernel/random/boot_id /tmp/boot")
    assert sandbox.files.read("/tmp/boot") == boot
    # sysfs too
    assert (
        sandbox.files.read("/sys/kernel/mm/transparent_hugepage/enabled")
        == sandbox.commands.run("cat /sys/kernel/mm/transparent_hugepage/enabled").stdout
    )


def test_pseudo_file_reads_have_the_sandboxs_rights_not_the_daemons(sandbox):
    """Nothing outside the sandbox becomes readable: a host file named through
    ``/proc/PID/root``, the test's own process, a root process's environment
    to the user, the host kernel's log (CAP_SYSLOG, which nothing inside holds)."""
    secret = Path(tempfile.mkdtemp(prefix="weenv-host-only-")) / "secret"
    secret.write_text("host only\n")
    try:
        for path in (
            f"/proc/1/root{secret}",
            f"/proc/self/root{secret}",
            f"/proc/{os.getpid()}/root{secret}",
            f"/proc/{os.getpid()}/environ",
        ):
            with pytest.raises(SandboxException) as err:
                sandbox.files.read(path, request_timeout=20)
            assert "host only" not in str(err.value)
        pid = sandbox.commands.run(
            "SECRET=root-only nohup sleep 300 >/dev/null 2>&1 & echo $!", user="root"
        ).stdout.strip()
        with pytest.raises(SandboxException, match="denied"):  # another user's process: not to the user
            sandbox.files.read(f"/proc/{pid}/environ", request_timeout=20)
        assert b"SECRET=root-only" in sandbox.files.read(f"/proc/{pid}/environ", user="root", format="bytes")
        t = time.monotonic()
        # refused at once, nothing drained (EPERM, or EACCES in a user namespace: /proc/kmsg is host root's)
        with pytest.raises(SandboxException, match="not permitted|Permission denied"):
            sandbox.files.read("/proc/kmsg", user="root", request_timeout=20)
        assert time.monotonic() - t < 15
    finally:
        shutil.rmtree(secret.parent)


# --- Template.exists --------------------------------------------------------------------------
def test_template_exists_for_a_store_template(served):
    """E2B's test_check_base_template_name_exists and test_check_non_existing_name."""
    assert Template.exists("base") is True
    assert Template.exists(f"nonexistent-{uuid.uuid4()}") is False
    assert Template.exists("base:default") is False  # a name, not a tag


# --- get_info of directories and links ----------------------------------------------------------
def test_get_info_of_directory_and_symlink(sandbox):
    """E2B's test_get_info_of_directory and test_file_symlink."""
    dirname = f"test_dir_{uuid.uuid4().hex[:6]}"
    sandbox.files.make_dir(dirname)
    info = sandbox.files.get_info(dirname)
    pwd = sandbox.commands.run("pwd").stdout.strip()
    assert (info.name, info.type, info.path) == (dirname, FileType.DIR, f"{pwd}/{dirname}")
    assert info.size > 0
    assert (info.mode, info.permissions, info.owner, info.group) == (0o755, "drwxr-xr-x", "user", "user")

    test_dir = f"test-simlink-entry-{uuid.uuid4().hex[:6]}"
    sandbox.files.make_dir(test_dir)
    sandbox.files.write(f"{test_dir}/test.txt", "Hello, World!")
    sandbox.commands.run("ln -s test.txt symlink_to_test.txt", cwd=test_dir)
    f = sandbox.files.get_info(f"{test_dir}/symlink_to_test.txt")
    assert f.type == FileType.FILE
    assert f.symlink_target == f"{pwd}/{test_dir}/test.txt"
    assert (f.mode, f.permissions) == (0o644, "Lrwxrwxrwx")  # envd: the target's bits, Go's form of the link's
    listed = {e.name: e for e in sandbox.files.list(test_dir)}
    assert listed["symlink_to_test.txt"].type == FileType.FILE and listed["test.txt"].symlink_target is None
    sandbox.commands.run("ln -s . dir_link && ln -s nowhere dangling", cwd=test_dir)
    assert sandbox.files.get_info(f"{test_dir}/dir_link").type == FileType.DIR
    dangling = {e.name: e for e in sandbox.files.list(test_dir)}["dangling"]  # weenv keeps it listed
    assert (dangling.type, dangling.symlink_target) == (FileType.SYMLINK, f"{pwd}/{test_dir}/nowhere")
    sandbox.files.remove(test_dir)


# --- metadata of a file written again ------------------------------------------------------------
def test_overwriting_clears_stale_metadata(sandbox):
    """E2B's test_overwriting_clears_stale_metadata."""
    filename = f"metadata_overwrite_{uuid.uuid4().hex[:6]}.txt"
    sandbox.files.write(filename, "first", metadata={"author": "mish", "stage": "1"})
    assert sandbox.files.get_info(filename).metadata == {"author": "mish", "stage": "1"}
    info = sandbox.files.write(filename, "second")
    assert info.metadata is None
    assert sandbox.files.get_info(filename).metadata is None
    assert sandbox.files.read(filename) == "second"
    sandbox.files.write(filename, "third", metadata={"stage": "3"})  # replaced, not merged
    assert sandbox.files.get_info(filename).metadata == {"stage": "3"}


# --- signed URLs --------------------------------------------------------------------------------
def test_download_url_with_expired_signing(sandbox):
    """E2B's test_download_url_with_expired_signing: 401 and envd's exact body."""
    import json

    path = "test_download_url_with_signing.txt"
    sandbox.files.write(path, "This file will be watched.")
    signed_url = sandbox.download_url(path, "user", use_signature_expiration=-120)
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(signed_url)
    assert err.value.code == 401
    assert json.loads(err.value.read().decode()) == {"code": 401, "message": "signature is already expired"}
    with urllib.request.urlopen(sandbox.download_url(path, "user", use_signature_expiration=120)) as r:
        assert r.read() == b"This file will be watched."
