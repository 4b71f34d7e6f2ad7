"""Streamed answers: NDJSON lines, and a batch's lines in the order its items finish.

A batch (``POST /v1/environments/batch``, on a node and at the cluster's
gateway alike) answers one line per item as it ends, ``{"index": I,
"environment": {...}}`` or ``{"index": I, "error": {"kind", "message"}}``.
:func:`batch_lines` holds the loop both share: it waits for the items' jobs,
writes each one's line, and when the stream ends before every line went out
(the client left) hands the indices it never wrote to the caller's undo."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.responses import StreamingResponse

from weenv.errors import WeenvError

log = logging.getLogger(__name__)

NDJSON = "application/x-ndjson"


class ClosingStream(StreamingResponse):
    """A streaming response that closes its async generator when the stream ends
    in any way.  When the client has gone, Starlette's ``send`` raises and the
    generator is left suspended at a ``yield``: its ``finally`` (the batch's
    undo) would run only when the garbage collector finds it."""

    async def stream_response(self, send) -> None:
        try:
            await super().stream_response(send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


def error_line(index: int, exc: BaseException) -> bytes:
    """The batch line of an item that failed with ``exc`` (kind ``weenv`` for an error not weenv's own)."""
    kind = exc.kind if isinstance(exc, WeenvError) else "weenv"
    line = {"index": index, "error": {"kind": kind, "message": str(exc)}}
    return json.dumps(line, separators=(",", ":")).encode() + b"\n"


async def batch_lines(
    jobs: dict[asyncio.Future, int],
    done_line: Callable[[int, Any], bytes],
    undo: Callable[[list[int]], None],
) -> AsyncIterator[bytes]:
    """The lines of a batch whose item ``i`` is made by the job ``jobs`` maps to
    ``i``, in the order the jobs end (ties in index order): ``done_line(i,
    result)`` for one that made its item (called just before its line goes
    out), :func:`error_line` for one that raised.  When the stream ends, in
    any way, ``undo`` gets the indices whose lines were not written (none
    when all were): what a client that left will never hear of."""
    pending, written = set(jobs), set()
    try:
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for job in sorted(done, key=jobs.__getitem__):
                i = jobs[job]
                exc = job.exception()
                if exc is None:
                    yield done_line(i, job.result())
                else:
                    if not isinstance(exc, WeenvError):
                        log.error("batch item %d failed", i, exc_info=exc)
                    yield error_line(i, exc)
                written.add(i)  # the response came back for more: it sent this one
    finally:
        undo([i for i in jobs.values() if i not in written])
