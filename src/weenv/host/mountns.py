"""Running a program in a mount namespace of its own that holds only the mounts it needs (Linux only).

Some programs read the whole mount table and look at every entry: ``mkfs.btrfs``
(btrfs-progs ``check_mounted_where``) reads ``/proc/self/mounts`` and stat(2)s
the source of every mount, and the backing file of every loop device, before
it formats anything.  On a host where another weenv home's FUSE daemon was
killed, a source inside that FUSE mount (the file an EROFS group mount reads)
fails with ``ENOTCONN``, and ``mkfs.btrfs`` gives up: "cannot check mount
status of ...: Transport endpoint is not connected".  A FUSE daemon that is
alive but stuck would make the same stat(2) wait forever.  There is no option
to skip the check (``-f`` does not).

:func:`run_isolated` runs such a program in a new mount namespace (private
propagation: nothing done there reaches the host, and no later host mount
reaches it) from which every mount that holds none of the paths it needs has
been detached (``umount2(MNT_DETACH)``, in that namespace only).  Its mount
table then lists the mounts holding those paths (the root, ``/proc``,
``/dev``, the program's and the libraries' directories, the caller's files)
and nothing another home made.  The namespace goes with the program.

The namespace is made by a short-lived Python child (``python -m
weenv.host.mountns``): unshare(2) of a mount namespace needs a process whose
file-system state no other thread shares, which a node daemon with its
threads is not, and work in a ``preexec_fn`` after fork(2) of a threaded
process is unsafe.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from weenv.errors import MountError
from weenv.host.mounts import MountSpec, _unescape, mount, umount

CLONE_NEWNS = 0x00020000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
SETUP_FAILED = 125
"""The child's exit status when it could not make the namespace or run the
program (``unshare``(1) uses 125 for its own failures); its stderr says why."""

ALWAYS_KEPT = ("/proc", "/dev", "/etc", "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64")
"""Paths every program needs (its mount table, devices, the dynamic linker's
cache and libraries): the mounts holding them are kept."""
MAX_ROUNDS = 256
"""Detach rounds at most (each round detaches the top mount of each point;
mounts stacked deeper need another round)."""


def _holds(point: str, path: str) -> bool:
    """Whether a mount at ``point`` is on the way to ``path`` (``point`` is ``path`` or one of its directories)."""
    return path == point or path.startswith(point.rstrip("/") + "/")


def foreign_roots(mountinfo: str, keep: Iterable[str]) -> list[str]:
    """The mount points to detach so that only mounts on the way to a path in
    ``keep`` (absolute, resolved) stay, from a ``/proc/PID/mountinfo`` text: the
    mounts that hold none of them and whose parent mount is kept (detaching one
    takes the mounts below it along).  In the table's order (parents first)."""
    keep = list(keep)
    entries = []
    for line in mountinfo.splitlines():
        fields = line.split(" - ", 1)[0].split()
        if len(fields) < 5:
            continue
        entries.append((fields[0], fields[1], _unescape(fields[4])))
    kept = {mid for mid, _parent, point in entries if any(_holds(point, p) for p in keep)}
    known = {mid for mid, _parent, _point in entries}
    roots = []
    for mid, parent, point in entries:
        if mid not in kept and (parent in kept or parent not in known) and point not in roots:
            roots.append(point)
    return roots


def needed_paths(argv: Sequence[str], keep: Iterable[str | os.PathLike[str]]) -> list[str]:
    """The resolved paths whose mounts stay: :data:`ALWAYS_KEPT`, the program
    ``argv[0]`` and ``keep``."""
    return [os.path.realpath(p) for p in (*ALWAYS_KEPT, argv[0], *keep)]


def run_isolated(
    argv: Sequence[str], *, keep: Iterable[str | os.PathLike[str]] = (), timeout: float | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` (``argv[0]`` a path) to its end in a mount namespace of its
    own holding only the mounts on the way to the paths in ``keep`` and to
    those every program needs (module docstring); its stdin is /dev/null, its
    output captured as text.  The result's ``returncode`` is
    :data:`SETUP_FAILED` if the namespace could not be made (no
    ``CAP_SYS_ADMIN``) or ``argv[0]`` not run; its stderr says why.  Raises
    :class:`subprocess.TimeoutExpired` past ``timeout`` (the child is killed)."""
    # this weenv, whatever the caller's sys.path; -S: no site-packages (the child needs the standard
    # library only, and a venv's .pth files more than quadruple its start-up time)
    package_root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
    paths = needed_paths(argv, keep)
    child = [sys.executable, "-S", "-m", "weenv.host.mountns", *[a for p in paths for a in ("--keep", p)], "--", *argv]
    return subprocess.run(
        child, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout, check=False
    )


def _enter(keep: list[str]) -> list[str]:
    """Unshare this process's mount namespace, make it private, detach every
    mount that holds none of ``keep``; return the points that could not be
    detached (mounts hidden under a kept one).  Raises ``OSError``."""
    libc = ctypes.CDLL(None, use_errno=True)  # the interpreter's own symbols: libc's among them
    if libc.unshare(CLONE_NEWNS) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare(CLONE_NEWNS): {os.strerror(err)}")
    mount(MountSpec("none", "none", "/", flags=MS_REC | MS_PRIVATE))  # nothing below reaches the host
    stuck: list[str] = []
    for _round in range(MAX_ROUNDS):
        with open("/proc/self/mountinfo") as f:
            roots = [p for p in foreign_roots(f.read(), keep) if p not in stuck]
        if not roots:
            break
        for point in roots:
            try:
                umount(point, detach=True)
            except MountError:
                stuck.append(point)  # unreachable by path: covered by a kept mount
    return stuck


def main(args: list[str]) -> int:
    """``python -m weenv.host.mountns [--keep PATH]... -- PROGRAM ARG...``: exec
    ``PROGRAM`` in a mount namespace holding only the mounts on the way to the
    paths kept (given resolved: :func:`needed_paths`)."""
    keep: list[str] = []
    while args and args[0] == "--keep" and len(args) > 1:
        keep.append(args[1])
        args = args[2:]
    if not args or args[0] != "--" or len(args) < 2:
        print("usage: python -m weenv.host.mountns [--keep PATH]... -- PROGRAM ARG...", file=sys.stderr)
        return SETUP_FAILED
    argv = args[1:]
    try:
        stuck = _enter(keep)
    except OSError as exc:
        print(f"cannot make a mount namespace of its own for {argv[0]}: {exc.strerror}", file=sys.stderr)
        return SETUP_FAILED
    if stuck:
        print(f"mounts left in {argv[0]}'s namespace (covered by kept mounts): {' '.join(stuck)}", file=sys.stderr)
    sys.stderr.flush()
    try:
        os.execv(argv[0], argv)
    except OSError as exc:
        print(f"cannot run {argv[0]}: {exc.strerror}", file=sys.stderr)
    return SETUP_FAILED


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
