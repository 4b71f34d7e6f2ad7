"""``weenv bench ...`` (and ``weenv-bench ...``): one subcommand per benchmark (see :mod:`weenv_bench`).

The product's CLI (:mod:`weenv.cli`) adds :data:`bench_app` as ``weenv bench``
when this package is importable; :func:`main` runs it alone as ``weenv-bench``.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

RUNTIMES_HELP = (
    "OCI runtimes to run the node with, one whole run each, side by side in the JSON "
    "(comma-separated of runc,crun; default: the node's WEENV_RUNTIME)"
)
USERNS_HELP = (
    "user-namespace modes to run the node in, one whole run each, side by side in the JSON "
    "(comma-separated of off,on; default: the node's WEENV_USERNS)"
)
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks: weenv against the usual way, side by side.")


@bench_app.command("update")
def update(
    templates: int = typer.Option(8, help="templates sharing base, runtime and tools"),
    json_path: Path | None = typer.Option(None, "--json", help="write JSON here (and a PNG beside it)"),
    quick: bool = typer.Option(False, "--quick", help="a small runtime (one wheel), tools change only"),
    base_change: bool | None = typer.Option(
        None, "--base-change/--no-base-change", help="also change one file of the base (default: unless --quick)"
    ),
) -> None:
    """Republish cost of a change to one shared component: weenv against Docker.

    Docker: a private dockerd + docker-registry on loopback, side by side."""
    from weenv.cli.common import err
    from weenv_bench.update import run

    result = run(templates, json_path=json_path, quick=quick, base_change=base_change, log=err.print)
    print(json.dumps(result["summary"]))


@bench_app.command("provision")
def provision(
    quick: bool = typer.Option(False, "--quick", help="a few minutes: 8 environments at most, 3 min per mode"),
    json_path: Path | None = typer.Option(None, "--json", help="write JSON here (and a PNG beside it)"),
    max_envs: int | None = typer.Option(None, help="environments to try to hold at once"),
    duration: float | None = typer.Option(None, help="seconds of workload per mode"),
    think: float | None = typer.Option(None, help="median think time per agent step, seconds (default 4)"),
    simulate: bool = typer.Option(
        False, "--simulate", help="only replay a real run's traces (--traces) on modelled 16/64/192-core nodes"
    ),
    traces: Path | None = typer.Option(None, "--traces", help="with --simulate: the --json of a real run"),
    rounds: int = typer.Option(
        1, "--rounds", min=1, help="both modes this many times, fresh homes, order alternating (summary: medians)"
    ),
) -> None:
    """Static against elastic provisioning: environments held, rollouts/hour, burst slowdown, OOM kills."""
    from weenv.cli.common import err
    from weenv.errors import InvalidInputError
    from weenv_bench.provision import run, simulate_recorded
    from weenv_bench.provision_rounds import run_rounds

    if simulate:
        if traces is None:
            raise InvalidInputError("--simulate replays recorded traces: give --traces PATH (the --json of a real run)")
        result = simulate_recorded(traces, json_path=json_path, log=err.print)
    else:
        kwargs = dict(quick=quick, json_path=json_path, max_envs=max_envs, duration_s=duration, think_s=think)
        result = run(**kwargs, log=err.print) if rounds == 1 else run_rounds(rounds, **kwargs, log=err.print)
    print(json.dumps(result["summary"]))


@bench_app.command("start")
def start(
    quick: bool = typer.Option(False, "--quick", help="a ~300 MB template, concurrency 1 and 16, fewer runs"),
    json_path: Path | None = typer.Option(None, "--json", help="write JSON here (and a PNG beside it)"),
    concurrency: list[int] | None = typer.Option(None, help="concurrency levels (repeat; default 1 16 [64])"),
    large: bool | None = typer.Option(
        None, "--large/--no-large", help="also the ~3 GB template, at concurrency 1 (default: unless --quick)"
    ),
    docker: bool = typer.Option(True, "--docker/--no-docker", help="measure Docker too (pull + run: minutes)"),
    layout: list[str] | None = typer.Option(
        None, help="group layouts to measure, in order (repeat; default tree, then profile: weenv update --profile)"
    ),
    commands: list[str] | None = typer.Option(
        None, "--command", help="first commands besides echo (repeat; default numpy)"
    ),
    runtimes: str | None = typer.Option(None, "--runtimes", help=RUNTIMES_HELP),
    userns: str | None = typer.Option(None, "--userns", help=USERNS_HELP),
) -> None:
    """Time to a new environment's first output, cold and warm: weenv against Docker.

    Weenv (oci:// store) against Docker (pull + run), both from one loopback docker-registry."""
    from weenv.cli.common import err
    from weenv_bench.runtimes import parse_runtimes
    from weenv_bench.start import LAYOUTS, run
    from weenv_bench.userns_modes import parse_userns

    result = run(
        quick=quick,
        json_path=json_path,
        concurrency=tuple(concurrency) if concurrency else None,
        large=large,
        docker=docker,
        layouts=tuple(layout) if layout else LAYOUTS,
        commands=tuple(commands) if commands is not None else ("numpy",),
        runtimes=parse_runtimes(runtimes),
        userns=parse_userns(userns),
        log=err.print,
    )
    print(json.dumps(result["summary"]))


@bench_app.command("import")
def import_(
    quick: bool = typer.Option(False, "--quick", help="the ~1 GB image only (a few minutes)"),
    json_path: Path | None = typer.Option(None, "--json", help="write JSON here (and a PNG beside it)"),
    runs: int = typer.Option(1, help="measure each system this many times, interleaved (summary: medians)"),
    systems: str | None = typer.Option(
        None,
        help="comma-separated of docker,weenv,weenv-ref,weenv-old (docker and weenv always; default all but weenv-ref)",
    ),
    ref_src: Path | None = typer.Option(
        None,
        "--ref-src",
        help="another checkout: its import measured as weenv-ref in the same run (e.g. the code before a change)",
    ),
    images: str | None = typer.Option(
        None, help="comma-separated of import-1g,import-3g (default both; --quick: import-1g)"
    ),
) -> None:
    """weenv import against docker pull and the old import path: time, peak disk and memory.

    The 1 GB and 3 GB images of weenv bench start, from a loopback registry."""
    from weenv.cli.common import err
    from weenv_bench.import_image import run

    def split(v: str | None) -> tuple[str, ...] | None:
        return tuple(x.strip() for x in v.split(",") if x.strip()) if v else None

    result = run(
        quick=quick,
        json_path=json_path,
        log=err.print,
        runs=runs,
        systems=split(systems),
        ref_src=ref_src,
        images=split(images),
    )
    print(json.dumps(result["summary"]))


@bench_app.command("rollout")
def rollout(
    quick: bool = typer.Option(False, "--quick", help="a few minutes: 3 of 6 tasks x G=4, think time x0.05"),
    json_path: Path | None = typer.Option(None, "--json", help="write JSON here (and a PNG beside it)"),
    seed: int = typer.Option(0, help="seed of the task sample, trajectories and think times"),
    pool: int | None = typer.Option(None, help="tasks published (default 22; quick 6)"),
    tasks: int | None = typer.Option(None, help="tasks in the iteration (default 8; quick 3)"),
    group: int | None = typer.Option(None, "-G", "--group", help="rollouts per task (default 8; quick 4)"),
    concurrency: int | None = typer.Option(None, help="rollouts at once (default 32; quick 6)"),
    think_scale: float | None = typer.Option(None, help="factor on think time (default 1; quick 0.05)"),
    setup: bool = typer.Option(
        False,
        "--setup",
        help="templates without the deps, a setup per task (pip installs, editable install, test "
        "collection); weenv group against weenv create and Docker, two iterations",
    ),
    systems: str | None = typer.Option(
        None, help="comma-separated systems (default weenv,docker; with --setup group,create,docker)"
    ),
) -> None:
    """The environment's share of an RL iteration's rollout stage: weenv against Docker.

    Real tasks (PyPI projects with injected bugs, replayed agent trajectories): weenv against
    Docker, both from one loopback docker-registry.  --setup adds each task's setup and
    weenv's RL groups (the setup once per task, a fork per group)."""
    from weenv.cli.common import err
    from weenv_bench.rollout import run

    result = run(
        quick=quick,
        json_path=json_path,
        seed=seed,
        pool=pool,
        tasks=tasks,
        group=group,
        concurrency=concurrency,
        think_scale=think_scale,
        setup=setup,
        systems=tuple(x.strip() for x in systems.split(",") if x.strip()) if systems else None,
        log=err.print,
    )
    print(json.dumps(result["summary"]))


@bench_app.command("fork")
def fork(
    quick: bool = typer.Option(False, "--quick", help="a 20 MB parent, 3 repeats (one fork of 100)"),
    json_path: Path | None = typer.Option(None, "--json", help="write JSON here (and a PNG beside it)"),
    counts: list[int] | None = typer.Option(None, "--count", help="children per fork (repeat; default 1 16 100)"),
    parent_mb: int | None = typer.Option(None, help="MB the parent writes first (default 100; quick 20)"),
    docker: bool = typer.Option(True, "--docker/--no-docker", help="Docker's commit + run and pause side by side"),
    runtimes: str | None = typer.Option(None, "--runtimes", help=RUNTIMES_HELP),
    userns: str | None = typer.Option(None, "--userns", help=USERNS_HELP),
) -> None:
    """Fork, snapshot, reset and pause of one running environment, timed.

    Fork into N children, snapshot (and a cold create from it), reset against
    destroy + create, pause and resume, of one running environment."""
    from weenv.cli.common import err
    from weenv_bench.fork import run
    from weenv_bench.runtimes import parse_runtimes
    from weenv_bench.userns_modes import parse_userns

    result = run(
        quick=quick,
        json_path=json_path,
        counts=tuple(counts) if counts else None,
        parent_mb=parent_mb,
        docker=docker,
        runtimes=parse_runtimes(runtimes),
        userns=parse_userns(userns),
        log=err.print,
    )
    print(json.dumps(result["summary"]))


@bench_app.command("image-writer")
def image_writer(
    trees: list[Path] | None = typer.Argument(
        None, help="source trees (default: /usr/lib/python3 and the tests' Debian root)"
    ),
    runs: int = typer.Option(3, help="writes per tool and tree"),
    json_path: Path | None = typer.Option(None, "--json", help="write JSON here"),
) -> None:
    """weenv's EROFS writer against Debian's mkfs.erofs: seconds and image bytes per tree."""
    from weenv.cli.common import err
    from weenv_bench.image_writer import run

    if not trees:
        from weenv.config import Paths
        from weenv.packaging.debootstrap import debian_rootfs

        trees = [Path("/usr/lib/python3"), debian_rootfs(Paths.from_env().cache, log=err.print)]
    result = run(trees, runs=runs, json_path=json_path, log=err.print)
    print(json.dumps(result["summary"]))


@bench_app.command("stores")
def stores(
    runs: int = typer.Option(3, help="cold starts per store"),
    json_path: Path | None = typer.Option(None, "--json", help="write JSON here"),
) -> None:
    """Cold create from a file://, an oci:// and an s3:// store, side by side.

    docker-registry and SeaweedFS, all on loopback."""
    from weenv.cli.common import err
    from weenv_bench.store_create import run

    result = run(runs, log=err.print)
    if json_path is not None:
        json_path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["summary"]))


