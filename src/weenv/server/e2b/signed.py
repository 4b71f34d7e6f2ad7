"""Signed file URLs: E2B's ``download_url`` / ``upload_url`` of a secured sandbox.

The SDK (``e2b/sandbox/signature.py``, v1) signs a ``/files`` URL with the
sandbox's envd access token and sends no header when the URL is fetched::

    signature = "v1_" + base64(sha256(f"{path}:{operation}:{user}:{token}"
                                      [+ f":{expiration}"])), "=" padding stripped

``operation`` is ``read`` (GET) or ``write`` (POST), ``user`` the URL's
``username`` ("" for the template's user), ``expiration`` the Unix second in
the URL's ``signature_expiration`` (none: the URL does not expire).  The URL
names its sandbox only through its host (``PORT-ID.domain``); through one
address for every sandbox (``E2B_SANDBOX_URL``, weenv's envd face) it names
none, so the signature is checked against each running sandbox's token (one
sha256 each: ~1 µs) and the one it matches is the sandbox.  A 256-bit
signature cannot match a sandbox whose token its maker did not hold, so this
tells nothing of which sandboxes exist.

As envd (``validateSigning``), the signature is checked before its expiry: a
URL no token signed is 401 "invalid signature", a signed one whose time has
passed is 401 "signature is already expired" (the words E2B's SDK tests read).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
from collections.abc import Callable, Iterable

from weenv.errors import InvalidInputError

PREFIX = "v1_"
MAX_SIGNATURE_CHARS = 64
"""A v1 signature is 46 characters; longer ones are refused before any hashing."""
MAX_CANDIDATES = 100_000
"""At most this many sandboxes' tokens are tried for one URL that names none."""


class SignatureError(InvalidInputError):
    """A signed URL that is malformed, expired or signed by no sandbox's token."""


def signature(path: str, operation: str, user: str, token: str, expiration: int | None) -> str:
    """The v1 signature of a ``/files`` URL (see the module docstring)."""
    raw = f"{path}:{operation}:{user}:{token}" + ("" if expiration is None else f":{expiration}")
    digest = hashlib.sha256(raw.encode("utf-8", errors="surrogateescape")).digest()
    return PREFIX + base64.b64encode(digest).rstrip(b"=").decode("ascii")


def expiration_of(value: str | None) -> int | None:
    """The URL's ``signature_expiration`` as a Unix second (None: none given).
    Raises :class:`SignatureError` when it is not an integer (whether it has
    passed is :func:`signer`'s to say, after the signature)."""
    if value is None or value == "":
        return None
    if len(value) > 20 or not value.lstrip("-").isdigit():
        raise SignatureError(f"signature_expiration must be a Unix time in seconds, not {value[:20]!r}")
    return int(value)


def signer(
    presented: str,
    path: str,
    operation: str,
    user: str,
    expiration: int | None,
    candidates: Iterable[str],
    token_of: Callable[[str], str],
    now: float | None = None,
) -> str:
    """The sandbox among ``candidates`` (ids) whose token signed ``presented``
    for this path, operation, user and expiration.  Raises :class:`SignatureError`
    for a malformed signature, one no candidate's token made ("invalid
    signature") and, after that, one whose expiration is before ``now``
    (default: the time now; "signature is already expired")."""
    if len(presented) > MAX_SIGNATURE_CHARS or not presented.startswith(PREFIX):
        raise SignatureError("a signature is 'v1_' and 43 base64 characters")
    given = presented.encode("ascii", errors="replace")
    found = None
    for n, sandbox_id in enumerate(candidates):
        if n >= MAX_CANDIDATES:
            break
        wanted = signature(path, operation, user, token_of(sandbox_id), expiration).encode()
        if hmac.compare_digest(given, wanted):
            found = sandbox_id  # no early return: the time does not say where it matched
    if found is None:
        raise SignatureError("invalid signature")
    if expiration is not None and expiration < (time.time() if now is None else now):
        raise SignatureError("signature is already expired")
    return found
