"""The route a node serves its peers' chunk requests on (:mod:`weenv.node.peers`)::

    GET /peer/v1/chunks/{digest}   X-Weenv-Peer-Token: TOKEN  [X-Weenv-Peer-Rank: N, the asker's]
        -> 200 the chunk's plaintext (application/octet-stream)
        -> 404 this node does not hold it (it fetches nothing for a peer)
        -> 409 at the node's serving bound (kind busy); 401 without the peer token

Only content-addressed chunk reads: the peer token opens this route and no
other (the node's API key is not a peer's).  The node is told its peers and
the token by ``PUT /v1/peers`` (API key or Unix socket; :mod:`weenv.server.api`).
"""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from weenv.errors import AuthenticationError
from weenv.node.node import Node
from weenv.node.peers import CHUNK_PATH, RANK_HEADER, TOKEN_HEADER


def peer_router(node: Node) -> APIRouter:
    r = APIRouter()

    @r.get(CHUNK_PATH + "{digest}", response_class=Response)
    def peer_chunk(digest: str, request: Request) -> Response:
        if not node.peers.check_token(request.headers.get(TOKEN_HEADER)):
            raise AuthenticationError(f"a peer's chunk request needs the cluster's peer token ({TOKEN_HEADER})")
        rank = request.headers.get(RANK_HEADER, "")
        data = node.peers.serve(digest, int(rank) if rank.isascii() and rank.isdigit() and len(rank) <= 20 else None)
        if data is None:
            return Response(status_code=404)
        return Response(data, media_type="application/octet-stream")

    return r
