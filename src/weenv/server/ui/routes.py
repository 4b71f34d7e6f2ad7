"""The dashboard's routes under ``/ui`` (see :mod:`weenv.server.ui`)::

    GET  /ui/login                       the login form (no key needed; no node data)
    POST /ui/login                       key=KEY -> 303 to /ui/, sets the weenv_key cookie (401 if wrong)
    POST /ui/logout                      -> 303 to /ui/login, the cookie cleared
    GET  /ui/                            environments: state, template, age, usage against quota, actions
    GET  /ui/node                        node health: chunk cache, chunk sources, admission, OOM kills, runtime
    GET  /ui/templates                   templates and their groups: sizes, stored bytes, mounts
    GET  /ui/tax                         the environment tax: meters' batches by phase, the node's seconds
    POST /ui/environments/{id}/{action}  kill, pause, resume, snapshot -> 303 to /ui/ (an error page if refused)
    GET  /ui/static/{name}               the stylesheet and script (no key needed; no node data)

A page asked without the key redirects to the login form; an action without
it is refused (401), as is one posted from another origin (403).
"""

from __future__ import annotations

import hmac
from importlib import resources
from urllib.parse import quote

import jinja2
from fastapi import APIRouter, Form, Request, Response
from fastapi.responses import HTMLResponse, RedirectResponse

from weenv.errors import WeenvError
from weenv.server.auth import ApiKey
from weenv.server.ui import views
from weenv.server.ui.access import (
    COOKIE,
    PATH,
    foreign_origin,
    form_token,
    key_source,
    on_trusted_socket,
)

ACTIONS = ("kill", "pause", "resume", "snapshot")
STATIC = {"ui.css": "text/css; charset=utf-8", "ui.js": "text/javascript; charset=utf-8"}
PAGES = (
    ("environments", f"{PATH}/", "Environments"),
    ("node", f"{PATH}/node", "Node"),
    ("templates", f"{PATH}/templates", "Templates"),
    ("tax", f"{PATH}/tax", "Environment tax"),
)
NO_STORE = {"cache-control": "no-store", "x-frame-options": "DENY", "referrer-policy": "same-origin"}


class _Refused(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def renderer(pages: tuple[tuple[str, str, str], ...]):
    """``render(name, request, status=200, **values)``: the dashboard's template
    ``name`` as an uncached page, its navigation ``pages`` (key, href, label)."""
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("weenv.server.ui", "templates"), autoescape=True, undefined=jinja2.StrictUndefined
    )

    def render(name: str, request: Request, status: int = 200, **values) -> HTMLResponse:
        values.setdefault("error", None)
        values.setdefault("notice", None)
        html = env.get_template(name).render(pages=pages, path=request.url.path, **values)
        return HTMLResponse(html, status_code=status, headers=NO_STORE)

    return render


NODE_KEY_WHERE = "$WEENV_HOME/run/api-key on the node"
"""Where the login form says the key is (a node's own dashboard)."""


