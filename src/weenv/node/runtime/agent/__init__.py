"""The exec agent: commands in a started environment without a runtime process each.

``runc exec`` costs tens of milliseconds per command (a Go binary that joins
the container's namespaces, cgroup and seccomp filter anew).  Instead, every
environment starts with a tiny static C program, the *agent* (``agent.c``),
that is already inside: it is bind-mounted read-only at
:data:`weenv.node.runtime.bundle.AGENT_PATH` (in the ``/dev`` tmpfs, so the root file
system keeps no trace) and runs as pid 1: ``AGENT -- INIT -- COMMAND...``.  It
forks a server and execs the init (tini), which stays pid 1, runs the
template's command and reaps the server if it dies.  Forked from what runc started, the server and every command it
starts share the first process's namespaces, cgroup, capabilities, seccomp
filter, no_new_privs, rlimits and user.  When the template's command only holds
the environment open (:data:`weenv.node.runtime.bundle.HOLD_COMMAND`, ``sleep
infinity``), the agent runs alone as ``AGENT --`` and stays pid 1 itself (it
reaps orphans), so nothing of the image needs to exist for the environment to
start; the node's first command is then ``AGENT -t`` (exits 0), not ``true``.

The node creates the server's listening socket on the host,
``ENV_DIR/agent.sock`` (mode 0600, outside the environment's root: nothing
inside can reach or replace it), and passes it as ``runc create``'s stdin; the
agent moves it off fd 0.  Per command the node connects, sends argv, variables
and working dir with the command's stdin/stdout/stderr pipes as SCM_RIGHTS;
a handler process forked for the connection (a child subreaper) forks the
command in a new session and reports ``forked``, ``runs`` or ``could not
start``, and the exit status.  A command may instead run on a new
pseudo-terminal the handler opens in the environment's own devpts (its
``/dev/ptmx``, with the command's user as the slave's owner); the handler
passes the master back over the connection and the node reads, writes and
resizes it.  Hanging up kills the command; the node kills
the whole tree from the host (the handler's host pid comes from
SCM_CREDENTIALS, checked by the kernel).

- :mod:`weenv.node.runtime.agent.build`: compile ``agent.c`` into the cache once per digest.
- :mod:`weenv.node.runtime.agent.client`: :func:`listen`, :func:`spawn`, :class:`AgentSpawned`.

When an environment has no agent (no compiler, disabled, or the agent was
killed inside), the node falls back to ``runc exec`` and counts it in its stats.
"""

from weenv.node.runtime.agent.build import AgentBinary, build_agent
from weenv.node.runtime.agent.client import AgentSpawned, AgentUnavailable, listen, spawn

__all__ = ["AgentBinary", "AgentSpawned", "AgentUnavailable", "build_agent", "listen", "spawn"]