@bench_app.command("cluster")
def cluster(
    quick: bool = typer.Option(False, "--quick", help="8 templates, 64 creates in batches of 16 (a few minutes)"),
    simulate: bool = typer.Option(False, "--simulate", help="only the model of 100 and 1,000 nodes"),
    json_path: Path | None = typer.Option(None, "--json", help="write JSON here (and a PNG beside it)"),
    store: str = typer.Option(
        "s3",
        "--store",
        help="s3: SeaweedFS on loopback behind the link model below; file: a file:// directory (no model)",
    ),
    store_latency_ms: float = typer.Option(
        20.0, "--store-latency-ms", min=0, help="the modelled store: ms added to every answer (0: none)"
    ),
    store_conn_mib_s: float = typer.Option(
        64.0, "--store-conn-mib-s", min=0, help="the modelled store: MiB/s of one connection (0: no bound)"
    ),
    store_total_mib_s: float = typer.Option(
        128.0, "--store-total-mib-s", min=0, help="the modelled store: MiB/s of all nodes together (0: no bound)"
    ),
    profiles: str = typer.Option(
        "recorded",
        "--profiles",
        help="recorded: every template's prefetch profile and pack recorded before both "
        "modes (a task set run before); fresh: none, each mode records its own",
    ),
    rounds: int = typer.Option(
        1,
        "--rounds",
        min=1,
        max=10,
        help="both modes this many times on fresh homes (alternating which goes first); "
        "the summary adds p99 over all rounds' creates pooled (the first round's stays)",
    ),
) -> None:
    """Placement and peer chunk sharing: random placement from the store against weenv's, real and modelled.

    4 Ray nodes on this machine (the store far away, as modelled by the --store-* options; both
    placements see the same), then a model of 100 and 1,000 nodes."""
    from weenv.cli.common import err
    from weenv_bench.cluster import StoreSetup, run

    if store not in ("s3", "file"):
        raise typer.BadParameter("--store is s3 or file")
    if profiles not in ("recorded", "fresh"):
        raise typer.BadParameter("--profiles is recorded or fresh")
    setup = StoreSetup(store, store_latency_ms, store_conn_mib_s, store_total_mib_s)
    result = run(
        quick=quick,
        simulate_only=simulate,
        json_path=json_path,
        store=setup,
        profiles=profiles,
        rounds=rounds,
        log=err.print,
    )
    print(json.dumps(result["summary"]))


def main() -> None:
    """``weenv-bench ...``: the same commands, with the product's one-line errors."""
    from weenv.cli import run_app

    run_app(bench_app)
