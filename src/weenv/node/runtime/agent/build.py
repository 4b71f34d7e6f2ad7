"""Compile the exec agent (``agent.c``) once per source digest, into the cache.

The binary is static (``cc -static -O2``: it runs in any environment's root,
whatever its libc) and kept at ``CACHE/exec-agent/DIGEST/weenv-agent``, where
DIGEST is the sha256 of the source and the compiler flags: editing the source
builds a new one, and homes sharing ``WEENV_CACHE`` share it.  Needs a C
compiler and static libc (Debian: ``gcc``, ``libc6-dev``).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import subprocess
import threading
from pathlib import Path

from weenv.errors import RuntimeFailedError, ToolMissingError

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("agent.c")
CFLAGS = ("-static", "-O2", "-Wall", "-Wextra")
BUILD_TIMEOUT_S = 120.0


def source_digest() -> str:
    """sha256 (hex) of the agent's source and :data:`CFLAGS`."""
    h = hashlib.sha256(SOURCE.read_bytes())
    h.update("\0".join(CFLAGS).encode())
    return h.hexdigest()


def build_agent(cache: Path, cc: str = "cc") -> Path:
    """The agent binary for the current source, compiled now if the cache has none.

    Concurrent callers (threads or processes) build it once: the build holds an
    flock(2) on the target directory's lock file and renames the result into
    place.  Raises :class:`ToolMissingError` without a compiler and
    :class:`RuntimeFailedError` when compiling fails (with the compiler's message).
    """
    out = Path(cache) / "exec-agent" / source_digest()[:32] / "weenv-agent"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    lock = os.open(out.parent / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if out.is_file():
            return out
        tmp = out.with_name(f".weenv-agent.{os.getpid()}.{threading.get_ident()}")
        try:
            proc = subprocess.run(
                [cc, *CFLAGS, "-o", str(tmp), str(SOURCE)], capture_output=True, timeout=BUILD_TIMEOUT_S
            )
        except FileNotFoundError as exc:
            raise ToolMissingError(f"no C compiler {cc!r} to build the exec agent (Debian: gcc, libc6-dev)") from exc
        except subprocess.TimeoutExpired as exc:
            raise RuntimeFailedError(f"building the exec agent took more than {BUILD_TIMEOUT_S} s") from exc
        if proc.returncode != 0:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            msg = proc.stderr.decode(errors="replace").strip()[-2000:]
            raise RuntimeFailedError(f"building the exec agent failed: {msg}")
        os.replace(tmp, out)
        log.info("built the exec agent at %s", out)
        return out
    finally:
        os.close(lock)


class AgentBinary:
    """The agent binary of one node, built on first use (thread-safe).

    :meth:`get` returns its path, or None when it cannot be built (logged once,
    with the reason in :attr:`error`): the node then runs every command with
    ``runc exec``.
    """

    def __init__(self, cache: Path, cc: str = "cc", enabled: bool = True):
        self.cache, self.cc, self.enabled = Path(cache), cc, enabled
        self.error: str | None = None if enabled else "disabled"
        self._path: Path | None = None
        self._lock = threading.Lock()

    def get(self) -> Path | None:
        with self._lock:
            if self._path is None and self.error is None:
                try:
                    self._path = build_agent(self.cache, self.cc)
                except (ToolMissingError, RuntimeFailedError, OSError) as exc:
                    self.error = str(exc)
                    log.warning("no exec agent (commands will use runc exec, ~10x slower): %s", exc)
            return self._path
