"""weenv's exceptions: one root, each kind also a matching builtin.

::

    WeenvError
    ├── NotFoundError(LookupError)        unknown template, group, chunk, environment, path
    ├── InvalidInputError(ValueError)     a bad name, digest, directory, manifest or request
    ├── DigestMismatchError(OSError)      bytes whose sha256 is not the digest they were asked by
    ├── MountError(OSError)               mount(2) / umount(2) / FUSE setup failed
    ├── RuntimeFailedError(RuntimeError)  runc (the OCI runtime) failed
    ├── CommandTimeoutError(TimeoutError) a command ran past its timeout and was killed
    ├── ToolMissingError(RuntimeError)    a host program weenv needs is not installed
    └── DaemonError(ConnectionError)      the node daemon is unreachable or answered an error

Backend errors (``OSError`` from syscalls, ``subprocess.CalledProcessError``) are
mapped to these at one boundary each, with ``raise ... from exc``.  Over HTTP the
daemon sends the error *kind* (the class name without ``Error``), never a class path.
"""

from __future__ import annotations


class WeenvError(Exception):
    """Root of every error weenv raises on purpose."""

    kind = "weenv"


class NotFoundError(WeenvError, LookupError):
    kind = "not_found"


class InvalidInputError(WeenvError, ValueError):
    kind = "invalid_input"


class DigestMismatchError(WeenvError, OSError):
    kind = "digest_mismatch"


class MountError(WeenvError, OSError):
    kind = "mount"


class RuntimeFailedError(WeenvError, RuntimeError):
    kind = "runtime"


class CommandTimeoutError(WeenvError, TimeoutError):
    kind = "timeout"


class ToolMissingError(WeenvError, RuntimeError):
    kind = "tool_missing"


class DaemonError(WeenvError, ConnectionError):
    kind = "daemon"


ERROR_KINDS: dict[str, type[WeenvError]] = {
    cls.kind: cls
    for cls in (
        WeenvError,
        NotFoundError,
        InvalidInputError,
        DigestMismatchError,
        MountError,
        RuntimeFailedError,
        CommandTimeoutError,
        ToolMissingError,
        DaemonError,
    )
}
