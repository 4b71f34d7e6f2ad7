"""Fuzzed tars: the upload and layer tar scanner and the layer reader raise
only weenv's own errors on any bytes (no ``IndexError``, ``struct.error``,
``tarfile`` or ``zlib`` errors, ``MemoryError``, no hang).

Seeds are real layer tars written here by ``tarfile`` (PAX, GNU, ustar; files,
dirs, links, whiteouts, xattrs), raw, gzip- and zstd-compressed, then mutated
(:mod:`fuzzing`)."""

from __future__ import annotations

import gzip
import io
import shutil
import tarfile
import tempfile
from pathlib import Path

import pytest
import zstandard
from fuzzing import corpus, expect_only, fuzz_settings, mutated, tar_mutated
from hypothesis import given
from hypothesis import strategies as st

from weenv.errors import WeenvError
from weenv.packaging.importer import tartree
from weenv.packaging.importer.layers import open_layer
from weenv.packaging.importer.source import ImageSource, Layer
from weenv.packaging.tarscan import TarScan

pytestmark = pytest.mark.timeout(120)


def _tar(fmt: int, entries: list[tuple[str, str, bytes | str]], pax: dict[str, str] | None = None) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt, pax_headers=pax or {}) as tar:
        for kind, name, data in entries:
            info = tarfile.TarInfo(name)
            info.mtime, info.uid, info.gid = 1_700_000_000, 1000, 1000
            if kind == "file":
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
                continue
            info.type = {
                "dir": tarfile.DIRTYPE,
                "symlink": tarfile.SYMTYPE,
                "link": tarfile.LNKTYPE,
                "fifo": tarfile.FIFOTYPE,
                "char": tarfile.CHRTYPE,
            }[kind]
            if kind in ("symlink", "link"):
                info.linkname = data
            if kind == "file_x":
                info.pax_headers = {"SCHILY.xattr.user.k": "v"}
            tar.addfile(info)
    return out.getvalue()


def _seeds() -> list[bytes]:
    layer = [
        ("dir", "app", b""),
        ("file", "app/main.py", b"print('hi')\n" * 20),
        ("symlink", "app/l", "main.py"),
        ("link", "app/h", "app/main.py"),
        ("file", "app/.wh.gone", b""),
        ("dir", "etc", b""),
        ("file", "etc/.wh..wh..opq", b""),
        ("fifo", "run.fifo", b""),
        ("file", "z" * 120 + "/long", b"x" * 600),
    ]
    pax = _tar(tarfile.PAX_FORMAT, layer, {"comment": "seed"})
    gnu = _tar(tarfile.GNU_FORMAT, layer)
    ustar = _tar(tarfile.USTAR_FORMAT, layer[:8])
    xattr = io.BytesIO()
    with tarfile.open(fileobj=xattr, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("x")
        info.size = 3
        info.pax_headers = {
            "SCHILY.xattr.user.k": "v",
            "SCHILY.xattr.security.capability": "\x01\x00\x00\x02",
            "mtime": "1700000000.5",
            "uname": "root",
        }
        tar.addfile(info, io.BytesIO(b"abc"))
    return [pax, gnu, ustar, xattr.getvalue(), *corpus("tar")]


SEEDS = _seeds()
COMPRESSED = [gzip.compress(s, mtime=0) for s in SEEDS[:2]] + [
    zstandard.ZstdCompressor().compress(s) for s in SEEDS[:2]
]


def _scan(data: bytes, cuts: list[int], **kw) -> None:
    scan = TarScan(max_entries=64, max_bytes=1 << 20, what="the fuzzed tar", **kw)
    pos = 0
    for cut in sorted(cuts) + [len(data)]:
        scan.feed(data[pos:cut])
        pos = max(pos, cut)
    scan.finish()


@fuzz_settings(400)
@given(
    data=tar_mutated(SEEDS) | mutated([gzip.compress(s, mtime=0) for s in SEEDS]),
    cuts=st.lists(st.integers(0, 8192), max_size=4),
    sparse=st.booleans(),
)
def test_tar_scanner_raises_only_weenv_errors(data, cuts, sparse):
    with expect_only(WeenvError):
        _scan(data, cuts, sparse=sparse)


class _Bytes(ImageSource):
    """An image source whose one blob is ``data`` (the layer under test)."""

    reference = "fuzz"

    def __init__(self, data: bytes):
        self.data = data

    def _open(self, location: str):
        return io.BytesIO(self.data)

    def _size(self, location: str) -> int:
        return len(self.data)


@pytest.fixture(scope="module")
def spool_dir():
    d = tempfile.mkdtemp(prefix="weenv-fuzz-spool-")
    yield Path(d)
    shutil.rmtree(d)


def _read_layer(data: bytes, spool_dir: Path) -> None:
    layer = Layer(index=0, diff_id="sha256:" + "0" * 64, digest=None, size=None, media_type="", location="blob")
    spool = tartree.Spool(spool_dir)
    try:
        with open_layer(_Bytes(data), layer, "layer sha256:fuzz") as tar:
            tartree.TreeMerger(tartree.View(), spool).apply_layer(tar, "layer sha256:fuzz")
    finally:
        spool.close()


@fuzz_settings(300)
@given(data=tar_mutated(SEEDS) | mutated(COMPRESSED))
def test_layer_reader_raises_only_weenv_errors(data, spool_dir):
    with expect_only(WeenvError):
        _read_layer(data, spool_dir)


def test_layer_reader_seeds_read_whole(spool_dir):
    """The seeds themselves are good layers (the fuzzing starts from inputs that reach the merge)."""
    for data in SEEDS[:4] + COMPRESSED:
        with pytest.raises(WeenvError, match="diff_id"):  # read whole; only the made-up diff_id differs
            _read_layer(data, spool_dir)
