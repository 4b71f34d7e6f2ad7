"""The get_host relay's limits from the daemon's environment (:func:`weenv.server.e2b.ports.relay_settings`)."""

from __future__ import annotations

import pytest

from weenv.errors import InvalidInputError
from weenv.server.e2b.ports import RELAY_IDLE_S, relay_settings


def test_defaults_are_a_quarter_of_the_tcp_cap_and_a_minute(monkeypatch):
    monkeypatch.delenv("WEENV_RELAY_MAX", raising=False)
    monkeypatch.delenv("WEENV_RELAY_IDLE_S", raising=False)
    assert relay_settings(1024) == {"max_relays": 256, "idle_timeout": RELAY_IDLE_S}
    monkeypatch.setenv("WEENV_RELAY_MAX", "5000")  # never the whole cap: the API keeps some
    monkeypatch.setenv("WEENV_RELAY_IDLE_S", "2.5")
    assert relay_settings(1024) == {"max_relays": 1016, "idle_timeout": 2.5}


@pytest.mark.parametrize(
    "name,value",
    [
        ("WEENV_RELAY_MAX", "0"),
        ("WEENV_RELAY_MAX", "many"),
        ("WEENV_RELAY_IDLE_S", "-1"),
        ("WEENV_RELAY_IDLE_S", "nan"),
    ],
)
def test_a_bad_value_names_its_variable(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(InvalidInputError, match=name):
        relay_settings(1024)


def test_many_slow_relayed_connects_leave_the_shared_thread_pool_alone():
    """The relay's connects (each may wait seconds on a sandbox's port) ran on
    anyio's shared 40-thread pool: 40 slow ones starved every other route's
    thread work.  Now they take the relay's own limiter (CONNECT_THREADS at
    once); the shared pool keeps answering meanwhile.  (The node here is a
    stand-in whose connect waits on an event: a slow connect cannot be made
    on demand with a real sandbox.)"""
    import asyncio
    import threading
    import types

    import anyio.to_thread
    import httpx

    from weenv.server.e2b.ports import CONNECT_THREADS, PortProxy

    release = threading.Event()
    waiting = []

    class SlowNode:
        table = types.SimpleNamespace(
            get=lambda sid: types.SimpleNamespace(info=types.SimpleNamespace(public_traffic=True, state="running"))
        )

        def open_port(self, sandbox_id, port):
            waiting.append(port)
            release.wait(30)
            raise ConnectionRefusedError

    async def app(scope, receive, send):
        raise AssertionError("not relayed")

    proxy = PortProxy(app, SlowNode(), sandboxes=None, max_relays=100)

    async def main():
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=proxy), base_url="http://d")
        relays = [
            asyncio.ensure_future(client.get("/", headers={"Host": f"{8000 + i}-0123456789ab.e2b.app"}))
            for i in range(50)
        ]
        deadline = asyncio.get_running_loop().time() + 30
        while len(waiting) < CONNECT_THREADS:  # a relay that fails before its connect never gets here
            assert asyncio.get_running_loop().time() < deadline, f"only {len(waiting)} connects began"
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        assert len(waiting) == CONNECT_THREADS  # the rest wait for the relay's own threads
        shared = anyio.to_thread.current_default_thread_limiter()
        assert shared.borrowed_tokens == 0
        assert await asyncio.wait_for(anyio.to_thread.run_sync(lambda: "answered"), 5) == "answered"
        release.set()
        answers = await asyncio.gather(*relays)
        assert {r.status_code for r in answers} == {502} and len(waiting) == 50
        await client.aclose()

    asyncio.run(main())
