"""Commands of environments: starting them (through :mod:`weenv.node.runtime.launcher`),
keeping them by pid, and collecting their output with a bound."""

from __future__ import annotations

import dataclasses

from weenv.api.models import ExecResult, ProcessInfo
from weenv.errors import InvalidInputError, NotFoundError, OutputLimitError
from weenv.host.rootfs import RootFS
from weenv.node.runtime.launcher import Launcher, Launchers
from weenv.node.runtime.process import PipeSink, Process
from weenv.node.runtime.spec import CommandSpec
from weenv.node.runtime.users import Identity, Users
from weenv.node.table import Environment, EnvironmentTable, check_timeout

KEEP_FINISHED = 64
"""Ended processes kept per environment (for their exit code and output)."""


class Commands:
    """Commands started in the environments of ``table``."""

    def __init__(self, table: EnvironmentTable, launchers: Launchers, *, retain_bytes: int, start_timeout: float):
        """``retain_bytes``: output kept per background command that nobody
        reads; ``start_timeout``: seconds a command may take to start."""
        self.table = table
        self.launchers = launchers
        self.retain_bytes = retain_bytes
        self.start_timeout = start_timeout
        self.sink = PipeSink()
        """Where what background descendants write after their command returned goes."""
        self.users = Users()
        """Each environment's users, from its own ``/etc/passwd`` and ``/etc/group``."""

    def reset(self) -> None:
        """Close the pipe sink (the node closes) and make a fresh one for a next start."""
        self.sink.close()
        self.sink = PipeSink()

    def identity(self, e: Environment, user: str | None = None) -> Identity:
        """``user`` (a name or ``UID[:GID]``; None: the template's) inside ``e``;
        raises :class:`UnknownUserError` or :class:`InvalidInputError`."""
        return self.users.lookup(RootFS(e.rootfs), user or e.template.runtime.user)

    def start(
        self,
        e: Environment,
        command: CommandSpec | list[str] | str,
        *,
        primary_reader: bool = False,
        launcher: Launcher | None = None,
        **fields,
    ) -> Process:
        """Start ``command`` in ``e`` (see :meth:`Node.spawn`) and wait until it
        runs: a :class:`CommandSpec`, or its ``command`` with its other fields as
        keyword arguments; ``launcher``: through that one alone (:meth:`Launchers.launch`'s ``only``)."""
        spec = command if isinstance(command, CommandSpec) else CommandSpec(command, **fields)
        if isinstance(spec.command, list) and not spec.command:
            raise InvalidInputError("empty command")
        if spec.timeout is not None:
            check_timeout(spec.timeout)
        if spec.tty is not None:
            check_tty_size(*spec.tty)
            spec = dataclasses.replace(spec, stdin=None, stdin_open=False)  # its input is the terminal's
        who = spec.user if isinstance(spec.user, Identity) else self.identity(e, spec.user)
        wd = spec.cwd or e.template.runtime.working_dir
        spawned = self.launchers.launch(e, spec.resolved(_variables(e, who, spec.env), wd, who), only=launcher)
        p = Process(
            spawned,
            command=spec.command,
            tag=spec.tag,
            cwd=wd,
            timeout=spec.timeout,
            stdin=spec.stdin if spec.stdin_open else None,
            retain_bytes=self.retain_bytes,
            sink=self.sink,
            primary_reader=primary_reader,
        )
        p.wait_started(self.start_timeout)
        return p

    def keep(self, e: Environment, p: Process) -> None:
        """Keep ``p`` under its pid in ``e`` (the last :data:`KEEP_FINISHED` ended ones too)."""
        if not p.pid:
            return
        with self.table.lock:
            e.processes[p.pid] = p
            ended = [pid for pid, q in e.processes.items() if not q.running]
            for pid in ended[: max(0, len(ended) - KEEP_FINISHED)]:
                del e.processes[pid]

    def forget(self, e: Environment) -> list[Process]:
        """Take every command of ``e`` out of its table (its container is being
        replaced: new commands may get the same pids); them."""
        with self.table.lock:
            procs, e.processes = list(e.processes.values()), {}
        return procs

    def get(self, e: Environment, pid: int) -> Process:
        with self.table.lock:
            p = e.processes.get(pid)
        if p is None:
            raise NotFoundError(f"no command with pid {pid} in environment {e.info.id!r}")
        return p

    def infos(self, e: Environment) -> list[ProcessInfo]:
        with self.table.lock:
            procs = list(e.processes.values())
        return [p.info() for p in procs]


MAX_TTY_SIDE = 10_000
"""Most columns, and most rows, of a command's terminal."""


def check_tty_size(cols: int, rows: int) -> None:
    """Raise :class:`InvalidInputError` unless a terminal of ``cols`` columns and
    ``rows`` rows is 1 to :data:`MAX_TTY_SIDE` each way."""
    for what, n in (("columns", cols), ("rows", rows)):
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_TTY_SIDE:
            raise InvalidInputError(f"a terminal has 1 to {MAX_TTY_SIDE} {what}, not {n!r}")


def _variables(e: Environment, who: Identity, env: dict[str, str] | None) -> dict[str, str]:
    """A command's variables as ``who``: the template's, then ``HOME``,
    ``USER``, ``LOGNAME`` of the user (a template's ``HOME`` is often
    ``RuntimeConfig``'s default ``/root`` whatever its user), then the
    create's, then the command's own."""
    return {**e.template.runtime.env, **who.env(), **e.info.envs, **(env or {})}


def collect(p: Process, max_output: int = 64 << 20) -> ExecResult:
    """Wait for ``p`` (spawned with ``primary_reader``) and return its result
    with its whole output; past ``max_output`` bytes (stdout + stderr) its tree
    is killed and :class:`OutputLimitError` raised."""
    out, err = bytearray(), bytearray()
    end = None
    for ev in p.log.follow(p.primary):
        if ev.type in ("stdout", "stderr"):
            (out if ev.type == "stdout" else err).extend(ev.data or b"")
            if len(out) + len(err) > max_output:
                p.kill()
                p.wait(30)
                raise OutputLimitError(
                    f"the command wrote more than {max_output} bytes of output and was killed "
                    "(stream its output instead, or redirect it to a file)"
                )
        elif ev.type == "end":
            end = ev
    if p.error is not None:
        raise p.error
    assert end is not None and end.exit_code is not None
    return ExecResult(
        exit_code=end.exit_code,
        stdout=bytes(out),
        stderr=bytes(err),
        duration_s=end.duration_s or 0.0,
        timed_out=bool(end.timed_out),
    )
