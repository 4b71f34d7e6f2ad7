"""A template's start and ready commands (E2B's ``startCmd`` / ``readyCmd``) at create.

E2B runs the start command while it builds and snapshots the running sandbox;
weenv does not snapshot processes, so every create does what that snapshot
stands for: start the start command in the background (``/bin/sh -c``, as the
template's user, kept as a background process of the sandbox, so
``commands.list()`` shows it), then run the ready command every
:data:`READY_POLL_S` seconds until it exits 0.  Only then is the create done.
"""

from __future__ import annotations

import time

from weenv.errors import CommandTimeoutError, RuntimeFailedError
from weenv.node.node import Node
from weenv.server.e2b.sandboxes import Sandbox

READY_POLL_S = 0.25
READY_ATTEMPT_S = 10.0
"""Seconds one run of the ready command may take."""


def start_and_wait_ready(node: Node, sb: Sandbox, timeout: float) -> None:
    """Start ``sb``'s start command and wait (at most ``timeout`` seconds) for its
    ready command to succeed.  Raises :class:`CommandTimeoutError` with the ready
    command's last exit and output when it never does, :class:`RuntimeFailedError`
    when the start command cannot start.  Without a start command: nothing."""
    runtime = sb.runtime
    if runtime.start_command:
        p = node.spawn(sb.id, ["/bin/sh", "-c", runtime.start_command], tag="start")
        if not p.pid:
            raise RuntimeFailedError(f"the template's start command `{runtime.start_command}` could not start")
    if not runtime.ready_command:
        return
    deadline = time.monotonic() + timeout
    last = ""
    while True:
        left = deadline - time.monotonic()
        r = node.exec(sb.id, ["/bin/sh", "-c", runtime.ready_command], timeout=max(0.1, min(READY_ATTEMPT_S, left)))
        if r.exit_code == 0 and not r.timed_out:
            return
        out = (r.stdout + r.stderr).decode(errors="replace").strip()
        last = f"exit {r.exit_code}" + (" (timed out)" if r.timed_out else "") + (f": {out[-500:]}" if out else "")
        if time.monotonic() + READY_POLL_S >= deadline:
            raise CommandTimeoutError(
                f"the template's ready command `{runtime.ready_command}` did not succeed within {timeout:g} s "
                f"(last run: {last}); the sandbox was removed"
            )
        time.sleep(READY_POLL_S)
