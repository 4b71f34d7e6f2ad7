"""``weenv bench provision --simulate``: recorded traces replayed through the real
provisioner on a modelled node (:mod:`weenv_bench.simulate`), its input checks,
its node model, and the calibration arithmetic."""

from __future__ import annotations

import json
import math
import random
import time

import pytest

from weenv.errors import InvalidInputError
from weenv.formats.manifest import Resources
from weenv.node.provision import ProvisionConfig
from weenv_bench.provision import simulate_recorded
from weenv_bench.simulate import (
    Trace,
    calibrate,
    compare,
    parse_background,
    parse_traces,
    share,
    simulate,
    unloaded_spread,
    with_noise,
)

MIB = 1 << 20
GIB = 1 << 30
ONE = Resources(cpus=1.0, memory_bytes=1536 * MIB, pids=64)
ELASTIC = ProvisionConfig(
    mode="elastic", interval_s=0.5, admission="burst", admission_min_history_s=60.0, memory_overcommit=1.0
)


def agent_trace(seed: int, seconds: int = 120, *, burst_every: int = 4, memory_burst: bool = False) -> Trace:
    """1-s samples of an agent: think (lognormal, median 4 s), then a command;
    one in ``burst_every`` a burst of 0.2-1.5 s at 1 core."""
    rng = random.Random(seed)
    cpu = [0.01] * seconds
    ws = [80 * MIB] * seconds
    t = 0.0
    while t < seconds:
        t += min(60.0, rng.lognormvariate(math.log(4.0), 0.8))
        if rng.random() < 1 / burst_every:
            d = rng.uniform(0.2, 1.5)
            for i in range(int(t), min(seconds, int(t + d) + 1)):
                cpu[i] = min(1.0, cpu[i] + max(0.0, min(i + 1, t + d) - max(i, t)))
                if memory_burst:
                    ws[i] = 700 * MIB
            t += d
    return Trace(1.0, tuple(cpu), tuple(ws))


def as_json(trace: Trace, t0: float = 1000.0) -> dict:
    return {
        "interval_s": trace.interval_s,
        "t": [t0 + i * trace.interval_s for i in range(len(trace.cpu))],
        "cpu": list(trace.cpu),
        "working_set": list(trace.working_set),
    }


def test_traces_round_trip_and_bad_ones_are_one_clear_error():
    good = as_json(agent_trace(1, 20))
    assert parse_traces({"e1": good})[0] == agent_trace(1, 20)
    gap = {**good, "t": good["t"][:5] + [x + 3.0 for x in good["t"][5:]]}
    with pytest.raises(InvalidInputError, match=r"trace of e1: a gap of 4.00 s before sample 5"):
        parse_traces({"e1": gap})
    for field, value, match in (
        ("cpu", -0.5, "sample 3 has a negative or non-finite value"),
        ("cpu", float("nan"), "sample 3 has a negative or non-finite value"),
        ("working_set", -1, "sample 3 has a negative"),
        ("t", float("inf"), "sample 3 has a negative or non-finite"),
    ):
        bad = json.loads(json.dumps(good))
        bad[field][3] = value
        with pytest.raises(InvalidInputError, match=match):
            parse_traces({"e1": bad})
    with pytest.raises(InvalidInputError, match="one length"):
        parse_traces({"e1": {**good, "cpu": good["cpu"][:-1]}})
    with pytest.raises(InvalidInputError, match="needs interval_s, t, cpu and working_set"):
        parse_traces({"e1": {"cpu": [1.0]}})
    with pytest.raises(InvalidInputError, match="interval_s 0 is not a positive number"):
        parse_traces({"e1": {**good, "interval_s": 0}})
    with pytest.raises(InvalidInputError, match="1 samples"):
        parse_traces({"e1": {k: (v[:1] if isinstance(v, list) else v) for k, v in good.items()}})
    for empty in ({}, None, []):
        with pytest.raises(InvalidInputError, match="no usage trace"):
            parse_traces(empty)


