"""``weenv bench update``: what republishing costs when one shared component changes.

N templates (default 8) share three components and differ in a fourth:

- ``base``: the Debian bookworm minbase + python3 tree (debootstrap, cached);
- ``runtime``: real PyPI packages installed by a ``pip`` step in a build environment;
- ``tools``: a directory of scripts copied to ``/opt/tools``;
- ``task-I``: the source tree of a real sdist from PyPI, at ``/workspace``.

All N recipes are built once into a private store; then one file of the tools
changes and every recipe is built again.  weenv's cost is what the second round
publishes: bytes (new chunks + manifests) and wall seconds for all N builds.

Docker's side (the same templates as Dockerfiles built by dockerd, pushed to a
docker-registry on loopback: bytes pushed, seconds for rebuild + push) needs the
dockerd harness in :mod:`weenv.services`; until it is wired in, the JSON has
``docker_bytes``/``docker_seconds``/``bytes_ratio`` set to null and a ``docker``
note saying so.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from weenv.bench import machine
from weenv.config import Paths
from weenv.errors import RuntimeFailedError
from weenv.packaging.builder import build_recipe
from weenv.packaging.debootstrap import debian_rootfs
from weenv.packaging.recipe import parse_recipe
from weenv.store.file import FileStore

SDISTS = (
    "six==1.17.0", "idna==3.10", "packaging==24.2", "toml==0.10.2", "iniconfig==2.0.0",
    "pluggy==1.5.0", "attrs==24.3.0", "pyparsing==3.2.0", "tomli==2.2.1", "wcwidth==0.2.13",
    "certifi==2024.12.14", "markupsafe==3.0.2",
)  # fmt: skip
"""Real sdists, one per template's task component (the first N are used)."""
RUNTIME_REQUIREMENTS = ("pytest==8.3.4",)

RECIPE = """
[template]
name = "task-{i}"
[template.runtime]
working_dir = "/workspace"
[[component]]
name = "base"
[[component.step]]
kind = "from_dir"
path = "{base}"
[[component]]
name = "runtime"
[[component.step]]
kind = "pip"
requirements = {requirements}
[[component]]
name = "tools"
[[component.step]]
kind = "copy"
src = "{tools}"
dest = "/opt/tools"
mode = "0755"
[[component]]
name = "task-{i}"
[[component.step]]
kind = "from_dir"
path = "{task}"
dest = "/workspace"
"""


def fetch_sdists(cache: Path, specs: tuple[str, ...]) -> list[Path]:
    """Download (once) and unpack the sdists ``specs`` under ``cache/sdists``; return
    their source trees.  Raises :class:`RuntimeFailedError` if pip fails."""
    base = Path(cache) / "sdists"
    src = base / "src"
    src.mkdir(parents=True, exist_ok=True)
    trees = []
    for spec in specs:
        tree = src / spec.replace("==", "-")
        if not tree.is_dir():
            with tempfile.TemporaryDirectory(dir=base) as tmp:
                proc = subprocess.run(
                    [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary=:all:",
                     "--disable-pip-version-check", "-d", tmp, spec],
                    capture_output=True, text=True, check=False,
                )  # fmt: skip
                archives = list(Path(tmp).glob("*.tar.gz"))
                if proc.returncode != 0 or not archives:
                    raise RuntimeFailedError(f"pip download {spec} failed:\n{proc.stderr[-800:]}")
                unpacked = Path(tmp) / "unpacked"
                with tarfile.open(archives[0]) as tar:
                    tar.extractall(unpacked, filter="data")
                (top,) = list(unpacked.iterdir()) or [unpacked]
                shutil.move(top, tree)
        trees.append(tree)
    return trees


def run(templates: int = 8, *, json_path: Path | None = None, work: Path | None = None, log=print) -> dict:
    """Run the benchmark; return the result dict (also written to ``json_path``
    with a PNG beside it)."""
    if not 1 <= templates <= len(SDISTS):
        raise ValueError(f"templates must be 1..{len(SDISTS)}")
    env_paths = Paths.from_env()
    own = work is None
    work = Path(work or tempfile.mkdtemp(prefix="weenv-bench-update-", dir=env_paths.home if env_paths.home.is_dir() else None))
    try:
        paths = Paths(home=work / "home", cache=env_paths.cache, store_url=f"file://{work / 'home' / 'store'}")
        store = FileStore(work / "home" / "store")
        base = debian_rootfs(paths.cache, log=log)
        tasks = fetch_sdists(paths.cache, SDISTS[:templates])
        tools = work / "tools"
        tools.mkdir()
        (tools / "run-tests").write_text("#!/bin/sh\nexec python3 -m pytest -q \"$@\"\n")
        (tools / "lint").write_text("#!/bin/sh\necho lint v1\n")
        recipes = [
            parse_recipe(RECIPE.format(i=i, base=base, tools=tools, task=task,
                                       requirements=json.dumps(list(RUNTIME_REQUIREMENTS))),
                         base_dir=work, origin=f"task-{i}")
            for i, task in enumerate(tasks)
        ]

        def build_all(label: str) -> tuple[list[dict], float]:
            rows, t0 = [], time.monotonic()
            for recipe in recipes:
                r = build_recipe(recipe, store, paths)
                rows.append({"template": r.template, "rebuilt": r.rebuilt, "bytes": r.bytes_published,
                             "seconds": round(r.seconds, 3)})
            total = time.monotonic() - t0
            log(f"{label}: {sum(x['bytes'] for x in rows)} bytes published in {total:.1f} s")
            return rows, total

        initial, initial_s = build_all("initial build")
        (tools / "lint").write_text("#!/bin/sh\necho lint v2\n")  # the shared change
        update, update_s = build_all("after changing one file of the tools")
        weenv_bytes = sum(x["bytes"] for x in update)
        result = {
            "benchmark": "update",
            "summary": {
                "templates": templates,
                "weenv_bytes": weenv_bytes,
                "weenv_seconds": round(update_s, 3),
                "docker_bytes": None,
                "docker_seconds": None,
                "bytes_ratio": None,
            },
            "change": "one file of the shared tools component",
            "docker": "not measured: needs the dockerd + docker-registry harness (weenv.services)",
            "weenv": {"initial": initial, "initial_bytes": sum(x["bytes"] for x in initial),
                      "initial_seconds": round(initial_s, 3), "update": update},
            "machine": machine(),
        }
        if json_path is not None:
            json_path = Path(json_path)
            json_path.write_text(json.dumps(result, indent=2) + "\n")
            plot(result, json_path.with_suffix(".png"))
        return result
    finally:
        if own:
            shutil.rmtree(work, ignore_errors=True)


def plot(result: dict, png: Path) -> None:
    """A bar chart of bytes republished (log scale), weenv beside Docker when measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result["summary"]
    labels, values = ["weenv"], [s["weenv_bytes"]]
    if s["docker_bytes"] is not None:
        labels.append("Docker")
        values.append(s["docker_bytes"])
    fig, ax = plt.subplots(figsize=(5, 4))
    ax.bar(labels, values, color=["#2a7", "#27a"][: len(values)])
    ax.set_yscale("log")
    ax.set_ylabel("bytes republished")
    ax.set_title(f"update of one shared component, {s['templates']} templates")
    for x, v in enumerate(values):
        ax.annotate(f"{v / 1024:.0f} KiB", (x, v), ha="center", va="bottom")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
