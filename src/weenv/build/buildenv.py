"""Build environments on a private in-process :class:`~weenv.node.node.Node`:
the node's :class:`~weenv.packaging.buildenv.BuildEnvironments`, which the CLI
hands to :func:`~weenv.packaging.builder.build_recipe`."""

from __future__ import annotations

from pathlib import Path

from weenv.api.models import ExecResult
from weenv.config import Paths
from weenv.node.runtime.bundle import DOCKER_DEFAULT_CAPS
from weenv.store.base import Store


class NodeBuildEnvironments:
    """Starts each build environment on a node of its own (home ``paths.home``)."""

    def start(self, paths: Paths, store: Store, template: str) -> NodeBuildEnvironment:
        from weenv.node.node import Node

        node = Node(paths, store=store)
        try:
            node.start()
            info = node.create(
                template, first_command=False, capabilities=DOCKER_DEFAULT_CAPS, prefetch=False, sudo=False
            )
        except BaseException:
            node.close()
            raise
        return NodeBuildEnvironment(node, info.id, Path(info.rootfs))


class NodeBuildEnvironment:
    """Environment ``env_id`` of ``node``; :meth:`close` closes the node (destroying it)."""

    def __init__(self, node, env_id: str, root: Path):
        self.node = node
        self.env_id = env_id
        self.root = root

    def exec(
        self,
        command: list[str],
        *,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        timeout: float | None = None,
    ) -> ExecResult:
        return self.node.exec(self.env_id, command, env=env, cwd=cwd, timeout=timeout)

    def stop(self) -> Path:
        return self.node.stop(self.env_id)

    def close(self) -> None:
        self.node.close()
