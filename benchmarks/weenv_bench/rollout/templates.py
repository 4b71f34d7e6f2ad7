"""The task templates on both systems, from the same trees.

- **weenv**: groups ``base`` (the cached Debian tree), ``runtime``
  (:func:`~weenv_bench.rollout.tasks.runtime_tree`), ``deps-NAME`` (the task's
  test requirements, :func:`weenv.demo.deps_tree`, when it has any) and
  ``src-NAME`` (the buggy source at ``/workspace/NAME``), built with
  :func:`~weenv.packaging.group.build_group` into a file store; template
  ``rollout-NAME`` over them (working dir the project, ``PYTHONPATH`` its
  import root, the benchmark's resources).  Copied to the registry's
  ``oci://`` store with :func:`~weenv.packaging.transfer.copy_template`.
- **Docker**: ``docker import`` of the same Debian tree, then per task
  ``FROM`` it ``COPY`` of the runtime, deps and source trees (one layer per
  weenv group), ``WORKDIR`` and ``ENV`` as the template's, built by the
  private dockerd (classic builder) and pushed to the same registry; then every
  local image is removed, so a run pulls what it uses.

:func:`verify_tasks` starts each task's template in an in-process weenv node
over the file store and checks, in one environment, that the task's tests fail
(pytest exit 1), still fail once the wrong patch is applied, and pass once it
is undone (``patch -R``) and the fixing patch applied.  A verified task is remembered under
``$WEENV_CACHE/bench-rollout/verified`` by the digest of its template's inputs
(trees, task spec, runtime settings).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from weenv.config import Paths
from weenv.errors import RuntimeFailedError
from weenv_bench.rollout.tasks import PreparedTask, patch_command, reward_command

DOCKER_BASE = "weenv-bench/rollout-base"


@dataclass
class Built:
    """A task's template in the build store and the trees behind it."""

    task: PreparedTask
    template: str
    digest: str
    deps_tree: Path | None
    image_bytes: int
    stored_bytes: int
    inputs: str = ""
    """A digest of the trees and settings the template was built from (a group
    manifest holds its build time, so the template's digest changes per build)."""


def build_weenv(
    store,
    base: Path,
    runtime: Path,
    tasks: list[PreparedTask],
    resources,
    work: Path,
    log=print,
    *,
    deps: bool = True,
    runtime_source: dict[str, str] | None = None,
) -> dict[str, Built]:
    """Build every group and template into ``store``; return task name -> :class:`Built`.
    ``deps=False``: no task gets a deps group (its setup installs them);
    ``runtime_source``: the runtime group's recorded source, when ``runtime``
    is another tree than :func:`~weenv_bench.rollout.tasks.runtime_tree`."""
    from weenv.demo import deps_tree
    from weenv.formats.manifest import RuntimeConfig
    from weenv.packaging.group import build_group
    from weenv.packaging.template import create_template

    t0 = time.monotonic()
    shared = {}
    for name, tree, source in (
        ("base", base, {"type": "debootstrap", "suite": "bookworm"}),
        ("runtime", runtime, runtime_source or {"type": "pip+deb", "contents": "pytest, patch"}),
    ):
        shared[name] = build_group(tree, store, name=name, source=source, workdir=work).manifest
    out = {}
    cache = Paths.from_env().cache
    for task in tasks:
        spec = task.spec
        groups = ["base", "runtime"]
        sizes = [shared["base"], shared["runtime"]]
        deps_dir = None
        if deps and spec.deps:
            deps_dir = deps_tree(cache, list(spec.deps))
            sizes.append(
                build_group(
                    deps_dir,
                    store,
                    name=f"deps-{spec.name}",
                    workdir=work,
                    source={"type": "pip", "requirements": " ".join(spec.deps)},
                ).manifest
            )
            groups.append(f"deps-{spec.name}")
        sizes.append(
            build_group(
                task.tree,
                store,
                name=f"src-{spec.name}",
                workdir=work,
                source={"type": "sdist", "requirement": spec.sdist, "bug": spec.key()},
            ).manifest
        )
        groups.append(f"src-{spec.name}")
        runtime_cfg = RuntimeConfig(
            working_dir=spec.workdir, env={**RuntimeConfig().env, **spec.env}, resources=resources
        )
        digest, _ = create_template(store, f"rollout-{spec.name}", groups, runtime=runtime_cfg)
        inputs = hashlib.sha256(
            json.dumps(
                [spec.key(), str(base), str(runtime), str(deps_dir), spec.env, runtime_cfg.model_dump(mode="json")]
            ).encode()
        ).hexdigest()[:32]
        out[spec.name] = Built(
            task,
            f"rollout-{spec.name}",
            digest,
            deps_dir,
            sum(g.image_size for g in sizes),
            sum(g.stored_size for g in sizes),
            inputs,
        )
    log(f"weenv: {len(out)} templates built in {time.monotonic() - t0:.1f} s")
    return out


