"""The prime face's pure parts: which image references name a loopback
registry (the only ones imported on first use), the template name an import
gets, and which command deadlines the gateway takes."""

from __future__ import annotations

import pytest

from weenv.server.e2b.connect import RpcError
from weenv.server.prime.gateway import command_timeout
from weenv.server.prime.images import imported_name, is_loopback_registry, registry_host


@pytest.mark.parametrize(
    ("image", "host"),
    [
        ("task", None),
        ("python:3.11", None),
        ("library/ubuntu:22.04", None),
        ("127.0.0.1:5000/repo:1", "127.0.0.1:5000"),
        ("localhost/repo", "localhost"),
        ("registry.example.com/a/b:2", "registry.example.com"),
        ("[::1]:5000/r:1", "[::1]:5000"),
    ],
)
def test_registry_host(image, host):
    assert registry_host(image) == host


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1:5000", True),
        ("127.9.9.9", True),
        ("localhost:5000", True),
        ("[::1]:5000", True),
        ("10.0.0.1:5000", False),
        ("registry.example.com", False),
        ("localhost.example.com:5000", False),
    ],
)
def test_only_loopback_registries_are_imported_from(host, loopback):
    assert is_loopback_registry(host) is loopback


def test_imported_names_are_template_names_and_differ_per_reference():
    a, b = imported_name("127.0.0.1:5000/team/Py_Thon:1"), imported_name("127.0.0.1:5000/team/Py_Thon:2")
    assert a.startswith("prime-py_thon-") and a != b
    assert imported_name("127.0.0.1:5000/r@sha256:" + "0" * 64).startswith("prime-r-")


@pytest.mark.parametrize("raw", ["0", "nan", "NaN", "-1", "1.5", "1e3", "", "99999999999"])
def test_command_deadlines_must_be_positive_whole_milliseconds(raw):
    with pytest.raises(RpcError) as err:
        command_timeout(raw)
    assert err.value.code == "invalid_argument" and "positive whole number of milliseconds" in err.value.message


def test_command_deadline_in_seconds():
    assert command_timeout("1500") == 1.5 and command_timeout(None) is None
