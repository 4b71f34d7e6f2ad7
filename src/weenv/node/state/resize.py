"""Live resize: new declared resources for a running environment.

:meth:`Resizes.resize` gives environment ``e`` new ``cpus``, ``memory_bytes``,
``pids`` and ``disk_bytes`` (those a :class:`~weenv.api.models.ResourcesUpdate`
leaves out stay) while it runs, in this order, all or nothing:

1. checks: it is running (a paused one keeps its reservation as it is:
   :class:`StateError`), the new resources are within what one environment of
   this node may have (:class:`InvalidInputError`), and its disk limit is not
   below what it has written (:class:`StateError`);
2. admission, under the provisioner's lock: each resource that grows must fit
   beside the others' as a create's must (the declared disk limits against
   the node's disk; the CPU reservations and, in ``static`` mode, the memory
   limits against the node's budget), else :class:`CapacityError`.  From here
   until the writes are done the larger of the old and new values counts, so
   no create admitted meanwhile can overcommit the node;
3. the writes: the memory limit first (lowering it below what the kernel can
   reclaim is refused, :class:`StateError`), then the quota of its upper dir
   (:meth:`~weenv.node.disk.NodeDisk.set_limit`), the CFS quota and the pids
   limit, and the limits of its OCI bundle and of a container a reset made
   ahead (so that a reset, or a resume after its memory was released, runs
   its container again with them); a failure rewrites the old values;
4. the new resources become the declared ones: the provisioner's ceilings
   (elastic provisioning adjusts within them from its next pass on), its
   ``env.json`` (a node restart takes them from there), its info (a fork's
   children take them from there).

In ``elastic`` mode the CPU reservation and memory limit in force are the
provisioner's: a resize lowers them to the new ceilings at once and lets them
grow up to a raised ceiling with usage; the CFS quota is the ceiling
(``cpu_quota_at="ceiling"``) or the reservation.  In ``static`` and ``off``
modes the cgroup gets the declared resources themselves.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
from pathlib import Path

from weenv.api.models import EnvironmentInfo, ResourcesUpdate
from weenv.errors import CapacityError, InvalidInputError, LimitRefusedError, StateError, WeenvError
from weenv.formats.manifest import Resources
from weenv.node.cgroups import Cgroup, open_cgroups
from weenv.node.disk import SPARE, NodeDisk
from weenv.node.provision import Provisioner
from weenv.node.provision.policy import clamp
from weenv.node.runtime.bundle import set_bundle_resources
from weenv.node.runtime.container import AHEAD
from weenv.node.state.pause import PAUSED
from weenv.node.table import CONTAINER_FILE, Environment, bundle_container_id, staged_info

log = logging.getLogger(__name__)

PID_MAX = "/proc/sys/kernel/pid_max"


def pid_max() -> int:
    """The kernel's ``pid_max`` (a bound of ``pids``)."""
    try:
        with open(PID_MAX) as f:
            return int(f.read())
    except (OSError, ValueError):
        return 1 << 22