def test_cores_are_shared_max_min_fairly():
    assert share([], 2.0) == []
    assert share([1.0, 1.0], 2.0) == [1.0, 1.0]
    assert share([1.0, 1.0, 1.0, 1.0], 2.0) == [0.5] * 4
    assert share([0.2, 1.0, 1.0, 0.0], 1.0) == pytest.approx([0.2, 0.4, 0.4, 0.0])


def test_a_burst_alone_is_not_slowed_and_shared_cores_slow_it_by_their_share():
    """Static on 2 cores: two 1-core environments, never contended (slowdown 1).
    Environments busy all the time, admitted by reservations (4 on 2 cores):
    each runs at half a core, its bursts take twice as long."""
    traces = [agent_trace(s) for s in range(2)]
    static = simulate(
        traces,
        cores=2,
        memory=8 * GIB,
        config=ProvisionConfig(mode="static", cpu_overcommit=1.0),
        declared=ONE,
        max_envs=8,
        duration_s=60,
    )
    assert static["envs"] == 2 and static["bursts"] > 0
    assert static["p95_burst_slowdown"] == pytest.approx(1.0) and static["oom_kills"] == 0
    busy = [Trace(1.0, (1.0,) * 30 + (0.0,), (80 * MIB,) * 31)]
    crowded = simulate(
        busy,
        cores=2,
        memory=8 * GIB,
        config=ProvisionConfig(admission="reservations"),
        declared=ONE,
        max_envs=4,
        duration_s=120,
        learn=False,
    )
    assert crowded["envs"] == 4
    assert 1.8 < crowded["p95_burst_slowdown"] < 2.2 and crowded["bursts_slowed_over_10pct"] > 0.9


def test_the_real_admission_decides_how_many_are_held():
    """The same low-duty traces on 16 cores: elastic holds several times
    static's environments with few bursts slowed; a stricter latency
    objective (the real ``admission_burst_risk``) holds fewer."""
    traces = [agent_trace(s) for s in range(4)]
    t = time.monotonic()
    r = compare(traces, cores=16, memory=64 * GIB, elastic=ELASTIC, declared=ONE, max_envs=400, duration_s=90)
    assert time.monotonic() - t < 30  # seconds of simulated node, not minutes
    assert r["static"]["envs"] == 16 and r["density_ratio"] >= 3
    assert r["bursts_slowed_over_10pct"] <= 0.05 and r["oom_kills"] == 0
    strict = simulate(
        traces,
        cores=16,
        memory=64 * GIB,
        config=ELASTIC.model_copy(update={"admission_burst_risk": 1e-6}),
        declared=ONE,
        max_envs=400,
        duration_s=90,
    )
    assert 16 <= strict["envs"] < r["elastic"]["envs"]


def test_memory_beyond_the_limit_waits_for_a_raise_and_beyond_the_declared_is_an_oom_kill():
    spiky = [agent_trace(s, memory_burst=True) for s in range(2)]
    r = simulate(spiky, cores=2, memory=8 * GIB, config=ELASTIC, declared=ONE, max_envs=3, duration_s=120, learn=False)
    assert r["oom_kills"] == 0 and r["bursts"] > 0  # 700 MiB above the initial 256 MiB: waited, raised
    huge = [Trace(1.0, (0.5,) * 10, (2 * GIB,) * 10)]
    assert (
        simulate(huge, cores=2, memory=8 * GIB, config=ELASTIC, declared=ONE, max_envs=1, duration_s=5, learn=False)[
            "oom_kills"
        ]
        > 0
    )
    with pytest.raises(InvalidInputError, match="cannot hold environments of 4 cores"):
        simulate(
            spiky,
            cores=2,
            memory=8 * GIB,
            config=ELASTIC,
            declared=Resources(cpus=4, memory_bytes=GIB),
            max_envs=1,
            duration_s=5,
        )


