"""The SDK's flows (create, commands, files, batches) against a fake daemon
behind ``httpx.MockTransport``: the requests each method sends, how streamed
answers become results and callbacks, and how error answers and transport
failures become weenv errors."""

from __future__ import annotations

import asyncio
import base64
import json

import httpx
import pytest

from weenv import AsyncSandbox, Sandbox
from weenv.errors import (
    ERROR_KINDS,
    AuthenticationError,
    CapacityError,
    CommandTimeoutError,
    DaemonError,
    InvalidInputError,
    NotFoundError,
    OutputLimitError,
    WeenvError,
)
from weenv.sdk import _core

URL = "http://node.test:7000"


def env_info(env_id: str, template: str = "task", **kw) -> dict:
    return {
        "id": env_id,
        "template": template,
        "template_digest": "sha256:" + "0" * 64,
        "created_at": 1.0,
        "state": "running",
        "rootfs": f"/r/{env_id}",
        "resources": {},
        "timing": {},
        **kw,
    }


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def ndjson(*lines: dict) -> bytes:
    return b"".join(json.dumps(x).encode() + b"\n" for x in lines)


def error(status: int, kind: str, message: str) -> httpx.Response:
    return httpx.Response(status, json={"error": {"kind": kind, "message": message}})


class FakeDaemon:
    """A tiny weenv API: environments in a dict, files in a dict, commands that
    echo their argv; every request is kept in ``requests``."""

    def __init__(self):
        self.requests: list[httpx.Request] = []
        self.envs: dict[str, dict] = {}
        self.files: dict[tuple[str, str], bytes] = {}
        self.answers: dict[tuple[str, str], httpx.Response] = {}
        """(method, path) -> a canned answer, for error cases."""

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        method, path = request.method, request.url.path
        if (method, path) in self.answers:
            return self.answers[(method, path)]
        body = json.loads(request.content) if request.headers.get("content-type") == "application/json" else None
        parts = path.removeprefix("/v1/").split("/")
        if parts == ["environments"] and method == "POST":
            env_id = f"e{len(self.envs)}"
            self.envs[env_id] = env_info(
                env_id, body["template"], envs=body["envs"], metadata=body["metadata"], priority=body["priority"]
            )
            return httpx.Response(200, json=self.envs[env_id])
        if parts == ["environments", "batch"]:
            lines = []
            for i, item in enumerate(body["items"]):
                if item["template"] == "missing":
                    lines.append({"index": i, "error": {"kind": "not_found", "message": "no template missing"}})
                else:
                    env_id = f"e{len(self.envs)}"
                    self.envs[env_id] = env_info(env_id, item["template"])
                    lines.append({"index": i, "environment": self.envs[env_id]})
            return httpx.Response(200, content=ndjson(*reversed(lines)))  # in the order they are ready
        if parts[0] != "environments" or parts[1] not in self.envs:
            return error(404, "not_found", f"no environment {parts[1:2]}")
        env_id, rest = parts[1], parts[2:]
        if not rest and method == "GET":
            return httpx.Response(200, json=self.envs[env_id])
        if not rest and method == "DELETE":
            del self.envs[env_id]
            return httpx.Response(204)
        if rest == ["commands", "stream"]:
            cmd = body["command"]
            text = (" ".join(cmd) if isinstance(cmd, list) else cmd).encode()
            if body.get("timeout"):
                return httpx.Response(
                    200,
                    content=ndjson(
                        {"type": "start", "pid": 7},
                        {"type": "end", "exit_code": 137, "timed_out": True, "duration_s": body["timeout"]},
                    ),
                )
            half = len(text) // 2
            return httpx.Response(
                200,
                content=ndjson(
                    {"type": "start", "pid": 7},
                    {"type": "stdout", "data": b64(text[:half])},
                    {"type": "stderr", "data": b64(b"warn")},
                    {"type": "stdout", "data": b64(text[half:])},
                    {"type": "end", "exit_code": 3, "timed_out": False, "duration_s": 0.5},
                ),
            )
        if rest == ["files"]:
            key = (env_id, request.url.params["path"])
            if method == "PUT":
                self.files[key] = request.content
                return httpx.Response(200, json={"path": key[1], "size": len(request.content)})
            if method == "GET":
                if key not in self.files:
                    return error(404, "not_found", f"no file {key[1]}")
                return httpx.Response(200, content=self.files[key])
        if rest == ["files", "stat"]:
            key = (env_id, request.url.params["path"])
            if key not in self.files:
                return error(404, "not_found", f"no file {key[1]}")
            return httpx.Response(
                200,
                json={
                    "name": key[1].rsplit("/", 1)[-1],
                    "path": key[1],
                    "type": "file",
                    "size": len(self.files[key]),
                    "mode": 0o644,
                },
            )
        return error(400, "invalid_input", f"unknown {method} {path}")


