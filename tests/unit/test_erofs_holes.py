"""The EROFS writer's holes: a reader may yield a hole as a count of zero bytes;
the image is the same as if it had yielded the zeros (no mount needed: bytes compared)."""

from __future__ import annotations

import io
import random
import stat

import pytest

from weenv.errors import InvalidInputError
from weenv.packaging.erofs_writer import BLOCK, Inode, new_dir, write_image

UUID = "12345678-1234-5678-1234-567812345678"


def _image(pieces: list[bytes | int]) -> bytes:
    size = sum(p if isinstance(p, int) else len(p) for p in pieces)
    root = new_dir()
    root.children[b"f"] = Inode(mode=stat.S_IFREG | 0o644, size=size, data=lambda: iter(pieces))
    out = io.BytesIO()
    write_image(root, out, uuid=UUID, build_time=1)
    return out.getvalue()


@pytest.mark.parametrize("seed", range(40))
def test_a_hole_as_a_count_writes_the_image_its_zeros_write(seed):
    rng = random.Random(seed)
    pieces: list[bytes | int] = []
    for _ in range(rng.randint(1, 8)):
        n = rng.choice([1, 7, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK, rng.randint(1, 5 * BLOCK)])
        pieces.append(n if rng.random() < 0.5 else bytes(rng.getrandbits(8) | 1 for _ in range(n)))
    zeros = [bytes(p) if isinstance(p, int) else p for p in pieces]
    assert _image(pieces) == _image(zeros)


def test_holes_are_not_stored_and_a_hole_past_the_size_is_refused():
    assert len(_image([b"x", 1 << 30, b"y"])) < 300 * BLOCK  # 1 GiB of holes: a 1 MiB block map, no data blocks
    root = new_dir()
    root.children[b"f"] = Inode(mode=stat.S_IFREG, size=5000, data=lambda: iter([b"abc", 4998]))
    with pytest.raises(InvalidInputError, match="more data than its size"):
        write_image(root, io.BytesIO(), uuid=UUID)
