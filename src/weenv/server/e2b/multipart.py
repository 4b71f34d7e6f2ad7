"""envd's multipart uploads (``POST /files``, ``multipart/form-data``), streamed
into the sandbox part by part.

Starlette's form parser keeps every file part in a ``SpooledTemporaryFile``
until the whole body is in: up to 1 MiB of each part in the daemon's memory
(10,000 parts of 1 MiB: 10 GB), larger ones in the host's temporary directory,
outside every disk limit.  :func:`write_parts` writes each ``file`` part's
bytes to its target as they arrive instead, so an upload holds one chunk of the
request in memory and writes only to the sandbox's own disk, where its limit
applies.

Parts are read as E2B's SDK sends them: a part named ``file`` with a
``filename`` is a file (its file name is its path when the request's ``path``
is absent); other parts are read and dropped.  Parts are written in order: a
bad part (a second file with one ``path``, a file without a path, a path the
sandbox refuses) fails the upload after the parts before it were written.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, Callable
from typing import BinaryIO

import anyio.to_thread
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, MultipartState, parse_options_header

from weenv.errors import InvalidInputError

MAX_BOUNDARY = 256
"""Longest multipart boundary taken, bytes (RFC 2046 allows 70; python-multipart's parser refuses past 256)."""
OpenTarget = Callable[[str], tuple[BinaryIO, dict[str, str]]]
"""Opens a file part's target path for writing: ``(file, answer entry)``."""


class _Parts:
    """python-multipart callbacks writing each file part to ``open_target(path)``."""

    def __init__(self, open_target: OpenTarget, path: str | None):
        self.open_target = open_target
        self.path = path
        self.entries: list[dict[str, str]] = []
        self.current: BinaryIO | None = None
        self._headers: dict[bytes, bytes] = {}
        self._field = self._value = b""

    def callbacks(self) -> dict:
        return {
            "on_part_begin": self.on_part_begin,
            "on_header_field": self.on_header_field,
            "on_header_value": self.on_header_value,
            "on_header_end": self.on_header_end,
            "on_headers_finished": self.on_headers_finished,
            "on_part_data": self.on_part_data,
            "on_part_end": self.on_part_end,
        }

    def on_part_begin(self) -> None:
        self._headers = {}

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._field += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._value += data[start:end]

    def on_header_end(self) -> None:
        self._headers[self._field.lower()] = self._value
        self._field = self._value = b""

    def on_headers_finished(self) -> None:
        _disposition, options = parse_options_header(self._headers.get(b"content-disposition", b""))
        if options.get(b"name") != b"file" or b"filename" not in options:
            return  # not a file: its bytes are dropped
        if self.path and self.entries:
            raise InvalidInputError("several files with one path")
        target = self.path or _decode(options[b"filename"])
        if not target:
            raise InvalidInputError("a file part without a path (file name)")
        self.current, entry = self.open_target(target)
        self.entries.append(entry)

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        if self.current is not None:
            self.current.write(data[start:end])

    def on_part_end(self) -> None:
        self.close()

    def close(self) -> None:
        if self.current is not None:
            current, self.current = self.current, None
            current.close()


async def write_parts(
    content_type: str, body: AsyncIterable[bytes], open_target: OpenTarget, path: str | None
) -> list[dict[str, str]]:
    """Write the file parts of the multipart ``body`` (with header
    ``content_type``) through ``open_target``, each to ``path`` or else to its
    file name; the entries ``open_target`` gave, in order.  Raises
    :class:`InvalidInputError` for a body that is not multipart, holds no file
    part or is cut short (what was written stays), and what ``open_target`` or a
    write raises."""
    _ctype, options = parse_options_header(content_type)
    boundary = options.get(b"boundary")
    if not boundary:
        raise InvalidInputError("a multipart upload without a boundary")
    if len(boundary) > MAX_BOUNDARY:
        raise InvalidInputError(f"a multipart boundary of {len(boundary)} bytes (at most {MAX_BOUNDARY} are taken)")
    parts = _Parts(open_target, path)
    try:
        parser = MultipartParser(boundary, parts.callbacks())
        async for chunk in body:
            await anyio.to_thread.run_sync(parser.write, chunk)
        parser.finalize()
        if parser.state not in (MultipartState.END, MultipartState.BOUNDARY_PADDING):
            raise InvalidInputError("the upload ended before its closing boundary")
    except FormParserError as exc:
        raise InvalidInputError(f"bad multipart body: {exc}") from exc
    finally:
        await anyio.to_thread.run_sync(parts.close)
    if not parts.entries:
        raise InvalidInputError("no 'file' part in the upload")
    return parts.entries


def _decode(name: bytes) -> str:
    """A part's file name as starlette reads it: UTF-8, else Latin-1."""
    try:
        return name.decode("utf-8")
    except UnicodeDecodeError:
        return name.decode("latin-1")