@pytest.fixture
def daemon(monkeypatch):
    """A FakeDaemon every SDK client of this test reaches (sync and async)."""
    return serve(monkeypatch, FakeDaemon())


def serve(monkeypatch, fake: FakeDaemon) -> FakeDaemon:
    """Make ``fake`` the daemon every SDK client reaches, sync and async, by WEENV_API_URL."""
    transport = httpx.MockTransport(fake)
    client, async_client = httpx.Client, httpx.AsyncClient
    monkeypatch.setattr(httpx, "Client", lambda **kw: client(**{**kw, "transport": transport}))
    monkeypatch.setattr(httpx, "AsyncClient", lambda **kw: async_client(**{**kw, "transport": transport}))
    monkeypatch.setenv("WEENV_API_URL", URL)
    monkeypatch.setenv("WEENV_API_KEY", "k" * 40)
    return fake


# --- create, info, kill ----------------------------------------------------------------------
def test_create_sends_the_request_model_with_the_key_and_returns_a_sandbox(daemon):
    s = Sandbox.create("task", timeout=60, envs={"A": "1"}, metadata={"run": "7"}, priority=5, resources={"cpus": 0.5})
    req = daemon.requests[0]
    assert (req.method, str(req.url)) == ("POST", URL + "/v1/environments")
    assert req.headers["x-api-key"] == "k" * 40
    body = json.loads(req.content)
    assert body["template"] == "task" and body["timeout"] == 60 and body["envs"] == {"A": "1"}
    assert body["metadata"] == {"run": "7"} and body["priority"] == 5 and body["resources"]["cpus"] == 0.5
    assert s.id == "e0" and s.info.template == "task" and s.info.priority == 5
    assert s.is_running()
    assert s.kill() is True and "e0" not in daemon.envs
    assert [r.method for r in daemon.requests] == ["POST", "GET", "DELETE"]


def test_a_context_manager_kills_on_exit_even_after_an_error(daemon):
    with pytest.raises(ZeroDivisionError):
        with Sandbox.create("task"):
            raise ZeroDivisionError
    assert daemon.envs == {} and daemon.requests[-1].method == "DELETE"


def test_kill_of_a_gone_sandbox_is_false_and_is_running_false(daemon):
    s = Sandbox.create("task")
    del daemon.envs[s.id]
    assert s.is_running() is False
    assert s.kill() is False


@pytest.mark.parametrize(
    "kw",
    [
        {"timeout": 0},
        {"timeout": -1},
        {"timeout": float("nan")},
        {"priority": 1001},
        {"resources": {"cpus": 0}},
        {"resources": {"bogus": 1}},
    ],
)
def test_bad_create_arguments_are_invalid_input_before_any_request(daemon, kw):
    with pytest.raises(InvalidInputError):
        Sandbox.create("task", **kw)
    assert daemon.requests == []


def test_a_bad_api_url_is_invalid_input(daemon):
    with pytest.raises(InvalidInputError, match="WEENV_API_URL"):
        Sandbox.create("task", api_url="node.test:7000")
    assert daemon.requests == []