def test_calibration_is_the_larger_relative_error_of_density_and_p95():
    traces = [agent_trace(s) for s in range(2)]
    sim = compare(traces, cores=2, memory=8 * GIB, elastic=ELASTIC, declared=ONE, max_envs=8, duration_s=120)
    real = {
        "static": {"envs": sim["static"]["envs"], "bursts": [{"slowdown": 1.0}]},
        "elastic": {"envs": sim["elastic"]["envs"], "p95_burst_slowdown": sim["p95_burst_slowdown"]},
    }
    same = calibrate(traces, real, cores=2, memory=8 * GIB, elastic=ELASTIC, declared=ONE, max_envs=8, duration_s=120)
    assert same["calibration_error"] == pytest.approx(0.0)  # deterministic: the same run predicts itself
    real["elastic"]["envs"] *= 2
    assert calibrate(traces, real, cores=2, memory=8 * GIB, elastic=ELASTIC, declared=ONE, max_envs=8, duration_s=120)[
        "calibration_error"
    ] == pytest.approx(0.5)
    assert with_noise([1.0, 2.0], [1.0, 1.5]) == 3.0 and with_noise([], [1.2]) is None


def test_background_load_takes_its_cores_from_the_environments_and_calibrates_a_loaded_run():
    """The machine's other load (``background``: cores per second, recorded by
    ``weenv bench provision`` beside the traces) is replayed: the cores it
    takes are not the environments', so their bursts slow down; a real run
    slowed by other tenants is predicted from it, not from the traces alone."""
    traces = [agent_trace(s) for s in range(2)]
    static = ProvisionConfig(mode="static", cpu_overcommit=1.0)
    alone = simulate(traces, cores=2, memory=8 * GIB, config=static, declared=ONE, max_envs=2, duration_s=120)
    loaded = simulate(
        traces,
        cores=2,
        memory=8 * GIB,
        config=static,
        declared=ONE,
        max_envs=2,
        duration_s=120,
        background=parse_background({"interval_s": 1.0, "cores": [1.5] * 120}, 2.0),
    )
    assert alone["p95_burst_slowdown"] == pytest.approx(1.0)
    # 1.5 cores busy: 2 tasks of 0.75; a 1-core burst shares the 2 cores with them (2/3 core each)
    assert loaded["p95_burst_slowdown"] == pytest.approx(1.5, rel=0.05)
    idle_beside = parse_background({"interval_s": 1.0, "cores": [0.9] * 120}, 2.0)  # one task: a core is left
    assert simulate(
        traces, cores=2, memory=8 * GIB, config=static, declared=ONE, max_envs=1, duration_s=120, background=idle_beside
    )["p95_burst_slowdown"] == pytest.approx(1.0)
    background = {"interval_s": 1.0, "cores": [1.5] * 120}
    sim = compare(
        traces,
        cores=2,
        memory=8 * GIB,
        elastic=ELASTIC,
        declared=ONE,
        max_envs=8,
        duration_s=120,
        background={"elastic": parse_background(background, 2.0)},
    )
    real = {
        "static": {"envs": sim["static"]["envs"], "bursts": [{"slowdown": 1.0}]},
        "elastic": {
            "envs": sim["elastic"]["envs"],
            "p95_burst_slowdown": sim["p95_burst_slowdown"],
            "background": background,
        },
    }
    cal = calibrate(traces, real, cores=2, memory=8 * GIB, elastic=ELASTIC, declared=ONE, max_envs=8, duration_s=120)
    assert cal["calibration_error"] == pytest.approx(0.0) and cal["background_cores"]["elastic"] == 1.5
    del real["elastic"]["background"]  # the same run's figures without its background: mispredicted
    assert (
        calibrate(traces, real, cores=2, memory=8 * GIB, elastic=ELASTIC, declared=ONE, max_envs=8, duration_s=120)[
            "calibration_error"
        ]
        > 0.3
    )
    # with a background, the model's slowdowns compose with the unloaded runs' spread (cold runs left out)
    assert unloaded_spread({"baseline_runs_s": [{"tests": [1.0, 2.0, 1.0], "tests:cold": [5.0]}]}) == [1.0, 2.0, 1.0]
    assert unloaded_spread({}) == []
    assert parse_background(None, 2.0) is None
    assert parse_background({"interval_s": 1.0, "cores": [0.5, 9.0]}, 2.0) == (1.0, [0.5, 2.0])  # capped at the node
    for bad, match in (
        ({"interval_s": 0, "cores": []}, "positive interval_s"),
        ({"interval_s": 1.0, "cores": [0.1, -1.0]}, "sample 1 .* negative"),
        ({"interval_s": 1.0, "cores": [float("nan")]}, "sample 0"),
        ({"interval_s": 1.0, "cores": "x"}, "must be a list"),
        ([1.0], "positive interval_s"),
    ):
        with pytest.raises(InvalidInputError, match=match):
            parse_background(bad, 2.0)


