"""The daemon's API key: one secret per ``WEENV_HOME``, in ``run/api-key``.

The file is created on the daemon's first start (mode 0600, 40 lowercase hex
digits from :func:`secrets.token_hex`) and kept across restarts; delete it and
restart to rotate the key.  Over TCP every weenv API request must carry it, as
``X-API-Key: KEY`` or ``Authorization: Bearer KEY``; the Unix socket is trusted
instead: it is created mode 0600, so only its owner (root, usually) can connect.

The same secret also has the spelling ``e2b_KEY`` (the form E2B clients insist
on); :meth:`ApiKey.matches` accepts both.
"""

from __future__ import annotations

import hmac
import os
import re
import secrets
from pathlib import Path

from weenv.errors import InvalidInputError

_KEY_RE = re.compile(r"^[0-9a-f]{32,128}\Z")
E2B_PREFIX = "e2b_"


class ApiKey:
    """The secret ``value`` (hex) and the file it came from."""

    def __init__(self, value: str, path: Path | None = None):
        self.value = value
        self.path = path

    @classmethod
    def load_or_create(cls, path: Path) -> ApiKey:
        """Read the key at ``path``, or create it (0600) if there is none.
        Raises :class:`InvalidInputError` if the file holds something else."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            value = path.read_text().strip()
            if not _KEY_RE.match(value):
                raise InvalidInputError(
                    f"{path} does not hold an API key (want hex digits); delete it to make one"
                ) from None
            return cls(value, path)
        value = secrets.token_hex(20)
        with os.fdopen(fd, "w") as f:
            f.write(value + "\n")
        return cls(value, path)

    def matches(self, presented: str | None) -> bool:
        """Whether ``presented`` is this key (or ``e2b_`` + it), in constant time."""
        if not presented:
            return False
        if presented.startswith(E2B_PREFIX):
            presented = presented[len(E2B_PREFIX) :]
        return hmac.compare_digest(presented.encode(), self.value.encode())

    @property
    def e2b(self) -> str:
        """The key as E2B clients want it (``E2B_API_KEY``)."""
        return E2B_PREFIX + self.value


def presented_key(headers) -> str | None:
    """The key a request carries: ``X-API-Key``, else ``Authorization: Bearer``."""
    key = headers.get("x-api-key")
    if key:
        return key.strip()
    scheme, _, token = (headers.get("authorization") or "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return None
