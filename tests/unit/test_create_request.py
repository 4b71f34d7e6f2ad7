"""Node.create's request: the model the server and SDK share, or a template
with the model's fields as keywords, checked once, by the model."""

from __future__ import annotations

import pytest

from weenv.api.models import CreateRequest
from weenv.errors import InvalidInputError
from weenv.node.node.create import _request


def test_keywords_make_the_shared_model():
    req = _request("task", {"timeout": 5, "priority": 3, "envs": {"A": "1"}, "resources": None})
    assert req == CreateRequest(template="task", timeout=5.0, priority=3, envs={"A": "1"})
    given = CreateRequest(template="task", metadata={"k": "v"})
    assert _request(given, {}) is given


@pytest.mark.parametrize(
    "fields",
    [
        {"timeout": -1},
        {"timeout": 8 * 86400},
        {"timeout": float("inf")},
        {"priority": 1001},
        {"envs": {"A=B": "1"}},
        {"envs": {"A": "a\0b"}},
        {"metadata": {"": "v"}},
    ],
)
def test_bad_fields_are_invalid_input(fields):
    with pytest.raises(InvalidInputError):
        _request("task", fields)
    if "envs" in fields:  # the node's own rule holds for a request made elsewhere too
        with pytest.raises(InvalidInputError):
            _request(CreateRequest(template="task", **fields), {})


def test_misuse_is_a_type_error():
    with pytest.raises(TypeError):
        _request(CreateRequest(template="task"), {"timeout": 1})
    with pytest.raises(TypeError):
        _request("task", {"bogus": 1})
    with pytest.raises(TypeError):
        _request("task", {"template": "other"})
