"""A program run in a mount namespace of its own (weenv.host.mountns) sees only
the mounts on the way to the paths it needs, the host's table is untouched,
and what fails says so."""

from __future__ import annotations

import shutil
import subprocess
import sys

from weenv.host import mountns
from weenv.host.mounts import MountSpec, mount, mounts_under, umount


def _table() -> list[str]:
    with open("/proc/self/mounts") as f:
        return [line.split()[1] for line in f]


def test_the_program_sees_only_the_mounts_on_the_way_to_what_it_needs(tmp_path):
    kept, other = tmp_path / "kept", tmp_path / "other"
    kept.mkdir()
    other.mkdir()
    mount(MountSpec("tmpfs", "weenv-test-kept", str(kept)))
    try:
        mount(MountSpec("tmpfs", "weenv-test-other", str(other)))
        try:
            r = mountns.run_isolated([shutil.which("cat"), "/proc/self/mounts"], keep=[kept / "file"])
            assert r.returncode == 0, r.stderr
            seen = [line.split()[1] for line in r.stdout.splitlines()]
            assert str(kept) in seen and str(other) not in seen, seen
            assert "/" in seen and "/proc" in seen
            assert not any(p.startswith("/proc/") or p.startswith("/sys") for p in seen), seen
            # the host's table: what the program's namespace detached is still mounted here
            assert [p for p in _table() if p.startswith(str(tmp_path))] == [str(kept), str(other)]
        finally:
            umount(other)
    finally:
        umount(kept)
    assert mounts_under(tmp_path) == []


def test_a_program_that_cannot_run_is_reported(tmp_path):
    r = mountns.run_isolated([str(tmp_path / "no-such-program")])
    assert r.returncode == mountns.SETUP_FAILED
    assert "cannot run" in r.stderr and "No such file or directory" in r.stderr


def test_without_the_right_to_make_a_namespace_it_says_so():
    # root without CAP_SYS_ADMIN (gone from the bounding set): unshare(CLONE_NEWNS) needs it
    r = subprocess.run(
        [
            "setpriv",
            "--bounding-set=-sys_admin",
            sys.executable,
            "-c",
            "from weenv.host import mountns; r = mountns.run_isolated(['/bin/true']); "
            "print(r.returncode); print(r.stderr)",
        ],
        capture_output=True,
        text=True,
        cwd="/",
    )
    assert r.returncode == 0, r.stderr
    code, _, message = r.stdout.partition("\n")
    assert int(code) == mountns.SETUP_FAILED
    assert "cannot make a mount namespace" in message and "Operation not permitted" in message, message
