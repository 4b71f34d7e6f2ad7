"""The warm pool's side in a node: making pooled environments and starting them.

:class:`~weenv.node.state.pool.WarmPool` decides when and for which request an
environment is made ahead; :class:`WarmStarts` makes one (the snapshotter's
rootfs and the container service's container, ``runc create`` without start)
and, for a create that took one, checks it can still serve and starts it.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from weenv.api.models import CreateTiming
from weenv.errors import NotFoundError, RuntimeFailedError
from weenv.formats.manifest import GroupManifest, Resources, TemplateManifest
from weenv.node.data.groups import GroupMounts
from weenv.node.resolver import Resolver
from weenv.node.runtime.container import Containers
from weenv.node.snapshotter import Snapshotter
from weenv.node.state.pool import Pooled, PoolKey, WarmPool

log = logging.getLogger(__name__)

POOLED_START_TIMEOUT_S = 2.0
"""Seconds a create gives ``runc start`` of a pooled environment before making its own."""


def pool_key(digest: str, resources: Resources | None, capabilities: tuple[str, ...]) -> PoolKey:
    """The key of a create of template ``digest`` asking ``resources`` (None:
    the template's) and ``capabilities``."""
    return PoolKey(digest, None if resources is None else resources.model_dump_json(), capabilities)


class WarmStarts:
    """Pooled environments of one node; :attr:`pool` is their :class:`WarmPool`."""

    def __init__(
        self,
        resolver: Resolver,
        snapshotter: Snapshotter,
        containers: Containers,
        groups: GroupMounts,
        *,
        size: int,
        may_fill: Callable[[int], bool],
    ):
        self.resolver = resolver
        self.snapshotter = snapshotter
        self.containers = containers
        self.groups = groups
        self.pool = WarmPool(self.prepare, may_fill=may_fill, size=size)

    def prepare(self, key: PoolKey) -> Pooled:
        """One environment of ``key`` for the pool: created, not started."""
        env_id = secrets.token_hex(6)
        manifest, group_manifests = self.resolver.load(key.digest)
        res = Resources.model_validate_json(key.resources) if key.resources else manifest.runtime.resources
        with contextlib.ExitStack() as undo:
            lowers = self.snapshotter.prepare(
                env_id,
                manifest.groups,
                group_manifests,
                res.disk_bytes,
                undo,
                CreateTiming(),  # a pooled one's phases are not a create's
                userns=self.containers.wants_userns(manifest.runtime),
            )
            self.containers.make(
                env_id,
                self.snapshotter.dir(env_id),
                manifest.runtime,
                res,
                key.capabilities,
                undo,
                CreateTiming(),
                start=False,
            )
            return Pooled(key, env_id, lowers, undo.pop_all())

    @contextlib.contextmanager
    def taken(self, key: PoolKey) -> Iterator[Pooled | None]:
        """A pooled environment for ``key`` (or None) while a create runs; the
        pool learns the create's end (a use of ``key`` if it succeeded); a
        template gone (:class:`NotFoundError`) is made no more."""
        created = False
        try:
            yield self.pool.take(key)
            created = True
        except NotFoundError:  # the template (or its name) is gone: make no more of it
            self.pool.forget(key)
            raise
        finally:
            self.pool.done(key, created)

    def own(self, pooled: Pooled, undo: contextlib.ExitStack) -> str:
        """Take ``pooled`` into a create: if it fails, ``undo`` gives it back
        untouched, or removes it once :meth:`start` tried it.  Its id."""
        undo.callback(lambda: pooled.undo.close() if pooled.tried else self.pool.give_back(pooled))
        return pooled.env_id

    def start(
        self, pooled: Pooled, manifest: TemplateManifest, group_manifests: list[GroupManifest], timing: CreateTiming
    ) -> list[Path] | None:
        """Start the pooled environment (``runc start``) and return its overlay's
        lower dirs; or remove it and return None if it cannot serve: a group it
        reads through FUSE has an assembled image now (new environments mount
        that directly), its overlay is no longer mounted on the host (the
        node's file access goes through it), or its container does not start
        (e.g. its waiting process was killed)."""
        pooled.tried = True
        why = None
        for g, g_manifest, lower in zip(manifest.groups, group_manifests, pooled.lowers):
            if self.groups.superseded(g, lower, g_manifest):
                why = f"it reads group {g} through FUSE, which is mounted directly now"
        if why is None and not self.snapshotter.is_mounted(pooled.env_id):
            why = "its overlay is not mounted"
        if why is not None:
            log.info("pooled environment %s not used (%s); creating it anew", pooled.env_id, why)
            self.pool.unusable()
            pooled.undo.close()
            return None
        t = time.perf_counter()
        try:  # ~7 ms; one that waits longer is stuck (e.g. its process stopped): made anew instead
            self.containers.start(pooled.env_id, timeout=POOLED_START_TIMEOUT_S)
        except (RuntimeFailedError, NotFoundError) as exc:
            log.warning("pooled environment %s did not start (%s); creating it anew", pooled.env_id, exc)
            self.pool.unusable()
            pooled.undo.close()
            return None
        timing.runtime_s = time.perf_counter() - t
        timing.pooled = True
        return pooled.lowers
