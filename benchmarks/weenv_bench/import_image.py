"""``weenv bench import``: ``weenv import`` of a registry image against ``docker
pull`` of the same image, and against the old import path, in one run.

**Content.**  The images of ``weenv bench start`` (:mod:`weenv_bench.start`):
``docker import`` of the cached Debian bookworm minbase + python3 tree, then
``COPY`` of the installed wheels (``import-1g``: :data:`~weenv_bench.start.FULL_WHEELS`,
about 1 GB; ``import-3g``: :data:`~weenv_bench.start.LARGE_WHEELS`, about 3 GB;
``quick``: 1 GB only), built by a private dockerd and pushed (gzip layers) to
a private docker-registry on loopback.

**Systems**, one after the other per image, each from nothing:

- ``docker``: ``docker pull REF`` (every image removed before; overlay2).
- ``weenv``: ``weenv import docker://REF`` into an empty ``file://`` store, the
  default path (layers streamed from the registry over HTTP into the EROFS
  writer, :mod:`weenv.packaging.importer.tartree`).
- ``weenv-old``: the same with the old path (:mod:`weenv_bench.extracting_import` and
  ``WEENV_IMPORT_SKOPEO=1``: ``skopeo copy`` to an OCI layout, each group's
  layers extracted to a directory, the image written from it).
- ``weenv-ref`` (with ``ref_src``): ``weenv``'s import run from another
  checkout's ``src`` (``PYTHONPATH``), e.g. the code before a change, in the
  same run.

``runs``: each system measured that many times, the systems interleaved
(docker, weenv, weenv-ref, weenv-old, then again); the summary takes each
system's median.  ``systems``: the ones to measure (``docker`` and ``weenv``
always).

**Measured**: wall seconds (weenv: the importing process's whole life,
interpreter start included); peak extra disk: every file the system writes
(dockerd's data root; weenv's store, work directory and ``TMPDIR``) lives on
one ext4 file system made for the run (a sparse file, loop-mounted), sampled
with statvfs(2) every 10 ms, peak minus the level before the run (the result
included: overlay2's layers, weenv's stored chunks); final disk: the same
after the run; peak memory: weenv: the importing process and its children
(``wait4`` ``ru_maxrss``), Docker: dockerd + containerd (VmHWM after
``clear_refs``).  ``image_bytes``: Docker's image size (``docker image
inspect .Size``, the layers unpacked).

``summary`` (the first image, medians over the runs): ``import_s``,
``docker_pull_s``, ``old_import_s``, ``ref_import_s``, ``time_ratio`` (weenv
over docker pull; goal <= 1), ``old_time_ratio`` (the old path over the
new), ``ref_time_ratio`` (weenv-ref over docker pull), ``disk_ratio``
(weenv's peak extra disk over the image's size; goal <= 1.1),
``docker_disk_ratio``, ``old_disk_ratio``, ``ref_disk_ratio``,
``peak_mem_bytes`` per system (None for a system not measured).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from weenv.config import Paths
from weenv_bench import machine, write_report
from weenv_bench.start import (
    DOCKER_BASE,
    DOCKERFILE,
    FULL_WHEELS,
    LARGE_WHEELS,
    _DaemonMeter,
    _DockerSide,
    _registry_image_bytes,
    _uptime,
    loadavg,
    packages_tree,
)

SYSTEMS = ("docker", "weenv", "weenv-ref", "weenv-old")
IMAGES = ("import-1g", "import-3g")
_IMPORT_SCRIPT = """
import json, sys
from weenv.packaging.importer import import_image
from weenv.store.file import FileStore
source, store, work, extract = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
if extract:  # the old path, kept in the benchmarks
    from weenv_bench.extracting_import import import_extracting as import_image
r = import_image(source, FileStore(store), name="bench", workdir=work)
print(json.dumps({"seconds": r.seconds, "groups": len(r.groups),
                  "image_bytes": sum(g.manifest.image_size for g in r.groups),
                  "stored_bytes": sum(g.manifest.stored_size for g in r.groups)}))
