"""``weenv bench update``: what republishing costs when one shared component changes,
weenv against Docker, side by side in one run.

N templates (default 8) share three components and differ in a fourth:

- ``base``: the Debian bookworm minbase + python3 tree (debootstrap, cached);
- ``runtime``: real PyPI packages installed by a ``pip`` step in a build environment;
- ``tools``: a directory of scripts copied to ``/opt/tools``;
- ``task-I``: the source tree of a real sdist from PyPI, at ``/workspace``.

**weenv**: the N recipes are built into a private file store.  **Docker**: the
same N templates as Dockerfiles, built by a private ``dockerd`` (Debian's
docker.io, classic builder: one layer per ``RUN``/``COPY``) and pushed to a
private ``docker-registry`` on loopback (:mod:`weenv_bench.services`), one repository
per template::

    FROM weenv-bench/base          # `docker import` of the same Debian tree
    RUN python3 pip.whl/pip install ... pytest==...   # same pinned pip, same packages
    COPY tools/ /opt/tools/
    COPY tasks/task-I/ /workspace/
    WORKDIR /workspace

(the ``RUN`` fetches pip's wheel and the host's CA bundle from a loopback HTTP
server and removes them in the same layer, so the layer holds what weenv's
``pip`` step installs; builds use the host network, as weenv's build
environments do).

Both sides are built once; then a change is made and everything is built and
published again.  Changes, in order:

1. ``tools`` (the headline): one file of the shared tools is rewritten;
2. ``base`` (unless ``base_change=False``): one file of the Debian tree is
   replaced (as a security update of a base package would), on a hard-linked
   copy of the cached tree; Docker re-imports its base image.

Measured per change, over all N templates, builds run one template after the
other:

- weenv: bytes published (new chunks + manifests written to the store, as
  reported by the builder) and wall seconds;
- Docker: bytes the registry stored (the growth of its blob directory: layers,
  image configs and manifests, each blob once however many repositories hold
  it), bytes uploaded (compressed sizes of the layers ``docker push`` reported as
  ``Pushed``, plus configs and manifests) and wall seconds for rebuild + push
  (the base change's ``docker import`` included).

``summary.docker_bytes`` is the registry's stored bytes for the tools change,
``bytes_ratio`` is ``docker_bytes / weenv_bytes``.  ``scaling`` gives both sides'
cumulative bytes after the first k templates of that same round (k = 1..N),
which is what a k-template run publishes: the ratio's growth with k.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path

from weenv.build.buildenv import NodeBuildEnvironments
from weenv.config import Paths
from weenv.errors import RuntimeFailedError
from weenv.packaging.builder import build_recipe, host_ca_bundle, pip_wheel
from weenv.packaging.debootstrap import debian_rootfs
from weenv.packaging.recipe import parse_recipe
from weenv.store.file import FileStore
from weenv_bench import machine, write_report

SDISTS = (
    "six==1.17.0",
    "idna==3.10",
    "packaging==24.2",
    "toml==0.10.2",
    "iniconfig==2.0.0",
    "pluggy==1.5.0",
    "attrs==24.3.0",
    "pyparsing==3.2.0",
    "tomli==2.2.1",
    "wcwidth==0.2.13",
    "certifi==2024.12.14",
    "markupsafe==3.0.2",
)
"""Real sdists, one per template's task component (the first N are used)."""
RUNTIME_REQUIREMENTS = ("pytest==8.3.4",)
QUICK_RUNTIME_REQUIREMENTS = ("iniconfig==2.0.0",)
"""``quick``: one small pure-Python wheel instead of pytest and its dependencies."""
BASE_CHANGED_FILE = "usr/lib/os-release"
"""The file of the Debian tree replaced by the ``base`` change."""

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

