"""A gzipped E2B upload is inflated in bounded pieces (issue 13, #9):
:func:`weenv.server.e2b.envd.inflated` never makes more than its piece at once."""

from __future__ import annotations

import zlib

import pytest

from weenv.errors import InvalidInputError
from weenv.server.e2b.envd import inflated


def test_a_gzip_bomb_inflates_in_pieces_of_at_most_the_limit():
    deflate = zlib.compressobj(9, zlib.DEFLATED, 31)
    bomb = deflate.compress(bytes(64 << 20)) + deflate.flush()
    inflate = zlib.decompressobj(wbits=31)
    total = 0
    for i in range(0, len(bomb), 65536):  # as the request's chunks come
        for piece in inflated(inflate, bomb[i : i + 65536], 1 << 20):
            assert len(piece) <= 1 << 20
            assert piece.count(0) == len(piece)
            total += len(piece)
    assert total == 64 << 20 and inflate.eof


def test_pieces_join_to_the_original_bytes():
    data = bytes(range(256)) * 40000 + b"tail"
    gz = zlib.compress(data, wbits=31)
    inflate = zlib.decompressobj(wbits=31)
    out = b"".join(p for i in range(0, len(gz), 1000) for p in inflated(inflate, gz[i : i + 1000], 4096))
    assert out == data


def test_bytes_that_are_not_gzip_are_invalid_input():
    with pytest.raises(InvalidInputError, match="bad gzip body"):
        list(inflated(zlib.decompressobj(wbits=31), b"not gzip at all"))
