"""Request validation (the models the node, server and SDK share,
:mod:`weenv.api.models`) and the error mapping of the HTTP boundary
(:mod:`weenv.errors` kinds <-> :mod:`weenv.server.app` statuses)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from weenv import errors
from weenv.api.models import (
    MAX_TIMEOUT_S,
    BatchCreateEvent,
    BatchCreateRequest,
    CreateRequest,
    ErrorResponse,
    ExecRequest,
    ProcessEvent,
    ProcessStdin,
    RenameRequest,
    SetPriorityRequest,
    SetTimeoutRequest,
)
from weenv.errors import ERROR_KINDS, WeenvError
from weenv.sdk import _core
from weenv.server.kit.errors import STATUS, describe_errors, error_response


# --- requests --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "fields",
    [
        {"template": ""},
        {"template": "t", "timeout": 0},
        {"template": "t", "timeout": -5},
        {"template": "t", "timeout": MAX_TIMEOUT_S + 1},
        {"template": "t", "timeout": float("inf")},
        {"template": "t", "timeout": float("nan")},
        {"template": "t", "priority": 1001},
        {"template": "t", "priority": -1001},
        {"template": "t", "resources": {"cpus": 0}},
        {"template": "t", "colour": "red"},
        {},
    ],
)
def test_bad_create_requests_are_refused(fields):
    with pytest.raises(ValidationError):
        CreateRequest(**fields)


def test_a_create_request_at_its_bounds_and_over_json():
    r = CreateRequest(template="t", timeout=MAX_TIMEOUT_S, priority=-1000)
    assert CreateRequest.model_validate_json(r.model_dump_json()) == r
    assert CreateRequest(template="t").first_command is True and CreateRequest(template="t").envs == {}


@pytest.mark.parametrize(
    "fields",
    [
        {"items": []},
        {"items": [{"template": "t"}] * 4097},
        {"items": [{"template": "t"}], "concurrency": 0},
        {"items": [{"template": "t"}], "concurrency": 257},
    ],
)
def test_batch_bounds(fields):
    with pytest.raises(ValidationError):
        BatchCreateRequest(**fields)
    assert len(BatchCreateRequest(items=[{"template": "t"}] * 4096, concurrency=256).items) == 4096


@pytest.mark.parametrize("timeout", [0, -1, float("inf"), float("nan"), MAX_TIMEOUT_S * 2])
def test_set_timeout_refuses_non_positive_infinite_and_too_long(timeout):
    with pytest.raises(ValidationError):
        SetTimeoutRequest(timeout=timeout)


def test_set_priority_bounds():
    assert SetPriorityRequest(priority=1000).priority == 1000
    for bad in (1001, -1001, "high"):
        with pytest.raises(ValidationError):
            SetPriorityRequest(priority=bad)


@pytest.mark.parametrize(
    "fields",
    [
        {"command": ["x"], "timeout": 0},
        {"command": ["x"], "timeout": float("nan")},
        {"command": ["x"], "tag": "t" * 257},
        {"command": 5},
        {"cmd": ["x"]},
    ],
)
def test_bad_exec_requests_are_refused(fields):
    with pytest.raises(ValidationError):
        ExecRequest(**fields)


def test_bytes_travel_as_base64_in_json():
    r = ExecRequest(command="cat", stdin=b"\0\xffdata")
    wire = json.loads(r.model_dump_json())
    assert wire["stdin"] == "AP9kYXRh"
    assert ExecRequest.model_validate_json(r.model_dump_json()).stdin == b"\0\xffdata"
    e = ProcessEvent.model_validate({"type": "stdout", "data": "aGk="})
    assert e.data == b"hi"
    assert ProcessStdin.model_validate_json('{"data": "AQI=", "eof": true}') == ProcessStdin(data=b"\1\2", eof=True)
    with pytest.raises(ValidationError):
        ProcessEvent.model_validate({"type": "progress"})


def test_rename_needs_both_paths():
    for fields in ({"src": "", "dst": "b"}, {"src": "a", "dst": ""}, {"src": "a"}):
        with pytest.raises(ValidationError):
            RenameRequest(**fields)


def test_a_batch_event_holds_an_environment_or_an_error():
    ev = BatchCreateEvent.model_validate({"index": 3, "error": {"kind": "capacity", "message": "full"}})
    assert ev.environment is None and ev.error.kind == "capacity"
    assert isinstance(_core.error_for_kind(ev.error.kind, ev.error.message), errors.CapacityError)


# --- error kinds and statuses ----------------------------------------------------------------
def test_every_error_class_has_its_own_kind_and_is_in_the_table():
    classes = [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, WeenvError)]
    kinds = [c.kind for c in classes]
    assert len(kinds) == len(set(kinds))
    assert {c.kind: c for c in classes} == ERROR_KINDS


@pytest.mark.parametrize("kind", sorted(ERROR_KINDS))
def test_an_error_sent_by_the_server_comes_back_as_its_class(kind):
    cls = ERROR_KINDS[kind]
    response = error_response(cls.kind, f"a {kind} happened")
    assert response.status_code == STATUS.get(kind, 500)
    body = ErrorResponse.model_validate_json(response.body)
    assert (body.error.kind, body.error.message) == (kind, f"a {kind} happened")
    back = _core.error_for_reply(response.status_code, response.body)
    assert type(back) is cls and str(back) == f"a {kind} happened"


def test_statuses_are_client_errors_only_for_what_a_client_can_fix():
    assert {k for k, s in STATUS.items() if 400 <= s < 500} == {
        "not_found",
        "invalid_input",
        "authentication",
        "timeout",
        "output_limit",
        "too_large",
        "busy",
        "state",
        "limit_refused",
        "unknown_user",
        "pseudo_file",
        "network_forbidden",
    }
    assert set(STATUS) <= set(ERROR_KINDS)
    assert error_response("authentication", "no key").headers["www-authenticate"] == "Bearer"


def test_every_error_is_also_the_matching_builtin():
    assert issubclass(errors.NotFoundError, LookupError) and issubclass(errors.InvalidInputError, ValueError)
    assert issubclass(errors.CommandTimeoutError, TimeoutError) and issubclass(errors.DaemonError, ConnectionError)
    assert issubclass(errors.AuthenticationError, PermissionError) and issubclass(errors.OutputLimitError, ValueError)
    assert all(issubclass(c, WeenvError) for c in ERROR_KINDS.values())


def test_validation_errors_are_one_line_naming_the_field():
    try:
        CreateRequest.model_validate({"template": "t", "timeout": -1, "priority": 5000})
    except ValidationError as exc:
        line = describe_errors([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()])
    assert "\n" not in line and line.startswith("timeout: ") and "priority: " in line
    many = [{"loc": ("body", f"f{i}"), "msg": "bad"} for i in range(8)]
    assert describe_errors(many).endswith("(+3 more)")


@pytest.mark.parametrize("name", ["", "Bad Name", "-x", "a" * 129, "x/y"])
def test_snapshot_and_reset_names_follow_the_nodes_rule(name):
    """The request models refuse what :meth:`Node.snapshot` and :meth:`Node.reset`
    refuse (:func:`check_name`: one rule); before, ``""`` passed the node as "no name"."""
    from weenv.api.models import ResetRequest, SnapshotRequest
    from weenv.formats.manifest import check_name

    with pytest.raises(errors.InvalidInputError):
        check_name(name)
    with pytest.raises(ValidationError):
        SnapshotRequest(name=name)
    with pytest.raises(ValidationError):
        ResetRequest(snapshot=name)
    assert SnapshotRequest(name="snap-1.ok_2").name == "snap-1.ok_2" and SnapshotRequest().name is None


@pytest.mark.parametrize("value", [1, 0, "yes", "no", "true"])
def test_pause_release_memory_is_a_json_boolean_only(value):
    """``{"release_memory": 1}`` or ``"yes"`` was read as true (pydantic's lax bool): a
    pause that ends every process of the environment; now refused, as fork counts are."""
    from weenv.api.models import PauseRequest

    with pytest.raises(ValidationError):
        PauseRequest.model_validate_json(json.dumps({"release_memory": value}))
    assert PauseRequest.model_validate_json('{"release_memory": true}').release_memory is True
