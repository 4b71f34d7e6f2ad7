"""``weenv build RECIPE``: build every component of a recipe into a group, then the template.

Components are built bottom to top.  For each one the builder computes its cache
key (:mod:`weenv.packaging.buildcache`); a hit reuses the group already in the
store (nothing is rebuilt or written).  A miss builds the component's tree:

- **Tree steps only** (``from_dir``, ``debootstrap``, ``copy``): the steps fill a
  staging directory on the host (a single ``from_dir``/``debootstrap`` at ``/`` is
  used in place), which becomes the group.  Such a component never sees the
  groups below.
- **With ``run``/``pip`` steps**: a *build environment* is started by the
  :class:`~weenv.packaging.buildenv.BuildEnvironments` the caller gives
  (the node's: :class:`weenv.build.buildenv.NodeBuildEnvironments`, a private
  in-process :class:`~weenv.node.node.Node` whose home is under
  ``$WEENV_HOME/build``, so it never touches the daemon's environments) from
  a scratch template of the groups below (an empty group if there are none),
  with network (its own namespace, NATed out: :mod:`weenv.node.runtime.network`), Docker's
  default capabilities and root as the user.
  Tree steps copy into its root through the overlay, confined to it (the
  destination directory is opened with openat2 ``RESOLVE_IN_ROOT``); commands
  run with :meth:`BuildEnvironment.exec`.  Then the environment is stopped, and its overlay
  upper dir — exactly what the steps changed, deletions as whiteouts and
  replaced directories as opaque — is cleaned (:func:`~weenv.packaging.upperdir.clean_upper`)
  and becomes the group.

``pip`` steps run the *base's own* interpreter inside the build environment,
with a pinned pip (:data:`~weenv.packaging.buildcache.PIP_VERSION`) run from its
wheel (a wheel is a zip that Python can run: ``python3 pip.whl/pip``), fetched once
with the host's pip into ``$WEENV_CACHE/pip``.  Host ``pip --target`` would be
wrong for a base whose Python differs from the host's: pip picks wheels for the
interpreter that runs it (version, ABI, glibc), would not see packages the groups
below already hold, writes console scripts whose ``#!`` names the host's Python,
and builds sdists with the host's compilers and headers.  Inside, pip installs into
the base's own scheme (Debian: ``/usr/local/lib/python3.X/dist-packages``, with
``--break-system-packages`` for Debian's PEP 668 marker, as a Dockerfile does).

Publication: groups are written (chunks, manifest, cache entry) as they are
built, by digest; the refs ``groups/NAME`` and ``templates/NAME`` move only when
every component has been built.  A failing step raises :class:`StepFailedError`
with the command's output; nothing of the failing component is kept and no
ref moves; components below it that were built stay in the build cache
(unreferenced until a build succeeds, or removed by ``weenv gc``), as Docker keeps
the layers before a failed ``RUN``.  Build environments, mounts and scratch
manifests are removed in every case.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from weenv.config import Paths
from weenv.errors import (
    InvalidInputError,
    NotFoundError,
    RuntimeFailedError,
    ToolMissingError,
)
from weenv.formats.manifest import (
    GroupManifest,
    Resources,
    RuntimeConfig,
    TemplateManifest,
    canonical_json,
)
from weenv.host import mounts
from weenv.host.rootfs import RootFS
from weenv.packaging import buildcache
from weenv.packaging.buildenv import BuildEnvironment, BuildEnvironments
from weenv.packaging.debootstrap import debian_rootfs
from weenv.packaging.group import BuildResult, build_group, load_group
from weenv.packaging.recipe import (
    Component,
    Copy,
    Debootstrap,
    FromDir,
    Pip,
    Recipe,
    Run,
)
from weenv.packaging.template import load_template
from weenv.packaging.upperdir import clean_upper
from weenv.progress import QUIET, Progress
from weenv.store.base import Store
from weenv.store.lease import Lease, LeasedStore, covered

OUTPUT_TAIL_LINES = 40
BUILD_MEMORY_BYTES = 8 << 30


class StepFailedError(RuntimeFailedError):
    """A build step failed; ``output`` holds what it printed (stdout and stderr, interleaved)."""

    def __init__(self, message: str, *, component: str, step: int, output: str = ""):
        super().__init__(message)
        self.component = component
        self.step = step
        self.output = output


@dataclass(frozen=True)
class ComponentResult:
    """One component of a build: its group and what building it cost."""

    name: str
    digest: str
    """The group manifest's digest."""
    cache_key: str
    cached: bool
    """Found in the build cache: not rebuilt, nothing written."""
    chunks_written: int = 0
    bytes_written: int = 0
    """Stored (zstd) bytes of new chunks plus the manifest's bytes."""
    seconds: float = 0.0
    image_size: int = 0


