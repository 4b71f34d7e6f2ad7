"""Who may see the dashboard, and which posts come from its own pages.

A browser presents the API key as the ``weenv_key`` cookie (HttpOnly,
SameSite=Strict, path ``/ui``) that the login form sets; a script as
``X-API-Key`` or ``Authorization: Bearer`` (:func:`weenv.server.auth.presented_key`).
A post that changes something (an action, the login) must come from the
dashboard's own origin: its ``Origin`` (else ``Referer``) names this host, and,
when the key came as the cookie, the form carries :func:`form_token`.  A
cross-site page never gets the cookie (SameSite=Strict), but pages of the same
site on another port would: the origin check refuses them.
"""

from __future__ import annotations

import hashlib
import hmac
from urllib.parse import urlsplit

from weenv.server.auth import ApiKey, presented_key

COOKIE = "weenv_key"
PATH = "/ui"


def on_trusted_socket(scope: dict, trusted_socket: str | None) -> bool:
    """Whether the request came on the Unix socket whose file mode decides who connects."""
    server = scope.get("server")
    return trusted_socket is not None and bool(server) and server[1] is None and server[0] == trusted_socket


def key_source(headers, cookies: dict, api_key: ApiKey | None) -> str | None:
    """``"header"`` or ``"cookie"``: where a valid key came from; None if none did."""
    if api_key is None:
        return None
    if api_key.matches(presented_key(headers)):
        return "header"
    if api_key.matches(cookies.get(COOKIE)):
        return "cookie"
    return None


def form_token(api_key: ApiKey) -> str:
    """The token the dashboard's forms carry: a MAC of a fixed text under the key
    (a page of another origin can neither read it nor make it)."""
    return hmac.new(api_key.value.encode(), b"weenv-dashboard-form", hashlib.sha256).hexdigest()[:32]


def foreign_origin(headers, scheme: str) -> str | None:
    """Why a post is not the dashboard's own (its ``Origin``, else its
    ``Referer``, names another origin than ``scheme://Host``, or it names
    none); None if it is."""
    host = headers.get("host")
    own = f"{scheme}://{host}"
    origin = headers.get("origin")
    if origin is None:
        referer = headers.get("referer")
        if referer is None:
            return "the request names no Origin (nor Referer)"
        parts = urlsplit(referer)
        origin = f"{parts.scheme}://{parts.netloc}"
    if origin != own:
        return f"the request comes from {origin}, not from this dashboard ({own})"
    return None