def verify_tasks(
    store, built: dict[str, Built], home: Path, *, marks: Path | None = None, log=print
) -> dict[str, dict]:
    """Check every task's bug and patches inside weenv (see the module docstring);
    return task name -> what was checked (pytest's exit code and seconds per
    patch).  ``home``: the checking node's home; ``marks``: where verified
    template digests are remembered (default ``$WEENV_CACHE/bench-rollout/verified``).
    Raises :class:`RuntimeFailedError` naming the task and the output when a
    check fails."""
    from weenv.node.node import Node
    from weenv.node.provision import ProvisionConfig

    cache = Paths.from_env().cache
    marks = marks or cache / "bench-rollout" / "verified"
    marks.mkdir(parents=True, exist_ok=True)
    todo = [b for b in built.values() if not (marks / b.inputs).is_file()]
    out = {name: json.loads((marks / b.inputs).read_text()) for name, b in built.items() if b not in todo}
    if not todo:
        return out
    log(f"verifying {len(todo)} tasks inside weenv environments ...")
    paths = Paths(home=home, cache=cache, store_url=f"file://{home / 'unused-store'}")
    with Node(paths, store=store, provisioning=ProvisionConfig(mode="off")) as node:
        for b in todo:
            spec, task = b.task.spec, b.task
            checks = {}
            info = node.create(b.template, prefetch=False)
            try:
                # bug; wrong patch; wrong patch undone and the fix applied
                for label, patches, want in (
                    ("none", [], 1),
                    ("wrong", [(task.wrong_patch, False)], 1),
                    ("right", [(task.wrong_patch, True), (task.fix_patch, False)], 0),
                ):
                    for text, reverse in patches:
                        r = node.exec(info.id, ["bash", "-c", patch_command(text, reverse=reverse)], timeout=120)
                        if r.exit_code != 0:
                            raise RuntimeFailedError(
                                f"task {spec.name}: a patch does not apply ({label}): "
                                f"{(r.stdout + r.stderr).decode(errors='replace')[-800:]}"
                            )
                    r = node.exec(info.id, ["bash", "-c", reward_command(spec)], timeout=300)
                    if r.exit_code != want:
                        raise RuntimeFailedError(
                            f"task {spec.name}: with patch {label!r} its tests exit {r.exit_code}, want {want}:\n"
                            f"{(r.stdout + r.stderr).decode(errors='replace')[-1500:]}"
                        )
                    checks[label] = {"exit_code": r.exit_code, "seconds": round(r.duration_s, 3)}
            finally:
                node.destroy(info.id)
            (marks / b.inputs).write_text(json.dumps(checks))
            out[spec.name] = checks
            log(f"  {spec.name}: tests fail with the bug and the wrong patch, pass with the fix")
    return out


def build_docker(
    dockerd, registry, base: Path, runtime: Path, built: dict[str, Built], work: Path, log=print
) -> tuple[dict[str, str], dict[str, tuple[int, dict[str, int]]]]:
    """Import the base, build and push one image per task, remove every local
    image; return (task name -> reference, reference -> (manifest + config
    bytes, {layer digest: compressed bytes}))."""

    t0 = time.monotonic()
    dockerd.import_tree(base, DOCKER_BASE)
    context = work / "context"
    context.mkdir()
    _link_tree(runtime, context / "runtime")
    refs, layers = {}, {}
    for name, b in built.items():
        spec = b.task.spec
        _link_tree(b.task.tree, context / f"src-{name}")
        lines = [f"FROM {DOCKER_BASE}", "COPY runtime/ /"]
        if b.deps_tree is not None:
            _link_tree(b.deps_tree, context / f"deps-{name}")
            lines.append(f"COPY deps-{name}/ /")
        lines += [
            f"COPY src-{name}/ /",
            f"WORKDIR {spec.workdir}",
            *(f"ENV {k}={v}" for k, v in sorted(spec.env.items())),
        ]
        (context / f"Dockerfile.{name}").write_text("\n".join(lines) + "\n")
        ref = registry.reference(f"bench/rollout-{name}", "latest")
        dockerd.docker("build", "-q", "-f", str(context / f"Dockerfile.{name}"), "-t", ref, str(context), timeout=900)
        dockerd.docker("push", ref, timeout=900)
        refs[name] = ref
        layers[ref] = image_layers(registry, f"bench/rollout-{name}", "latest")
    shutil.rmtree(context, ignore_errors=True)
    remove_images(dockerd)
    log(f"docker: imported the base, built and pushed {len(refs)} images in {time.monotonic() - t0:.1f} s")
    return refs, layers


def _link_tree(src: Path, dst: Path) -> None:
    """``cp -a --link`` (a plain copy across file systems)."""
    if subprocess.run(["cp", "-a", "--link", str(src), str(dst)], capture_output=True, check=False).returncode:
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src, dst, symlinks=True)


def image_layers(registry, repository: str, tag: str) -> tuple[int, dict[str, int]]:
    """(bytes of the manifest and config, {layer digest: compressed size}) of an
    image in ``registry`` (Docker's v2 schema 2 manifest)."""
    import httpx

    accept = "application/vnd.docker.distribution.manifest.v2+json"
    r = httpx.get(f"{registry.url}/v2/{repository}/manifests/{tag}", headers={"Accept": accept}, timeout=30)
    r.raise_for_status()
    m = r.json()
    return len(r.content) + m["config"]["size"], {ly["digest"]: ly["size"] for ly in m["layers"]}


def remove_images(dockerd) -> None:
    """Remove every local image; :class:`RuntimeFailedError` if one remains."""
    dockerd.docker("image", "prune", "-a", "-f", timeout=300)
    left = dockerd.docker("images", "-aq").stdout.decode().split()
    if left:
        dockerd.docker("rmi", "-f", *left, timeout=300, check=False)
    if dockerd.docker("images", "-aq").stdout.strip():
        raise RuntimeFailedError("docker images remain after docker image prune -a")
