"""Stores: where groups and templates are published.  ``open_store(url)`` picks one."""

from __future__ import annotations

from weenv.errors import InvalidInputError
from weenv.store.base import Store


def open_store(url: str, *, check: bool = True) -> Store:
    """Open the store at ``url``.

    Supported: ``file:///absolute/path`` (or a bare absolute path) and
    ``oci://HOST[:PORT]/REPO[?OPTIONS]`` (an OCI registry, :class:`weenv.store.oci.OciStore`;
    ``oci+http://``/``oci+https://`` force the scheme) and ``s3://BUCKET[/PREFIX][?OPTIONS]``
    (an S3 bucket, :class:`weenv.store.s3.S3Store`; needs ``weenv[s3]``).  Raises :class:`InvalidInputError`
    for other schemes, and what the store raises when it opens
    (:class:`~weenv.errors.StoreUnavailableError` for an unreachable registry).
    ``check=False``: an ``oci://`` or ``s3://`` store sends nothing when it opens;
    its first operation checks the registry or bucket (a node starts while its store is down).
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
    if url.startswith("s3://"):
        from weenv.store.s3 import S3Store

        return S3Store(url, check=check)
    raise InvalidInputError(
        f"unsupported store URL {url!r} (supported: file:///path, oci://host:port/repo, s3://bucket/prefix)"
    )


__all__ = ["Store", "open_store"]