@dataclass(frozen=True)
class RecipeResult:
    """What :func:`build_recipe` published."""

    template: str
    template_digest: str
    template_changed: bool
    """False when the template's groups and runtime were already what the store's ref points at."""
    components: list[ComponentResult] = field(default_factory=list)
    seconds: float = 0.0
    template_bytes_written: int = 0
    """Bytes of the template manifest, if it was written."""

    @property
    def bytes_published(self) -> int:
        """Stored bytes written: new chunks, group manifests and the template manifest."""
        return sum(c.bytes_written for c in self.components) + self.template_bytes_written

    @property
    def rebuilt(self) -> list[str]:
        """Names of the components that were built (not cache hits)."""
        return [c.name for c in self.components if not c.cached]


def build_recipe(
    recipe: Recipe,
    store: Store,
    paths: Paths | None = None,
    *,
    progress: Progress = QUIET,
    environments: BuildEnvironments | None = None,
) -> RecipeResult:
    """Build and publish every component of ``recipe`` and its template.

    ``environments`` starts the build environments of components with
    ``run``/``pip`` steps (:class:`weenv.build.buildenv.NodeBuildEnvironments`).
    Raises :class:`InvalidInputError` (a missing source, a bad tree, such a
    component without ``environments``, before anything is built),
    :class:`StepFailedError` (a step exited non-zero or timed out),
    :class:`ToolMissingError`, :class:`RuntimeFailedError` and the store's errors.
    """
    paths = paths or Paths.from_env()
    needing = [c.name for c in recipe.component if c.needs_environment]
    if needing and environments is None:
        raise InvalidInputError(
            f"components {needing} have run/pip steps: build_recipe needs environments "
            "(weenv.build.buildenv.NodeBuildEnvironments)"
        )
    for comp in recipe.component:
        progress.start(comp.name, status="waiting")
    t0 = time.monotonic()
    results: list[ComponentResult] = []
    below: list[str] = []
    # The lease names every chunk and manifest the build stores or reuses
    # (weenv.store.lease) until its template is published.
    with buildcache.store_lock(paths, exclusive=False), Lease(store, what=f"build {recipe.template.name}") as lease:
        store = LeasedStore(store, lease)
        for comp in recipe.component:
            progress.advance(comp.name, 0, status="hashing inputs")
            key = buildcache.component_key(recipe, comp, below)
            hit = _cached(store, lease, key)
            if hit is not None:
                progress.finish(comp.name, status="cached")
                results.append(ComponentResult(comp.name, hit[0], key, True, image_size=hit[1].image_size))
            else:
                t = time.monotonic()
                r = build_component(
                    recipe, comp, below, store, paths, progress, cache_key=key, environments=environments
                )
                buildcache.record(store, key, r.digest)
                written = r.bytes_written + len(canonical_json(r.manifest))
                results.append(
                    ComponentResult(
                        comp.name,
                        r.digest,
                        key,
                        False,
                        r.chunks_written,
                        written,
                        time.monotonic() - t,
                        r.manifest.image_size,
                    )
                )
                progress.finish(comp.name, status="built")
            below.append(results[-1].digest)

        lease.check()
        for comp, res in zip(recipe.component, results):
            store.set_ref("groups", comp.name, res.digest)
        tpl = recipe.template
        manifest = TemplateManifest(name=tpl.name, version=tpl.version, groups=below, runtime=tpl.runtime)
        try:
            cur_digest, current = load_template(store, tpl.name)
        except NotFoundError:
            current = None
        if current is not None and (current.groups, current.runtime, current.version) == (
            manifest.groups,
            manifest.runtime,
            manifest.version,
        ):
            digest, written = cur_digest, 0
        else:
            data = canonical_json(manifest)
            digest, written = store.put_manifest(data), len(data)
            store.set_ref("templates", tpl.name, digest)
    return RecipeResult(tpl.name, digest, written > 0, results, time.monotonic() - t0, written)


