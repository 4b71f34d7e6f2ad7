"""Inputs the fuzz tests (``test_fuzz_*.py``) found raising something other
than weenv's own errors, each kept as a plain example: it must be refused with
a :class:`~weenv.errors.WeenvError` saying what is wrong."""

from __future__ import annotations

import json

import pytest

from weenv.errors import InvalidInputError
from weenv.formats.manifest import parse_group_manifest


@pytest.mark.parametrize("version", [[1], {"v": 2}, [None, None]])
def test_a_group_manifest_whose_schema_version_is_a_list_or_object_is_invalid_input(version):
    doc = {"schema_version": version, "name": "g", "image_size": 0, "chunk_size": 4096, "chunks": [],
           "file_count": 1}
    with pytest.raises(InvalidInputError, match="has schema version"):
        parse_group_manifest(json.dumps(doc).encode())
