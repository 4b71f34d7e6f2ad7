"""Startup files together (issue 18): the writer puts the files it is given
first, contiguous, in that order, and the extents read back from the image's
bytes (the kernel's on-disk format) say where every file's data lies."""

from __future__ import annotations

import io
import stat

from weenv.packaging.erofs_extents import file_extents, files_in_chunks
from weenv.packaging.erofs_writer import BLOCK, Inode, new_dir, write_image


def _tree() -> Inode:
    root = new_dir()
    a, b = new_dir(), new_dir()
    root.children = {b"a": a, b"b": b}
    for i in range(6):
        data = bytes([i + 1]) * (3 * BLOCK + 100 * i)
        node = Inode(mode=stat.S_IFREG | 0o644, size=len(data), data=data)
        (a if i % 2 else b).children[f"f{i}".encode()] = node
    a.children[b"small"] = Inode(mode=stat.S_IFREG | 0o644, size=5, data=b"tiny\n")  # inline: no extent
    link = Inode(mode=stat.S_IFLNK | 0o777, data=b"../a/f1")
    b.children[b"link"] = link
    hole = Inode(mode=stat.S_IFREG | 0o644, size=3 * BLOCK, data=lambda: iter([BLOCK, b"x" * BLOCK, BLOCK]))
    root.children[b"sparse"] = hole
    return root


def _image(first=()) -> bytes:
    out = io.BytesIO()
    write_image(_tree(), out, uuid="3a5e0f3c-6b2d-5c1e-9f47-7765656e7601", first=first)
    return out.getvalue()


def _reader(img: bytes):
    return lambda off, n: img[off : off + n]


def test_extents_read_back_where_the_writer_put_each_file():
    img = _image()
    ext = file_extents(_reader(img))
    assert set(ext) == {f"/{'a' if i % 2 else 'b'}/f{i}" for i in range(6)} | {"/sparse", "/a/small"}
    assert ext.pop("/a/small") == []  # inline: in the metadata, no data extent
    for path, runs in ext.items():
        data = b"".join(img[s:e] for s, e in runs)
        if path == "/sparse":
            assert data == b"x" * BLOCK and len(runs) == 1  # the holes are no extents
        else:
            i = int(path[-1])
            assert data == bytes([i + 1]) * (3 * BLOCK + 100 * i)


def test_first_files_are_contiguous_in_the_order_given_and_the_tree_is_the_same():
    order = ["/b/f4", "/a/f1", "/missing", "/b/f0"]
    before, after = _image(), _image(order)
    assert before != after
    ext = file_extents(_reader(after))
    runs = [ext[p] for p in ("/b/f4", "/a/f1", "/b/f0")]
    assert all(len(r) == 1 for r in runs)
    assert runs[0][0][0] == BLOCK  # right after the superblock's block
    for prev, nxt in zip(runs, runs[1:]):
        assert nxt[0][0] == -(-prev[0][1] // BLOCK) * BLOCK  # the next block after it
    old = file_extents(_reader(before))
    assert set(old) == set(ext)
    for p in old:  # same content at the new places
        assert b"".join(before[s:e] for s, e in old[p]) == b"".join(after[s:e] for s, e in ext[p])
    assert len(after) == len(before)


def test_files_in_chunks_follow_the_chunk_order_then_offsets():
    ext = {"/x": [(0, 10)], "/y": [(10, 5000)], "/z": [(8192, 9000)], "/w": [(20000, 30000)]}
    assert files_in_chunks(ext, [2, 0], 4096) == ["/z", "/x", "/y"]
    assert files_in_chunks(ext, [7], 4096) == ["/w"]
    assert files_in_chunks(ext, [99], 4096) == []


def test_files_in_ranges_follow_the_reads():
    from weenv.packaging.erofs_extents import files_in_ranges

    ext = {"/x": [(0, 10)], "/y": [(10, 5000)], "/z": [(8192, 9000)], "/w": [(20000, 30000)]}
    assert files_in_ranges(ext, [(8500, 100), (0, 4096)]) == ["/z", "/x", "/y"]
    assert files_in_ranges(ext, [(25000, 1), (9000, 11000)]) == ["/w"]
