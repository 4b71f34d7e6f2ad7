"""The directory watches' wake pipe is closed with them (it was left open: two
descriptors per app that closed)."""

from __future__ import annotations

import os

from weenv.server.e2b.watch import Watches


def test_close_closes_the_wake_pipe_and_is_idempotent():
    w = Watches(node=None, alive=lambda sandbox_id: False)
    fds = (w._wake_r, w._wake_w)
    w.close()
    for fd in fds:
        try:
            os.fstat(fd)
        except OSError:
            continue
        raise AssertionError(f"descriptor {fd} of the wake pipe is still open")
    w.close()
