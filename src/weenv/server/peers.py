"""The route a node serves its peers' chunk requests on (:mod:`weenv.node.data.peers`)::

    GET /peer/v1/chunks/{digest}   X-Weenv-Peer-Token: TOKEN  [X-Weenv-Peer-Rank: N, the asker's]
        [X-Weenv-Peer-Wait: S, the seconds the asker waits for the answer]
        -> 200 the chunk's plaintext (application/octet-stream)
        -> 404 this node does not hold it (it fetches nothing for a peer)
        -> 409 at the node's serving bound, or its rate's tokens would come after the asker
           stops waiting (then with Retry-After: seconds) (kind busy); 401 without the peer token

Only content-addressed chunk reads: the peer token opens this route and no
other (the node's API key is not a peer's).  The node is told its peers and
the token by ``PUT /v1/peers`` (API key or Unix socket; :mod:`weenv.server.api`).
"""

from __future__ import annotations

import math

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from weenv.errors import AuthenticationError
from weenv.node.data.peers import CHUNK_PATH, RANK_HEADER, TOKEN_HEADER, WAIT_HEADER, RateBusyError, parse_wait
from weenv.node.node import Node


def peer_router(node: Node) -> APIRouter:
    r = APIRouter()

    @r.get(CHUNK_PATH + "{digest}", response_class=Response)
    def peer_chunk(digest: str, request: Request) -> Response:
        if not node.peers.check_token(request.headers.get(TOKEN_HEADER)):
            raise AuthenticationError(f"a peer's chunk request needs the cluster's peer token ({TOKEN_HEADER})")
        rank = request.headers.get(RANK_HEADER, "")
        try:
            data = node.peers.serve(
                digest,
                int(rank) if rank.isascii() and rank.isdigit() and len(rank) <= 20 else None,
                parse_wait(request.headers.get(WAIT_HEADER)),
            )
        except RateBusyError as exc:
            return JSONResponse(
                {"error": {"kind": exc.kind, "message": str(exc)}},
                status_code=409,
                headers={"retry-after": str(max(1, math.ceil(exc.retry_after_s)))},
            )
        if data is None:
            return Response(status_code=404)
        return Response(data, media_type="application/octet-stream")

    return r