def _sync(path: Path) -> None:
    """syncfs(2) of the file system holding ``path`` (a btrfs commit: its quota counts are current after)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if _libc.syncfs(fd) != 0:
            err = ctypes.get_errno()
            log.warning("syncfs of %s: %s", path, os.strerror(err))
    finally:
        os.close(fd)


_libc = ctypes.CDLL(None, use_errno=True)


class _Plan:
    """What a resize writes: the declared resources and the quota and limit in force."""

    def __init__(self, resources: Resources, cpu_quota: float, memory_limit: int):
        self.resources = resources
        self.cpu_quota = cpu_quota
        self.memory_limit = memory_limit


class Resizes:
    """Live resizes of one node's environments (see the module doc)."""

    def __init__(self, provisioner: Provisioner, disk: NodeDisk):
        self.provisioner = provisioner
        self.disk = disk

    def resize(self, e: Environment, update: ResourcesUpdate) -> EnvironmentInfo:
        """Give ``e`` the resources ``update`` says; its info.  Raises
        :class:`StateError` (paused, not running, or using more than the new
        limits allow), :class:`InvalidInputError` (beyond what one environment
        of this node may have), :class:`CapacityError` (the node cannot hold
        it), :class:`DiskFullError` (no room to save its state); nothing is
        changed then."""
        with e.lock:
            env_id, old = e.info.id, e.info.resources
            if e.info.state == PAUSED:
                raise StateError(
                    f"environment {env_id} is paused: resume it before resizing it "
                    "(while paused it keeps the reservation it had)"
                )
            if e.info.state != "running":
                raise StateError(f"environment {env_id} is {e.info.state}, not running: cannot resize it")
            new = update.applied_to(old)
            if new == old:
                return e.info
            self._check_node(new)
            if new.disk_bytes < old.disk_bytes:
                _sync(e.dir)  # quota usage is counted at a commit: files just removed count no more
                used, _ = self.disk.usage(e.dir)
                if used > new.disk_bytes:
                    raise StateError(
                        f"environment {env_id} has written {used / (1 << 20):.1f} MiB: "
                        f"its disk limit cannot go down to {new.disk_bytes / (1 << 20):.1f} MiB"
                    )
            with staged_info(e.dir, e.info.model_copy(update={"resources": new})):
                self._apply(e, old, new)
                e.info.resources = new
            if new.disk_bytes != old.disk_bytes and (e.dir / SPARE).exists():
                try:  # the upper dir a reset made ready swaps in with the new limit too
                    self.disk.set_limit(e.dir, new.disk_bytes, SPARE)
                except WeenvError as exc:
                    log.warning("the spare upper dir of %s keeps its old disk limit: %s", env_id, exc)
        return e.info

    def _check_node(self, new: Resources) -> None:
        p = self.provisioner
        if new.cpus > p.cpu_capacity + 1e-9:
            raise InvalidInputError(f"resources.cpus: {new.cpus:g} is more than the node's {p.cpu_capacity:g} cores")
        if new.memory_bytes > p.memory_capacity:
            raise InvalidInputError(
                f"resources.memory_bytes: {new.memory_bytes} is more than the "
                f"{p.memory_capacity} bytes the node gives environments"
            )
        disk = p._budget().disk
        if disk is not None and p.config.mode != "off" and new.disk_bytes > disk:
            raise InvalidInputError(
                f"resources.disk_bytes: {new.disk_bytes} is more than the node's disk for environments "
                f"({disk} bytes: WEENV_DISK_BYTES x WEENV_DISK_OVERCOMMIT)"
            )
        if new.pids > pid_max():
            raise InvalidInputError(f"resources.pids: {new.pids} is more than the kernel's pid_max ({pid_max()})")

    # --- admission and writes (the provisioner's record of the environment) ----------------------
    def _apply(self, e: Environment, old: Resources, new: Resources) -> None:
        p, env_id = self.provisioner, e.info.id
        t = p._get(env_id)  # NotFoundError: not provisioned (destroyed meanwhile)
        # no pass between: one observed before the new ceilings would grant within the old ones
        with p._tick_lock, t.lock:
            if not t.attached or t.cgroup is None:
                raise StateError(f"environment {env_id} is not under the provisioner's control now: cannot resize it")
            before = _Plan(old, t.policy.cpu_quota, t.policy.memory_limit)
            after = self._plan(t, new)
            self._admit(t, before, after)
            try:
                self._write(t, e, before, after)
            except BaseException:
                self._count(t, before)
                p._wake()
                raise
            self._count(t, after)
        p._event(
            env_id,
            "resize",
            f"resized to {new.cpus:g} cores, {new.memory_bytes >> 20} MiB, {new.pids} pids, "
            f"{new.disk_bytes >> 20} MiB disk (was {old.cpus:g}, {old.memory_bytes >> 20}, {old.pids}, "
            f"{old.disk_bytes >> 20})",
        )
        p._wake()  # creates waiting for room judge the new reservations

    def _plan(self, t, new: Resources) -> _Plan:
        """The quota and limit in force after the resize: the declared ones
        (``static``, ``off``), or the elastic ones within the new ceilings."""
        cfg = self.provisioner.config
        if cfg.mode != "elastic":
            return _Plan(new, new.cpus, new.memory_bytes)
        pol = t.policy
        cpu = clamp(pol.cpu_quota, min(cfg.cpu_floor, new.cpus), new.cpus)
        memory = int(clamp(pol.memory_limit, min(cfg.memory_floor, new.memory_bytes), new.memory_bytes))
        return _Plan(new, cpu, memory)

    def _admit(self, t, before: _Plan, after: _Plan) -> None:
        """Refuse what grows beyond the node (:class:`CapacityError`), else count
        the larger of ``before`` and ``after`` until the writes are done."""
        p = self.provisioner
        with p._lock:
            why = None if p.config.mode == "off" else self._refusal(t, before, after)
            if why is not None:
                p._event(t.env_id, "admission", f"resize refused: {why}")
                raise CapacityError(f"cannot resize environment {t.env_id}: {why}; nothing changed")
            r0, r1 = before.resources, after.resources
            larger = Resources(
                cpus=max(r0.cpus, r1.cpus),
                memory_bytes=max(r0.memory_bytes, r1.memory_bytes),
                pids=max(r0.pids, r1.pids),
                disk_bytes=max(r0.disk_bytes, r1.disk_bytes),
            )
            self._count_locked(
                t,
                _Plan(
                    larger,
                    max(before.cpu_quota, after.cpu_quota),
                    max(before.memory_limit, after.memory_limit),
                ),
            )

    def _refusal(self, t, before: _Plan, after: _Plan) -> str | None:
        """Why the node cannot hold ``t`` grown to ``after`` (None: it can; under the provisioner's lock)."""
        p = self.provisioner
        budget = p._budget()
        others = [x for x in p._envs.values() if x is not t]
        grow_disk = after.resources.disk_bytes - before.resources.disk_bytes
        if grow_disk > 0 and budget.disk is not None:
            held = p._disk_sum() - before.resources.disk_bytes
            if held + after.resources.disk_bytes > budget.disk:
                return (
                    f"disk limits would reach {(held + after.resources.disk_bytes) / (1 << 30):.2f} GiB "
                    f"of the node's {budget.disk / (1 << 30):.2f} GiB disk"
                )
        if after.cpu_quota > before.cpu_quota + 1e-9 and not t.paused:
            cpu_sum = sum(x.cpu_reservation for x in others)
            if cpu_sum + after.cpu_quota > budget.cpu + 1e-9:
                return f"CPU quotas would reach {cpu_sum + after.cpu_quota:.2f} of {budget.cpu:.2f} cores"
        if after.memory_limit > before.memory_limit:
            memory_sum = sum(x.policy.memory_held() for x in others)
            if memory_sum + after.memory_limit > budget.memory:
                return (
                    f"memory limits would reach {(memory_sum + after.memory_limit) >> 20} MiB "
                    f"of {budget.memory >> 20} MiB"
                )
        return None

    def _count(self, t, plan: _Plan) -> None:
        with self.provisioner._lock:
            self._count_locked(t, plan)

    def _count_locked(self, t, plan: _Plan) -> None:
        """Make ``plan`` what the provisioner counts and controls ``t`` within."""
        cfg, pol, r = self.provisioner.config, t.policy, plan.resources
        t.resources = r
        pol.cpu_ceiling, pol.memory_ceiling = r.cpus, r.memory_bytes
        pol.cpu_floor, pol.memory_floor = min(cfg.cpu_floor, r.cpus), min(cfg.memory_floor, r.memory_bytes)
        pol.cpu_quota, pol.memory_limit = plan.cpu_quota, plan.memory_limit
        pol.peak_ws = min(pol.peak_ws, float(r.memory_bytes))

    def _write(self, t, e: Environment, before: _Plan, after: _Plan) -> None:
        """Write ``after`` to ``t``'s cgroup and ``e``'s disk quota; on a failure, ``before`` again."""
        cg: Cgroup = t.cgroup
        try:
            cg.set_memory_limit(after.memory_limit)  # first: the one write the kernel may refuse
        except LimitRefusedError:
            raise StateError(
                f"environment {e.info.id} holds more memory than {after.memory_limit >> 20} MiB "
                "and the kernel could not reclaim it: nothing changed"
            ) from None
        done = ["memory"]
        try:
            self._oom_killer(t, after)
            if after.resources.disk_bytes != before.resources.disk_bytes:
                self.disk.set_limit(e.dir, after.resources.disk_bytes)
                done.append("disk")
            cg.set_cpu(self._cfs(after))
            cg.set_pids_limit(after.resources.pids)
            self._rerun_with(e, after)
            done.append("bundle")
        except BaseException:
            with contextlib.suppress(WeenvError, OSError):  # best effort: what was there
                cg.set_pids_limit(before.resources.pids)
                cg.set_cpu(self._cfs(before))
                if "disk" in done:
                    self.disk.set_limit(e.dir, before.resources.disk_bytes)
                cg.set_memory_limit(before.memory_limit)
                self._oom_killer(t, before)
                if "bundle" in done:
                    self._rerun_with(e, before)
            raise

    def _rerun_with(self, e: Environment, plan: _Plan) -> None:
        """What a container of ``e`` run again has: its bundle's limits, and
        those of the container a reset made ahead (created already, its own cgroup)."""
        for name in ("bundle", "bundle" + AHEAD):
            set_bundle_resources(e.dir / name, plan.resources)
        ahead = e.dir / ("bundle" + AHEAD)
        if (ahead / CONTAINER_FILE).exists():
            cg = open_cgroups(f"/{bundle_container_id(e.info.id, ahead)}")
            if cg.exists():
                cg.set_memory_limit(plan.resources.memory_bytes)
                cg.set_cpu(plan.resources.cpus)
                cg.set_pids_limit(plan.resources.pids)

    def _cfs(self, plan: _Plan) -> float:
        """The CFS quota (cores) of ``plan``: its declared cores, or the elastic reservation."""
        cfg = self.provisioner.config
        if cfg.mode == "elastic" and cfg.cpu_quota_at != "ceiling":
            return plan.cpu_quota
        return plan.resources.cpus

    def _oom_killer(self, t, plan: _Plan) -> None:
        """Elastic: tasks at a limit below the ceiling wait rather than die (as the provisioner writes it)."""
        cfg = self.provisioner.config
        if cfg.mode != "elastic":
            return
        killer = not (cfg.oom_wait and plan.memory_limit < plan.resources.memory_bytes)
        if t.oom_killer != killer:
            t.oom_killer = killer if t.cgroup.set_oom_killer(killer) else True
