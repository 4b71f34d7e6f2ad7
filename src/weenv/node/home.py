"""The home lock: one node per ``WEENV_HOME``."""

from __future__ import annotations

import fcntl
import os

from weenv.config import Paths
from weenv.errors import BusyError


class HomeLock:
    """An flock(2) on ``run/weenv.lock`` of a home, held from :meth:`take` to :meth:`release`."""

    def __init__(self, paths: Paths):
        self.paths = paths
        self._fd: int | None = None

    def take(self) -> None:
        """Raises :class:`BusyError` if another node (a daemon, or a program
        using :class:`Node` directly) holds the home."""
        fd = os.open(self.paths.run / "weenv.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise BusyError(
                f"a weenv node already serves WEENV_HOME={self.paths.home}; use its daemon "
                "(weenv.Sandbox / weenv.sdk.NodeClient) or another WEENV_HOME"
            ) from None
        self._fd = fd

    def release(self) -> None:
        """Idempotent."""
        if self._fd is not None:
            os.close(self._fd)  # releases the flock
            self._fd = None
