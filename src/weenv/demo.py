"""``weenv demo``: the whole path on real input.

1. a **base** group from Debian bookworm minbase + python3 (debootstrap, cached
   under ``$WEENV_CACHE``);
2. a **deps** group: pytest and the library's dependencies, installed from PyPI
   with pip into ``/usr/local/lib/python3.11/dist-packages`` (cached);
3. a **task** group: the library's own source and tests from its PyPI sdist,
   at ``/workspace/NAME``;
4. the template of the three; the node's chunk cache emptied; a **cold** start,
   the library's test suite run inside with pytest; then a **warm** start and the
   same again.  Phase timings and bytes fetched are printed for both.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from weenv.config import Paths
from weenv.errors import RuntimeFailedError
from weenv.formats.manifest import Resources, RuntimeConfig
from weenv.packaging.debootstrap import debian_rootfs
from weenv.packaging.group import build_group
from weenv.packaging.template import create_template
from weenv.store import open_store

DEFAULT_LIBRARY = "idna==3.20"
"""A real library whose sdist ships its test suite (6,400 tests, ~20 s)."""
DEFAULT_TEST_REQUIREMENTS = ("pytest", "hypothesis")
"""What the default library's test suite imports besides the library itself."""
SITE_PACKAGES = "usr/local/lib/python3.11/dist-packages"


def _pip(*args: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-8:])
        raise RuntimeFailedError(f"pip {' '.join(args[:2])} failed:\n{tail}")