def recorded_run(tmp_path, **change):
    traces = {f"e{s}": as_json(agent_trace(s, 60)) for s in range(2)}
    run = {
        "config": {
            "max_envs": 4,
            "duration_s": 60,
            "declared": ONE.model_dump(),
            "elastic": {"interval_s": 0.5, "admission": "burst", "admission_min_history_s": 60.0},
        },
        "machine": {"cpus": 2, "memory_bytes": 8 * GIB},
        "static": {"envs": 2, "p95_burst_slowdown": 1.2, "bursts": [{"slowdown": 1.1}], "traces": traces},
        "elastic": {"envs": 3, "p95_burst_slowdown": 1.3, "bursts": []},
        "summary": {"static_envs": 2, "elastic_envs": 3},
        **change,
    }
    path = tmp_path / "run.json"
    path.write_text(json.dumps(run))
    return path


def test_simulate_recorded_reads_a_real_runs_json_and_refuses_bad_ones(tmp_path):
    out = simulate_recorded(recorded_run(tmp_path), sizes=((16, 64),), duration_s=30, log=lambda _m: None)
    s = out["summary"]
    assert s["elastic_envs"] == 3 and set(s["sim"]["16"]) == {
        "density_ratio",
        "p95_burst_slowdown",
        "bursts_slowed_over_10pct",
        "oom_kills",
    }
    assert s["calibration_error"] is not None and s["calibration_error"] >= 0
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(InvalidInputError, match="not JSON"):
        simulate_recorded(bad)
    with pytest.raises(InvalidInputError, match="not the JSON of a weenv bench provision run"):
        simulate_recorded(recorded_run(tmp_path, static=[]))
    gap = json.loads(recorded_run(tmp_path).read_text())
    gap["static"]["traces"]["e1"]["t"][10] += 5
    bad.write_text(json.dumps(gap))
    with pytest.raises(InvalidInputError, match="trace of e1: a gap"):
        simulate_recorded(bad)
    with pytest.raises(InvalidInputError, match="No such file"):
        simulate_recorded(tmp_path / "missing.json")


def test_a_real_runs_traces_predict_its_density(tmp_path):
    """The traces of a real ``weenv bench provision --quick`` on this 2-core
    machine (``data/provision-quick-2cores.json``), replayed through the real
    provisioner on a node of its size: the elastic density it held (4 against
    2 static) within 10 %.  Its p95 burst slowdown is not (predicted 1.32,
    real 2.38): its slowest bursts ran while no more bench bursts than cores
    were in flight, when other tenants used 0.5 cores the traces do not hold."""
    from pathlib import Path

    recorded = Path(__file__).parent / "data" / "provision-quick-2cores.json"
    out = simulate_recorded(recorded, sizes=((16, 64),), duration_s=30, log=lambda _m: None)
    cal = out["simulation"]["calibration"]
    assert cal["real"]["density_ratio"] == 2.0
    assert cal["predicted"]["density_ratio"] == pytest.approx(cal["real"]["density_ratio"], rel=0.10)
    slow = [b for b in json.loads(recorded.read_text())["elastic"]["bursts"] if b["slowdown"] > 2.0]
    assert slow and all(b["concurrent"] <= 2 for b in slow)  # not the bench's own bursts contending


