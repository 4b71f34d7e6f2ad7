"""Closed, busy and broken are kinds of their own (trio's distinction), apart
from a client's bad input; every error class is a wire kind."""

from __future__ import annotations

import pytest

from weenv import errors
from weenv.config import Paths
from weenv.errors import ERROR_KINDS, BusyError, ClosedError, InvalidInputError, WeenvError
from weenv.node.cgroups import CgroupError, LimitRefusedError
from weenv.node.node import Node
from weenv.server.kit.errors import STATUS


def test_a_node_not_started_is_closed_not_bad_input(tmp_path):
    node = Node(Paths(home=tmp_path / "home", cache=tmp_path / "cache", store_url=f"file://{tmp_path}/store"))
    with pytest.raises(ClosedError, match="not started") as caught:
        node.create("task")
    assert not isinstance(caught.value, InvalidInputError)
    assert STATUS[caught.value.kind] == 503  # a client retries elsewhere, it does not fix its request


def test_closed_busy_broken_and_cgroup_errors_are_wire_kinds():
    for cls in (ClosedError, BusyError, errors.BrokenError, CgroupError, LimitRefusedError):
        assert ERROR_KINDS[cls.kind] is cls and issubclass(cls, WeenvError)
    assert issubclass(LimitRefusedError, CgroupError) and issubclass(CgroupError, OSError)
    assert {STATUS["closed"], STATUS["busy"], STATUS["broken"]} == {503, 409, 502}
    every = {c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, WeenvError)}
    assert every == set(ERROR_KINDS.values())