def _cached(store: LeasedStore, lease: Lease, key: str) -> tuple[str, GroupManifest] | None:
    """The cached group of ``key`` and its manifest, once ``lease`` names it
    and its chunks and they are still stored (:func:`~weenv.store.lease.covered`:
    a gc that deleted them meanwhile makes it a miss, so the component is
    built again); None on a miss."""
    hit = covered(
        lease,
        lambda: buildcache.lookup(store, key),
        lambda digest: [c.digest for c in load_group(store, digest).chunks],
    )
    if hit is None:
        return None
    try:
        return hit, load_group(store, hit)
    except NotFoundError:
        return None


def build_component(
    recipe: Recipe,
    comp: Component,
    below: list[str],
    store: Store,
    paths: Paths,
    progress: Progress,
    *,
    cache_key: str = "",
    environments: BuildEnvironments | None = None,
) -> BuildResult:
    """Build one component over the groups ``below`` and publish its group by digest
    (no ref).  Errors as :func:`build_recipe`; nothing is left behind on failure."""
    work = paths.home / "build" / secrets.token_hex(6)
    work.mkdir(parents=True)
    provenance = {"type": "recipe", "path": str(recipe.base_dir), "component": comp.name, "cache_key": cache_key}
    try:
        if comp.needs_environment:
            if environments is None:
                raise InvalidInputError(f"component {comp.name!r} has run/pip steps: give environments")
            return _build_in_environment(recipe, comp, below, store, paths, work, progress, provenance, environments)
        source = _in_place_source(recipe, comp, paths)
        if source is None:
            source = work / "tree"
            source.mkdir()
            for i, step in enumerate(comp.step, 1):
                progress.advance(comp.name, 0, status=f"step {i}/{len(comp.step)}: {step.kind}")
                _apply_tree_step(recipe, step, source, paths, work, comp.name, i)
        progress.advance(comp.name, 0, status="publishing")
        return build_group(
            source, store, name=comp.name, version=comp.version, source=provenance, workdir=work, ref=False
        )
    finally:
        _remove_work(work)


def _remove_work(work: Path) -> None:
    """Remove a build's work dir, unless something is still mounted in it (then
    deleting would reach into the mount; the node's next start clears it)."""
    left = mounts.mounts_under(work)
    if left:
        raise RuntimeFailedError(f"build dir {work} still has mounts: {[p for _t, p in left]}")
    shutil.rmtree(work, ignore_errors=True)


def _in_place_source(recipe: Recipe, comp: Component, paths: Paths) -> Path | None:
    """The one directory that is the whole tree (a lone from_dir/debootstrap at ``/``), else None."""
    if len(comp.step) != 1 or comp.step[0].dest != "/":
        return None
    step = comp.step[0]
    if isinstance(step, FromDir):
        path = recipe.path(step.path)
        if not path.is_dir():
            raise InvalidInputError(f"component {comp.name!r}: {path} is not a directory")
        return path
    if isinstance(step, Debootstrap):
        return debian_rootfs(paths.cache, suite=step.suite, variant=step.variant, include=tuple(step.packages))
    return None


# --- tree steps ------------------------------------------------------------------------


def copy_into(src_dir: Path, root: Path, dest: str) -> None:
    """Copy the contents of ``src_dir`` into directory ``dest`` of the tree at ``root``
    (created if missing), keeping owners, modes, times, xattrs and hardlinks
    (``cp -a``).  ``dest`` is resolved inside ``root``: a symbolic link in the tree
    cannot lead the copy out of it.  Raises :class:`InvalidInputError` if cp fails."""
    fs = RootFS(root)
    fs.make_dir(dest)
    fd = fs.open_dir(dest)
    try:
        proc = subprocess.run(
            ["cp", "-a", "--remove-destination", "--", f"{src_dir}/.", f"/proc/self/fd/{fd}/"],
            pass_fds=(fd,),
            capture_output=True,
            text=True,
            check=False,
            errors="replace",
        )
    finally:
        os.close(fd)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-5:]).replace(f"/proc/self/fd/{fd}", dest.rstrip("/"))
        raise InvalidInputError(f"copying {src_dir} into {dest}: {tail}")