def ui_router(node, metrics, *, api_key: ApiKey | None, trusted_socket: str | None) -> APIRouter:
    """The ``/ui`` routes over ``node`` (and ``metrics.tax``, the node's tax book)."""
    render = renderer(PAGES)
    r = APIRouter(prefix=PATH, tags=["dashboard"])

    def credentials(request: Request) -> str | None:
        """``"socket"``, ``"header"`` or ``"cookie"``: how the request is allowed; None: it is not."""
        if on_trusted_socket(request.scope, trusted_socket):
            return "socket"
        return key_source(request.headers, request.cookies, api_key)

    def page(name: str, request: Request, gather) -> Response:
        if credentials(request) is None:
            return RedirectResponse(f"{PATH}/login", status_code=303, headers=NO_STORE)
        token = form_token(api_key) if api_key is not None else ""
        return render(name, request, token=token, notice=request.query_params.get("done"), **gather())

    def check_post(request: Request, token: str | None) -> None:
        """Raises :class:`_Refused` unless the post is allowed and the dashboard's own."""
        how = credentials(request)
        if how is None:
            raise _Refused(401, "missing or wrong API key: log in at /ui/login, or send it as 'X-API-Key: KEY'")
        if how == "cookie":
            why = foreign_origin(request.headers, request.url.scheme)
            if why is not None:
                raise _Refused(403, f"refused: {why}")
            if api_key is None or token is None or not _same(token, form_token(api_key)):
                raise _Refused(403, "refused: the form's token is missing or wrong (reload the page)")

    add_access_routes(r, render, api_key, key_where=NODE_KEY_WHERE)

    @r.get("/")
    def environments_page(request: Request) -> Response:
        """The dashboard's environments page (HTML): state, template, age, usage against quota, actions."""
        return page("environments.html", request, lambda: {"rows": views.environments(node)})

    @r.get("/node")
    def node_page(request: Request) -> Response:
        """The dashboard's node health page (HTML): chunk cache, chunk sources, admission, OOM kills, runtime."""
        return page("node.html", request, lambda: {"h": views.node_health(node)})

    @r.get("/templates")
    def templates_page(request: Request) -> Response:
        """The dashboard's templates page (HTML): templates, their groups and sizes."""
        return page("templates.html", request, lambda: views.templates(node))

    @r.get("/tax")
    def tax_page(request: Request) -> Response:
        """The dashboard's environment tax page (HTML): meters' batches by phase, the node's own seconds."""
        return page("tax.html", request, lambda: views.tax(metrics.tax))

    @r.post("/environments/{env_id}/{action}")
    def act(env_id: str, action: str, request: Request, token: str | None = Form(None)) -> Response:
        """An action of the dashboard on an environment: kill, pause, resume or snapshot (the page's own posts only)."""
        try:
            check_post(request, token)
            if action not in ACTIONS:
                raise _Refused(404, f"no action {action!r}: one of {', '.join(ACTIONS)}")
            done = _act(node, env_id, action)
        except _Refused as exc:
            return render("error.html", request, exc.status, token="", error=str(exc))
        except WeenvError as exc:
            # the API's kind -> status table (app imports this module: not at its top)
            from weenv.server.kit.errors import STATUS

            return render("error.html", request, STATUS.get(exc.kind, 500), token="", error=f"{action} {env_id}: {exc}")
        return RedirectResponse(f"{PATH}/?done={quote(done)}", status_code=303, headers=NO_STORE)

    return r


def add_access_routes(r: APIRouter, render, api_key: ApiKey | None, *, key_where: str) -> None:
    """The routes that need no key on ``r``: the login form (saying the key is
    in ``key_where``), login, logout and the static assets."""

    @r.get("/login")
    def login_form(request: Request) -> Response:
        """The dashboard's login form (no key needed; it holds no node data)."""
        return render("login.html", request, token="", key_where=key_where)

    @r.post("/login")
    def login(request: Request, key: str = Form("")) -> Response:
        """Log in to the dashboard: a right ``key`` sets the ``weenv_key`` cookie (HttpOnly, SameSite=Strict)."""
        origin = request.headers.get("origin")
        why = foreign_origin(request.headers, request.url.scheme) if origin is not None else None
        if why is not None:
            return render("login.html", request, 403, token="", key_where=key_where, error=f"refused: {why}")
        if api_key is None or not api_key.matches(key.strip()):
            return render(
                "login.html", request, 401, token="", key_where=key_where, error=f"wrong key: it is in {key_where}"
            )
        response = RedirectResponse(f"{PATH}/", status_code=303, headers=NO_STORE)
        response.set_cookie(
            COOKIE, api_key.value, path=PATH, httponly=True, samesite="strict", secure=request.url.scheme == "https"
        )
        return response

    @r.post("/logout")
    def logout(request: Request) -> Response:
        """Log out of the dashboard: the ``weenv_key`` cookie is cleared."""
        response = RedirectResponse(f"{PATH}/login", status_code=303, headers=NO_STORE)
        response.delete_cookie(COOKIE, path=PATH, httponly=True, samesite="strict")
        return response

    @r.get("/static/{name}")
    def static(name: str) -> Response:
        """The dashboard's stylesheet and script (no key needed; no node data)."""
        if name not in STATIC:
            return Response("not found", status_code=404, media_type="text/plain")
        body = resources.files("weenv.server.ui").joinpath("static", name).read_bytes()
        return Response(body, media_type=STATIC[name], headers={"cache-control": "max-age=300"})


def _same(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


def _act(node, env_id: str, action: str) -> str:
    """Do ``action`` on the environment; the line the page shows after it."""
    if action == "kill":
        node.destroy(env_id)
        return f"killed {env_id}"
    if action == "pause":
        node.pause(env_id)
        return f"paused {env_id}"
    if action == "resume":
        node.resume(env_id)
        return f"resumed {env_id}"
    snap = node.snapshot(env_id, None)
    return f"snapshot {snap.name} of {env_id}"
