"""Wake the FUSE thread when its read of ``/dev/fuse`` blocks while holding the GIL.

pyfuse3 (3.5) waits for the ``/dev/fuse`` descriptor to be readable (trio),
then calls libfuse's ``fuse_session_receive_buf``, a blocking ``read(2)``,
*without releasing the GIL*.  A request can vanish between the two: the kernel
withdraws a request not yet read by the daemon when its caller gets a fatal
signal (fs/fuse/dev.c, ``request_wait_answer``: "Request is not yet in
userspace, bail out"), which is what destroying an environment does to its
processes blocked in lazy reads.  The read then waits for the next request with
the GIL held, every other thread of the daemon stops, and if the next request
would come from the daemon itself nothing ever arrives (seen: ``runc delete``
finished, its caller waiting forever for the GIL, the FUSE thread in
``fuse_dev_do_read``).

The fix is outside the GIL: a small watcher *process* (this file, run with
``python3 -I -S``, standard library only) samples the FUSE thread's wait channel
(``/proc/PID/task/TID/wchan``) every ``interval`` seconds; a thread still in
``fuse_dev_do_read`` at two samples in a row is blocked there (a read that
follows readability returns at once), so the watcher looks up a name that does
not exist on the mount.  That LOOKUP is the next request: the read returns, the
file system answers ENOENT (not cached: error replies are never negative
entries) and the daemon runs on.  A spurious wake-up costs one lookup.  The
watcher exits when the daemon process is gone or its stdin closes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

WAKE_NAME = ".weenv-wake"
"""The name looked up to wake the reader; never an image's name (those end in ``.img``)."""
BLOCKED_IN = "fuse_dev_do_read"
DEFAULT_INTERVAL_S = 0.25


class ReadWaker:
    """The watcher process for one FUSE thread.  :meth:`start` / :meth:`stop`
    (idempotent; the process is stopped by its PID and reaped)."""

    def __init__(self, mountpoint: os.PathLike | str, interval: float = DEFAULT_INTERVAL_S):
        self.mountpoint = os.fspath(mountpoint)
        self.interval = interval
        self._proc: subprocess.Popen | None = None

    def start(self, tid: int) -> None:
        """Watch thread ``tid`` (a native thread id) of this process."""
        if self._proc is not None:
            return
        self._proc = subprocess.Popen(
            [sys.executable, "-I", "-S", __file__, str(os.getpid()), str(tid), self.mountpoint, str(self.interval)],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, close_fds=True,
        )  # fmt: skip

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        proc.kill()
        proc.wait()
        if proc.stdin is not None:
            proc.stdin.close()


def _blocked(path: str) -> bool:
    try:
        with open(path) as f:
            return f.read().strip() == BLOCKED_IN
    except OSError:
        return False


def watch(pid: int, tid: int, mountpoint: str, interval: float) -> None:
    """Sample thread ``tid`` of ``pid``; wake it when blocked at two samples in a row."""
    wchan = f"/proc/{pid}/task/{tid}/wchan"
    wake = os.path.join(mountpoint, WAKE_NAME)
    before = False
    while os.path.exists(f"/proc/{pid}/task/{tid}"):
        now = _blocked(wchan)
        if now and before:
            try:
                os.stat(wake)
            except OSError:
                pass
            now = False
        before = now
        time.sleep(interval)


if __name__ == "__main__":
    import signal
    import threading

    def orphaned() -> None:  # stdin closes when the daemon goes, however it goes
        sys.stdin.buffer.read()
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=orphaned, daemon=True).start()
    watch(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[4]))