# --- commands --------------------------------------------------------------------------------
def test_commands_run_streams_output_to_callbacks_and_returns_the_result(daemon):
    s = Sandbox.create("task")
    out, err = [], []
    r = s.commands.run(["echo", "héllo wörld"], on_stdout=out.append, on_stderr=err.append, cwd="/w")
    body = json.loads(daemon.requests[-1].content)
    assert daemon.requests[-1].url.path == f"/v1/environments/{s.id}/commands/stream"
    assert body["command"] == ["echo", "héllo wörld"] and body["cwd"] == "/w"
    assert r.exit_code == 3 and r.stdout == "echo héllo wörld" and r.stderr == "warn"
    assert "".join(out) == r.stdout and err == ["warn"]  # a character split between chunks stays whole
    assert r.pid == 7 and r.duration_s == 0.5 and not r.timed_out


def test_a_timed_out_command_raises_with_its_result(daemon):
    s = Sandbox.create("task")
    with pytest.raises(CommandTimeoutError) as info:
        s.commands.run("sleep 10", timeout=2)
    assert info.value.result.exit_code == 137 and info.value.result.timed_out


def test_an_error_event_in_the_stream_raises_its_kind(daemon):
    s = Sandbox.create("task")
    daemon.answers[("POST", f"/v1/environments/{s.id}/commands/stream")] = httpx.Response(
        200,
        content=ndjson(
            {"type": "start", "pid": 1}, {"type": "error", "error": {"kind": "output_limit", "message": "too much"}}
        ),
    )
    with pytest.raises(OutputLimitError, match="too much"):
        s.commands.run("yes")


def test_a_stream_that_ends_before_the_command_is_a_daemon_error(daemon):
    s = Sandbox.create("task")
    daemon.answers[("POST", f"/v1/environments/{s.id}/commands/stream")] = httpx.Response(
        200, content=ndjson({"type": "start", "pid": 1}, {"type": "stdout", "data": b64(b"x")})
    )
    with pytest.raises(DaemonError, match="ended before"):
        s.commands.run("true")


def test_a_line_that_is_not_json_is_a_daemon_error(daemon):
    s = Sandbox.create("task")
    daemon.answers[("POST", f"/v1/environments/{s.id}/commands/stream")] = httpx.Response(200, content=b"<html>\n")
    with pytest.raises(DaemonError, match="not JSON"):
        s.commands.run("true")


# --- files -----------------------------------------------------------------------------------
def test_files_write_read_exists_round_trip(daemon):
    s = Sandbox.create("task")
    info = s.files.write("/w/a.txt", "hé")
    assert (info.path, info.size) == ("/w/a.txt", len("hé".encode()))
    put = daemon.requests[-1]
    assert put.method == "PUT" and put.url.params["path"] == "/w/a.txt"
    assert put.headers["content-type"] == "application/octet-stream"
    assert s.files.read("/w/a.txt") == "hé" and s.files.read("/w/a.txt", format="bytes") == "hé".encode()
    assert s.files.exists("/w/a.txt") and not s.files.exists("/w/b.txt")
    with pytest.raises(NotFoundError, match="/w/b.txt"):
        s.files.read("/w/b.txt")


def test_files_write_streams_a_file_object_and_an_iterable(daemon, tmp_path):
    s = Sandbox.create("task")
    local = tmp_path / "big"
    local.write_bytes(bytes(range(256)) * 5000)
    assert s.files.upload(local, "/w/big").size == local.stat().st_size
    assert daemon.files[(s.id, "/w/big")] == local.read_bytes()
    s.files.write("/w/it", (bytes([i]) * 10 for i in range(3)))
    assert daemon.files[(s.id, "/w/it")] == b"\0" * 10 + b"\1" * 10 + b"\2" * 10
    dest = tmp_path / "back"
    assert s.files.download("/w/big", dest) == local.stat().st_size and dest.read_bytes() == local.read_bytes()
    with pytest.raises(NotFoundError):
        s.files.download("/w/none", tmp_path / "none")


