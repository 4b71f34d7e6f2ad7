"""One command as it is asked of an environment: :class:`CommandSpec`.

Built once where the command comes in (``ExecRequest`` on the weenv API,
:meth:`CommandSpec.of`; the E2B and prime faces, the SDK-less callers) and
passed whole down to the launcher that starts it: :meth:`Node.spawn
<weenv.node.node.Node.spawn>`, :meth:`Commands.start
<weenv.node.runtime.commands.Commands.start>`, which resolves it inside the
environment (:meth:`CommandSpec.resolved`: the argv, every variable, the
working dir, the user's identity), :class:`~weenv.node.runtime.launcher.Launchers`
and the :class:`~weenv.node.runtime.launcher.Launcher` (exec agent or runtime)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from weenv.api.models import ExecRequest
from weenv.node.runtime.users import Identity


@dataclass(frozen=True)
class CommandSpec:
    """A command to start in an environment.

    As asked: ``command`` argv or a ``/bin/sh -c`` string; ``env`` added to the
    environment's variables; ``cwd`` (None: the template's working dir);
    ``timeout`` seconds; ``stdin`` bytes read then end of file, or with
    ``stdin_open`` a pipe kept open (those bytes written first); ``tag`` a
    label; ``user`` a name of the environment's ``/etc/passwd``, ``UID[:GID]``
    or an :class:`Identity` (None: the template's user); ``tty`` ``(cols,
    rows)`` of a terminal it runs on.  Resolved (:meth:`resolved`): ``command``
    the argv, ``env`` exactly its variables, ``cwd`` absolute, ``user`` an
    :class:`Identity`, ``stdin`` what the launcher reads from (None with a pipe)."""

    command: list[str] | str
    env: dict[str, str] | None = None
    cwd: str | None = None
    timeout: float | None = None
    stdin: bytes | None = None
    stdin_open: bool = False
    tag: str | None = None
    user: str | Identity | None = None
    tty: tuple[int, int] | None = None

    @classmethod
    def of(cls, req: ExecRequest) -> CommandSpec:
        """The command an API request asks."""
        return cls(
            req.command,
            env=dict(req.env),
            cwd=req.cwd,
            timeout=req.timeout,
            stdin=req.stdin,
            stdin_open=req.stdin_open,
            tag=req.tag,
            user=req.user,
        )

    def resolved(self, env: dict[str, str], cwd: str, user: Identity) -> CommandSpec:
        """This command as a launcher starts it: exactly the variables ``env``,
        in ``cwd``, as ``user``; stdin read from ``stdin`` unless a pipe
        (``command`` is checked and made an argv by the launchers,
        :func:`~weenv.node.runtime.runc.exec_args`)."""
        return dataclasses.replace(self, env=env, cwd=cwd, user=user, stdin=None if self.stdin_open else self.stdin)
