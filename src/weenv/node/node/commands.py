"""Commands, templates and files of :class:`~weenv.node.node.Node`'s environments
(:class:`CommandsAndFiles`, a part of the node)."""

from __future__ import annotations

import logging
import os
import socket

from weenv.api.models import (
    ExecResult,
    ProcessInfo,
    TemplateInfo,
)
from weenv.errors import (
    CommandTimeoutError,
    NotFoundError,
)
from weenv.host.procroot import ProcessRootFS, pin_process
from weenv.host.rootfs import RootFS
from weenv.node.runtime import idmap, network
from weenv.node.runtime.commands import collect
from weenv.node.runtime.process import Process
from weenv.node.runtime.spec import CommandSpec
from weenv.node.runtime.users import Identity
from weenv.node.state.pause import check_running

log = logging.getLogger(__name__)


class CommandsAndFiles:
    """Commands in an environment, the templates, an environment's files, ports
    and users; a part of :class:`~weenv.node.node.Node`, over its collaborators."""

    # --- commands ---------------------------------------------------------------------
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
        max_output: int = 64 << 20,
        user: str | None = None,
    ) -> ExecResult:
        """Run ``command`` (argv, or a ``/bin/sh -c`` string) in environment ``env_id``.

        ``env`` adds to the template's variables; ``cwd`` defaults to its working
        dir; ``timeout`` in seconds kills the command and its children, reported
        as ``timed_out`` (or raised as :class:`CommandTimeoutError`).

        The output comes through pipes (:meth:`run`): past ``max_output`` bytes
        the command is killed (:class:`OutputLimitError`), and what a background
        descendant (``cmd &``) writes after the command returned goes to the
        node's :class:`~weenv.node.runtime.process.PipeSink`, never to a file on the host.
        """
        r = self.run(env_id, command, env=env, cwd=cwd, timeout=timeout, stdin=stdin, max_output=max_output, user=user)
        if r.timed_out and raise_on_timeout:
            raise CommandTimeoutError(f"command timed out after {timeout} s in {env_id}")
        return r

    def spawn(
        self, env_id: str, command: CommandSpec | list[str] | str, *, primary_reader: bool = False, **fields
    ) -> Process:
        """Start ``command`` in environment ``env_id`` and return once it runs
        (or could not start: then its pid is 0 and it has already ended with
        127/126 and the reason on stderr, as runc words it).  ``command``: a
        :class:`~weenv.node.runtime.spec.CommandSpec` (passed whole to the
        launcher), or its ``command`` (argv or a ``/bin/sh -c`` string) with its
        other fields (``env``, ``cwd``, ``timeout``, ``stdin``, ``stdin_open``,
        ``tag``, ``user``, ``tty``) as keyword arguments.

        Its output streams through ``process.log`` (see :mod:`weenv.node.runtime.process`);
        ``stdin_open`` makes stdin a pipe for :meth:`Process.write_stdin`;
        ``primary_reader`` attaches a reader that sees every event (a foreground
        stream; read it to the end or detach it).  The process is kept under
        its pid (:meth:`process`) while it runs and a while after.

        ``user``: who it runs as, a name of the environment's ``/etc/passwd``
        or ``"UID[:GID]"`` (default: the template's user), with that user's
        gid, supplementary groups (``/etc/group``) and ``HOME``/``USER``/
        ``LOGNAME`` (:mod:`weenv.node.runtime.users`).  Raises :class:`NotFoundError`
        for an unknown environment, :class:`UnknownUserError` for a user it
        does not have and :class:`InvalidInputError` for a bad command,
        variable, directory, user or terminal size.

        ``tty``: ``(cols, rows)``: run it on a new pseudo-terminal of that size
        inside the environment (its stdin, stdout and stderr; ``stdin`` and
        ``stdin_open`` do not apply): its output is all ``stdout`` events,
        :meth:`Process.write_stdin` types into it and :meth:`Process.resize`
        resizes it.  Needs the exec agent (:class:`StateError` without it).
        """
        e = self.table.get(env_id)
        with e.gate.passing():  # not while a reset or pause replaces or freezes its container
            check_running(e)
            p = self.commands.start(e, command, primary_reader=primary_reader, **fields)
            self.commands.keep(e, p)  # before the gate opens: a reset now kills and forgets it
        self.prefetch.watch_command(env_id, p.wait)
        return p

    def process(self, env_id: str, pid: int) -> Process:
        """The streamed or background command ``pid`` of ``env_id``; :class:`NotFoundError` if unknown."""
        return self.commands.get(self.table.get(env_id), pid)

    def processes(self, env_id: str) -> list[ProcessInfo]:
        return self.commands.infos(self.table.get(env_id))

    def run(
        self,
        env_id: str,
        command: list[str] | str,
        *,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        timeout: float | None = None,
        stdin: bytes | None = None,
        max_output: int = 64 << 20,
        user: str | None = None,
    ) -> ExecResult:
        """Like :meth:`exec`, through a streamed process whose output is counted
        as it comes: past ``max_output`` bytes (stdout + stderr) the command tree
        is killed and :class:`OutputLimitError` raised, so a huge output never
        fills the daemon's memory or disk."""
        p = self.spawn(env_id, command, env=env, cwd=cwd, timeout=timeout, stdin=stdin, primary_reader=True, user=user)
        return collect(p, max_output)

    def collect(self, p: Process, max_output: int = 64 << 20) -> ExecResult:
        """Wait for ``p`` (spawned with ``primary_reader``) and return its result
        with its whole output, as :meth:`run` does (:class:`OutputLimitError`
        past ``max_output`` bytes)."""
        return collect(p, max_output)

    # --- templates and files ----------------------------------------------------------
    def templates(self) -> list[TemplateInfo]:
        """The store's templates by name (name and digest only)."""
        return self.resolver.templates()

    def template(self, name: str) -> TemplateInfo:
        """One template (name or digest) with its groups, runtime and sizes; :class:`NotFoundError` if unknown."""
        return self.resolver.template(name)

    def files(self, env_id: str) -> RootFS:
        """File access inside the environment's root (paths cannot escape it;
        owners shifted into its id range, if it has one)."""
        e = self.table.get(env_id)
        return RootFS(e.rootfs, idmap.range_of(e.dir) or 0)

    def mounted_files(self, env_id: str) -> RootFS:
        """File access inside the environment as its processes see it: its root
        *with its mounts* (``/proc``, ``/dev``, ``/dev/shm``: through its first
        process's root, :class:`~weenv.host.procroot.ProcessRootFS`), confined as
        :meth:`files`; the bare root (:meth:`files`) while it has no running
        process.  Raises :class:`NotFoundError` if unknown."""
        e = self.table.get(env_id)
        shift = idmap.range_of(e.dir) or 0
        for _attempt in range(2):
            pid = e.init_pid
            if pid is None:
                state = self.runc.state(e.container_id) or {}
                if state.get("status") not in ("running", "paused") or not state.get("pid"):
                    return RootFS(e.rootfs, shift)
                pid = e.init_pid = int(state["pid"])
            try:
                return ProcessRootFS(pid, expect_cgroup=f"/{e.container_id}", shift=shift)
            except NotFoundError:
                e.init_pid = None  # restarted or gone: ask runc again
        return RootFS(e.rootfs, shift)

    def open_port(self, env_id: str, port: int) -> socket.socket:
        """A TCP connection to ``port`` on the environment's own loopback (inside
        its network namespace, with or without network; E2B's ``get_host``).
        Raises :class:`NotFoundError` (unknown or stopped), ``OSError`` (nothing listens)."""
        e = self.table.get(env_id)
        netns = e.dir / network.NETNS_FILE
        if netns.exists():
            return network.open_in(netns, port, timeout=5.0)
        # No network of its own: the namespace runc made, found through its first
        # process, pinned by a pidfd known to be in the environment's cgroup (a
        # number runc reported may name another process by the time it is used).
        state = self.runc.state(e.container_id)
        if not state or not state.get("pid"):
            raise NotFoundError(f"environment {env_id!r} is not running")
        pidfd = pin_process(int(state["pid"]), expect_cgroup=f"/{e.container_id}")
        try:
            return network.open_in(pidfd, port, timeout=5.0)
        except ProcessLookupError:
            raise NotFoundError(f"environment {env_id!r} is not running") from None
        finally:
            os.close(pidfd)

    def user(self, env_id: str, user: str | None = None) -> Identity:
        """``user`` (a name or ``"UID[:GID]"``; None: the template's) inside the
        environment: uid, gid, groups, home.  Raises :class:`NotFoundError`,
        :class:`UnknownUserError` or :class:`InvalidInputError`."""
        return self.commands.identity(self.table.get(env_id), user)
