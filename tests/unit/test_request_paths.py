"""A request path holding a control character (a percent-encoded newline,
tab, NUL) is refused 400 before routing, in the error form of the API it
names: Starlette's route patterns end in ``$``, which matches before a final
newline, so ``/e2b/templates/%0A`` reached the E2B app as ``templates/`` and
was answered 501 "weenv does not serve" (found by the API fuzzing)."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from weenv.server.limits import BodyLimit


def _app() -> FastAPI:
    app = FastAPI()
    app.add_middleware(BodyLimit)

    @app.get("/e2b/templates/{template_id}")
    def template(template_id: str) -> dict:
        return {"templateID": template_id}

    return app


@pytest.mark.parametrize(
    "path", ["/e2b/templates/%0A", "/e2b/templates/a%0Ab", "/e2b/templates/%09", "/e2b/templates/%00"]
)
def test_an_e2b_path_with_a_control_character_is_400_in_e2b_form(path):
    with TestClient(_app()) as client:
        r = client.get(path)
    assert r.status_code == 400, r.text
    assert r.json()["code"] == 400 and "control character" in r.json()["message"]


def test_a_weenv_path_with_a_control_character_is_invalid_input():
    with TestClient(_app()) as client:
        r = client.get("/v1/environments/%0A")
    assert r.status_code == 400 and r.json()["error"]["kind"] == "invalid_input"


def test_a_path_without_one_is_routed():
    with TestClient(_app()) as client:
        assert client.get("/e2b/templates/t%20x").json() == {"templateID": "t x"}
