"""Inputs the fuzz tests (``test_fuzz_*.py``) found raising something other
than weenv's own errors, each kept as a plain example: it must be refused with
a :class:`~weenv.errors.WeenvError` saying what is wrong."""

from __future__ import annotations

import asyncio
import io
import json

import pytest

from weenv.errors import InvalidInputError
from weenv.formats.manifest import parse_group_manifest
from weenv.server.e2b.multipart import write_parts


@pytest.mark.parametrize("version", [[1], {"v": 2}, [None, None]])
def test_a_group_manifest_whose_schema_version_is_a_list_or_object_is_invalid_input(version):
    doc = {"schema_version": version, "name": "g", "image_size": 0, "chunk_size": 4096, "chunks": [],
           "file_count": 1}
    with pytest.raises(InvalidInputError, match="has schema version"):
        parse_group_manifest(json.dumps(doc).encode())


def test_a_multipart_upload_with_a_boundary_past_256_bytes_is_invalid_input():
    boundary = "b" * 257
    body = f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"f\"\r\n\r\nx\r\n--{boundary}--\r\n"

    async def chunks():
        yield body.encode()

    opened = []
    with pytest.raises(InvalidInputError, match="boundary of 257 bytes"):
        asyncio.run(write_parts(f"multipart/form-data; boundary={boundary}", chunks(),
                                lambda p: opened.append(p) or (io.BytesIO(), {"path": p}), None))  # fmt: skip
    assert opened == []
