"""weenv's exceptions: one root, each kind also a matching builtin.

::

    WeenvError
    ├── NotFoundError(LookupError)        unknown template, group, chunk, environment, path
    │   └── LostError                     an environment whose cluster node is gone (weenv.cluster)
    ├── InvalidInputError(ValueError)     a bad name, digest, directory, manifest or request
    │   ├── UnknownUserError              a user the environment's /etc/passwd does not name
    │   └── PseudoFileError               a file of a kernel pseudo file system (procfs, sysfs...),
    │                                     which the host side does not read or write
    ├── DigestMismatchError(OSError)      bytes whose sha256 is not the digest they were asked by
    │   └── ContentLimitError             store content past a read limit (:mod:`weenv.formats.limits`)
    ├── MountError(OSError)               mount(2) / umount(2) / FUSE setup failed
    ├── RuntimeFailedError(RuntimeError)  runc (the OCI runtime) failed
    │   └── BrokenError                   something outside failed under a right call (HTTP 502)
    ├── CommandTimeoutError(TimeoutError) a command ran past its timeout and was killed
    ├── ToolMissingError(RuntimeError)    a host program (or an optional part) weenv needs is not installed
    ├── StoreUnavailableError(OSError)    a store is unreachable, timed out, failed or refused (a remote
    │                                     one), or cannot be written or read (a local one: full, read-only)
    ├── DaemonError(ConnectionError)      the node daemon is unreachable or answered an error
    ├── AuthenticationError(PermissionError)  no API key, or a wrong one (HTTP 401)
    ├── NetworkForbiddenError(PermissionError)  network asked of a node whose policy forbids it (HTTP 403)
    ├── CapacityError(RuntimeError)       the node runs as many environments as it may (HTTP 503)
    ├── ClosedError(RuntimeError)         the node (or the object) was closed, or is not started (HTTP 503)
    ├── BusyError(RuntimeError)           concurrent misuse: the thing is held by another user (HTTP 409)
    ├── StateError(RuntimeError)          the environment is not in the state the call needs (paused, not
    │                                     paused) (HTTP 409)
    ├── CgroupError(OSError)              a cgroup file could not be read or written
    │   └── LimitRefusedError             the kernel refused to lower a memory limit (EBUSY)
    ├── DiskFullError(OSError)            a write reached the environment's disk limit (HTTP 507)
    ├── OutputLimitError(ValueError)      a captured command's output passed the limit; it was killed (HTTP 413)
    └── RequestTooLargeError(ValueError)  a request body passed the daemon's limit (HTTP 413)

Closed, busy and broken are trio's distinction (``trio.ClosedResourceError``,
``BusyResourceError``, ``BrokenResourceError``): you closed it; someone else
holds it; something outside failed.  A client can tell them from its own bad
input (``invalid_input``, 400): retry elsewhere, wait, or report.

Backend errors (``OSError`` from syscalls, ``subprocess.CalledProcessError``) are
mapped to these at one boundary each, with ``raise ... from exc``.  Over HTTP the
daemon sends the error *kind* (the class name without ``Error``), never a class path.
"""

from __future__ import annotations

import errno
import os


class WeenvError(Exception):
    """Root of every error weenv raises on purpose."""

    kind = "weenv"


class NotFoundError(WeenvError, LookupError):
    kind = "not_found"


class LostError(NotFoundError):
    """An environment of a cluster whose node went (died, or fell silent): it is
    reported lost, not silently forgotten."""

    kind = "lost"


class InvalidInputError(WeenvError, ValueError):
    kind = "invalid_input"


class UnknownUserError(InvalidInputError):
    """A command or file call named a user the environment does not have (HTTP 400)."""

    kind = "unknown_user"


class PseudoFileError(InvalidInputError):
    """A file call reached a file of a kernel pseudo file system (procfs,
    sysfs, cgroupfs...) inside an environment: the host side, which holds
    every capability, neither reads nor writes it (HTTP 400).  ``fs``: the
    file system's kind."""

    kind = "pseudo_file"

    def __init__(self, message: str, fs: str = ""):
        super().__init__(message)
        self.fs = fs


class DigestMismatchError(WeenvError, OSError):
    kind = "digest_mismatch"


class ContentLimitError(DigestMismatchError):
    """Content a store holds under a digest is larger than weenv reads
    (:mod:`weenv.formats.limits`): a chunk's frame or plaintext, a manifest,
    a ref, a pack.  Refused before it is read whole; no weenv build writes such
    content, so it is a kind of bad content (HTTP 502)."""

    kind = "content_limit"


