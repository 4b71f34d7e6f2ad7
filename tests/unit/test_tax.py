"""The environment tax's arithmetic (weenv.formats.tax), the node's book of it
(weenv.server.tax) and the SDK's meter over a fake daemon (weenv.sdk._meter)."""

from __future__ import annotations

import math
import time

import httpx
import pytest
from pydantic import ValidationError
from test_sdk_flows import FakeDaemon, serve

import weenv
from weenv.formats.tax import MAX_BATCH_NAME, PHASES, Tally, TaxBatch, phase_of
from weenv.server.tax import TaxBook, command_overlap


@pytest.mark.parametrize(
    ("method", "path", "expected"),
    [
        ("POST", "/v1/environments", ("create", None)),
        ("POST", "/v1/environments/batch", ("create", None)),
        ("GET", "/v1/environments", (None, None)),
        ("DELETE", "/v1/environments/abc", ("destroy", "abc")),
        ("GET", "/v1/environments/abc", ("other", "abc")),
        ("POST", "/v1/environments/abc/timeout", ("other", "abc")),
        ("POST", "/environments/abc/commands/stream", ("exec", "abc")),
        ("GET", "/v1/environments/abc/processes/7/output", ("exec", "abc")),
        ("PUT", "/v1/environments/abc/files", ("files", "abc")),
        ("GET", "/v1/environments/abc/files/list", ("files", "abc")),
        ("GET", "/v1/templates", (None, None)),
        ("GET", "/v1/metrics", (None, None)),
    ],
)
def test_phase_of_each_route(method, path, expected):
    assert phase_of(method, path) == expected


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_tally_phases_commands_and_think_time_add_up_to_the_rollouts():
    clock = Clock()
    t = Tally("b", clock=clock)
    # rollout a: create 2 s, a 10 s command with 0.5 s overhead, 1 s of files, 3 s think, destroy 0.5 s
    t.begin("a", 100.0, node="n1")
    t.record("create", 2.0, env_id="a", node="n1")
    t.record("exec", 0.5, env_id="a", command_s=10.0)
    t.record("files", 1.0, env_id="a")
    t.record("destroy", 0.5, env_id="a")
    t.end("a", 117.0)
    # rollout b on another node, not destroyed: its span runs to the batch's end
    t.begin("b", 101.0, node="n2")
    t.record("create", 1.0, env_id="b", node="n2")
    t.record("create", 0.25)  # a create that failed: no environment
    clock.t = 121.0
    t.close()
    clock.t = 500.0  # closed: the figures stay
    assert t.wall_s == 21.0
    assert t.phases == {"create": 3.25, "exec": 0.5, "files": 1.0, "destroy": 0.5, "other": 0.0}
    assert t.env_s == 5.25 and t.command_s == 10.0
    assert t.rollout_s == 17.0 + 20.0 + 0.25
    assert math.isclose(t.other_s, t.rollout_s - 5.25 - 10.0)
    assert math.isclose(t.env_s + t.command_s + t.other_s, t.rollout_s)
    assert math.isclose(t.share, 5.25 / 37.25)
    b1 = t.batch("n1")
    assert (b1.environments, b1.rollout_s, b1.command_s) == (1, 17.25, 10.0)
    assert b1.phases["create"] == 2.25 and math.isclose(b1.other_s, 17.25 - 4.25 - 10.0)
    whole = t.batch()
    assert whole.environments == 2 and math.isclose(whole.share, t.share) and whole.wall_s == 21.0


def test_tally_ignores_bad_seconds_and_refuses_unknown_phases():
    t = Tally(clock=Clock())
    t.record("exec", -1.0, env_id="a", command_s=float("nan"))
    t.record("exec", float("inf"), env_id="a")
    assert t.env_s == 0.0 and t.command_s == 0.0 and t.share == 0.0
    with pytest.raises(ValueError, match="unknown phase"):
        t.record("think", 1.0)


def test_spans_keep_the_earliest_start_and_latest_end():
    t = Tally(clock=Clock())
    t.begin("a", 10.0)
    t.begin("a", 12.0)
    t.end("a", 20.0)
    t.end("a", 15.0)
    assert t.environments["a"].span(0.0) == 10.0
    t.record("exec", 1.0, env_id="b")  # seen only after its create: no span
    assert t.environments["b"].span(50.0) == 0.0


def batch(**kw) -> dict:
    return {
        "name": "b",
        "started_at": 1.0,
        "wall_s": 1.0,
        "rollout_s": 1.0,
        "environments": 1,
        "phases": {"create": 0.5},
        "command_s": 0.0,
        "other_s": 0.5,
        "share": 0.5,
        **kw,
    }


def test_tax_batches_are_checked_where_they_enter():
    assert TaxBatch.model_validate(batch()).phases == {"create": 0.5, **dict.fromkeys(PHASES[1:], 0.0)}
    for bad in (
        batch(wall_s=float("nan")),
        batch(phases={"think": 1.0}),
        batch(share=1.5),
        batch(name="x" * (MAX_BATCH_NAME + 1)),
        batch(command_s=-1.0),
        batch(extra=1),
        batch(started_at=1e300),
    ):  # past year 9999: a page formatting it would overflow
        with pytest.raises(ValidationError):
            TaxBatch.model_validate(bad)