@pytest.mark.parametrize("bad", ["", "a/b", "../x"])
def test_a_bad_sandbox_id_is_refused_before_a_request(daemon, bad):
    with pytest.raises((InvalidInputError, NotFoundError)):
        Sandbox.connect(bad)
    assert all("/environments/../" not in str(r.url) for r in daemon.requests)


# --- batches ---------------------------------------------------------------------------------
def test_create_many_returns_sandboxes_in_request_order_and_calls_on_ready(daemon):
    ready = []
    batch = Sandbox.create_many(["a", "b", "c"], on_ready=lambda i, s: ready.append((i, s.info.template)))
    assert [s.info.template for s in batch] == ["a", "b", "c"]
    assert sorted(ready) == [(0, "a"), (1, "b"), (2, "c")] and ready[0] == (2, "c")  # as each is ready
    assert len(daemon.envs) == 3


def test_create_many_with_a_failure_kills_the_others_and_raises(daemon):
    with pytest.raises(NotFoundError, match="missing"):
        Sandbox.create_many(["a", "missing", "b"])
    assert daemon.envs == {}


def test_create_many_with_return_exceptions_keeps_each_in_its_place(daemon):
    batch = Sandbox.create_many(["a", "missing"], return_exceptions=True)
    assert isinstance(batch[0], Sandbox) and isinstance(batch[1], NotFoundError)
    assert list(daemon.envs) == [batch[0].id]


def test_create_many_count_needs_one_template(daemon):
    assert [s.info.template for s in Sandbox.create_many("t", count=3)] == ["t"] * 3
    with pytest.raises(InvalidInputError):
        Sandbox.create_many(["a", "b"], count=2)


# --- error answers and transport failures ------------------------------------------------------
@pytest.mark.parametrize(
    "status, kind, cls",
    [
        (404, "not_found", NotFoundError),
        (400, "invalid_input", InvalidInputError),
        (401, "authentication", AuthenticationError),
        (408, "timeout", CommandTimeoutError),
        (413, "output_limit", OutputLimitError),
        (503, "capacity", CapacityError),
        (500, "no_such_kind", WeenvError),
    ],
)
def test_error_answers_raise_the_class_of_their_kind(daemon, status, kind, cls):
    daemon.answers[("POST", "/v1/environments")] = error(status, kind, f"the {kind} message")
    with pytest.raises(cls, match=f"the {kind} message") as info:
        Sandbox.create("task")
    assert type(info.value) is cls


def test_an_error_answer_that_is_not_weenvs_is_a_daemon_error_with_the_status(daemon):
    daemon.answers[("POST", "/v1/environments")] = httpx.Response(502, content=b"Bad Gateway from a proxy")
    with pytest.raises(DaemonError, match="502: Bad Gateway"):
        Sandbox.create("task")


@pytest.mark.parametrize(
    "exc, cls",
    [
        (httpx.ConnectError("refused"), DaemonError),
        (httpx.ReadTimeout("slow"), CommandTimeoutError),
        (httpx.RemoteProtocolError("cut"), DaemonError),
    ],
)
def test_transport_failures_are_weenv_errors_with_the_cause(monkeypatch, exc, cls):
    def fail(request):
        raise exc

    transport = httpx.MockTransport(fail)
    client = httpx.Client
    monkeypatch.setattr(httpx, "Client", lambda **kw: client(**{**kw, "transport": transport}))
    with pytest.raises(cls, match=URL) as info:
        Sandbox.create("task", api_url=URL)
    assert info.value.__cause__ is exc


def test_every_wire_kind_maps_back_to_its_class():
    for kind, cls in ERROR_KINDS.items():
        assert cls.kind == kind
        e = _core.error_for_reply(500, json.dumps({"error": {"kind": kind, "message": "m"}}).encode())
        assert type(e) is cls and str(e) == "m"
    assert len(set(ERROR_KINDS.values())) == len(ERROR_KINDS)


