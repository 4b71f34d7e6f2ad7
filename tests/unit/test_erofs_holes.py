"""The EROFS writer's layouts and holes (no mount needed: images parsed as bytes).

A regular file without holes is one contiguous run of blocks (``FLAT_PLAIN``:
the kernel finds its blocks without a block map, so a page fault never needs
a metadata read; issue 18's SIGBUS).  Only a source's holes (a reader yields
them as counts of zero bytes) become holes; zero blocks in its data are data.
"""

from __future__ import annotations

import io
import random
import stat
import struct

import pytest

from weenv.errors import InvalidInputError
from weenv.packaging.erofs_writer import BLOCK, NULL_ADDR, Inode, new_dir, write_image

UUID = "12345678-1234-5678-1234-567812345678"
FLAT_PLAIN, CHUNK_BASED = 0, 4


def _image(pieces: list[bytes | int]) -> bytes:
    size = sum(p if isinstance(p, int) else len(p) for p in pieces)
    root = new_dir()
    root.children[b"f"] = Inode(mode=stat.S_IFREG | 0o644, size=size, data=lambda: iter(pieces))
    out = io.BytesIO()
    write_image(root, out, uuid=UUID, build_time=1)
    return out.getvalue()


def _file_inode(image: bytes) -> tuple[int, int, int, list[int]]:
    """(layout, size, i_u, block map) of the root's one entry ``f``, read from the on-disk format."""
    meta = struct.unpack_from("<I", image, 1024 + 40)[0] * BLOCK  # meta_blkaddr
    root_blk = struct.unpack_from("<I", image, meta + 16)[0]  # FLAT_INLINE root: its dirents are inline
    assert root_blk == 0
    dirents = meta + 64
    nids = [struct.unpack_from("<QHBB", image, dirents + 12 * i) for i in range(3)]
    nid = next(n for n, _off, ftype, _ in nids if ftype == 1)
    at = meta + 32 * nid
    fmt, icount, _mode, _, size, i_u = struct.unpack_from("<HHHHQI", image, at)
    assert icount == 0
    layout = (fmt >> 1) & 7
    nblocks = -(-size // BLOCK)
    bmap = list(struct.unpack_from(f"<{nblocks}I", image, at + 64)) if layout == CHUNK_BASED else []
    return layout, size, i_u, bmap


@pytest.mark.parametrize("seed", range(40))
def test_holes_are_holes_and_the_rest_is_stored_as_given(seed):
    rng = random.Random(seed)
    pieces: list[bytes | int] = []
    for _ in range(rng.randint(1, 8)):
        n = rng.choice([1, 7, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK, rng.randint(1, 5 * BLOCK)])
        kind = rng.random()
        pieces.append(n if kind < 0.4 else bytes(n) if kind < 0.6 else rng.randbytes(n))
    content = b"".join(bytes(p) if isinstance(p, int) else p for p in pieces)
    if len(content) <= 2048:
        pieces.append(BLOCK)  # not an inline file
        content += bytes(BLOCK)
    image = _image(pieces)
    layout, size, i_u, bmap = _file_inode(image)
    assert size == len(content)
    # blocks wholly inside a yielded hole are holes; every other block is stored
    hole = bytearray(len(content))
    at = 0
    for p in pieces:
        n = p if isinstance(p, int) else len(p)
        if isinstance(p, int):
            hole[at : at + n] = b"\1" * n
        at += n
    holes = [all(hole[i : i + BLOCK]) for i in range(0, len(content), BLOCK)]
    if not any(holes):
        assert layout == FLAT_PLAIN
        read = image[i_u * BLOCK : i_u * BLOCK + size]
    else:
        assert layout == CHUNK_BASED and [b == NULL_ADDR for b in bmap] == holes
        read = b"".join(bytes(BLOCK) if b == NULL_ADDR else image[b * BLOCK : (b + 1) * BLOCK] for b in bmap)[:size]
    assert read == content


def test_a_file_of_zeros_without_holes_is_stored_plain():
    layout, size, i_u, _ = _file_inode(_image([bytes(3 * BLOCK + 5)]))
    assert (layout, size) == (FLAT_PLAIN, 3 * BLOCK + 5) and i_u > 0


def test_holes_are_not_stored_and_a_hole_past_the_size_is_refused():
    assert len(_image([b"x", 1 << 30, b"y"])) < 300 * BLOCK  # 1 GiB of holes: a 1 MiB block map, no data blocks
    root = new_dir()
    root.children[b"f"] = Inode(mode=stat.S_IFREG, size=5000, data=lambda: iter([b"abc", 4998]))
    with pytest.raises(InvalidInputError, match="more data than its size"):
        write_image(root, io.BytesIO(), uuid=UUID)
