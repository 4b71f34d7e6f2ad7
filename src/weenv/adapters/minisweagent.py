"""mini-swe-agent on weenv: ``WeenvEnvironment``, an environment class for its
``environment_class`` setting (mini-swe-agent's own loader takes a dotted path)::

    environment:
      environment_class: weenv.adapters.minisweagent.WeenvEnvironment
      template: my-task          # a weenv template (name or digest)
      cwd: /workspace            # default: the template's working directory
      timeout: 60                # seconds per command (killed after it)
      lifetime: 7200             # seconds the environment lives (the node destroys it then)
      cpus: 2                    # elastic ceiling; also memory_mib, disk_gib

It behaves as mini-swe-agent's Docker environment does: ``execute(action,
cwd, timeout=)`` runs ``action["command"]`` with ``interpreter`` (``bash
-lc``) and returns ``{"output", "returncode", "exception_info"}`` with stderr
merged into the output in order; a command past its timeout is killed and
returns its partial output, ``returncode`` -1 and the reason in
``exception_info`` (as Docker's and Local's do); output whose first line is
``COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`` (exit 0) raises ``Submitted``.
``get_template_vars`` adds ``weenv_env_id`` and ``weenv_node``.  The
environment is created when the class is, destroyed by ``cleanup()`` (also at
garbage collection).  The daemon: ``api_url``/``api_key``, else
``WEENV_API_URL``/``WEENV_API_KEY``, else the local one.
"""

from __future__ import annotations

import logging
import os
import platform
from typing import Any

from minisweagent.exceptions import Submitted
from minisweagent.utils.serialize import recursive_merge
from pydantic import BaseModel

from weenv.adapters._resources import GIB, MIB, ceiling
from weenv.errors import CommandTimeoutError, WeenvError
from weenv.sdk import Sandbox

SUBMIT_MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
MERGE_STDERR = ["/bin/sh", "-c", 'exec "$@" 2>&1', "sh"]
"""Runs the interpreter with stderr on stdout (one stream, in order, as Docker's ``stderr=STDOUT``)."""


class WeenvEnvironmentConfig(BaseModel):
    template: str
    """The weenv template (name or digest) each environment starts from."""
    cwd: str = ""
    """Working directory of commands (empty: the template's)."""
    env: dict[str, str] = {}
    """Variables of every command."""
    forward_env: list[str] = []
    """Variables passed on from the host when set there (``env`` wins)."""
    timeout: int = 30
    """Seconds a command may run; it is killed after that."""
    interpreter: list[str] = ["bash", "-lc"]
    """argv the command is appended to."""
    lifetime: float = 7200.0
    """Seconds the environment lives (Docker's ``container_timeout``): the node destroys it then."""
    cpus: float | None = None
    """Elastic ceiling, cores (None: the template's resources)."""
    memory_mib: int | None = None
    disk_gib: int | None = None
    priority: int = 0
    """Elastic provisioning: higher grows first, is frozen last."""
    api_url: str | None = None
    api_key: str | None = None
    create_timeout: float | None = None
    """Seconds to wait for the create (default: the SDK's)."""


class WeenvEnvironment:
    def __init__(self, *, config_class: type = WeenvEnvironmentConfig, logger: logging.Logger | None = None, **kwargs):
        """Create the environment; see :class:`WeenvEnvironmentConfig` for the keyword arguments.
        Raises weenv's errors (:class:`~weenv.errors.NotFoundError` for an unknown template...)."""
        self.logger = logger or logging.getLogger("minisweagent.environment")
        self.config = config_class(**kwargs)
        self.sandbox: Sandbox | None = None
        self.env_id: str | None = None
        """The environment's id (kept after ``cleanup``)."""
        self.node: str | None = None
        """The node it runs on (its daemon's address)."""
        c = self.config
        resources = ceiling(
            cpus=c.cpus,
            memory_bytes=None if c.memory_mib is None else c.memory_mib * MIB,
            disk_bytes=None if c.disk_gib is None else c.disk_gib * GIB,
        )
        self.sandbox = Sandbox.create(
            c.template,
            timeout=c.lifetime,
            resources=resources,
            priority=c.priority,
            metadata={"harness": "mini-swe-agent"},
            api_url=c.api_url,
            api_key=c.api_key,
            request_timeout=c.create_timeout,
        )
        self.env_id, self.node = self.sandbox.id, self.sandbox.node
        self.logger.info("started weenv environment %s of %s on %s", self.env_id, c.template, self.node)

    def execute(self, action: dict, cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
        """Run ``action["command"]``; a dict of ``output``, ``returncode``, ``exception_info``."""
        command = action.get("command", "")
        assert self.sandbox is not None, "environment not started"
        env = {k: v for k in self.config.forward_env if (v := os.getenv(k)) is not None}
        env.update(self.config.env)
        limit = timeout or self.config.timeout
        try:
            r = self.sandbox.commands.run(
                [*MERGE_STDERR, *self.config.interpreter, command],
                cwd=cwd or self.config.cwd or None,
                envs=env,
                timeout=limit,
            )
            output = {"output": r.stdout, "returncode": r.exit_code, "exception_info": ""}
        except CommandTimeoutError as e:
            partial = getattr(e, "result", None)
            output = {
                "output": partial.stdout if partial is not None else "",
                "returncode": -1,
                "exception_info": f"An error occurred while executing the command: Command {command!r} "
                f"timed out after {limit} seconds",
                "extra": {"exception_type": "TimeoutExpired", "exception": str(e)},
            }
        except WeenvError as e:
            output = {
                "output": "",
                "returncode": -1,
                "exception_info": f"An error occurred while executing the command: {e}",
                "extra": {"exception_type": type(e).__name__, "exception": str(e)},
            }
        self._check_finished(output)
        return output

    def _check_finished(self, output: dict) -> None:
        """Raises ``Submitted`` if the output says the task is complete (as mini-swe-agent's environments do)."""
        lines = output.get("output", "").lstrip().splitlines(keepends=True)
        if lines and lines[0].strip() == SUBMIT_MARKER and output["returncode"] == 0:
            submission = "".join(lines[1:])
            raise Submitted(
                {"role": "exit", "content": submission, "extra": {"exit_status": "Submitted", "submission": submission}}
            )

    def get_template_vars(self, **kwargs) -> dict[str, Any]:
        return recursive_merge(
            self.config.model_dump(exclude={"api_key"}),
            platform.uname()._asdict(),
            {"weenv_env_id": self.env_id, "weenv_node": self.node},
            kwargs,
        )

    def serialize(self) -> dict:
        return {
            "info": {
                "config": {
                    "environment": self.config.model_dump(mode="json", exclude={"api_key"}),
                    "environment_type": f"{self.__class__.__module__}.{self.__class__.__name__}",
                    "weenv_env_id": self.env_id,
                    "weenv_node": self.node,
                }
            }
        }

    def cleanup(self) -> None:
        """Destroy the environment (idempotent)."""
        sandbox, self.sandbox = self.sandbox, None
        if sandbox is not None:
            try:
                sandbox.kill()
            except WeenvError as e:
                self.logger.warning("could not destroy weenv environment %s: %s", sandbox.id, e)

    def __del__(self) -> None:
        if getattr(self, "sandbox", None) is not None:
            self.cleanup()
