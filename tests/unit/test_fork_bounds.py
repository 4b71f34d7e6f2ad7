"""Fork counts and the state requests' bounds (issue 16), checked before anything is made."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from weenv.api.models import ForkRequest, ResumeRequest, SnapshotRequest
from weenv.errors import InvalidInputError
from weenv.node.state.fork import DEFAULT_MAX_FORK, check_count, max_fork_from_env

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("count", [0, -1, 101, True, 1.0, "2", None])
def test_fork_counts_out_of_bounds_are_refused(count):
    with pytest.raises(InvalidInputError, match="fork count"):
        check_count(count, 100)


def test_fork_counts_in_bounds_pass():
    assert [check_count(n, 100) for n in (1, 16, 100)] == [1, 16, 100]


def test_the_maximum_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv("WEENV_MAX_FORK", raising=False)
    assert max_fork_from_env() == DEFAULT_MAX_FORK
    monkeypatch.setenv("WEENV_MAX_FORK", "16")
    assert max_fork_from_env() == 16
    for bad in ("0", "-3", "many"):
        monkeypatch.setenv("WEENV_MAX_FORK", bad)
        with pytest.raises(InvalidInputError, match="WEENV_MAX_FORK"):
            max_fork_from_env()


@pytest.mark.parametrize(
    "body", [{"count": 0}, {"count": 10_001}, {"timeout": 0}, {"timeout": float("inf")}, {"count": 1, "extra": 1}]
)
def test_fork_requests_out_of_bounds_are_refused(body):
    with pytest.raises(ValidationError):
        ForkRequest.model_validate(body)


@pytest.mark.parametrize("count", ["true", '"2"', "2.0"])
def test_fork_request_counts_are_integers_only(count):
    """JSON ``true`` was a fork of 1 (pydantic's lax bool -> int), unlike the node's own check."""
    from weenv.server.e2b.api import ForkBody

    for model in (ForkRequest, ForkBody):
        with pytest.raises(ValidationError):
            model.model_validate_json(f'{{"count": {count}}}')


def test_snapshot_and_resume_requests_are_bounded():
    with pytest.raises(ValidationError):
        SnapshotRequest(name="x" * 129)
    with pytest.raises(ValidationError):
        ResumeRequest(timeout=-1)
    assert SnapshotRequest().name is None and ResumeRequest().timeout is None


def test_the_pause_release_time_comes_from_the_environment(monkeypatch):
    from weenv.node.state.pause import release_after_from_env

    monkeypatch.delenv("WEENV_PAUSE_RELEASE_S", raising=False)
    assert release_after_from_env() is None
    monkeypatch.setenv("WEENV_PAUSE_RELEASE_S", "300")
    assert release_after_from_env() == 300.0
    for bad in ("0", "-1", "inf", "nan", "soon"):
        monkeypatch.setenv("WEENV_PAUSE_RELEASE_S", bad)
        with pytest.raises(InvalidInputError, match="WEENV_PAUSE_RELEASE_S"):
            release_after_from_env()


@pytest.mark.parametrize("body", [{"release_memory": "yes please"}, {"memory": 1}])
def test_pause_requests_out_of_bounds_are_refused(body):
    from weenv.api.models import PauseRequest

    with pytest.raises(ValidationError):
        PauseRequest.model_validate(body)


def test_create_requests_take_only_kill_or_pause_at_their_timeout():
    from weenv.api.models import CreateRequest

    assert CreateRequest(template="t", on_timeout="pause").on_timeout == "pause"
    with pytest.raises(ValidationError):
        CreateRequest(template="t", on_timeout="hibernate")
