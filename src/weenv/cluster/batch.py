"""Batch create across the cluster: ``POST /v1/environments/batch`` at the gateway
(the same request and NDJSON answer as on one node: ``BatchCreateRequest`` in,
one ``BatchCreateEvent`` line per item as it is ready, in the order they finish).

- **Refused whole, before any create**, when the cluster could not hold the
  batch at once now (:meth:`ClusterView.room <weenv.cluster.view.ClusterView.room>`:
  every item placed in turn where it fits, by capacity and ``max_environments``):
  ``capacity`` (503) naming the room there is.  A batch is never left waiting
  for room that will not come.
- **Admission per node**: each item is placed as a single create is (best of K,
  the template's cached bytes, hints in its metadata) and created on its node
  with one request; placement passes over a node with
  :data:`~weenv.cluster.placement.MAX_INFLIGHT` creates in progress, so an item
  finding every node busy **waits in the queue** (retrying, 20 ms doubling to
  0.5 s) up to ``queue_timeout_s``, after which its line is a ``capacity`` error.
  At most ``concurrency`` items (default: ``MAX_INFLIGHT`` per alive node) are
  in flight at once.
- **A client that leaves** gets nothing made for it kept: items not started are
  not started, environments made or being made and not yet written to the
  connection are destroyed on their nodes when their create ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import TYPE_CHECKING

from starlette.responses import Response

from weenv.api.models import BatchCreateRequest
from weenv.cluster import proxy
from weenv.cluster.placement import MAX_INFLIGHT
from weenv.errors import CapacityError, WeenvError
from weenv.server.kit.stream import NDJSON, ClosingStream, batch_lines

if TYPE_CHECKING:
    from weenv.cluster.gateway import Gateway

log = logging.getLogger(__name__)

RETRY_FIRST_S = 0.02
RETRY_MAX_S = 0.5


async def batch_stream(gw: Gateway, req: BatchCreateRequest, raw: list[dict], *, queue_timeout_s: float) -> Response:
    """The answer to a batch (``req`` validated, ``raw`` its items as sent).
    Raises :class:`CapacityError` before any create if the cluster cannot hold it."""
    asks = [
        (it.template, it.resources.cpus if it.resources else None, it.resources.memory_bytes if it.resources else None)
        for it in req.items
    ]
    room = await gw.directory.call("room", asks)
    routes = await gw.routes()
    if room < len(asks):
        raise CapacityError(
            f"a batch of {len(asks)} environments is more than the cluster can hold now: room for "
            f"{room} on its {len(routes)} alive nodes; send at most {room} (or smaller ones), "
            f"or wait for environments to end"
        )
    workers = req.concurrency or min(len(asks), MAX_INFLIGHT * max(1, len(routes)))
    return ClosingStream(_events(gw, req, raw, workers, queue_timeout_s), media_type=NDJSON)


async def _events(gw: Gateway, req: BatchCreateRequest, raw: list[dict], workers: int, queue_timeout_s: float):
    loop = asyncio.get_running_loop()
    gate = asyncio.Semaphore(workers)
    left = asyncio.Event()  # the client went: start nothing more

    async def one(i: int) -> dict | None:
        item = req.items[i]
        res = item.resources
        async with gate:
            if left.is_set():
                return None
            deadline, delay = loop.time() + queue_timeout_s, RETRY_FIRST_S
            while True:
                try:
                    answer, _ = await gw.create(
                        raw[i],
                        template=item.template,
                        cpus=res.cpus if res else None,
                        memory_bytes=res.memory_bytes if res else None,
                        path="/v1/environments",
                        e2b=False,
                        id_field="id",
                    )
                    break
                except CapacityError as exc:
                    if left.is_set() or loop.time() + delay > deadline:
                        raise CapacityError(f"no node had room for it within {queue_timeout_s:g} s: {exc}") from None
                    await asyncio.sleep(delay)
                    delay = min(2 * delay, RETRY_MAX_S)
        if answer.status_code != 201:
            raise _node_error(answer)
        return answer.json()

    started = [asyncio.ensure_future(one(i)) for i in range(len(req.items))]
    undoing: set[asyncio.Task] = set()

    def undo(unwritten: list[int]) -> None:
        left.set()
        for i in unwritten:
            started[i].add_done_callback(lambda t: _undo(gw, t, undoing))

    jobs = {task: i for i, task in enumerate(started)}
    async with contextlib.aclosing(batch_lines(jobs, _env_line, undo)) as lines:  # closed with this one
        async for line in lines:
            yield line


def _env_line(i: int, environment: dict) -> bytes:
    """The line of item ``i``, made: the node's answer as it sent it."""
    return json.dumps({"index": i, "environment": environment}, separators=(",", ":")).encode() + b"\n"


def _undo(gw: Gateway, task: asyncio.Task, undoing: set) -> None:
    """Destroy what ``task`` made for a client that left (in a task of its own)."""
    if task.cancelled() or task.exception() is not None or task.result() is None:
        return
    env_id = task.result()["id"]

    async def destroy() -> None:
        try:
            route = await gw.route(env_id)
            await proxy.call(gw.client, route, "DELETE", f"/v1/environments/{env_id}")
            await gw.directory.call("forget", env_id)
        except WeenvError as exc:
            log.warning("undoing batch environment %s: %s", env_id, exc)

    t = asyncio.get_running_loop().create_task(destroy())
    undoing.add(t)
    t.add_done_callback(undoing.discard)


def _node_error(answer) -> WeenvError:
    """A node's error answer (weenv's ``{"error": {"kind", "message"}}``) as a weenv error of that kind."""
    from weenv.sdk._core import error_for_reply

    return error_for_reply(answer.status_code, answer.content)