def test_a_loaded_runs_background_predicts_its_p95(tmp_path):
    """A real ``weenv bench provision --quick`` with other helpers' tests
    beside it (``data/provision-quick-2cores-background.json``: 1.2 cores of
    other load during static, 0.55 during elastic).  Replayed with each mode's
    recorded background, its elastic p95 burst slowdown (1.94) is predicted
    within 20 % (1.58); without it, from the static bursts' spread, 55 % off
    (3.02).  Its density is predicted 3 against 4 environments (the fourth
    was admitted at 79 s, once its own usage was known): 25 % on 2 cores,
    where one environment is a quarter."""
    from pathlib import Path

    recorded = Path(__file__).parent / "data" / "provision-quick-2cores-background.json"
    cal = simulate_recorded(recorded, sizes=((16, 64),), duration_s=30, log=lambda _m: None)["simulation"][
        "calibration"
    ]
    assert cal["background_cores"]["static"] > 1.0 and cal["real"]["p95_burst_slowdown"] == pytest.approx(
        1.945, abs=1e-3
    )
    assert cal["predicted"]["p95_burst_slowdown"] == pytest.approx(cal["real"]["p95_burst_slowdown"], rel=0.20)
    bare = json.loads(recorded.read_text())
    for mode in ("static", "elastic"):
        del bare[mode]["background"]
    (tmp_path / "bare.json").write_text(json.dumps(bare))
    blind = simulate_recorded(tmp_path / "bare.json", sizes=((16, 64),), duration_s=30, log=lambda _m: None)
    p95_blind = blind["simulation"]["calibration"]["predicted"]["p95_burst_slowdown"]
    assert abs(p95_blind / cal["real"]["p95_burst_slowdown"] - 1) > 0.4
    assert cal["calibration_error"] <= 0.25


def test_admission_leaves_room_for_the_memory_peak_a_decayed_limit_will_need_again():
    """The real run's traces on a 16-core node of 64 GiB: environments idle
    between 600 MiB bursts, their limits decaying meanwhile.  Admission counted
    the decayed limits and held 130, whose bursts then waited at limits the
    node could no longer raise (p95 slowdown 6.2, 19 % of bursts slowed by more
    than 10 %); counting each at the limit its template's known peak needs, it
    holds fewer and no burst waits."""
    from pathlib import Path

    recorded = Path(__file__).parent / "data" / "provision-quick-2cores.json"
    out = simulate_recorded(recorded, sizes=((16, 64),), duration_s=300, log=lambda _m: None)
    sim = out["summary"]["sim"]["16"]
    assert sim["density_ratio"] >= 3 and sim["oom_kills"] == 0
    assert sim["bursts_slowed_over_10pct"] <= 0.01


def test_a_short_burst_of_a_fifth_of_a_core_second_is_a_burst():
    """A ``compile`` of ``weenv bench provision`` runs 0.13-0.19 s on one core:
    a 1-s sample of 0.15 cores.  The replay counts it as a burst (at a
    threshold of 0.2 cores it counted none of them, 22 bursts of a real run's
    36), and slows it when the cores are shared; a light command (0.02) is not one."""
    cpu = tuple(0.15 if i % 10 == 5 else (0.02 if i % 10 == 8 else 0.0) for i in range(60))
    short = [Trace(1.0, cpu, (80 * MIB,) * 60)]
    static = ProvisionConfig(mode="static", cpu_overcommit=1.0)
    alone = simulate(short, cores=2, memory=8 * GIB, config=static, declared=ONE, max_envs=1, duration_s=60)
    assert alone["bursts"] == 6 and alone["p95_burst_slowdown"] == pytest.approx(1.0)
    loaded = simulate(
        short,
        cores=2,
        memory=8 * GIB,
        config=static,
        declared=ONE,
        max_envs=1,
        duration_s=60,
        background=parse_background({"interval_s": 1.0, "cores": [2.0] * 60}, 2.0),
    )
    assert loaded["bursts"] >= 5 and loaded["p95_burst_slowdown"] == pytest.approx(1.5, rel=0.05)