class MountError(WeenvError, OSError):
    kind = "mount"


class RuntimeFailedError(WeenvError, RuntimeError):
    kind = "runtime"


class CommandTimeoutError(WeenvError, TimeoutError):
    kind = "timeout"


class ToolMissingError(WeenvError, RuntimeError):
    kind = "tool_missing"


class StoreUnavailableError(WeenvError, OSError):
    """A store cannot serve a request.  A remote one (an OCI registry):
    unreachable, timed out, failing (5xx) after retries, or refusing it
    (authentication, deletes disabled), raised within the store's configured
    timeout, never a hang.  A local one (a directory): a system call failed
    (full or read-only file system, no permission); ``errno`` is kept."""

    kind = "store_unavailable"


class DaemonError(WeenvError, ConnectionError):
    kind = "daemon"


class AuthenticationError(WeenvError, PermissionError):
    kind = "authentication"


class NetworkForbiddenError(WeenvError, PermissionError):
    """A create asked for network on a node whose policy (``WEENV_NETWORK=off``) forbids it."""

    kind = "network_forbidden"


class CapacityError(WeenvError, RuntimeError):
    kind = "capacity"


class ClosedError(WeenvError, RuntimeError):
    """The node was closed (or is closing), or never started: nothing is wrong
    with the request; send it to a node that runs (HTTP 503)."""

    kind = "closed"


class BusyError(WeenvError, RuntimeError):
    """Concurrent misuse: what the call needs is held by another user (a home
    served by another node, for one) (HTTP 409)."""

    kind = "busy"


class StateError(WeenvError, RuntimeError):
    """The environment is not in the state the call needs: a command or a fork
    of a paused one, a resume of one that is not paused (HTTP 409)."""

    kind = "state"


class BrokenError(RuntimeFailedError):
    """Something outside weenv failed under a call that was right (an exec
    agent killed from inside, for one); the cause is attached (HTTP 502).  A
    kind of runtime failure: the environment's runtime broke under the call."""

    kind = "broken"


class CgroupError(WeenvError, OSError):
    """A cgroup file could not be read or written (cause attached)."""

    kind = "cgroup"


class LimitRefusedError(CgroupError):
    """The kernel refused to lower a memory limit (``EBUSY``: usage cannot be
    reclaimed below it).  The limit is unchanged."""

    kind = "limit_refused"


class DiskFullError(WeenvError, OSError):
    """A write into an environment reached its disk limit (``EDQUOT``) or the
    node's disk is full (``ENOSPC``); ``errno`` is kept."""

    kind = "disk_full"


FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
"""What a write that found no room raises (the node's disk full, a quota reached)."""


def disk_full(who: str, doing: str, exc: OSError) -> DiskFullError:
    """:class:`DiskFullError` for ``exc`` (an ``ENOSPC`` or ``EDQUOT`` of
    ``doing``; ``who``: ``"environment ID"``, or what was being made), its errno kept."""
    why = "no space left on the node's disk" if exc.errno == errno.ENOSPC else "no space left under the disk quota"
    return DiskFullError(exc.errno, f"{who}: {doing}: {why} ({os.strerror(exc.errno)})")


class OutputLimitError(WeenvError, ValueError):
    kind = "output_limit"


class RequestTooLargeError(WeenvError, ValueError):
    kind = "too_large"


class SetupError(WeenvError, RuntimeError):
    """A task's setup failed or did not finish in its time (the SDK's
    :mod:`weenv.sdk.groups`): the message holds the command and its output;
    nothing of the setup is left."""

    kind = "setup"


ERROR_KINDS: dict[str, type[WeenvError]] = {
    cls.kind: cls
    for cls in (
        WeenvError,
        NotFoundError,
        LostError,
        InvalidInputError,
        UnknownUserError,
        PseudoFileError,
        NetworkForbiddenError,
        DigestMismatchError,
        ContentLimitError,
        MountError,
        RuntimeFailedError,
        CommandTimeoutError,
        ToolMissingError,
        StoreUnavailableError,
        DaemonError,
        AuthenticationError,
        CapacityError,
        ClosedError,
        BusyError,
        StateError,
        BrokenError,
        CgroupError,
        LimitRefusedError,
        DiskFullError,
        OutputLimitError,
        RequestTooLargeError,
        SetupError,
    )
}
