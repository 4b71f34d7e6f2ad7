"""The E2B face's answer to a request whose method its API does not use: a
method of E2B's API on a route weenv lacks is a feature not served yet (501,
naming it), any other method (TRACE, OPTIONS) on a served path is the client's
mistake (405 with ``Allow``), not a server error."""

from __future__ import annotations

from fastapi import APIRouter, FastAPI
from fastapi.testclient import TestClient

from weenv.server.e2b.api import install_error_handlers


def _app() -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)
    router = APIRouter()

    @router.get("/sandboxes/{sandbox_id}")
    def get(sandbox_id: str) -> dict:
        return {"sandboxID": sandbox_id}

    app.include_router(router)
    return app


def test_a_method_outside_e2b_api_on_a_served_path_is_405_with_allow():
    with TestClient(_app()) as client:
        r = client.request("TRACE", "/sandboxes/x")
    assert r.status_code == 405, r.text
    assert r.headers["allow"] == "GET"
    assert r.json()["code"] == 405 and "TRACE" in r.json()["message"]


def test_an_e2b_method_on_a_route_weenv_lacks_stays_501_naming_the_feature():
    with TestClient(_app()) as client:
        r = client.delete("/sandboxes/x")
        missing = client.get("/volumes")
    assert r.status_code == 501 and "weenv does not serve DELETE" in r.json()["message"]
    assert missing.status_code == 501 and "volumes" in missing.json()["message"]
