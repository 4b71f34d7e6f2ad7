"""The streaming import's tree source (:mod:`weenv.packaging.importer.tartree`)
on layer tars written here by GNU tar and Python's tarfile: GNU sparse members
in every format GNU tar writes, holes never read or spooled, the spool freed
as the writer reads it, and tar headers bounded before ``tarfile`` reads them."""

from __future__ import annotations

import io
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

from weenv.errors import InvalidInputError
from weenv.packaging.erofs_writer import write_image
from weenv.packaging.importer import tartree
from weenv.packaging.tarscan import MAX_SPARSE_ENTRIES, TarScan


def _merge(tmp_path: Path, layers: list[bytes]) -> tuple[tartree.TreeMerger, tartree.Spool]:
    spool = tartree.Spool(tmp_path)
    merger = tartree.TreeMerger(tartree.View(), spool)
    for k, data in enumerate(layers):
        scan = TarScan(max_entries=100, max_bytes=1 << 40, what=f"layer {k}", sparse=True, compressed=False)
        scan.feed(data)
        with tarfile.open(fileobj=io.BytesIO(data), mode="r|") as tar:
            merger.apply_layer(tar, f"layer {k}")
    return merger, spool


def _sparse_tar(tmp_path: Path, *fmt: str) -> bytes:
    tree = tmp_path / "tree"
    tree.mkdir(exist_ok=True)
    with open(tree / "sparse", "wb") as f:
        f.truncate(3 << 30)
        f.seek(1 << 20)
        f.write(b"one" * 2000)
        f.seek((3 << 30) - 5)
        f.write(b"tail!")
    return subprocess.run(
        ["tar", "-C", str(tree), "--sparse", *fmt, "-cf", "-", "sparse"], capture_output=True, check=True
    ).stdout


@pytest.mark.parametrize(
    "fmt", [("--format=gnu",), ("--format=posix", "--sparse-version=0.1"), ("--format=posix", "--sparse-version=1.0")]
)
def test_gnu_sparse_members_keep_their_holes(tmp_path, fmt):
    data = _sparse_tar(tmp_path, *fmt)
    assert len(data) < 1 << 20
    merger, spool = _merge(tmp_path, [data])
    node = merger.root.children[b"sparse"]
    assert node.size == 3 << 30
    assert spool.live < 64 << 10  # only the data blocks were spooled
    pieces = list(node.data())
    assert sum(p if isinstance(p, int) else len(p) for p in pieces) == 3 << 30
    content = {}
    pos = 0
    for p in pieces:
        if not isinstance(p, int):
            content[pos] = p
        pos += p if isinstance(p, int) else len(p)
    joined = b"".join(content.values())
    assert b"one" * 2000 in joined and joined.endswith(b"tail!")
    assert spool.live == 0  # each range punched once read
    spool.close()


def test_the_spool_shrinks_as_the_writer_reads(tmp_path):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        for i in range(4):
            data = os.urandom(1 << 20) + bytes(1 << 20)  # half zero blocks: holes, not spooled
            info = tarfile.TarInfo(f"f{i}")
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    merger, spool = _merge(tmp_path, [buf.getvalue()])
    assert spool.live == 4 << 20 and spool.peak == 4 << 20
    with open(tmp_path / "img", "wb") as out:
        write_image(merger.root, out, uuid="6d1b8a52-4f0e-4c55-8a0e-7765656e7601")
    assert spool.live == 0
    assert os.fstat(spool.fd).st_blocks * 512 < 64 << 10
    spool.close()


def test_sparse_maps_and_headers_are_bounded_before_tarfile_reads_them():
    scan = TarScan(max_entries=10, max_bytes=1 << 30, what="layer 3", sparse=True, compressed=False)
    info = tarfile.TarInfo("f")
    info.pax_headers = {"GNU.sparse.major": "1", "GNU.sparse.minor": "0", "GNU.sparse.realsize": "100"}
    info.size = 512
    head = info.tobuf(tarfile.PAX_FORMAT)
    body = (f"{MAX_SPARSE_ENTRIES + 1}\n".encode()).ljust(512, b"\0")
    with pytest.raises(InvalidInputError, match="layer 3 has a GNU sparse map of"):
        scan.feed(head + body)
    scan = TarScan(max_entries=10, max_bytes=1 << 30, what="layer 3")
    with pytest.raises(InvalidInputError, match="sparse"):
        scan.feed(head + body)  # without sparse=True (COPY uploads) refused as before