# --- the async face ----------------------------------------------------------------------------
def test_the_async_face_does_the_same_flows(daemon):
    async def main():
        out = []
        async with await AsyncSandbox.create("task", envs={"A": "1"}) as s:
            r = await s.commands.run("echo hi", on_stdout=out.append)
            await s.files.write("/f", b"\0\1")
            data = await s.files.read("/f", format="bytes")
            missing = await s.files.exists("/nope")
        return s.id, r, out, data, missing

    env_id, r, out, data, missing = asyncio.run(main())
    assert r.exit_code == 3 and r.stdout == "echo hi" and "".join(out) == "echo hi"
    assert data == b"\0\1" and missing is False
    assert daemon.envs == {} and daemon.requests[-1].method == "DELETE" and env_id == "e0"


def test_async_callbacks_may_be_coroutines(daemon):
    async def main():
        seen = []

        async def on_stdout(text):
            await asyncio.sleep(0)
            seen.append(text)

        s = await AsyncSandbox.create("task")
        await s.commands.run(["ab", "cd"], on_stdout=on_stdout)
        await s.kill()
        return seen

    assert "".join(asyncio.run(main())) == "ab cd"


# --- the node client (what the CLI uses) ------------------------------------------------------
def test_node_client_batch_reports_each_event_as_it_comes_and_keeps_failures(daemon):
    from weenv.api.models import CreateRequest
    from weenv.sdk import NodeClient

    seen = []
    with NodeClient() as c:
        events = c.create_many(
            [CreateRequest(template="a"), CreateRequest(template="missing")],
            concurrency=2,
            on_event=lambda ev: seen.append(ev.index),
        )
    assert seen == [1, 0] and [e.index for e in events] == [1, 0]  # the daemon's order
    assert events[0].error.kind == "not_found" and events[1].environment.template == "a"
    assert list(daemon.envs) == ["e0"]  # a failed item destroys nothing
    assert json.loads(daemon.requests[0].content)["concurrency"] == 2


def test_node_client_records_commands_stats_and_admin(daemon):
    from weenv.api.models import ExecResult
    from weenv.sdk import AsyncNodeClient, NodeClient

    ran = ExecResult(exit_code=0, stdout=b"out\xff", stderr=b"", duration_s=0.1)
    daemon.answers[("POST", "/v1/environments/e0/commands")] = httpx.Response(200, content=ran.model_dump_json())
    daemon.answers[("GET", "/v1/health")] = httpx.Response(200, json={"ok": True})
    daemon.answers[("POST", "/v1/cache/drop")] = httpx.Response(204)
    daemon.answers[("POST", "/v1/shutdown")] = httpx.Response(202, json={})
    with NodeClient() as c:
        info = c.create("task", first_command=False, priority=3)
        assert json.loads(daemon.requests[-1].content)["first_command"] is False
        assert c.exec(info.id, ["echo", "out"], env={"A": "1"}) == ran
        assert json.loads(daemon.requests[-1].content)["env"] == {"A": "1"}
        assert c.health() is True
        c.drop_cache()
        c.shutdown()
        c.destroy(info.id)
        with pytest.raises(NotFoundError):
            c.destroy(info.id)  # a record client: a missing environment is an error
        with pytest.raises(InvalidInputError):
            c.exec("../../etc", ["true"])

    daemon.answers[("GET", "/v1/health")] = httpx.Response(200, json={"ok": True})  # an answer is read once

    async def main():
        async with AsyncNodeClient() as c:
            return await c.health()

    assert asyncio.run(main()) is True


def test_node_client_on_a_socket_ignores_the_environments_url(daemon, tmp_path):
    """``socket=``: the given home's daemon, even with WEENV_API_URL set (the daemon helpers' own client)."""
    from weenv.sdk import NodeClient

    with NodeClient(socket=tmp_path / "weenv.sock") as c:
        assert c.where == f"unix:{tmp_path / 'weenv.sock'}"
        assert c._conn.config.headers == {}