def quiet_static_run(cold: float = 2.0, warm: float = 1.3) -> dict:
    """A static mode of 2 environments: 2 first runs (``KIND:cold``) and 10
    later ones that had their core on a quiet machine, and 3 bursts that did
    not (under other load, beside more bursts than cores), one a first run."""
    quiet = [{"base": "tests:cold", "slowdown": cold, "background": 0.1, "concurrent": 1}] * 2 + [
        {"base": "tests", "slowdown": warm, "background": 0.1, "concurrent": 1}
    ] * 10
    loud = [
        {"base": "pip:cold", "slowdown": 3.0, "background": 1.5, "concurrent": 1},
        {"base": "pip", "slowdown": 5.0, "background": 0.0, "concurrent": 3},
        {"base": "pip", "slowdown": 4.0, "background": None, "concurrent": 1},
    ]
    return {"static": {"envs": 2, "bursts": quiet + loud}}


def test_the_workload_noise_weighs_first_runs_as_the_predicted_mode_holds_them():
    """The noise is the static mode's quiet bursts; first runs of a kind in
    an environment weigh as many as the predicted mode has: each of its
    environments runs as many as a static one did (3 first runs over 2
    environments here, 1.5 each), so 4 environments and 200 bursts hold 6
    first runs (3 %: the p95 is a later run's 1.3) and 100 bursts 6 %
    (the p95 is a first run's 2.0); unweighted (2 of 12) it would be 2.0
    either way.  Fewer than 10 quiet bursts are no noise; a run whose bursts
    do not tell first runs apart weighs each quiet burst once."""
    from weenv_bench.simulate import p95, weighted_p95, workload_noise

    real = quiet_static_run()
    noise, weights = workload_noise(real, 2, envs=4, bursts=200)
    assert noise == [2.0] * 2 + [1.3] * 10
    assert weights == [6 * 10] * 2 + [194 * 2] * 10  # 6 of 200 over 2 first runs, 194 over 10 later ones
    assert weighted_p95(list(zip(noise, weights))) == 1.3 and p95(noise) == 2.0
    assert weighted_p95(list(zip(*workload_noise(real, 2, envs=4, bursts=100)))) == 2.0
    assert weighted_p95(list(zip(*workload_noise(real, 2, envs=100, bursts=60)))) == 2.0  # all 60 first runs
    few = {"static": {"envs": 2, "bursts": real["static"]["bursts"][3:]}}  # 9 quiet
    assert workload_noise(few, 2, envs=4, bursts=200) == ([], [])
    unmarked = {
        "static": {"envs": 2, "bursts": [{k: v for k, v in b.items() if k != "base"} for b in real["static"]["bursts"]]}
    }
    assert workload_noise(unmarked, 2, envs=4, bursts=200) == (noise, [1] * 12)
    rng = random.Random(5)
    for n in (1, 19, 20, 21, 36, 99):
        xs = [rng.uniform(1.0, 2.0) for _ in range(n)]
        ws = [rng.randrange(0, 4) for _ in xs]
        assert weighted_p95([(x, 1) for x in xs]) == p95(xs)
        if any(ws):
            assert weighted_p95(list(zip(xs, ws))) == p95([x for x, w in zip(xs, ws) for _ in range(w)])
    assert weighted_p95([(1.0, 0)]) is None and weighted_p95([]) is None