def test_the_book_keeps_the_newest_batches_and_sums_phases():
    book = TaxBook(max_batches=3)
    for i in range(5):
        book.report_batch(TaxBatch.model_validate(batch(name=f"b{i}")))
    book.add("exec", 0.25)
    book.add("exec", -1.0)  # a clock step: counts as a request of 0 s
    r = book.report()
    assert [b.name for b in r.batches] == ["b2", "b3", "b4"]
    assert r.node["exec"] == 0.25 and r.requests["exec"] == 2 and r.node["create"] == 0.0


def test_the_book_keeps_the_newest_post_of_an_open_batch():
    book = TaxBook()
    book.report_batch(TaxBatch.model_validate(batch(name="it", wall_s=1.0)))
    book.report_batch(TaxBatch.model_validate(batch(name="other", wall_s=1.0)))
    book.report_batch(TaxBatch.model_validate(batch(name="it", wall_s=2.0)))  # the same batch, later
    assert [(b.name, b.wall_s) for b in book.report().batches] == [("it", 2.0), ("other", 1.0)]


class Proc:
    def __init__(self, started_at, duration_s):
        self.started_at, self.duration_s = started_at, duration_s


def test_command_overlap():
    assert command_overlap(Proc(10.0, 5.0), 9.0, 20.0) == 5.0  # ran inside the request
    assert command_overlap(Proc(10.0, 5.0), 12.0, 20.0) == 3.0  # started before it (a wait)
    assert command_overlap(Proc(10.0, 5.0), 16.0, 20.0) == 0.0  # ended before it
    assert command_overlap(Proc(10.0, None), 12.0, 20.0) == 8.0  # still running
    assert command_overlap(object(), 0.0, 1.0) == 0.0


# --- the SDK's meter over a fake daemon --------------------------------------------------------
class SlowDaemon(FakeDaemon):
    """The fake daemon, each answer ``delays[phase]`` seconds late; commands report ``duration_s`` 0.06."""

    delays = {"create": 0.05, "exec": 0.09, "files": 0.03, "destroy": 0.02, "other": 0.0}

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/tax":
            self.reported = request.content
            return httpx.Response(204)
        phase, _ = phase_of(request.method, request.url.path)
        time.sleep(self.delays.get(phase, 0.0))
        r = super().__call__(request)
        if request.url.path.endswith("/commands/stream"):
            r = httpx.Response(200, content=r.content.replace(b'"duration_s": 0.5', b'"duration_s": 0.06'))
        return r


@pytest.fixture
def slow(monkeypatch):
    return serve(monkeypatch, SlowDaemon())


def test_the_meter_counts_phases_apart_from_commands_callbacks_and_think_time(slow):
    with weenv.meter("unit") as tally:
        sb = weenv.Sandbox.create("task")
        sb.commands.run("echo hi", on_stdout=lambda s: time.sleep(0.04))  # the callback is the caller's time
        sb.files.write("/w/a.txt", "x")
        time.sleep(0.05)  # think
        sb.kill()
    tol = 0.025
    p = tally.phases
    assert abs(p["create"] - 0.05) < tol and abs(p["files"] - 0.03) < tol and abs(p["destroy"] - 0.02) < tol
    assert abs(p["exec"] - 0.03) < tol  # 0.09 answered, 0.06 of it the command's own run
    assert abs(tally.command_s - 0.06) < 0.005
    assert abs(tally.other_s - 0.13) < tol  # think, and the callback (twice: the fake sends two chunks)
    assert math.isclose(tally.env_s + tally.command_s + tally.other_s, tally.rollout_s, rel_tol=1e-9)
    assert tally.rollout_s <= tally.wall_s
    assert list(tally.environments) == [sb.id] and tally.environments[sb.id].node == "http://node.test:7000"
    reported = TaxBatch.model_validate_json(slow.reported)
    assert reported.name == "unit" and reported.environments == 1 and math.isclose(reported.share, tally.share)


def test_batch_creates_count_each_environment_until_it_was_ready(slow):
    with weenv.meter(report=False) as tally:
        sandboxes = weenv.Sandbox.create_many("task", count=3)
    assert len(tally.environments) == 3 and not hasattr(slow, "reported")
    for s in sandboxes:
        assert 0.04 < tally.environments[s.id].phases["create"] < 0.2
    assert tally.unattributed["create"] == 0.0


def test_without_a_meter_nothing_is_counted(slow):
    sb = weenv.Sandbox.create("task")
    with weenv.meter(report=False) as tally:
        pass
    sb.kill()
    assert tally.env_s == 0.0 and tally.environments == {}


def test_an_open_meter_posts_its_tally_every_interval(slow):
    with weenv.meter("live", report_every=0.05) as tally:
        weenv.Sandbox.create("task")
        deadline = time.monotonic() + 5
        while not hasattr(slow, "reported") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert hasattr(slow, "reported"), "no post while the meter was open"
        live = TaxBatch.model_validate_json(slow.reported)
        assert live.name == "live" and live.environments == 1 and tally.ended is None
    final = TaxBatch.model_validate_json(slow.reported)  # the closing post comes last
    assert final.started_at == live.started_at and final.wall_s >= live.wall_s
    with pytest.raises(ValueError, match="report_every"):
        weenv.meter(report_every=-1)
