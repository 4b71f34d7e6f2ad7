"""Stores: where groups and templates are published.  ``open_store(url)`` picks one."""

from __future__ import annotations

from weenv.errors import InvalidInputError
from weenv.store.base import Store


def open_store(url: str, *, check: bool = True) -> Store:
    """Open the store at ``url``.

    Supported: ``file:///absolute/path`` (or a bare absolute path) and
    ``oci://HOST[:PORT]/REPO[?OPTIONS]`` (an OCI registry, :class:`weenv.store.oci.OciStore`;
    ``oci+http://``/``oci+https://`` force the scheme).  Raises :class:`InvalidInputError`
    for other schemes, and what the store raises when it opens
    (:class:`~weenv.errors.StoreUnavailableError` for an unreachable registry).
    ``check=False``: an ``oci://`` store sends nothing when it opens; its first
    operation checks the registry (a node starts while its registry is down).
    """
    if url.startswith("file://"):
        from weenv.store.file import FileStore

        return FileStore(url[len("file://") :])
    if url.startswith("/"):
        from weenv.store.file import FileStore

        return FileStore(url)
    if url.startswith(("oci://", "oci+http://", "oci+https://")):
        from weenv.store.oci import OciStore

        return OciStore(url, check=check)
    raise InvalidInputError(f"unsupported store URL {url!r} (supported: file:///path, oci://host:port/repo)")


__all__ = ["Store", "open_store"]