"""


class _Scratch:
    """An ext4 file system in a sparse file under ``parent``, loop-mounted at
    ``parent/m`` (``size`` bytes); :meth:`used` is its statvfs(2) used bytes."""

    def __init__(self, parent: Path, size: int):
        self.file, self.mount = parent / "scratch.ext4", parent / "m"
        with open(self.file, "wb") as f:
            f.truncate(size)
        subprocess.run(
            ["mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=1,lazy_journal_init=1", "-m", "0", str(self.file)],
            check=True,
            capture_output=True,
        )
        self.mount.mkdir()
        subprocess.run(["mount", "-o", "loop", str(self.file), str(self.mount)], check=True, capture_output=True)

    def used(self) -> int:
        return used_bytes(self.mount)

    def close(self) -> None:
        subprocess.run(["umount", str(self.mount)], check=False, capture_output=True)
        with contextlib.suppress(OSError):
            self.file.unlink()


class DiskMeter:
    """Peak and final growth (``peak_bytes``, ``final_bytes``) of a file
    system's used bytes (``used()``, e.g. :meth:`_Scratch.used`) over a block,
    sampled every ``interval`` seconds."""

    def __init__(self, used, interval: float = 0.01):
        self.used, self.interval = used, interval

    def __enter__(self) -> DiskMeter:
        os.sync()
        self.base = self.peak = self.used()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self.used())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        os.sync()
        final = self.used()
        self.peak = max(self.peak, final)
        self.peak_bytes, self.final_bytes = self.peak - self.base, final - self.base


def used_bytes(path: str | os.PathLike[str]) -> int:
    """statvfs(2) used bytes of the file system holding ``path``."""
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def run(
    *,
    quick: bool = False,
    json_path: Path | None = None,
    work: Path | None = None,
    scratch_bytes: int | None = None,
    log=print,
    runs: int = 1,
    systems: tuple[str, ...] | None = None,
    ref_src: Path | None = None,
    images: tuple[str, ...] | None = None,
) -> dict:
    """Run the benchmark; return the result dict (also written to ``json_path``
    with a PNG beside it).  ``quick``: the ~1 GB image only; ``images``: the
    images by name (:data:`IMAGES`; default both, or the first with
    ``quick``).  ``runs``, ``systems``, ``ref_src``: see the module doc (default
    every system but ``weenv-ref``, which needs ``ref_src``).  ``work``: the
    directory for the registry and the scratch file system (default a new one
    in the system's temporary directory, removed).  Raises
    :class:`ToolMissingError` without docker.io / docker-registry / skopeo /
    debootstrap, :class:`RuntimeFailedError` if a build, push, pull or import
    fails.  The dockerd and the registry are stopped by PID, the scratch file
    system unmounted and removed in every case."""
    from weenv.errors import InvalidInputError
    from weenv.packaging.debootstrap import debian_rootfs
    from weenv_bench.services.dockerd import Dockerd
    from weenv_bench.services.registry import Registry

    env_paths = Paths.from_env()
    wanted = images or (IMAGES[:1] if quick else IMAGES)
    if unknown := set(wanted) - set(IMAGES):
        raise InvalidInputError(f"no such bench image: {', '.join(sorted(unknown))} (one of {', '.join(IMAGES)})")
    plan = [(n, w) for n, w in zip(IMAGES, (FULL_WHEELS, LARGE_WHEELS)) if n in wanted]
    if systems is None:
        systems = tuple(x for x in SYSTEMS if x != "weenv-ref" or ref_src is not None)
    if unknown := set(systems) - set(SYSTEMS):
        raise InvalidInputError(f"no such system: {', '.join(sorted(unknown))} (of {', '.join(SYSTEMS)})")
    systems = tuple(x for x in SYSTEMS if x in systems or x in ("docker", "weenv"))
    if "weenv-ref" in systems and ref_src is None:
        raise InvalidInputError("weenv-ref needs ref_src (the other checkout)")
    if runs < 1:
        raise InvalidInputError(f"runs must be at least 1, not {runs}")
    own = work is None
    work = Path(work or tempfile.mkdtemp(prefix="wbi-"))
    t_run = time.monotonic()
    load_start = loadavg()
    rows: list[dict] = []
    images: list[dict] = []
    try:
        base_tree = debian_rootfs(env_paths.cache, log=log)
        with contextlib.ExitStack() as stack:
            scratch = _Scratch(work, scratch_bytes or ((16 if quick else 32) << 30))
            stack.callback(scratch.close)
            registry = stack.enter_context(Registry(work / "registry"))
            dockerd = stack.enter_context(Dockerd(scratch.mount / "d", insecure_registries=[registry.address]))
            for name, wheels in plan:
                image, measured = _measure(
                    name,
                    base_tree,
                    wheels,
                    registry=registry,
                    dockerd=dockerd,
                    scratch=scratch,
                    env_paths=env_paths,
                    log=log,
                    runs=runs,
                    systems=systems,
                    ref_src=ref_src,
                )
                images.append(image)
                rows += measured
        summary = _summary(plan[0][0], images[0]["image_bytes"], rows)
        result = {
            "benchmark": "import",
            "summary": summary,
            "table": rows,
            "images": images,
            "method": {
                "docker": "docker pull REF from the loopback registry (private dockerd, overlay2), no image present",
                "weenv": "weenv import docker://REF (default: layers streamed over HTTP into the EROFS writer) into "
                "an empty file:// store, in a child process",
                "weenv-old": "the old path: skopeo copy to an OCI layout, layers extracted to a directory per "
                "group, the image written from it (weenv_bench.extracting_import, WEENV_IMPORT_SKOPEO=1)",
                "weenv-ref": f"weenv's import from {ref_src}/src (PYTHONPATH)" if ref_src else None,
                "runs": f"{runs} per system, interleaved; the summary takes medians",
                "disk": "one loop-mounted ext4 holds all each system writes; statvfs used bytes every 10 ms, peak "
                "minus the level before; ratio over the image's unpacked size (docker image inspect .Size)",
                "memory": "weenv: wait4 ru_maxrss of the importing process (children included); docker: dockerd + "
                "containerd VmHWM",
            },
            "not_run": [f"the {n} image" for n in IMAGES if n not in wanted]
            + [f"system {x}" for x in SYSTEMS if x not in systems],
            "load": {"start": load_start, "end": loadavg(), "uptime": _uptime()},
            "seconds": round(time.monotonic() - t_run, 1),
            "machine": machine(),
        }
        if json_path is not None:
            write_report(result, json_path, plot)
        return result
    finally:
        if own:
            shutil.rmtree(work, ignore_errors=True)


def _summary(image: str, image_bytes: int, rows: list[dict]) -> dict:
    """Medians per system of image ``image``'s rows (see the module doc)."""

    def med(system: str, key: str):
        vals = [r[key] for r in rows if r["image"] == image and r["system"] == system]
        return round(statistics.median(vals), 3) if vals else None

    def ratio(a, b):
        return round(a / b, 2) if a is not None and b else None

    weenv, docker, old, ref = (med(x, "seconds") for x in ("weenv", "docker", "weenv-old", "weenv-ref"))
    return {
        "image": image,
        "image_bytes": image_bytes,
        "import_s": weenv,
        "docker_pull_s": docker,
        "old_import_s": old,
        "ref_import_s": ref,
        "time_ratio": ratio(weenv, docker),
        "old_time_ratio": ratio(old, weenv),
        "ref_time_ratio": ratio(ref, docker),
        **{
            f"{k}disk_ratio": med(x, "disk_ratio")
            for k, x in (("", "weenv"), ("docker_", "docker"), ("old_", "weenv-old"), ("ref_", "weenv-ref"))
        },
        "peak_mem_bytes": {x: med(x, "peak_mem_bytes") for x in SYSTEMS},
    }


def _measure(
    name: str,
    base_tree: Path,
    wheels: tuple[str, ...],
    *,
    registry,
    dockerd,
    scratch: _Scratch,
    env_paths: Paths,
    log,
    runs: int = 1,
    systems: tuple[str, ...] = ("docker", "weenv", "weenv-old"),
    ref_src: Path | None = None,
) -> tuple[dict, list[dict]]:
    """Build and push image ``name``, then measure each of ``systems`` ``runs``
    times, interleaved; (image facts, rows)."""
    pkgs = packages_tree(env_paths.cache, wheels, log=log)
    context = scratch.mount / "context"
    context.mkdir()
    t = time.monotonic()
    dockerd.import_tree(base_tree, DOCKER_BASE)
    proc = subprocess.run(["cp", "-a", str(pkgs), str(context / "packages")], capture_output=True, check=False)
    if proc.returncode != 0:
        shutil.copytree(pkgs, context / "packages", symlinks=True)
    (context / "Dockerfile").write_text(DOCKERFILE.format(base=DOCKER_BASE))
    ref = registry.reference("bench/import", name)
    dockerd.docker("build", "-q", "-t", ref, str(context), timeout=1800)
    shutil.rmtree(context, ignore_errors=True)
    dockerd.docker("push", ref, timeout=1800)
    image_bytes = int(dockerd.docker("image", "inspect", "--format", "{{.Size}}", ref).stdout.decode().strip())
    compressed = _registry_image_bytes(registry, "bench/import", name)
    log(
        f"{name}: {image_bytes / 1e9:.2f} GB unpacked, {compressed / 1e9:.2f} GB compressed "
        f"(built and pushed in {time.monotonic() - t:.0f} s)"
    )
    docker = _DockerSide(dockerd, ref, compressed, log)
    docker.remove_images()
    dockerd.docker("builder", "prune", "-a", "-f", timeout=300, check=False)
    rows = []

    def row(system: str, seconds: float, disk: DiskMeter, mem: int, **extra) -> dict:
        r = {
            "image": name,
            "system": system,
            "run": run_no,
            "seconds": round(seconds, 2),
            "peak_disk_bytes": disk.peak_bytes,
            "final_disk_bytes": disk.final_bytes,
            "disk_ratio": round(disk.peak_bytes / image_bytes, 3),
            "peak_mem_bytes": mem,
            **extra,
        }
        log(
            f"{name} {system}: {r['seconds']:.1f} s, peak disk {disk.peak_bytes / 1e9:.2f} GB "
            f"({r['disk_ratio']}x the image), final {disk.final_bytes / 1e9:.2f} GB, peak memory {mem / 1e6:.0f} MB"
        )
        return r

    for run_no in range(runs):  # noqa: B007 (the row builders above read it)
        for system in systems:
            if system == "docker":
                rows.append(_docker_pull(dockerd, docker, ref, scratch, row))
            else:
                rows.append(_weenv_import(system, ref, scratch, row, ref_src))
    dockerd.docker("rmi", "-f", DOCKER_BASE, timeout=300, check=False)
    return {
        "name": name,
        "ref": ref,
        "image_bytes": image_bytes,
        "compressed_bytes": compressed,
        "wheels": list(wheels),
    }, rows


def _docker_pull(dockerd, docker: _DockerSide, ref: str, scratch: _Scratch, row) -> dict:
    with _DaemonMeter(docker.daemon_pids) as meter, DiskMeter(scratch.used) as disk:
        t = time.monotonic()
        dockerd.docker("pull", "-q", ref, timeout=1800)
        seconds = time.monotonic() - t
    r = row("docker", seconds, disk, meter.peak_bytes, daemon_cpu_s=round(meter.cpu_s, 2))
    docker.remove_images()
    return r


def _weenv_import(system: str, ref: str, scratch: _Scratch, row, ref_src: Path | None) -> dict:
    """One ``weenv import`` of ``ref`` in a child process (``system``: weenv, weenv-ref, weenv-old); its row."""
    extract = system == "weenv-old"
    base = scratch.mount / system
    for sub in ("store", "work", "tmp"):
        (base / sub).mkdir(parents=True)
    env = {**os.environ, "TMPDIR": str(base / "tmp")}
    if extract:
        env["WEENV_IMPORT_SKOPEO"] = "1"
    if system == "weenv-ref":
        env["PYTHONPATH"] = os.pathsep.join([str(Path(ref_src) / "src"), *filter(None, [env.get("PYTHONPATH")])])
    argv = [
        sys.executable,
        "-c",
        _IMPORT_SCRIPT,
        f"docker://{ref}",
        str(base / "store"),
        str(base / "work"),
        "1" if extract else "0",
    ]
    with DiskMeter(scratch.used) as disk, tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t = time.monotonic()
        child = subprocess.Popen(argv, stdout=out, stderr=err, env=env)
        _pid, status, usage = os.wait4(child.pid, 0)  # its rusage: peak memory with its children
        child.returncode = os.waitstatus_to_exitcode(status)
        seconds = time.monotonic() - t
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(), err.read().decode(errors="replace")
    if child.returncode != 0:
        from weenv.errors import RuntimeFailedError

        raise RuntimeFailedError(f"{system} import failed: {stderr[-800:]}")
    info = json.loads(stdout.strip().splitlines()[-1])
    r = row(
        system,
        seconds,
        disk,
        usage.ru_maxrss * 1024,
        inner_seconds=round(info["seconds"], 2),
        stored_bytes=info["stored_bytes"],
        erofs_bytes=info["image_bytes"],
    )
    shutil.rmtree(base, ignore_errors=True)
    return r


def plot(result: dict, png: Path) -> None:
    """Bars per image: seconds, and peak extra disk over the image's size, per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [i["name"] for i in result["images"]]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    colors = {"docker": "#27a", "weenv": "#2a7", "weenv-ref": "#7c9", "weenv-old": "#aaa"}
    present = [x for x in SYSTEMS if any(r["system"] == x for r in result["table"])]
    width = 0.8 / len(present)
    for ax, key, label in (
        (axes[0], "seconds", "import / pull, s"),
        (axes[1], "disk_ratio", "peak extra disk / image"),
    ):
        for j, system in enumerate(present):
            vals = [
                statistics.median(r[key] for r in result["table"] if r["image"] == n and r["system"] == system)
                for n in names
            ]
            xs = [i + (j - (len(present) - 1) / 2) * width for i in range(len(names))]
            ax.bar(xs, vals, width, label=system, color=colors[system])
            for x, v in zip(xs, vals):
                ax.annotate(
                    f"{v:.2f}" if key == "disk_ratio" else f"{v:.0f}", (x, v), ha="center", va="bottom", fontsize=7
                )
        ax.set_xticks(range(len(names)), names)
        ax.set_ylabel(label)
    axes[0].legend()
    s = result["summary"]
    fig.suptitle(
        f"import of {s['image']}: {s['time_ratio']}x docker pull's time, disk {s['disk_ratio']}x the image", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
