"""Crash recovery: what a node finds in its home when the previous node
process of that home was killed.

With the FUSE holder (:mod:`weenv.node.data.fuse.holder`) still keeping the lazy
file system's connection, the new node takes it over (:meth:`LazyFS.take_over`)
and :meth:`Recovery.recover` adopts the group mounts and every environment
whose container still runs; without it, :meth:`Recovery.recover_direct`
removes the environments that read through the lost connection and adopts
those whose every group is mounted directly.  Either way, environments not
fully created, not delivered to their client, or whose container died are
removed (:meth:`Recovery.remove_leftover`), and so are containers left
without their environment.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from weenv.api.models import EnvironmentInfo
from weenv.errors import InvalidInputError
from weenv.node.cgroups import open_cgroups, remove_environment_dirs
from weenv.node.data.groups import GroupMounts, clear_stale
from weenv.node.data.lazyfs import LazyFS
from weenv.node.manifests import NodeManifests
from weenv.node.provision import Provisioner
from weenv.node.runtime import network
from weenv.node.runtime.container import Containers
from weenv.node.runtime.runtime import recorded_runtime
from weenv.node.snapshotter import Snapshotter
from weenv.node.state.pause import disk_key
from weenv.node.table import (
    CONTAINER_PREFIX,
    UNDELIVERED,
    Environment,
    EnvironmentTable,
    container_id,
    current_container_id,
    stale_info_files,
)

log = logging.getLogger(__name__)


class Recovery:
    """Adoption of a killed node's environments into ``table``."""

    def __init__(
        self,
        *,
        table: EnvironmentTable,
        snapshotter: Snapshotter,
        containers: Containers,
        groups: GroupMounts,
        lazyfs: LazyFS,
        manifests: NodeManifests,
        provisioner: Provisioner,
        group_mounts: Path,
        lazy_mountpoint: Path,
    ):
        self.table = table
        self.snapshotter = snapshotter
        self.containers = containers
        self.groups = groups
        self.lazyfs = lazyfs
        self.manifests = manifests
        self.provisioner = provisioner
        self.group_mounts = group_mounts
        self.lazy_mountpoint = lazy_mountpoint

    def recover(self) -> None:
        """Adopt the group mounts and running environments of a killed node
        process whose FUSE connection :meth:`LazyFS.take_over` took, then
        serve that connection."""
        try:
            self.groups.recover(self.manifests.group)
        finally:
            self.lazyfs.start()  # serve the taken connection in any case: readers wait on it
        self._adopt_all()

    def recover_direct(self) -> None:
        """After a crash without the FUSE holder (or on a clean home): remove
        every environment with a lower dir that is not a direct group mount
        (its lazy reads can no longer be served), detach the dead lazy mounts,
        start the lazy file system, then adopt the direct group mounts and the
        environments on them only."""
        for env_dir in self.snapshotter.dirs():
            lowers = self.snapshotter.overlay_lowers(env_dir)
            if not lowers or not all(self.groups.is_direct_point(p) for p in lowers):
                log.warning(
                    "removing environment %s: %s",
                    env_dir.name,
                    "it read through the lost FUSE connection" if lowers else "it has no overlay",
                )
                self.remove_leftover(env_dir)
        clear_stale(self.group_mounts, self.lazy_mountpoint, keep_direct=True)
        self.groups.recover(self.manifests.group)  # the node's copies: recovery needs no store
        self.lazyfs.start()
        self._adopt_all()

    def _adopt_all(self) -> None:
        """Adopt every environment left in the home that can go on running;
        remove the others and every container left without its environment."""
        status = self.containers.status()
        kept: set[str] = set()
        for env_dir in self.snapshotter.dirs():
            env_id = env_dir.name
            try:
                e = self._adopt(env_dir, status.get(current_container_id(env_id, env_dir)))
            except Exception as exc:
                log.warning("cannot recover environment %s (removing it): %s", env_id, exc)
                self.remove_leftover(env_dir)
                continue
            self.table.add(e)
            kept.add(e.container_id)
            log.info(
                "recovered environment %s (template %s, container made by %s)",
                env_id,
                e.info.template,
                recorded_runtime(env_dir / "bundle") or "runc",
            )
        for cid, st in status.items():
            if cid and cid.startswith(CONTAINER_PREFIX) and cid not in kept:
                log.warning("removing container %s (%s) left without its environment", cid, st)
                with logged(f"removing container {cid}"):
                    self.containers.runc.delete(cid, force=True)

    def _adopt(self, env_dir: Path, runc_status: str | None) -> Environment:
        """The environment in ``env_dir`` as a killed node process left it, its
        references counted; raises if it cannot go on running (not fully
        created, its container gone or stopped, its overlay not mounted)."""
        info_path = env_dir / "env.json"
        if not info_path.exists():
            raise InvalidInputError("it was not fully created")
        info = EnvironmentInfo.model_validate_json(info_path.read_text())
        for tmp in stale_info_files(env_dir):  # a state the dead node was about to save: env.json holds the last
            tmp.unlink(missing_ok=True)
        if info.id != env_dir.name:
            raise InvalidInputError(f"its env.json names {info.id!r}")
        if (env_dir / UNDELIVERED).exists():
            raise InvalidInputError("the answer of its create never reached its client")
        released = info.state == "paused" and info.memory_released  # paused without processes: no container
        if runc_status not in ("running", "paused") and not (released and runc_status is None):
            raise InvalidInputError(f"its container is {runc_status or 'gone'}")
        rootfs = env_dir / "rootfs"
        lowers = self.snapshotter.overlay_lowers(env_dir)
        if lowers is None:
            raise InvalidInputError(f"{rootfs} is not an overlay mount")
        template = self.manifests.template(info.template_digest)
        if len(lowers) != len(template.groups):
            raise InvalidInputError(
                f"its overlay has {len(lowers)} lower dirs, its template {len(template.groups)} groups"
            )
        adopted: list[tuple[str, Path]] = []
        try:
            for g_digest, lower in zip(template.groups, lowers):
                self.groups.adopt(g_digest, lower)
                adopted.append((g_digest, lower))
        except BaseException:
            for g_digest, lower in adopted:
                self.groups.release(g_digest, lower)
            raise
        e = Environment(info, template, env_dir)
        e.lowers = list(lowers)
        cid = current_container_id(info.id, env_dir)
        e.cid = cid if cid != container_id(info.id) else None
        # what a reset made ahead or replaced goes (the containers with the others left: _adopt_all)
        with logged(f"removing the containers a reset of environment {info.id} made ahead or replaced"):
            self.containers.discard_ahead(info.id, env_dir)
            self.containers.delete_retiring(info.id, env_dir)
            self.snapshotter.unmount_ahead(env_dir)
            self.snapshotter.unmount_retired(env_dir)
        # its name server was the dead node's (the namespace outlives a memory release too)
        if (env_dir / network.NETNS_FILE).exists():
            try:
                self.containers.serve_names(
                    info.id, env_dir, network.egress_of(info.network, info.allow_out, info.deny_out)
                )
            except Exception as exc:  # it runs on, without names
                log.warning("cannot serve names of recovered environment %s: %s", info.id, exc)
        if released:  # its disk counted as before; its resume reserves it
            try:
                self.provisioner.hold_disk(
                    disk_key(info.id), info.resources.disk_bytes, f"paused environment {info.id}'s disk"
                )
            except Exception as exc:
                log.warning("cannot count paused recovered environment %s's disk: %s", info.id, exc)
            return e
        if info.state == "paused" and runc_status == "paused":  # paused by a user: it stays so, still counted
            try:
                self.provisioner.reserve(info.id, info.resources, priority=info.priority, template=info.template_digest)
                self.provisioner.pause(info.id)
            except Exception as exc:  # it stays paused; its resume reserves it (or refuses while full)
                log.warning("reserving paused recovered environment %s failed: %s", info.id, exc)
            return e
        e.info.state = "running"
        if runc_status == "paused":  # frozen by the dead node's provisioner or mid-capture
            try:
                open_cgroups(f"/{e.container_id}").thaw()
            except Exception as exc:
                log.warning("cannot thaw recovered environment %s: %s", info.id, exc)
        try:
            self.provisioner.reserve(info.id, info.resources, priority=info.priority, template=info.template_digest)
            self.provisioner.attach(info.id, f"/{e.container_id}")
        except Exception as exc:  # it runs anyway, with the limits it had
            log.warning("provisioning of recovered environment %s failed: %s", info.id, exc)
            self.provisioner.detach(info.id)
        return e

    def remove_leftover(self, env_dir: Path) -> None:
        """Remove an environment directory not recovered: its container, overlay and files."""
        env_id = env_dir.name
        self.provisioner.detach(env_id)
        with logged(f"removing the container of leftover environment {env_id}"):
            self.containers.delete(env_id, env_dir)
        # a create killed inside `runc create` leaves the container's cgroups and no container runc knows
        busy = remove_environment_dirs(env_id)
        if busy:
            log.warning("cgroups of leftover environment %s not removed: %s", env_id, "; ".join(busy))
        self.containers.teardown_network(env_id, env_dir)
        self.snapshotter.unmount_all(env_dir)
        self.snapshotter.remove_dir(env_dir)


@contextlib.contextmanager
def logged(what: str):
    """Go on past any failure of ``what`` (crash cleanup must release all it
    can), but say so in the log, with the traceback: never swallow silently."""
    try:
        yield
    except Exception:
        log.warning("%s failed; going on", what, exc_info=True)
