"""prime-sandboxes compatibility: the endpoints Prime Intellect's ``prime-sandboxes``
client (the sandboxes of ``verifiers``' environments) calls, over a weenv node.

A user of the client switches to weenv by pointing it at the daemon::

    PRIME_API_BASE_URL=http://HOST:PORT/prime   # the client adds /api/v1
    PRIME_API_KEY=KEY                           # the daemon's API key ($WEENV_HOME/run/api-key)

:func:`create_prime_app` returns an ASGI app (FastAPI) the daemon mounts at
``/prime`` beside the E2B one:

- ``/api/v1`` — the control plane (:mod:`.api`): create, list, get, delete,
  bulk delete, batch status, gateway auth;
- ``/gateway/{ns}/{sandbox id}`` — the gateway (:mod:`.gateway`): a command as
  a Connect stream, file upload, download and read.

A sandbox's ``docker_image`` is a weenv template (:mod:`.images`): an E2B
template of the daemon, a template of the store, or an image of a loopback
registry imported on first use.  Its OpenAPI document is ``/prime/openapi.json``.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI
from starlette.routing import Mount

from weenv.node.node import Node
from weenv.server.auth import ApiKey
from weenv.server.e2b.sandboxes import Sandboxes
from weenv.server.prime.api import install_error_handlers, make_api
from weenv.server.prime.gateway import Gateway
from weenv.server.prime.images import Images
from weenv.server.prime.sandboxes import Tokens


def create_prime_app(
    node: Node, *, api_key: ApiKey, sandboxes: Sandboxes, resolve: Callable[[str], str | None] | None = None
) -> FastAPI:
    """The prime-compatible API over ``node`` (started, shared with the daemon).

    ``api_key``: the key the control plane accepts (``Authorization: Bearer``);
    ``sandboxes``: the E2B face's registry (its template runtime configs);
    ``resolve``: E2B's template lookup, so E2B-built templates are images too.
    ``app.state.credentialed(scope)`` says whether a gateway request carries its
    sandbox's token (for the daemon's body limit)."""
    tokens = Tokens(api_key.value)
    app = FastAPI(title="weenv: prime-sandboxes-compatible API", docs_url=None, redoc_url=None)
    install_error_handlers(app)
    app.include_router(make_api(node, Images(node, resolve=resolve), tokens, api_key))
    gateway = Gateway(sandboxes, tokens)
    app.router.routes.append(Mount("/gateway", routes=gateway.routes()))
    app.state.credentialed = gateway.credentialed
    return app


__all__ = ["create_prime_app"]
