"""What the builder needs of a runtime to run a recipe's ``run``/``pip`` steps.

:func:`~weenv.packaging.builder.build_recipe` is given a
:class:`BuildEnvironments` (the node implements it:
:class:`weenv.build.buildenv.NodeBuildEnvironments`; the CLI passes it), so
packaging never imports the node.  The builder starts one build environment
per component from a scratch template, copies tree steps into its
:attr:`~BuildEnvironment.root`, runs commands with
:meth:`~BuildEnvironment.exec`, and takes :meth:`~BuildEnvironment.stop`'s
upper dir as the new group.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from weenv.config import Paths
from weenv.store.base import Store


class StepResult(Protocol):
    """What a command in a build environment did."""

    exit_code: int
    timed_out: bool
    stdout: bytes
    stderr: bytes


class BuildEnvironment(Protocol):
    """One running build environment."""

    root: Path
    """Its root file system, as the host sees it (tree steps copy into it, confined)."""

    def exec(
        self,
        command: list[str],
        *,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        timeout: float | None = None,
    ) -> StepResult:
        """Run ``command`` (argv) inside; ``timeout`` in seconds kills it (``timed_out``)."""
        ...

    def stop(self) -> Path:
        """Stop it; its overlay upper dir (what the steps changed, whiteouts for deletions)."""
        ...

    def close(self) -> None:
        """Destroy it and everything it holds (mounts, container); idempotent, after :meth:`stop` too."""
        ...


class BuildEnvironments(Protocol):
    """Starts build environments."""

    def start(self, paths: Paths, store: Store, template: str) -> BuildEnvironment:
        """Start an environment of ``template`` (a template manifest's digest in
        ``store``) with network, Docker's default capabilities and root as the user,
        on a runtime of its own whose home is ``paths.home`` (never the daemon's).
        Raises what the runtime raises (:class:`~weenv.errors.RuntimeFailedError`,
        the store's errors); nothing is left running when it raises."""
        ...
