"""Resume through the cluster's address of a paused environment whose node is
gone: from its published pause (:mod:`weenv.node.state.handoff`), on another node.

A resume of an environment the cluster lost with its node, or does not know
(its node restarted without it, the cluster brought up again), is served from
the store (:func:`resume_elsewhere`): weenv's ``POST /v1/environments/{id}/resume``,
E2B's ``POST /e2b/sandboxes/{id}/resume`` and ``.../connect`` (``/e2b/v2`` too).

1. Any alive node reads its published pause (``GET /v1/paused/{id}``).  None:
   the environment is gone, answered as the route's own error (404 not found,
   or 410 lost).
2. Placement chooses a node with room for its resources (none: 503 ``capacity``,
   the published pause kept for a later resume).
3. That node resumes it with its own id (``POST /v1/paused/{id}/resume``):
   metadata, variables, resources and network policy as it was paused, its
   files as they were when its memory was released, its first process started
   anew; ``weenv.node`` in its metadata names that node now.

The answer is the API's own, as a resume on its own node answers: weenv's
``EnvironmentInfo`` (200), E2B's ``Sandbox`` (201; its connect on the new node:
its envd token is that node's).
"""

from __future__ import annotations

from fastapi.responses import Response

from weenv.cluster import proxy
from weenv.cluster.gateway import NODE_HINT, Gateway, _e2b_error, _message_of
from weenv.errors import CapacityError, DaemonError, InvalidInputError, WeenvError
from weenv.node.state.handoff import snapshot_name


def is_resume(method: str, path: str, env_id: str, *, e2b: bool) -> bool:
    """Whether ``method path`` resumes ``env_id`` (E2B's connect resumes a paused sandbox too)."""
    parts = path.rstrip("/").split("/")
    return (
        method == "POST" and parts[-2:-1] == [env_id] and parts[-1] in (("resume", "connect") if e2b else ("resume",))
    )


async def resume_elsewhere(gw: Gateway, env_id: str, body: dict, *, e2b: bool, why: WeenvError) -> Response:
    """Resume ``env_id`` from its published pause on a node placement chooses
    (see the module doc); ``body``: the resume's (its ``timeout``); ``why``: the
    route's error, raised if nothing of it was published.  Raises
    :class:`CapacityError` when no node has room (the published pause kept),
    :class:`ClosedError` when no node is alive."""
    timeout = body.get("timeout")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int | float)):
        raise InvalidInputError(f"timeout: {timeout!r} is not a number of seconds")
    reader = await gw.any_route()
    found = await proxy.call(gw.client, reader, "GET", f"/v1/paused/{env_id}")
    if found.status_code == 404:
        raise why
    if found.status_code != 200:
        raise DaemonError(
            f"node {reader.node_id[:12]} cannot read environment {env_id}'s published pause: {_message_of(found)}"
        )
    res = found.json()["resources"]
    try:
        placed = await gw.directory.call("place", snapshot_name(env_id), res["cpus"], res["memory_bytes"], None, None)
    except CapacityError as exc:
        raise CapacityError(
            f"no node has room to resume environment {env_id} ({res['cpus']} CPUs, {res['memory_bytes'] >> 20} MiB): "
            f"{exc}; its published pause (snapshot {snapshot_name(env_id)}) is kept: resume it once a node has room"
        ) from None
    node_id, made = placed.route.node_id, None
    try:
        answer = await proxy.call(
            gw.client,
            placed.route,
            "POST",
            f"/v1/paused/{env_id}/resume",
            json={"timeout": timeout, "metadata": {NODE_HINT: node_id}},
        )
        if answer.status_code == 201:
            made = env_id
    finally:
        await gw.done(placed.token, node_id, made)
    if made is None:  # the node's refusal (its published pause is kept)
        if e2b:
            return _e2b_error(answer.status_code, _message_of(answer))
        return Response(answer.content, status_code=answer.status_code, media_type="application/json")
    if e2b:  # E2B's Sandbox, with the envd token of the node it runs on now
        answer = await proxy.call(
            gw.client, placed.route, "POST", f"/e2b/sandboxes/{env_id}/connect", e2b=True, json={}
        )
        if answer.status_code not in (200, 201):
            return _e2b_error(answer.status_code, _message_of(answer))
    return Response(answer.content, status_code=201 if e2b else 200, media_type="application/json")