def test_calibration_composes_the_model_with_the_quiet_static_bursts_or_else_the_unloaded_runs():
    """With a background recorded, the model's slowdowns are composed with
    the quiet static bursts weighted as the predicted elastic mode holds its
    first runs; with fewer than 10 of them, with the unloaded runs' spread
    (repeated and first runs in fresh environments)."""
    from weenv_bench.simulate import workload_noise

    traces = [agent_trace(s) for s in range(2)]
    sim = compare(traces, cores=2, memory=8 * GIB, elastic=ELASTIC, declared=ONE, max_envs=8, duration_s=120)
    real = quiet_static_run()
    real["static"]["background"] = {"interval_s": 1.0, "cores": [0.0] * 120}
    real.update(
        {
            "elastic": {
                "envs": sim["elastic"]["envs"],
                "p95_burst_slowdown": 2.0,
                "background": {"interval_s": 1.0, "cores": [0.0] * 120},
            },
            "baseline_runs_s": [{"tests": [1.0, 1.0, 1.0], "tests:cold": [1.0, 1.0, 1.0]}],
        }
    )
    cal = calibrate(traces, real, cores=2, memory=8 * GIB, elastic=ELASTIC, declared=ONE, max_envs=8, duration_s=120)
    envs, bursts = sim["elastic"]["envs"], sim["elastic"]["bursts"]
    assert cal["noise"]["from"] == "quiet static bursts" and cal["noise"]["n"] == 12
    assert cal["noise"]["cold_share"] == pytest.approx(min(bursts, round(1.5 * envs)) / bursts)
    noise, weights = workload_noise(real, 2, envs=envs, bursts=bursts)
    assert cal["predicted"]["p95_burst_slowdown"] == with_noise(sim["_slowdowns"], noise, weights)
    real["static"]["bursts"] = real["static"]["bursts"][3:]  # 9 quiet ones
    few = calibrate(traces, real, cores=2, memory=8 * GIB, elastic=ELASTIC, declared=ONE, max_envs=8, duration_s=120)
    assert few["noise"]["from"] == "unloaded runs" and few["noise"]["n"] == 6
    assert few["predicted"]["p95_burst_slowdown"] == pytest.approx(sim["p95_burst_slowdown"])
    assert unloaded_spread(
        {"baseline_runs_s": [{"tests": [1.0, 2.0, 1.0], "tests:cold": [4.0, 5.0, 6.0]}]}, cold=True
    ) == [1.0, 2.0, 1.0, 0.8, 1.0, 1.2]


def test_a_p95_of_a_few_dozen_bursts_comes_with_its_bootstrap_interval():
    """The nearest-rank p95 of 36 bursts is their second largest: one burst
    more or less moves it.  The interval (10th-90th percentile over bootstrap
    resamples, seeded) says by how much; bursts all alike have none."""
    from weenv_bench.provision import ratio_interval
    from weenv_bench.simulate import p95_draws, p95_interval

    assert p95_interval([1.2] * 30) == [1.2, 1.2] and p95_interval([]) is None
    tail = [1.0] * 34 + [1.6, 2.5]
    lo, hi = p95_interval(tail)
    # its p95 is 1.0 in a resample holding at most one of the two outliers (40 % of them),
    # 2.5 in one holding 2.5 twice (26 %): the interval spans both
    assert lo == 1.0 and hi == 2.5
    assert p95_draws(tail, 50) == p95_draws(tail, 50)  # seeded: a run's JSON reproduces
    assert ratio_interval([1.2] * 30, [1.0] * 20) == pytest.approx([1.2, 1.2])
    lo, hi = ratio_interval(tail, [1.0] * 17 + [1.4])
    assert lo < 1.05 < hi and ratio_interval([], [1.0]) is None


def test_a_default_settings_run_is_predicted_from_its_static_traces():
    """``data/provision-quick-2cores-s19.json``: a real ``weenv bench provision
    --quick`` with the default settings (burst admission), 2 static and 4
    elastic environments, p95 burst slowdown 1.40 and 1.58.  Its static traces
    replayed on 2 cores predict the density exactly, 33 bursts of the real 36
    (22 when a burst needed 0.2 cores of a sample) and the p95 at 1.35
    composed with its 16 quiet static bursts: 14 % off (24 % with the
    unloaded runs pooled with them, 1.20; 27 % with the unloaded repeated
    runs alone, 1.15).  The real p95 is the second largest of 36 bursts,
    within [1.37, 2.48] by chance alone; over its 23 quiet bursts it is
    1.40, the rest is bursts beside other tenants' load, which slows a
    burst more than the cores it takes."""
    from pathlib import Path

    recorded = Path(__file__).parent / "data" / "provision-quick-2cores-s19.json"
    cal = simulate_recorded(recorded, sizes=((16, 64),), duration_s=30, log=lambda _m: None)["simulation"][
        "calibration"
    ]
    assert cal["predicted"]["density_ratio"] == cal["real"]["density_ratio"] == 2.0
    assert cal["noise"]["from"] == "quiet static bursts" and cal["noise"]["n"] == 16
    assert cal["predicted"]["bursts"] >= 0.9 * cal["real"]["bursts"]
    assert cal["calibration_error"] < 0.15
    lo, hi = cal["real"]["p95_interval"]
    assert lo < cal["real"]["p95_burst_slowdown"] < hi and hi / lo > 1.5