def test_whiteouts_and_opaque_dirs_within_and_across_layers(tmp_path):
    def tar(*entries) -> bytes:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
            for name, kind in entries:
                info = tarfile.TarInfo(name)
                info.type = kind
                t.addfile(info, io.BytesIO(b"") if kind == tarfile.REGTYPE else None)
        return buf.getvalue()

    view = tartree.View()
    lower = tartree.TreeMerger(view, tartree.Spool(tmp_path))
    with tarfile.open(
        fileobj=io.BytesIO(tar(("d/", tarfile.DIRTYPE), ("d/x", tarfile.REGTYPE), ("f", tarfile.REGTYPE))), mode="r|"
    ) as t:
        lower.apply_layer(t, "layer 0")
    view.apply_group(lower.root)
    upper = tartree.TreeMerger(view, tartree.Spool(tmp_path))
    for data in (
        tar(("d/.wh..wh..opq", tarfile.REGTYPE), ("d/y", tarfile.REGTYPE), (".wh.f", tarfile.REGTYPE)),
        tar(("d/.wh.y", tarfile.REGTYPE), ("f/", tarfile.DIRTYPE)),
    ):
        with tarfile.open(fileobj=io.BytesIO(data), mode="r|") as t:
            upper.apply_layer(t, "layer n")
    root = upper.root
    d = root.children[b"d"]
    assert d.xattrs[tartree.OPAQUE_XATTR] == b"y" and d.children == {}  # y gone, x hidden by the opaque dir
    assert root.children[b"f"].children == {} and root.children[b"f"].xattrs[tartree.OPAQUE_XATTR] == b"y"


def test_read_ahead_gives_the_bytes_in_order_and_its_errors():
    from weenv.packaging.importer.layers import _ReadAhead

    data = os.urandom(5 << 20)
    for sizes in ((1,), (10240,), (1 << 20,), (3 << 20, 7, 1 << 20), (-1,)):
        ahead, out, i = _ReadAhead(io.BytesIO(data)), bytearray(), 0
        while piece := ahead.read(sizes[i % len(sizes)]):
            out += piece
            i += 1
        assert bytes(out) == data
        ahead.close()

    class Broken(io.RawIOBase):
        def read(self, n=-1):
            raise ValueError("broken below")

    ahead = _ReadAhead(Broken())
    with pytest.raises(ValueError, match="broken below"):
        ahead.read(10)
    ahead.close()
    ahead = _ReadAhead(io.BytesIO(data))  # closed before the end: the thread stops
    ahead.read(100)
    ahead.close()


def test_a_layer_streams_into_the_image_in_its_order_without_a_spool(tmp_path):
    """One layer, one group: file data goes straight into the image (a
    ChunkSink: stored as written), in the tar's order, zero blocks as holes, a
    GNU sparse member's holes unread; the files read back from the store are
    the tar's."""
    from weenv.packaging.chunksink import ChunkSink
    from weenv.packaging.erofs_extents import file_extents
    from weenv.packaging.group import publish_sink
    from weenv.packaging.layout import image_reader
    from weenv.store.file import FileStore

    files = {
        "z/last": os.urandom(300_000),
        "a/first": os.urandom(5 << 20) + bytes(1 << 20) + b"end",
        "m/small": b"tiny",
        "m/zeros": bytes(3 << 20),
    }
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    store = FileStore(tmp_path / "store")
    for layer in (buf.getvalue(), _sparse_tar(tmp_path, "--format=posix", "--sparse-version=1.0")):
        with ChunkSink(store, 1 << 20) as sink:
            merger = tartree.TreeMerger(tartree.View(), image=sink)
            with tarfile.open(fileobj=io.BytesIO(layer), mode="r|") as tar:
                merger.apply_layer(tar, "layer 0")
            scan = write_image(
                merger.root, sink, uuid="6d1b8a52-4f0e-4c55-8a0e-7765656e7602", placed_blocks=merger.placed_blocks
            )
            result = publish_sink(sink, store, name="g", file_count=scan.inodes, source={}, ref=False)
        tartree.release(merger.root, image_reader(store, result.manifest, keep=False))
        root = merger.root
        if b"sparse" in root.children:  # its data blocks only, never its 3 GiB of holes
            sparse = root.children[b"sparse"]
            assert (
                sparse.size == 3 << 30 and merger.placed_blocks == 3 and result.manifest.image_size < 4 << 20
            )  # its block map: 3 MiB
            pieces = list(sparse.data())
            assert sum(p if isinstance(p, int) else len(p) for p in pieces) == 3 << 30
            joined = b"".join(p for p in pieces if not isinstance(p, int))
            assert b"one" * 2000 in joined and joined.endswith(b"tail!")
            continue
        # z/last, then a/first (its zero MiB a hole), m/zeros all holes, m/small inline
        assert merger.placed_blocks == -(-300_000 // 4096) + (5 << 20) // 4096 + 1
        extents = file_extents(image_reader(store, result.manifest))
        assert extents["/z/last"] == [(4096, 4096 + 300_000)] and extents["/a/first"] == [
            (307200, 307200 + (5 << 20) + 3)
        ]
        assert extents["/m/zeros"] == extents["/m/small"] == []  # all holes; inline
        for name, data in files.items():
            d, f = (os.fsencode(p) for p in name.split("/"))
            node = root.children[d].children[f]
            got = (
                node.data
                if isinstance(node.data, bytes)
                else b"".join(bytes(p) if isinstance(p, int) else bytes(p) for p in node.data())
            )
            assert got == data, name
