"""Launchers: how a command starts inside an environment.

A :class:`Launcher` starts one command (argv, variables, working dir, stdin)
in a running environment and returns its :class:`~weenv.node.runtime.process.Spawned`,
which :class:`~weenv.node.runtime.process.Process` drives the same way whatever
started it.  Two backends:

- :class:`AgentLauncher`: the exec agent inside the environment
  (:mod:`weenv.node.runtime.agent`), one connect per command, no runc process;
- :class:`RuncLauncher`: ``runc exec`` (:mod:`weenv.node.runtime.runc`).

:class:`Launchers` picks one per command: the agent when its socket is there,
``runc exec`` otherwise or when the agent does not answer (for this command,
or from now on when it is gone for good), and counts what each started.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import json
import logging
import threading

from weenv.errors import StateError
from weenv.node.runtime.agent import AgentUnavailable
from weenv.node.runtime.agent import spawn as agent_spawn
from weenv.node.runtime.bundle import CAPS_ANNOTATION
from weenv.node.runtime.process import Spawned
from weenv.node.runtime.runc import Runc, exec_args
from weenv.node.runtime.spec import CommandSpec
from weenv.node.runtime.users import Identity
from weenv.node.table import Environment

log = logging.getLogger(__name__)


class Launcher(abc.ABC):
    """Starts commands inside running environments."""

    name: str
    """Its key in :attr:`Launchers.counts` (and ``NodeStats.exec_*``)."""

    @abc.abstractmethod
    def spawn(self, e: Environment, spec: CommandSpec) -> Spawned:
        """Start ``spec`` (resolved, :meth:`CommandSpec.resolved`: its ``command``
        the argv :func:`~weenv.node.runtime.runc.exec_args` checked) in ``e``
        with exactly the variables ``spec.env``, in ``spec.cwd``, as
        ``spec.user`` (its uid, gid and supplementary groups); ``spec.stdin``:
        bytes written then closed, or ``spec.stdin_open``: a pipe kept open;
        ``spec.tty``: ``(cols, rows)`` of a new pseudo-terminal inside ``e`` the
        command runs on instead (its stdin, stdout and stderr).  A command that
        cannot start still returns (its pid 0, ended 127/126)."""


class AgentLauncher(Launcher):
    """Through the exec agent; raises :class:`AgentUnavailable` when it does not answer."""

    name = "agent"

    def spawn(self, e: Environment, spec: CommandSpec) -> Spawned:
        user = spec.user
        assert isinstance(user, Identity)
        return agent_spawn(
            e.agent_socket,
            spec.command,
            env=spec.env,
            cwd=spec.cwd,
            stdin=spec.stdin,
            stdin_pipe=spec.stdin_open,
            cgroup=f"/{e.container_id}",
            ident=f"{user.spec}:{','.join(map(str, user.groups))}",
            tty=spec.tty,
        )


class RuncLauncher(Launcher):
    """Through ``runc exec``, with a process of the environment's capability set
    (its bundle's :data:`~weenv.node.runtime.bundle.CAPS_ANNOTATION`: the first
    process also holds the agent's) and the user's groups."""

    name = "runc"

    def __init__(self, runc: Runc):
        self.runc = runc

    def spawn(self, e: Environment, spec: CommandSpec) -> Spawned:
        if spec.tty is not None:
            raise StateError(f"environment {e.info.id!r} has no exec agent running, which a terminal needs")
        user = spec.user
        assert isinstance(user, Identity)
        return self.runc.spawn(
            e.container_id,
            spec.command,
            env=spec.env,
            cwd=spec.cwd,
            user=user.spec,
            stdin=spec.stdin,
            stdin_pipe=spec.stdin_open,
            process=_process(e, user),
        )


def _process(e: Environment, user: Identity) -> dict | None:
    """The OCI process for a ``runc exec`` in ``e`` as ``user``: its bundle's,
    with the environment's capabilities and ``user``'s groups (None without a
    readable bundle: runc's own defaults)."""
    try:
        config = json.loads((e.dir / "bundle" / "config.json").read_text())
    except (OSError, ValueError):
        return None
    process = dict(config.get("process") or {})
    caps = (config.get("annotations") or {}).get(CAPS_ANNOTATION)
    if caps is not None:
        names = [c for c in caps.split(",") if c]
        process["capabilities"] = {k: names for k in ("bounding", "effective", "permitted", "ambient")}
    process["user"] = {"uid": user.uid, "gid": user.gid, "additionalGids": list(user.groups[1:])}
    return process


class Launchers:
    """The agent where it answers, ``runc exec`` otherwise (see the module's doc)."""

    def __init__(self, runc: Runc):
        self.agent = AgentLauncher()
        self.runc = RuncLauncher(runc)
        self.counts = {"agent": 0, "runc": 0}
        """Commands started through each launcher (``runc``: the fallback)."""
        self._lock = threading.Lock()

    def launch(self, e: Environment, spec: CommandSpec, *, only: Launcher | None = None) -> Spawned:
        """Start ``spec`` (resolved: :meth:`CommandSpec.resolved`; its command argv
        or a ``/bin/sh -c`` string) in ``e`` (a ``tty``: on a new terminal, see
        :meth:`Launcher.spawn`: through the agent alone, :class:`StateError`
        without one); raises :class:`InvalidInputError` for a bad command,
        variable or directory.  ``only``: through that launcher, with no
        fallback (its own errors raised)."""
        user = spec.user
        assert isinstance(user, Identity)
        _flags, argv = exec_args(spec.command, spec.env, spec.cwd, user.spec)  # raises for bad input
        spec = dataclasses.replace(spec, command=argv)
        if only is not None:
            return self._count(only, e, spec)
        if e.agent_socket.exists():
            try:
                return self._count(self.agent, e, spec)
            except AgentUnavailable as exc:
                if exc.gone:  # for good: later commands go straight to runc
                    log.warning("environment %s: %s; using runc exec from now on", e.info.id, exc)
                    with contextlib.suppress(FileNotFoundError):
                        e.agent_socket.unlink()
                else:
                    log.info("environment %s: %s; using runc exec for this command", e.info.id, exc)
        return self._count(self.runc, e, spec)

    def _count(self, launcher: Launcher, e: Environment, spec: CommandSpec) -> Spawned:
        spawned = launcher.spawn(e, spec)
        with self._lock:
            self.counts[launcher.name] += 1
        return spawned