def deps_tree(cache: Path, requirements: list[str]) -> Path:
    """A tree holding ``requirements`` installed for Debian's Python 3.11 (cached)."""
    key = hashlib.sha256("\n".join(sorted(requirements)).encode()).hexdigest()[:16]
    root = cache / "pip" / f"deps-{key}"
    if (root / SITE_PACKAGES).is_dir():
        return root
    tmp = Path(tempfile.mkdtemp(dir=cache, prefix=".tmp-deps-"))
    try:
        target = tmp / SITE_PACKAGES
        _pip(
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--target",
            str(target),
            "--python-version",
            "3.11",
            "--only-binary=:all:",
            *requirements,
        )
        shutil.rmtree(target / "bin", ignore_errors=True)  # scripts with the host's shebang
        root.parent.mkdir(parents=True, exist_ok=True)
        tmp.rename(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return root


def sdist(cache: Path, requirement: str) -> Path:
    """The sdist of ``requirement`` (e.g. ``idna==3.20``) from PyPI (cached)."""
    d = cache / "sdist" / re.sub(r"[^A-Za-z0-9._-]", "_", requirement)
    found = sorted(d.glob("*.tar.gz")) if d.is_dir() else []
    if not found:
        d.mkdir(parents=True, exist_ok=True)
        _pip(
            "download",
            "--quiet",
            "--disable-pip-version-check",
            "--no-deps",
            "--no-binary",
            ":all:",
            "-d",
            str(d),
            requirement,
        )
        found = sorted(d.glob("*.tar.gz"))
        if not found:
            raise RuntimeFailedError(f"pip found no sdist for {requirement}")
    return found[0]


def task_tree(work: Path, archive: Path) -> tuple[Path, str]:
    """Unpack ``archive`` to ``work/task/workspace/NAME``; return (tree root, NAME)."""
    root = work / "task"
    shutil.rmtree(root, ignore_errors=True)
    ws = root / "workspace"
    ws.mkdir(parents=True)
    with tarfile.open(archive) as tf:
        tf.extractall(ws, filter="data")
    (project,) = [p.name for p in ws.iterdir()]
    return root, project


def _library_deps(project_dir: Path) -> list[str]:
    """``[project] dependencies`` of the sdist's pyproject.toml (empty if none)."""
    import tomllib

    try:
        data = tomllib.loads((project_dir / "pyproject.toml").read_text())
    except (FileNotFoundError, tomllib.TOMLDecodeError):
        return []
    return list(data.get("project", {}).get("dependencies", []))


def _pytest_summary(text: str) -> str:
    lines = [line.strip("= ") for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


def run_demo(
    paths: Paths,
    *,
    library: str = DEFAULT_LIBRARY,
    test_requirements: tuple[str, ...] = DEFAULT_TEST_REQUIREMENTS,
    keep_daemon: bool = False,
    console: Console | None = None,
) -> int:
    """Run the demo; return 0 if the test suite passed in both starts."""
    from weenv.server import daemon

    console = console or Console(stderr=True)
    paths.cache.mkdir(parents=True, exist_ok=True)
    store = open_store(paths.store_url)
    work = paths.home / "demo"
    work.mkdir(parents=True, exist_ok=True)

    console.rule("[bold]1. layer groups from real input")
    base = debian_rootfs(paths.cache, log=console.print)
    archive = sdist(paths.cache, library)
    task_root, project = task_tree(work, archive)
    requirements = list(test_requirements) + _library_deps(task_root / "workspace" / project)
    deps = deps_tree(paths.cache, requirements)
    name = re.sub(r"[^a-z0-9._-]", "-", re.split(r"[<>=!~\[; ]", library)[0].lower())
    built = {}
    for group_name, tree, source in (
        ("debian-bookworm-python3", base, {"type": "debootstrap", "suite": "bookworm"}),
        (f"{name}-deps", deps, {"type": "pip", "requirements": " ".join(requirements)}),
        (f"{name}-task", task_root, {"type": "sdist", "requirement": library}),
    ):
        r = build_group(tree, store, name=group_name, source=source)
        built[group_name] = r
        console.print(
            f"  group [bold]{group_name}[/bold]: {r.manifest.file_count} files, "
            f"{r.manifest.image_size / 2**20:.1f} MiB image, {len(r.manifest.chunks)} chunks, "
            f"{r.chunks_written} new, {r.seconds:.1f} s"
        )
    template = f"demo-{name}"
    runtime = RuntimeConfig(
        working_dir=f"/workspace/{project}", resources=Resources(cpus=2.0, memory_bytes=2 << 30, pids=4096)
    )
    digest, _ = create_template(store, template, list(built), runtime=runtime)
    console.print(f"  template [bold]{template}[/bold] {digest[:19]}: {' + '.join(built)}")

    started_here = not daemon.is_running(paths)
    client = daemon.connect(paths)
    ok = True
    try:
        client.drop_cache()
        results = {}
        for step, label in ((2, "cold"), (3, "warm")):
            console.rule(f"[bold]{step}. {label} start, then the test suite of {library}")
            fetched0 = client.stats().cache_bytes_fetched
            info = client.create(template)
            try:
                r = client.exec(
                    info.id,
                    ["python3", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "tests"],
                    timeout=900,
                )
            finally:
                client.destroy(info.id)
            fetched = client.stats().cache_bytes_fetched - fetched0
            summary = _pytest_summary(r.stdout.decode(errors="replace"))
            ok = ok and r.exit_code == 0
            results[label] = (info.timing, r, fetched)
            console.print(f"  environment {info.id}: pytest exit {r.exit_code}: {summary} ({r.duration_s:.1f} s)")
            if r.exit_code != 0:
                console.print(r.stdout.decode(errors="replace")[-3000:], markup=False)
                console.print(r.stderr.decode(errors="replace")[-2000:], markup=False)
        console.rule("[bold]4. results")
        _print_table(console, results)
    finally:
        client.close()
        if started_here and not keep_daemon:
            daemon.stop(paths)
    return 0 if ok else 1


def _print_table(console: Console, results: dict) -> None:
    table = Table(show_header=True, header_style="bold")
    table.add_column("")
    for label in results:
        table.add_column(label, justify="right")

    def row(name, fn):
        table.add_row(name, *(fn(*v) for v in results.values()))

    def sec(x):
        return "-" if x is None else f"{x:.3f} s"

    row("manifest fetch", lambda t, r, f: sec(t.manifest_s))
    row("group mounts", lambda t, r, f: sec(t.groups_s))
    row("overlay", lambda t, r, f: sec(t.overlay_s))
    row("runtime create/start", lambda t, r, f: sec(t.runtime_s))
    row("first command", lambda t, r, f: sec(t.first_command_s))
    row("create total", lambda t, r, f: sec(t.total_s))
    row("bytes fetched by create", lambda t, r, f: f"{t.bytes_fetched / 2**20:.2f} MiB")
    row("bytes fetched in all", lambda t, r, f: f"{f / 2**20:.2f} MiB")
    row("template size (image)", lambda t, r, f: f"{t.template_bytes / 2**20:.1f} MiB")
    row("template size (stored)", lambda t, r, f: f"{t.template_stored_bytes / 2**20:.1f} MiB")
    row("fetched / stored", lambda t, r, f: f"{f / t.template_stored_bytes:.1%}")
    row("test suite", lambda t, r, f: f"exit {r.exit_code}, {r.duration_s:.1f} s")
    console.print(table)