def test_host_busy_cores_stay_within_the_cpus():
    """The benchmark's host sampling counts busy cores against the jiffies that
    passed, so a sample never reads more cores than the machine has (a full run
    read 2.002 cores on 2 when dividing by wall seconds) and 0 jiffies read 0."""
    from weenv_bench.provision import busy_cores

    assert busy_cores(200, 0, 2) == 2.0
    assert busy_cores(201, 0, 2) == 2.0
    assert busy_cores(200, 100, 2) == 1.0
    assert busy_cores(200, 250, 2) == 0.0  # idle read after total: clamped
    assert busy_cores(0, 0, 2) == 0.0


RECORDED = {"420s": 0.10, "s19": 0.15, "background": 0.11, "": 0.45, "s22": 0.11, "s22b": 0.10}
"""The recorded runs (``data/provision-quick-2cores-NAME.json``) and the
error of the predicted p95 each must stay within (s22 and s22b were
recorded after the noise was chosen)."""


def test_the_recorded_runs_p95_is_predicted_by_the_quiet_static_bursts_better_than_pooled_with_the_unloaded_runs():
    """Six real runs replayed: the four the noise was chosen on (the 420-s
    run of 2026-12-04 on a quiet machine, s19, the loaded run, s14) and two
    quick ones recorded after (s22, its static mode under other load; s22b,
    a quiet machine).  The predicted p95, composed with the quiet static
    bursts weighted to the elastic mode's first runs, is within each run's
    bound (``RECORDED``: the 420-s run 0.065, s19 0.143, s22b 0.083; the
    fallbacks for the loaded run 0.106 and s22 0.109, too few quiet static
    bursts, and for s14 0.443, no background recorded) and no worse than
    with the noise
    before (the unloaded runs pooled with the quiet static bursts, sample
    by sample: 0.124 and 0.240 on the first two).  The 420-s run's
    calibration error (density predicted exactly) is within 10 %, and the
    noise is the one chosen leave-one-out (:mod:`weenv_bench.noise_choice`)."""
    from pathlib import Path

    from weenv_bench.noise_choice import CANDIDATES, choose, errors, leave_one_out

    table = {}
    for name, bound in RECORDED.items():
        path = Path(__file__).parent / "data" / f"provision-quick-2cores{'-' + name if name else ''}.json"
        cal = simulate_recorded(path, sizes=(), log=lambda _m: None)["simulation"]["calibration"]
        new = abs(cal["predicted"]["p95_burst_slowdown"] / cal["real"]["p95_burst_slowdown"] - 1)
        table[name] = errors(json.loads(path.read_text()))
        assert new == pytest.approx(table[name][CANDIDATES[0]])  # calibrate composes the first candidate
        assert new <= bound and new <= table[name]["pooled"] + 1e-9, (name, table[name])
        if name == "420s":
            assert cal["calibration_error"] <= 0.10 and cal["predicted"]["density_ratio"] == 3.0
    assert table["420s"]["pooled"] > 0.10 and table["s19"]["pooled"] > 0.20
    # chosen leave-one-out on the four runs before s22: in three of the four folds;
    # with s19 left out a lognormal fit wins on the 420-s run and misses s19 by 0.197
    before = ["420s", "s19", "background", ""]
    assert choose(table, before) == CANDIDATES[0]
    folds = leave_one_out(table, before)
    assert [c for c, _ in folds.values()].count(CANDIDATES[0]) == 3 and folds["s19"][0] == "lognormal"