DOCKERFILE = """\
FROM {base}
RUN python3 -c 'import sys, urllib.request as u; [u.urlretrieve(sys.argv[1] + n, "/tmp/" + n) for n in ("{wheel}", "ca.crt")]' {url} \\
 && python3 /tmp/{wheel}/pip install --no-cache-dir --root-user-action=ignore --disable-pip-version-check \\
    --break-system-packages --cert=/tmp/ca.crt {requirements} \\
 && rm -f /tmp/{wheel} /tmp/ca.crt
COPY tools/ /opt/tools/
COPY tasks/task-{i}/ /workspace/
WORKDIR /workspace
"""
DOCKER_BASE = "weenv-bench/base"
SUMMARY_KEYS = ("templates", "weenv_bytes", "weenv_seconds", "docker_bytes", "docker_seconds", "bytes_ratio")


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
                    [
                        sys.executable,
                        "-m",
                        "pip",
                        "download",
                        "--no-deps",
                        "--no-binary=:all:",
                        "--disable-pip-version-check",
                        "-d",
                        tmp,
                        spec,
                    ],
                    capture_output=True,
                    text=True,
                    check=False,
                )
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


@contextlib.contextmanager
def _file_server(directory: Path):
    """Serve ``directory`` over HTTP on 127.0.0.1:<free port> from a thread; yield
    its URL (ending in ``/``)."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(directory)))
    thread = threading.Thread(target=server.serve_forever, name="bench-files", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def _copy_tree_linked(src: Path, dst: Path) -> None:
    """``cp -a --link``: a copy of ``src`` whose files are hard links (a plain copy
    across filesystems).  Files are then only ever replaced, never written to."""
    proc = subprocess.run(["cp", "-a", "--link", f"{src}/.", str(dst)], capture_output=True, check=False)
    if proc.returncode != 0:
        shutil.rmtree(dst, ignore_errors=True)
        subprocess.run(["cp", "-a", f"{src}/.", str(dst)], capture_output=True, check=True)


def _replace_file(path: Path, data: bytes) -> None:
    """Replace ``path`` by a new inode holding ``data`` (its hard-linked twins unchanged)."""
    mode = path.stat().st_mode & 0o7777 if path.exists() else 0o644
    tmp = path.with_name(path.name + ".weenv-new")
    tmp.write_bytes(data)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


class _DockerSide:
    """Docker's half: imports the base, builds and pushes each template, measures."""

    def __init__(
        self,
        dockerd,
        registry,
        context: Path,
        names: list[str],
        requirements: tuple[str, ...],
        files_url: str,
        wheel: str,
        log,
    ):
        self.dockerd, self.registry, self.context, self.names = dockerd, registry, context, names
        self.requirements, self.files_url, self.wheel, self.log = requirements, files_url, wheel, log

    def import_base(self, tree: Path) -> float:
        """``tar -c TREE | docker import - weenv-bench/base``; return seconds."""
        t0 = time.monotonic()
        tar = subprocess.Popen(
            ["tar", "-C", str(tree), "--xattrs", "--numeric-owner", "-c", "."],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        try:
            imp = subprocess.run(
                [self._docker, "import", "-", DOCKER_BASE],
                stdin=tar.stdout,
                capture_output=True,
                env=self.dockerd.env(),
                check=False,
            )
        finally:
            tar.stdout.close()
            tar_err = tar.stderr.read()
            tar.stderr.close()
            tar.wait()
        if tar.returncode != 0 or imp.returncode != 0:
            raise RuntimeFailedError(
                f"docker import of {tree} failed: {tar_err.decode(errors='replace')[-400:]}"
                f"{imp.stderr.decode(errors='replace')[-400:]}"
            )
        return time.monotonic() - t0

    @property
    def _docker(self) -> str:
        from weenv_bench.services.dockerd import DOCKER

        return DOCKER

    def round(self, tag: str, label: str, *, extra_seconds: float = 0.0) -> tuple[list[dict], float, int]:
        """Build and push every template as ``:TAG``; return per-template rows,
        wall seconds (plus ``extra_seconds``, e.g. a base import), registry bytes added."""
        rows, t0, start_bytes = [], time.monotonic(), self.registry.blob_bytes()
        for i, name in enumerate(self.names):
            before, t = self.registry.blob_bytes(), time.monotonic()
            dockerfile = self.context / f"Dockerfile.{name}"
            dockerfile.write_text(
                DOCKERFILE.format(
                    base=DOCKER_BASE,
                    url=self.files_url,
                    wheel=self.wheel,
                    i=i,
                    requirements=" ".join(self.requirements),
                )
            )
            ref = self.registry.reference(f"bench/{name}", tag)
            build = self.dockerd.docker(
                "build",
                "--network",
                "host",
                "--force-rm",
                "-f",
                str(dockerfile),
                "-t",
                ref,
                str(self.context),
                timeout=1800,
            )
            built = time.monotonic() - t
            out = build.stdout.decode(errors="replace")
            pushed = self._push(ref)
            rows.append(
                {
                    "template": name,
                    "layers_rebuilt": _layers_rebuilt(out),
                    "layers_pushed": pushed["layers_pushed"],
                    "uploaded_bytes": pushed["uploaded_bytes"],
                    "registry_bytes": self.registry.blob_bytes() - before,
                    "build_seconds": round(built, 3),
                    "seconds": round(time.monotonic() - t, 3),
                }
            )
        total = time.monotonic() - t0 + extra_seconds
        added = self.registry.blob_bytes() - start_bytes
        self.log(f"docker {label}: {added} bytes stored by the registry in {total:.1f} s")
        return rows, total, added

    def _push(self, ref: str) -> dict:
        """``docker push REF``; return the layers it uploaded and their compressed
        bytes plus the config's and the manifest's (from the registry's manifest)."""
        out = self.dockerd.docker("push", ref, timeout=1800).stdout.decode(errors="replace")
        pushed_ids = {line.split(":", 1)[0].strip() for line in out.splitlines() if line.strip().endswith(": Pushed")}
        repo, tag = ref.split("/", 1)[1].rsplit(":", 1)
        import httpx

        accept = "application/vnd.docker.distribution.manifest.v2+json"
        r = httpx.get(f"{self.registry.url}/v2/{repo}/manifests/{tag}", headers={"Accept": accept}, timeout=30)
        r.raise_for_status()
        manifest = r.json()
        # docker push names a layer by its diff ID's first 12 hex digits; the
        # image's diff IDs and the manifest's (compressed) layers are in the same order
        diff_ids = json.loads(
            self.dockerd.docker("image", "inspect", "--format", "{{json .RootFS.Layers}}", ref).stdout
        )
        layers = [ly for d, ly in zip(diff_ids, manifest["layers"]) if d.split(":", 1)[1][:12] in pushed_ids]
        uploaded = sum(ly["size"] for ly in layers) + manifest["config"]["size"] + len(r.content)
        return {"layers_pushed": len(layers), "uploaded_bytes": uploaded}


def _layers_rebuilt(build_output: str) -> int:
    """Steps of a classic ``docker build`` that made a new layer (RUN/COPY not
    served from the build cache)."""
    n, step = 0, None
    for line in build_output.splitlines():
        if line.startswith("Step "):
            step = line.split(":", 1)[1].strip().split(" ", 1)[0].upper() if ":" in line else None
        elif "---> Using cache" in line:
            step = None
        elif line.strip().startswith("--->") and step in ("RUN", "COPY", "ADD"):
            n += 1
            step = None
    return n


def run(
    templates: int = 8,
    *,
    json_path: Path | None = None,
    work: Path | None = None,
    quick: bool = False,
    base_change: bool | None = None,
    log=print,
) -> dict:
    """Run the benchmark; return the result dict (also written to ``json_path``
    with a PNG beside it, ``.png`` for ``.json``).

    ``templates``: 1..len(SDISTS).  ``quick``: a small runtime
    (:data:`QUICK_RUNTIME_REQUIREMENTS`) and no base change unless ``base_change``
    says so.  ``work``: a directory for the stores and build contexts (default: a
    temporary one, removed).  Raises :class:`ValueError` for a bad ``templates``,
    :class:`ToolMissingError` without docker.io / docker-registry / debootstrap,
    :class:`RuntimeFailedError` if a build or push fails.  The dockerd and the
    registry are stopped (by PID) and their directories removed in every case.
    """
    from weenv_bench.services.dockerd import Dockerd
    from weenv_bench.services.registry import Registry

    if not 1 <= templates <= len(SDISTS):
        raise ValueError(f"templates must be 1..{len(SDISTS)}")
    if base_change is None:
        base_change = not quick
    requirements = QUICK_RUNTIME_REQUIREMENTS if quick else RUNTIME_REQUIREMENTS
    env_paths = Paths.from_env()
    own = work is None
    work = Path(
        work or tempfile.mkdtemp(prefix="weenv-bench-update-", dir=env_paths.home if env_paths.home.is_dir() else None)
    )
    try:
        paths = Paths(home=work / "home", cache=env_paths.cache, store_url=f"file://{work / 'home' / 'store'}")
        store = FileStore(work / "home" / "store")
        cached_base = debian_rootfs(paths.cache, log=log)
        tasks = fetch_sdists(paths.cache, SDISTS[:templates])
        context = work / "context"  # Docker's build context; weenv reads the same trees
        base = work / "base"
        base.mkdir()
        _copy_tree_linked(cached_base, base)
        tools = context / "tools"
        tools.mkdir(parents=True)
        _write_tools(tools, "v1")
        names = [f"task-{i}" for i in range(templates)]
        for name, task in zip(names, tasks):
            shutil.copytree(task, context / "tasks" / name, symlinks=True)
        recipes = [
            parse_recipe(
                RECIPE.format(
                    i=i,
                    base=base,
                    tools=tools,
                    task=context / "tasks" / name,
                    requirements=json.dumps(list(requirements)),
                ),
                base_dir=work,
                origin=name,
            )
            for i, name in enumerate(names)
        ]
        files = work / "files"  # pip's wheel and the CA bundle, for Docker's RUN
        files.mkdir()
        wheel = pip_wheel(paths.cache)
        shutil.copy(wheel, files / wheel.name)
        shutil.copy(host_ca_bundle() or "/etc/ssl/certs/ca-certificates.crt", files / "ca.crt")

        def weenv_round(label: str) -> tuple[list[dict], float]:
            rows, t0 = [], time.monotonic()
            for recipe in recipes:
                r = build_recipe(recipe, store, paths, environments=NodeBuildEnvironments())
                rows.append(
                    {
                        "template": r.template,
                        "rebuilt": r.rebuilt,
                        "bytes": r.bytes_published,
                        "seconds": round(r.seconds, 3),
                    }
                )
            total = time.monotonic() - t0
            log(f"weenv {label}: {sum(x['bytes'] for x in rows)} bytes published in {total:.1f} s")
            return rows, total

        changes = []
        services = {}
        with contextlib.ExitStack() as stack:
            registry = stack.enter_context(Registry(work / "registry"))
            dockerd = stack.enter_context(Dockerd(insecure_registries=[registry.address]))
            services = {
                "dockerd_pid": dockerd.pid,
                "dockerd_root": str(dockerd.root),
                "dockerd_cgroup_parent": dockerd.cgroup_parent,
                "registry_pid": registry.pid,
            }
            url = stack.enter_context(_file_server(files))
            docker = _DockerSide(dockerd, registry, context, names, requirements, url, wheel.name, log)

            w_initial, w_initial_s = weenv_round("initial build")
            import_s = docker.import_base(base)
            d_initial, d_initial_s, d_initial_bytes = docker.round("v1", "initial build", extra_seconds=import_s)
            initial = {
                "weenv": {
                    "bytes": sum(x["bytes"] for x in w_initial),
                    "seconds": round(w_initial_s, 3),
                    "per_template": w_initial,
                },
                "docker": {
                    "registry_bytes": d_initial_bytes,
                    "seconds": round(d_initial_s, 3),
                    "uploaded_bytes": sum(x["uploaded_bytes"] for x in d_initial),
                    "import_seconds": round(import_s, 3),
                    "per_template": d_initial,
                },
            }

            _write_tools(tools, "v2")  # the shared change
            changes.append(
                _measure("tools", "one file of the shared tools component (/opt/tools/lint)", weenv_round, docker, "v2")
            )
            if base_change:
                target = base / BASE_CHANGED_FILE
                _replace_file(target, target.read_bytes() + b'WEENV_BENCH_UPDATE="1"\n')
                import_s = docker.import_base(base)
                changes.append(
                    _measure(
                        "base",
                        f"one file of the shared Debian base (/{BASE_CHANGED_FILE})",
                        weenv_round,
                        docker,
                        "v3",
                        import_seconds=import_s,
                    )
                )
        head = changes[0]
        result = {
            "benchmark": "update",
            "summary": {
                "templates": templates,
                "weenv_bytes": head["weenv"]["bytes"],
                "weenv_seconds": head["weenv"]["seconds"],
                "docker_bytes": head["docker"]["registry_bytes"],
                "docker_seconds": head["docker"]["seconds"],
                "bytes_ratio": _ratio(head["docker"]["registry_bytes"], head["weenv"]["bytes"]),
            },
            "change": head["change"],
            "docker_bytes_measure": "growth of the registry's blob storage (layers, configs, manifests; "
            "a blob shared by repositories counted once); uploaded_bytes: compressed "
            "sizes of layers docker push reported Pushed + configs + manifests",
            "runtime_requirements": list(requirements),
            "initial": initial,
            "changes": changes,
            "scaling": head["scaling"],
            "docker_services": services,
            "machine": machine(),
        }
        if json_path is not None:
            write_report(result, json_path, plot)
        return result
    finally:
        if own:
            shutil.rmtree(work, ignore_errors=True)


def _write_tools(tools: Path, version: str) -> None:
    """The shared tools at ``version``: only ``lint`` differs between versions."""
    for name, text in (
        ("run-tests", '#!/bin/sh\nexec python3 -m pytest -q "$@"\n'),
        ("lint", f"#!/bin/sh\necho lint {version}\n"),
    ):
        path = tools / name
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            # weenv's copy step sets 0755; Docker's COPY keeps the source's mode
            os.chmod(path, 0o755)


def _measure(
    name: str, change: str, weenv_round, docker: _DockerSide, tag: str, *, import_seconds: float = 0.0
) -> dict:
    """One change: rebuild and republish both sides; the table row and scaling."""
    w_rows, w_s = weenv_round(f"after changing {change}")
    d_rows, d_s, d_bytes = docker.round(tag, f"after changing {change}", extra_seconds=import_seconds)
    w_bytes = sum(x["bytes"] for x in w_rows)
    scaling, wc, dc = [], 0, 0
    for k, (w, d) in enumerate(zip(w_rows, d_rows), start=1):
        wc, dc = wc + w["bytes"], dc + d["registry_bytes"]
        scaling.append({"templates": k, "weenv_bytes": wc, "docker_bytes": dc, "bytes_ratio": _ratio(dc, wc)})
    return {
        "name": name,
        "change": change,
        "weenv": {"bytes": w_bytes, "seconds": round(w_s, 3), "per_template": w_rows},
        "docker": {
            "registry_bytes": d_bytes,
            "uploaded_bytes": sum(x["uploaded_bytes"] for x in d_rows),
            "seconds": round(d_s, 3),
            "import_seconds": round(import_seconds, 3),
            "per_template": d_rows,
        },
        "bytes_ratio": _ratio(d_bytes, w_bytes),
        "scaling": scaling,
    }


def _ratio(docker_bytes: int, weenv_bytes: int) -> float | None:
    return round(docker_bytes / weenv_bytes, 1) if weenv_bytes else None


def plot(result: dict, png: Path) -> None:
    """Left: bytes republished per change, weenv beside Docker (log scale).  Right:
    Docker's bytes over weenv's against the number of templates (tools change)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    changes = result["changes"]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 4.2))
    width = 0.38
    for j, (side, key, color) in enumerate((("weenv", "bytes", "#2a7"), ("Docker", "registry_bytes", "#27a"))):
        values = [c["weenv" if side == "weenv" else "docker"][key] for c in changes]
        xs = [i + (j - 0.5) * width for i in range(len(changes))]
        ax.bar(xs, values, width, label=side, color=color)
        for x, v in zip(xs, values):
            ax.annotate(_human(v), (x, v), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(changes)), [f"{c['name']} change" for c in changes])
    ax.set_yscale("log")
    ax.set_ylabel("bytes republished")
    ax.set_title(f"update of one shared component, {result['summary']['templates']} templates", fontsize=10)
    ax.legend()
    for c in changes:
        ks = [s["templates"] for s in c["scaling"]]
        ax2.plot(ks, [s["bytes_ratio"] for s in c["scaling"]], marker="o", label=f"{c['name']} change")
    ax2.set_xlabel("templates sharing the component")
    ax2.set_ylabel("Docker bytes / weenv bytes")
    ax2.set_title("ratio against the number of templates", fontsize=10)
    ax2.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
