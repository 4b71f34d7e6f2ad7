"""E2B compatibility: the endpoints the official ``e2b`` Python SDK calls, over a weenv node.

A user of the ``e2b`` SDK switches to weenv by pointing the SDK at it::

    E2B_API_URL=http://HOST:PORT/e2b          # the control plane (REST)
    E2B_SANDBOX_URL=http://HOST:PORT/e2b/envd # the in-sandbox services, one URL for all
    E2B_API_KEY=e2b_...                       # a key this app accepts

:func:`create_e2b_app` returns an ASGI app (FastAPI) to mount on the daemon's app
(``app.mount("/e2b", create_e2b_app(node, api_keys=[api_key.e2b]))``):

- ``/`` — E2B's REST API (:mod:`.api`): create, connect, list, get, kill, set_timeout;
  its template API (:mod:`.templates`, builds in :mod:`.builds`);
- ``/envd`` — envd, E2B's in-sandbox services (:mod:`.envd`): ``/files``, ``/health``
  and the Connect RPC services ``process.Process`` (:mod:`.processes`) and
  ``filesystem.Filesystem`` (:mod:`.files`), each request routed to the sandbox
  its ``E2b-Sandbox-Id`` header names.

Protocol sources: E2B's public ``spec/openapi.yml``, ``spec/envd/envd.yaml`` and
``spec/envd/{process,filesystem}/*.proto`` (github.com/e2b-dev/E2B), and the
Connect protocol (connectrpc.com/docs/protocol).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from fastapi import FastAPI
from starlette.datastructures import Headers, QueryParams
from starlette.routing import Mount

from weenv.config import settings
from weenv.errors import InvalidInputError
from weenv.node.node import Node
from weenv.server.e2b.api import install_error_handlers, key_checker, key_dependency, make_api
from weenv.server.e2b.builds import Templates
from weenv.server.e2b.envd import Envd, sandbox_id_in, signed_sandbox_id
from weenv.server.e2b.sandboxes import Sandboxes, token_secret
from weenv.server.e2b.signed import SignatureError
from weenv.server.e2b.templates import UPLOAD_HEADER, make_template_api

READY_TIMEOUT_S = 120.0
"""Seconds a create waits for a template's ready command (``WEENV_E2B_READY_TIMEOUT_S``)."""

KEY_RE = re.compile(r"^e2b_[0-9a-f]{32,128}\Z")
"""The form of an E2B API key: ``e2b_`` and hex digits (the daemon's key spelled
for E2B clients is :attr:`weenv.server.auth.ApiKey.e2b`)."""


def create_e2b_app(node: Node, *, api_keys: Iterable[str]) -> FastAPI:
    """The E2B-compatible API over ``node`` (a started node, shared with the daemon).

    ``api_keys``: the keys accepted in ``X-API-Key`` (each ``e2b_`` + hex: the
    daemon passes ``[api_key.e2b]``).  Raises :class:`InvalidInputError` for a key
    of another form or none.  ``app.state.sandboxes`` is the :class:`Sandboxes`
    registry, ``app.state.templates`` the :class:`Templates` (call its ``close()``
    when the daemon stops: it cancels and undoes the builds running),
    ``app.state.watches`` the directory watchers (:class:`~weenv.server.e2b.watch.Watches`:
    ``close()`` them then too).
    """
    keys = list(api_keys)
    if not keys or not all(isinstance(k, str) and KEY_RE.match(k) for k in keys):
        raise InvalidInputError("E2B API keys are 'e2b_' followed by 32 to 128 lowercase hex digits")
    # envd access tokens keyed by the first API key: stable across restarts, new with a new key
    secret = token_secret(keys[0])
    sandboxes = Sandboxes(node, token_secret=secret)
    server = settings().server
    templates = Templates(node, secret=secret, ttl_s=server.e2b_upload_ttl_s, max_total=server.e2b_uploads_max_bytes)
    app = FastAPI(title="weenv: E2B-compatible API", docs_url=None, redoc_url=None)
    install_error_handlers(app)
    check = key_checker(keys)
    ready_timeout = server.e2b_ready_timeout_s
    app.include_router(make_api(sandboxes, check, resolve=templates.resolve, ready_timeout=ready_timeout))
    keyed, uploads = make_template_api(templates, key_dependency(check))
    app.include_router(keyed)
    app.include_router(uploads)
    envd = Envd(sandboxes)
    app.router.routes.append(Mount("/envd", routes=envd.routes()))
    app.state.sandboxes = sandboxes
    app.state.watches = envd.watches
    app.state.envd = envd
    app.state.templates = templates
    app.state.envd_credentialed = lambda scope: _credentialed(sandboxes, templates, scope)
    return app


def _credentialed(sandboxes: Sandboxes, templates: Templates, scope: dict) -> bool:
    """Whether the request of ASGI ``scope`` carries the envd access token of
    the sandbox it names, or is an upload with that upload's live token (a
    token is no credential for any other route)."""
    headers = Headers(scope=scope)
    if templates.uploads.authorises(headers.get(UPLOAD_HEADER), scope.get("method", ""), scope.get("path", "")):
        return True
    if scope.get("method") == "POST" and scope.get("path", "").endswith("/files"):  # a signed URL's upload
        try:
            if (
                signed_sandbox_id(
                    sandboxes, scope.get("method", ""), headers, QueryParams(scope.get("query_string", b""))
                )
                is not None
            ):
                return True
        except SignatureError:
            return False
    sid = sandbox_id_in(headers)
    return bool(sid) and sandboxes.token_matches(sid, headers.get("x-access-token"))


__all__ = ["check_api_key", "create_e2b_app", "load_or_create_api_key", "new_api_key"]
