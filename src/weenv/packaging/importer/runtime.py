"""An image config's ``config`` object (image-spec v1.0 ``config.md``) as a
template's :class:`RuntimeConfig`.

How Docker's run semantics map to weenv's (an environment's first process must
keep running; commands are exec'd beside it):

- ``Entrypoint`` + ``Cmd`` -> ``default_command`` (what ``docker run IMAGE``
  would run); the first process stays ``sleep infinity``, which the node
  runs as its own exec agent (:data:`weenv.node.runtime.bundle.HOLD_COMMAND`), so
  images without ``sleep`` start.
- ``Env`` (``KEY=VALUE`` list) -> ``env``; like Docker, ``PATH`` gets Docker's
  default and ``HOME`` the user's home from the image's ``/etc/passwd`` (or
  ``/``) when the image sets neither.
- ``WorkingDir`` -> ``working_dir`` (``/`` when empty; made absolute).
- ``User`` (``user``, ``uid``, ``user:group``, ``uid:gid``...) -> numeric
  ``UID:GID``, names looked up in the image's ``/etc/passwd`` and
  ``/etc/group``; a user without a group gets its passwd group (or 0), as in
  Docker.  Supplementary groups are not kept (RuntimeConfig has none).
- ``ExposedPorts``, ``Volumes``, ``Labels``, ``StopSignal``, ``Healthcheck``: not kept.
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable
from typing import Any

from weenv.errors import InvalidInputError
from weenv.formats.manifest import RuntimeConfig

DOCKER_DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
ReadFile = Callable[[str], "bytes | None"]
"""Reads a file of the image by absolute path; ``None`` if it has none."""


def runtime_from_config(config: dict[str, Any], read_file: ReadFile) -> RuntimeConfig:
    """The :class:`RuntimeConfig` for image config ``config`` (the whole config
    JSON); ``read_file`` reads ``/etc/passwd`` and ``/etc/group`` of the image.
    Raises :class:`InvalidInputError` for malformed fields or an unknown user."""
    c = config.get("config") or {}
    if not isinstance(c, dict):
        raise InvalidInputError("image config: 'config' is not an object")
    env: dict[str, str] = {}
    for item in _str_list(c.get("Env"), "Env"):
        key, _, value = item.partition("=")
        if not key:
            raise InvalidInputError(f"image config: bad Env entry {item!r}")
        env[key] = value
    uid, gid, home = resolve_user(str(c.get("User") or ""), read_file)
    env.setdefault("PATH", DOCKER_DEFAULT_PATH)
    env.setdefault("HOME", home)
    workdir = str(c.get("WorkingDir") or "/")
    workdir = posixpath.normpath(posixpath.join("/", workdir))
    command = _str_list(c.get("Entrypoint"), "Entrypoint") + _str_list(c.get("Cmd"), "Cmd")
    return RuntimeConfig(env=env, working_dir=workdir, user=f"{uid}:{gid}", default_command=command or None)


def _str_list(value: Any, field: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise InvalidInputError(f"image config: {field} is not a list of strings")
    return list(value)


def _table(data: bytes | None) -> list[list[str]]:
    if not data:
        return []
    return [line.split(":") for line in data.decode(errors="replace").splitlines() if line and not line.startswith("#")]


def resolve_user(user: str, read_file: ReadFile) -> tuple[int, int, str]:
    """``(uid, gid, home)`` for an image's ``User`` string (see the module doc).
    Raises :class:`InvalidInputError` for a name the image does not define."""
    name, _, group = user.partition(":")
    passwd = [row for row in _table(read_file("/etc/passwd")) if len(row) >= 6]
    if not name:
        name = "0"
    if name.isdigit():
        uid = int(name)
        entry = next((r for r in passwd if r[2] == name), None)
    else:
        entry = next((r for r in passwd if r[0] == name), None)
        if entry is None:
            raise InvalidInputError(f"image user {name!r} is not in the image's /etc/passwd")
        uid = int(entry[2])
    home = entry[5] if entry is not None and entry[5] else "/"
    if not group:
        gid = int(entry[3]) if entry is not None and entry[3].isdigit() else 0
    elif group.isdigit():
        gid = int(group)
    else:
        groups = [row for row in _table(read_file("/etc/group")) if len(row) >= 3]
        g = next((r for r in groups if r[0] == group), None)
        if g is None or not g[2].isdigit():
            raise InvalidInputError(f"image group {group!r} is not in the image's /etc/group")
        gid = int(g[2])
    return uid, gid, home
