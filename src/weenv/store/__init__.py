"""Stores: where groups and templates are published.  ``open_store(url)`` picks one."""

from __future__ import annotations

from weenv.errors import InvalidInputError
from weenv.store.base import Store


def open_store(url: str) -> Store:
    """Open the store at ``url``.

    Supported: ``file:///absolute/path`` (or a bare absolute path).
    Raises :class:`InvalidInputError` for other schemes.
    """
    if url.startswith("file://"):
        from weenv.store.file import FileStore

        return FileStore(url[len("file://") :])
    if url.startswith("/"):
        from weenv.store.file import FileStore

        return FileStore(url)
    raise InvalidInputError(f"unsupported store URL {url!r} (supported: file:///path)")


__all__ = ["Store", "open_store"]
