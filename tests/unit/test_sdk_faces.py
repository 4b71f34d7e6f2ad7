"""The SDK's two faces (``weenv.Sandbox``, ``weenv.AsyncSandbox``) over one core."""

from __future__ import annotations

import inspect

import weenv
from weenv import AsyncSandbox, Sandbox
from weenv.sdk import _async, _sync

ASYNC_NAMES = {"close": "aclose"}
"""Methods whose async twin has another name (trio's and httpx's)."""


def test_sync_and_async_faces_match():
    """One logic, two faces: the same public methods with the same parameters
    (``close`` is ``aclose`` on the async face)."""
    pairs = [
        (_sync.Sandbox, _async.AsyncSandbox),
        (_sync.Commands, _async.AsyncCommands),
        (_sync.Files, _async.AsyncFiles),
        (_sync.CommandHandle, _async.AsyncCommandHandle),
    ]
    for s, a in pairs:
        names = {n for n in dir(s) if not n.startswith("_")}
        assert {ASYNC_NAMES.get(n, n) for n in names} == {n for n in dir(a) if not n.startswith("_")}, (s, a)
        for n in names:
            fs, fa = getattr(s, n), getattr(a, ASYNC_NAMES.get(n, n))
            if callable(fs) and not isinstance(fs, type):
                assert list(inspect.signature(fs).parameters) == list(inspect.signature(fa).parameters), n
                assert inspect.iscoroutinefunction(fa) != inspect.iscoroutinefunction(fs) or n == "pid", n
    assert weenv.Sandbox is Sandbox and weenv.AsyncSandbox is AsyncSandbox
