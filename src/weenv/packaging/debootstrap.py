"""A Debian root file system from debootstrap, cached under ``$WEENV_CACHE``.

debootstrap (Debian's package) downloads and unpacks a suite's packages with
the host's ordinary Debian mirror settings.  The result is kept in
``CACHE/rootfs/SUITE-VARIANT[+PKG...]`` and reused; a build in progress lives in
a temporary directory next to it and is renamed into place only when complete,
under an flock(2) so two processes never build the same tree at once.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from weenv.errors import RuntimeFailedError, ToolMissingError


def debian_rootfs(
    cache: Path,
    *,
    suite: str = "bookworm",
    variant: str = "minbase",
    include: tuple[str, ...] = ("python3",),
    log=None,
) -> Path:
    """Path of a cached debootstrap tree; build it first if missing.

    ``log`` (optional callable taking a str) hears progress.  Raises
    :class:`ToolMissingError` without debootstrap and :class:`RuntimeFailedError`
    when debootstrap fails (its last output lines are in the message).
    Takes ~40-60 s and ~260 MB for bookworm minbase + python3.
    """
    key = f"{suite}-{variant}" + ("+" + "+".join(sorted(include)) if include else "")
    base = Path(cache) / "rootfs"
    target = base / key
    if (target / "etc" / "debian_version").exists():
        return target
    if shutil.which("debootstrap") is None:
        raise ToolMissingError("debootstrap is not installed (apt-get install debootstrap)")
    base.mkdir(parents=True, exist_ok=True)
    with open(base / f".{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "etc" / "debian_version").exists():
            return target
        tmp = Path(tempfile.mkdtemp(dir=base, prefix=f".tmp-{key}-"))
        try:
            argv = ["debootstrap", f"--variant={variant}"]
            if include:
                argv.append("--include=" + ",".join(include))
            argv += [suite, str(tmp)]
            if log:
                log(f"debootstrap {suite} ({variant}, +{','.join(include)}) into {target} ...")
            proc = subprocess.run(argv, capture_output=True, text=True)
            if proc.returncode != 0:
                tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-8:])
                raise RuntimeFailedError(f"debootstrap failed (exit {proc.returncode}):\n{tail}")
            # apt caches are not part of an environment.
            shutil.rmtree(tmp / "var" / "cache" / "apt" / "archives", ignore_errors=True)
            (tmp / "var" / "cache" / "apt" / "archives" / "partial").mkdir(parents=True, exist_ok=True)
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target
