"""The node: every environment on one machine, and the shared data path under them.

A :class:`Node` owns, for one ``WEENV_HOME``:

- the node chunk cache (:class:`~weenv.node.cache.ChunkCache`), filled from the store;
- the lazy FUSE file system (:class:`~weenv.node.lazyfs.LazyFS`) that shows each
  group image as one file whose reads fetch missing chunks on demand;
- one shared read-only EROFS mount per group (:class:`~weenv.node.groups.GroupMounts`);
- per environment: an overlay rootfs with a private upper dir, an OCI bundle,
  a runc container in its own namespaces and cgroup.

Methods are blocking and thread-safe; the daemon calls them from worker threads.
Create and destroy undo every step on failure: no mount, cgroup, process or
directory of a failed environment remains.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import shutil
import threading
import time
from pathlib import Path

from weenv.config import Paths
from weenv.errors import (
    CommandTimeoutError,
    InvalidInputError,
    MountError,
    NotFoundError,
)
from weenv.node import mounts
from weenv.node.bundle import write_bundle
from weenv.node.cache import ChunkCache
from weenv.node.groups import GroupMounts, clear_stale
from weenv.node.lazyfs import LazyFS
from weenv.node.models import CreateTiming, EnvironmentInfo, ExecResult, NodeStats
from weenv.node.rootfs import RootFS
from weenv.node.runc import Runc
from weenv.packaging.group import load_group
from weenv.packaging.manifest import GroupManifest, Resources, TemplateManifest
from weenv.packaging.template import load_template
from weenv.store import Store, open_store

log = logging.getLogger(__name__)

CONTAINER_PREFIX = "weenv-"
INIT = Path("/usr/bin/tini-static")
"""The environment's pid 1 (Debian's ``tini``): it reaps orphans, so killed and
backgrounded processes do not pile up as zombies against the pids limit."""


class _Environment:
    """What the node keeps of one running environment."""

    def __init__(self, info: EnvironmentInfo, template: TemplateManifest, dir: Path):
        self.info = info
        self.template = template
        self.dir = dir
        self.lock = threading.Lock()

    @property
    def container_id(self) -> str:
        return CONTAINER_PREFIX + self.info.id

    @property
    def rootfs(self) -> Path:
        return self.dir / "rootfs"


class Node:
    """All environments of one machine.  Use as a context manager or call
    :meth:`start` then :meth:`close`."""

    def __init__(self, paths: Paths | None = None, store: Store | None = None):
        self.paths = paths or Paths.from_env()
        self.store = store or open_store(self.paths.store_url)
        self.cache = ChunkCache(self.paths.chunk_cache, self.store)
        self.lazyfs = LazyFS(self.paths.lazy_mountpoint, self.cache)
        self.groups = GroupMounts(self.paths.group_mounts, self.lazyfs)
        self.runc = Runc(self.paths.runc_root)
        self._envs: dict[str, _Environment] = {}
        self._lock = threading.Lock()
        self._started = False

    # --- lifetime -------------------------------------------------------------------
    def start(self) -> "Node":
        for d in (self.paths.node, self.paths.environments, self.paths.group_mounts, self.paths.run):
            d.mkdir(parents=True, exist_ok=True)
        self._clean_stale()
        self.lazyfs.start()
        self._started = True
        return self

    def close(self) -> None:
        """Destroy every environment, unmount every group, stop the FUSE daemon.  Idempotent."""
        if not self._started:
            return
        errors = []
        for env_id in list(self._envs):
            try:
                self.destroy(env_id)
            except Exception as exc:  # keep going: close must release everything it can
                log.exception("destroying %s on close", env_id)
                errors.append(exc)
        try:
            self.groups.unmount_all()
        finally:
            self.lazyfs.stop()
            self._started = False
        if errors:
            raise errors[0]

    def __enter__(self) -> "Node":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def _clean_stale(self) -> None:
        """Remove what a previous node process of this home left (after a crash)."""
        for state in self.runc.list():
            if state.get("id", "").startswith(CONTAINER_PREFIX):
                with contextlib.suppress(Exception):
                    self.runc.delete(state["id"], force=True)
        for _fstype, point in mounts.mounts_under(self.paths.environments):
            _umount_quietly(Path(point))
        clear_stale(self.paths.group_mounts, self.paths.lazy_mountpoint)
        if self.paths.environments.is_dir():
            for d in self.paths.environments.iterdir():
                shutil.rmtree(d, ignore_errors=True)

    # --- environments ---------------------------------------------------------------
    def create(
        self,
        template: str,
        *,
        resources: Resources | None = None,
        first_command: bool = True,
    ) -> EnvironmentInfo:
        """Create and start an environment from ``template`` (name or digest).

        Returns its info with the create's phase timings (seconds) and bytes fetched.
        Raises :class:`NotFoundError` for an unknown template, :class:`MountError`
        or :class:`RuntimeFailedError` when a step fails; every step already done
        is undone first.
        """
        self._check_started()
        t0 = time.perf_counter()
        fetched0, chunks0 = self.cache.bytes_fetched, self.cache.chunks_fetched
        timing: dict[str, float | None] = {}

        digest, manifest = load_template(self.store, template)
        group_manifests: list[GroupManifest] = [load_group(self.store, g) for g in manifest.groups]
        timing["manifest_s"] = time.perf_counter() - t0

        env_id = secrets.token_hex(6)
        env_dir = self.paths.environments / env_id
        res = resources or manifest.runtime.resources
        with contextlib.ExitStack() as undo:
            env_dir.mkdir(parents=True)
            undo.callback(shutil.rmtree, env_dir, ignore_errors=True)

            t = time.perf_counter()
            lowers = []
            for g_digest, g_manifest in zip(manifest.groups, group_manifests):
                lowers.append(self.groups.acquire(g_digest, g_manifest))
                undo.callback(self.groups.release, g_digest)
            timing["groups_s"] = time.perf_counter() - t

            t = time.perf_counter()
            upper, work, rootfs = env_dir / "upper", env_dir / "work", env_dir / "rootfs"
            for d in (upper, work, rootfs):
                d.mkdir()
            mounts.mount(mounts.overlay_spec(lowers, upper, work, rootfs))
            undo.callback(_umount_quietly, rootfs)
            timing["overlay_s"] = time.perf_counter() - t

            t = time.perf_counter()
            container_id = CONTAINER_PREFIX + env_id
            bundle = env_dir / "bundle"
            bundle.mkdir()
            write_bundle(
                bundle,
                rootfs,
                manifest.runtime,
                hostname=f"weenv-{env_id}",
                cgroups_path=f"/{container_id}",
                resources=res,
                init=INIT if INIT.exists() else None,
            )
            undo.callback(self._delete_container, container_id)
            self.runc.create(container_id, bundle)
            self.runc.start(container_id)
            timing["runtime_s"] = time.perf_counter() - t

            info = EnvironmentInfo(
                id=env_id,
                template=manifest.name,
                template_digest=digest,
                created_at=time.time(),
                state="running",
                rootfs=str(rootfs),
                resources=res,
                timing=CreateTiming(),
            )
            env = _Environment(info, manifest, env_dir)
            if first_command:
                t = time.perf_counter()
                result = self._exec(env, ["true"], timeout=60)
                if result.exit_code != 0:
                    raise InvalidInputError(
                        f"template {template}: 'true' exited {result.exit_code} inside the "
                        f"environment: {result.stderr.decode(errors='replace').strip()}"
                    )
                timing["first_command_s"] = time.perf_counter() - t
            undo.pop_all()

        info.timing = CreateTiming(
            **timing,
            total_s=time.perf_counter() - t0,
            bytes_fetched=self.cache.bytes_fetched - fetched0,
            chunks_fetched=self.cache.chunks_fetched - chunks0,
            template_bytes=sum(g.image_size for g in group_manifests),
            template_stored_bytes=sum(g.stored_size for g in group_manifests),
        )
        (env_dir / "env.json").write_text(info.model_dump_json(indent=2))
        with self._lock:
            self._envs[env_id] = env
        return info

    def get(self, env_id: str) -> EnvironmentInfo:
        return self._env(env_id).info

    def list(self) -> list[EnvironmentInfo]:
        with self._lock:
            return [e.info for e in self._envs.values()]

    def exec(
        self,
        env_id: str,
        command: list[str] | str,
        *,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        timeout: float | None = None,
        stdin: bytes | None = None,
        raise_on_timeout: bool = False,
    ) -> ExecResult:
        """Run ``command`` (argv, or a ``/bin/sh -c`` string) in environment ``env_id``.

        ``env`` adds to the template's variables; ``cwd`` defaults to its working
        dir; ``timeout`` in seconds kills the command and its children, reported
        as ``timed_out`` (or raised as :class:`CommandTimeoutError`).
        """
        return self._exec(
            self._env(env_id), command, env=env, cwd=cwd, timeout=timeout, stdin=stdin,
            raise_on_timeout=raise_on_timeout,
        )

    def _exec(self, e: _Environment, command, *, env=None, cwd=None, timeout=None, stdin=None,
              raise_on_timeout=False) -> ExecResult:
        if isinstance(command, list) and not command:
            raise InvalidInputError("empty command")
        merged = dict(e.template.runtime.env)
        merged.update(env or {})
        r = self.runc.exec(
            e.container_id,
            command,
            env=merged,
            cwd=cwd or e.template.runtime.working_dir,
            user=e.template.runtime.user,
            timeout=timeout,
            stdin=stdin,
        )
        if r.timed_out and raise_on_timeout:
            raise CommandTimeoutError(f"command timed out after {timeout} s in {e.info.id}")
        return r

    def files(self, env_id: str) -> RootFS:
        """File access inside the environment's root (paths cannot escape it)."""
        return RootFS(self._env(env_id).rootfs)

    def destroy(self, env_id: str) -> None:
        """Kill the environment's processes and remove its container, cgroup,
        overlay and directory.  Raises :class:`NotFoundError` if unknown."""
        with self._lock:
            e = self._envs.pop(env_id, None)
        if e is None:
            raise NotFoundError(f"no environment {env_id!r}")
        with e.lock:
            try:
                self._delete_container(e.container_id)
                _umount_quietly(e.rootfs)
            finally:
                for g in e.template.groups:
                    self.groups.release(g)
                shutil.rmtree(e.dir, ignore_errors=True)

    def stats(self) -> NodeStats:
        return NodeStats(
            environments=len(self._envs),
            groups_mounted=self.groups.mounted(),
            cache_chunks_fetched=self.cache.chunks_fetched,
            cache_bytes_fetched=self.cache.bytes_fetched,
        )

    def drop_caches(self) -> None:
        """Unmount groups no environment uses and empty the node chunk cache
        (for cold-start measurements).  Raises :class:`InvalidInputError` while
        any environment runs."""
        with self._lock:
            if self._envs:
                raise InvalidInputError("cannot drop the node cache while environments run")
            self.groups.unmount_unused()
            self.cache.clear()

    # --- helpers --------------------------------------------------------------------
    def _env(self, env_id: str) -> _Environment:
        with self._lock:
            e = self._envs.get(env_id)
        if e is None:
            raise NotFoundError(f"no environment {env_id!r}")
        return e

    def _delete_container(self, container_id: str) -> None:
        self.runc.delete(container_id, force=True)

    def _check_started(self) -> None:
        if not self._started:
            raise InvalidInputError("node is not started")


def _umount_quietly(target: Path) -> None:
    if not mounts.is_mounted(target):
        return
    try:
        mounts.umount(target)
    except MountError:
        mounts.umount(target, detach=True)