def _apply_tree_step(recipe: Recipe, step, root: Path, paths: Paths, work: Path, comp: str, index: int) -> None:
    where = f"component {comp!r}, step {index} ({step.kind})"
    if isinstance(step, FromDir):
        src = recipe.path(step.path)
        if not src.is_dir():
            raise InvalidInputError(f"{where}: {src} is not a directory")
        copy_into(src, root, step.dest)
    elif isinstance(step, Debootstrap):
        tree = debian_rootfs(paths.cache, suite=step.suite, variant=step.variant, include=tuple(step.packages))
        copy_into(tree, root, step.dest)
    elif isinstance(step, Copy):
        _copy_step(recipe, step, root, work / f"copy-{index}", where)
    else:
        raise InvalidInputError(f"{where}: not a tree step")


def _copy_step(recipe: Recipe, step: Copy, root: Path, stage: Path, where: str) -> None:
    src = recipe.path(step.src)
    if not (src.exists() or src.is_symlink()):
        raise InvalidInputError(f"{where}: {src} does not exist")
    stage.mkdir()
    if src.is_dir():
        dest_dir, items = step.dest, [f"{src}/."]
        target = stage
    else:
        if step.dest.endswith("/"):
            dest_dir, name = step.dest, src.name
        else:
            dest_dir, name = os.path.dirname(step.dest) or "/", os.path.basename(step.dest)
        items, target = [str(src)], stage / name
    proc = subprocess.run(["cp", "-a", "--", *items, str(target)], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise InvalidInputError(f"{where}: cp {src}: {proc.stderr.strip()}")
    uid, gid = (int(x) for x in step.owner.split(":"))
    for dirpath, dirnames, filenames in os.walk(stage):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            os.chown(p, uid, gid, follow_symlinks=False)
            if step.mode is not None and not os.path.islink(p):
                os.chmod(p, int(step.mode, 8))
    copy_into(stage, root, dest_dir)


# --- build environments ----------------------------------------------------------------


def _build_in_environment(
    recipe: Recipe,
    comp: Component,
    below: list[str],
    store: Store,
    paths: Paths,
    work: Path,
    progress: Progress,
    provenance: dict[str, str],
    environments: BuildEnvironments,
) -> BuildResult:
    token = work.name
    scratch_manifests: list[str] = []
    scratch_chunks: list[str] = []
    env: BuildEnvironment | None = None
    try:
        lowers = list(below)
        if not lowers:  # overlayfs needs a lower dir: an empty group
            empty = work / "empty"
            empty.mkdir(mode=0o755)
            r = build_group(empty, store, name=f"build-{token}-empty", workdir=work, ref=False)
            scratch_manifests.append(r.digest)
            scratch_chunks.extend(r.new_chunks)
            lowers = [r.digest]
        runtime = RuntimeConfig(
            env=recipe.template.runtime.env,
            network=True,
            resources=Resources(cpus=float(os.cpu_count() or 1), memory_bytes=BUILD_MEMORY_BYTES, pids=16384),
        )
        scratch = TemplateManifest(name=f"build-{token}", groups=lowers, runtime=runtime)
        scratch_manifests.append(store.put_manifest(canonical_json(scratch)))
        progress.advance(comp.name, 0, status="starting build environment")
        env = environments.start(
            Paths(home=work / "node", cache=paths.cache, store_url=store.url), store, scratch_manifests[-1]
        )
        root = env.root
        for i, step in enumerate(comp.step, 1):
            progress.advance(comp.name, 0, status=f"step {i}/{len(comp.step)}: {step.kind}")
            if isinstance(step, Run):
                for command in step.commands:
                    _check(
                        env.exec(
                            ["/bin/sh", "-c", "exec 2>&1\n" + command],
                            env=step.env,
                            cwd=step.workdir,
                            timeout=step.timeout,
                        ),
                        comp.name,
                        i,
                        step.kind,
                        command,
                        step.timeout,
                    )
            elif isinstance(step, Pip):
                _pip_step(recipe, step, env, root, paths, comp.name, i, token)
            else:
                _apply_tree_step(recipe, step, root, paths, work, comp.name, i)
        progress.advance(comp.name, 0, status="collecting changes")
        upper = env.stop()
        clean_upper(upper)
        progress.advance(comp.name, 0, status="publishing")
        return build_group(
            upper, store, name=comp.name, version=comp.version, source=provenance, workdir=work, ref=False
        )
    finally:
        if env is not None:
            env.close()
        for digest in scratch_manifests:
            store.delete_manifest(digest)
        for digest in scratch_chunks:  # named after this build's token: no one else has them
            store.delete_chunk(digest)


def _check(result, comp: str, index: int, kind: str, command: str, timeout: float) -> None:
    if result.exit_code == 0 and not result.timed_out:
        return
    output = result.stdout.decode(errors="replace") + result.stderr.decode(errors="replace")
    tail = "\n".join(output.rstrip().splitlines()[-OUTPUT_TAIL_LINES:])
    what = f"timed out after {timeout:g} s" if result.timed_out else f"exited {result.exit_code}"
    raise StepFailedError(
        f"component {comp!r}, step {index} ({kind}): `{command}` {what}; nothing was published"
        + (f"\n--- output (last {OUTPUT_TAIL_LINES} lines) ---\n{tail}" if tail else " (no output)"),
        component=comp,
        step=index,
        output=output,
    )


def _pip_step(
    recipe: Recipe, step: Pip, env: BuildEnvironment, root: Path, paths: Paths, comp: str, index: int, token: str
) -> None:
    wheel = pip_wheel(paths.cache)
    fs = RootFS(root)
    tmp = f"/tmp/.weenv-pip-{token}"
    fs.make_dir(tmp, 0o700)
    try:
        fs.write_file(f"{tmp}/{wheel.name}", wheel.read_bytes())
        argv = [
            step.python,
            f"{tmp}/{wheel.name}/pip",
            "install",
            "--no-cache-dir",
            "--root-user-action=ignore",
            "--disable-pip-version-check",
            "--break-system-packages",
            *step.options,
            *step.requirements,
        ]
        ca = host_ca_bundle()
        if ca is not None:
            fs.write_file(f"{tmp}/ca.crt", ca.read_bytes())
            argv.insert(3, f"--cert={tmp}/ca.crt")
        if step.requirements_file:
            path = recipe.path(step.requirements_file)
            if not path.is_file():
                raise InvalidInputError(f"component {comp!r}, step {index} (pip): {path} does not exist")
            fs.write_file(f"{tmp}/requirements.txt", path.read_bytes())
            argv += ["-r", f"{tmp}/requirements.txt"]
        result = env.exec(["/bin/sh", "-c", 'exec "$@" 2>&1', "pip", *argv], timeout=step.timeout)
        _check(result, comp, index, "pip", " ".join(["pip install", *step.options, *step.requirements]), step.timeout)
    finally:
        with contextlib.suppress(NotFoundError):
            fs.remove(tmp)


def host_ca_bundle() -> Path | None:
    """The CA bundle the host's clients trust (``PIP_CERT``, ``SSL_CERT_FILE``,
    ``REQUESTS_CA_BUNDLE``, else Debian's ``/etc/ssl/certs/ca-certificates.crt``),
    or None.  ``pip`` steps verify TLS against it, so a build reaches the package
    index as the host's own pip does (behind a TLS-inspecting proxy too); it is
    placed in the environment's ``/tmp`` for the step only, never in the group."""
    for var in ("PIP_CERT", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE"):
        value = os.environ.get(var)
        if value and Path(value).is_file():
            return Path(value)
    debian = Path("/etc/ssl/certs/ca-certificates.crt")
    return debian if debian.is_file() else None


def pip_wheel(cache: Path) -> Path:
    """Path of pip's wheel (:data:`~weenv.packaging.buildcache.PIP_VERSION`) in
    ``cache/pip``, downloaded with the host's pip on first use.

    Raises :class:`ToolMissingError` without a host pip, :class:`RuntimeFailedError`
    if the download fails."""
    version = buildcache.PIP_VERSION
    base = Path(cache) / "pip"
    wheel = base / f"pip-{version}-py3-none-any.whl"
    if wheel.is_file():
        return wheel
    base.mkdir(parents=True, exist_ok=True)
    with open(base / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if wheel.is_file():
            return wheel
        with tempfile.TemporaryDirectory(dir=base, prefix=".tmp-") as tmp:
            try:
                proc = subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "pip",
                        "download",
                        "--no-deps",
                        "--only-binary=:all:",
                        "--disable-pip-version-check",
                        "-d",
                        tmp,
                        f"pip=={version}",
                    ],
                    capture_output=True,
                    text=True,
                    check=False,
                )
            except OSError as exc:
                raise ToolMissingError(f"cannot run the host's pip: {exc}") from exc
            got = Path(tmp) / wheel.name
            if proc.returncode != 0 or not got.is_file():
                tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-6:])
                raise RuntimeFailedError(f"downloading pip {version} failed:\n{tail}")
            os.rename(got, wheel)
    return wheel
