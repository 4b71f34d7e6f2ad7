"""COPY uploads checked before ``tarfile`` reads them (:mod:`weenv.packaging.tarscan`)
and against the ``filesHash`` the real ``e2b`` SDK computes (:mod:`weenv.packaging.fileshash`)."""

from __future__ import annotations

import gzip
import io
import os
import tarfile
import tracemalloc
import zlib

import pytest

from weenv.errors import InvalidInputError
from weenv.formats.limits import MAX_TAR_HEADER_BYTES
from weenv.packaging.steps import MAX_COPY_BYTES, MAX_COPY_ENTRIES, Step, UploadMismatchError, unpack_upload
from weenv.packaging.tarscan import TarScan


def _scan(data: bytes, step: int = 7) -> TarScan:
    scan = TarScan(max_entries=MAX_COPY_ENTRIES, max_bytes=MAX_COPY_BYTES)
    for i in range(0, len(data), step):
        scan.feed(data[i : i + step])
    scan.finish()
    return scan


def _header(name: str, kind: bytes, size: int) -> bytes:
    """One raw 512-byte header (``tobuf`` writes no extended header for these)."""
    info = tarfile.TarInfo(name)
    info.type, info.size = kind, size
    return info.tobuf(format=tarfile.USTAR_FORMAT if size < 8 << 30 else tarfile.GNU_FORMAT)


@pytest.mark.parametrize("kind", [tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK])
@pytest.mark.parametrize("compressed", [False, True])
def test_a_huge_extended_header_is_refused_before_its_body_is_read(kind, compressed):
    """A 1 GiB PAX / GNU long-name header: refused on its 512-byte header, with
    none of its body fed (tarfile would read the whole GiB in one read)."""
    head = _header("././@LongLink", kind, 1 << 30)
    data = gzip.compress(head) if compressed else head
    scan = TarScan(max_entries=10, max_bytes=1 << 20)
    with pytest.raises(
        InvalidInputError, match=f"header of {1 << 30} bytes at offset 0 .at most {MAX_TAR_HEADER_BYTES}"
    ):
        scan.feed(data)


def _pax_bomb(path, declared: int) -> None:
    """A gzip tar whose first member is a PAX header of ``declared`` bytes (NULs:
    no records), then a small file: written a MiB at a time."""
    z = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    with open(path, "wb") as f:
        f.write(z.compress(_header("pax", tarfile.XHDTYPE, declared)))
        zeros = bytes(1 << 20)
        for _ in range(declared >> 20):
            f.write(z.compress(zeros))
        body = tarfile.TarInfo("a.txt")
        body.size = 2
        f.write(z.compress(body.tobuf(format=tarfile.USTAR_FORMAT) + b"hi".ljust(512, b"\0") + bytes(1024)))
        f.write(z.flush())


def test_unpacking_an_upload_with_a_huge_pax_header_stays_small(tmp_path):
    """256 MiB declared by a PAX header (a 256 KiB gzip file): tarfile alone
    allocated all of it; the upload is refused holding at most a few MiB."""
    _pax_bomb(tmp_path / "bomb.tar.gz", 256 << 20)
    assert (tmp_path / "bomb.tar.gz").stat().st_size < 1 << 20
    (tmp_path / "out").mkdir()
    tracemalloc.start()
    try:
        with pytest.raises(InvalidInputError, match="PAX extended header of 268435456 bytes"):
            unpack_upload(tmp_path / "bomb.tar.gz", tmp_path / "out")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, peak
    assert not list((tmp_path / "out").iterdir())


def _real_tar(fmt: int, compress: bool) -> bytes:
    buf = io.BytesIO()
    long_dir = "d" * 120
    with tarfile.open(fileobj=buf, mode="w:gz" if compress else "w", format=fmt) as tar:
        for name, kind, data in [
            (long_dir, tarfile.DIRTYPE, b""),
            (f"{long_dir}/é-{'f' * 150}", tarfile.REGTYPE, b"x" * 1000),
            ("link", tarfile.SYMTYPE, b""),
            ("empty", tarfile.REGTYPE, b""),
        ]:
            info = tarfile.TarInfo(name)
            info.type, info.size = kind, len(data)
            if kind == tarfile.SYMTYPE:
                info.linkname = "t" * 200
            tar.addfile(info, io.BytesIO(data) if data else None)
    return buf.getvalue()


@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT])
@pytest.mark.parametrize("compress", [False, True])
def test_real_tars_pass_whatever_their_chunking(fmt, compress):
    data = _real_tar(fmt, compress)
    for step in (1, 7, 512, 1 << 20):
        scan = _scan(data, step)
        assert (scan.entries, scan.file_bytes, scan.gzip, scan.ended) == (4, 1000, compress, True)


def _pax(records: bytes, name: str = "x") -> bytes:
    return _header("pax", tarfile.XHDTYPE, len(records)) + records.ljust(-(-len(records) // 512) * 512, b"\0")


def _file(name: str, data: bytes) -> bytes:
    return _header(name, tarfile.REGTYPE, len(data)) + data.ljust(-(-len(data) // 512) * 512, b"\0")


def test_what_tarfile_would_read_otherwise_is_refused():
    end = bytes(1024)
    # a PAX size makes tarfile skip other bytes than the header says: followed exactly
    data = _pax(b"12 size=600\n") + _header("big", tarfile.REGTYPE, 0) + bytes(1024) + _file("b", b"hi") + end
    assert _scan(data).entries == 2 and _scan(data).file_bytes == 602
    for bad, why in [
        (_pax(b"13 size=-100\n") + _file("a", b"") + end, "negative size"),
        (_pax(b"8 size=1\n") + _file("a", b"") + end, "malformed PAX record"),
        (_pax(b"12 size=600\n") + _pax(b"10 path=b\n") + _file("a", b"") + end, "two PAX extended headers"),
        (_header("g", tarfile.XGLTYPE, 12) + b"12 size=600\n".ljust(512, b"\0") + _file("a", b"") + end, "global"),
        (_pax(b"22 GNU.sparse.major=1\n") + _file("a", b"") + end, "sparse"),
        (_header("s", tarfile.GNUTYPE_SPARSE, 0) + end, "type b'S'"),
        (_pax(b"10 path=b\n") + end, "ends right after an extended header"),
        (_file("a", b"hi")[:700], "truncated"),
        (b"not a tar at all", "not a tar|not a readable tar"),
    ]:
        with pytest.raises(InvalidInputError, match=why):
            _scan(bad)
    with pytest.raises(InvalidInputError, match="second gzip stream"):
        _scan(gzip.compress(_file("a", b"hi")) + gzip.compress(end))
    scan = TarScan(max_entries=2, max_bytes=1 << 20)
    with pytest.raises(InvalidInputError, match="more than 2 entries"):
        scan.feed(_file("a", b"") * 3 + end)
    # after the end, nothing more is read (a trailing gzip bomb of zeros is never inflated)
    assert _scan(gzip.compress(_file("a", b"hi") + end) + b"\0" * 100).ended


# --- filesHash, as the real SDK computes it ---------------------------------------------------
sdk = pytest.importorskip("e2b.template.utils")


def _context(root):
    (root / "app" / "sub").mkdir(parents=True)
    (root / "app" / "a.txt").write_text("hello\n")
    (root / "app" / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (root / "app" / "run.sh").chmod(0o755)
    (root / "app" / "sub" / ("n" * 130 + "-é.txt")).write_bytes(os.urandom(3000))
    (root / "app" / "sub" / "empty").mkdir()
    (root / "app" / "rel-link").symlink_to("a.txt")
    os.link(root / "app" / "a.txt", root / "app" / "hard.txt")
    (root / "top.txt").write_text("top\n")


@pytest.mark.parametrize("src", ["app", ".", "app/*.txt", "top.txt"])
@pytest.mark.parametrize("resolve", [False, True])
@pytest.mark.parametrize("compress", [True, False])
def test_the_files_hash_of_an_upload_is_the_sdks(tmp_path, src, resolve, compress):
    ctx = tmp_path / "ctx"
    _context(ctx)
    want = sdk.calculate_files_hash(src, "/dest/", str(ctx), [], resolve, None)
    upload = tmp_path / "up.tar"
    with sdk.tar_file_stream(src, str(ctx), [], resolve, compress) as f:
        upload.write_bytes(f.read())
    step = Step(type="COPY", args=[src, "/dest/"], filesHash=want)
    (tmp_path / "out").mkdir()
    unpack_upload(upload, tmp_path / "out", step)  # matches: no error
    (tmp_path / "out2").mkdir()
    with pytest.raises(UploadMismatchError, match="is not the files of COPY"):
        unpack_upload(upload, tmp_path / "out2", step.model_copy(update={"args": [src, "/elsewhere/"]}))


def test_an_upload_of_other_files_does_not_match(tmp_path):
    ctx = tmp_path / "ctx"
    _context(ctx)
    want = sdk.calculate_files_hash("app", "/d", str(ctx), [], False, None)
    step = Step(type="COPY", args=["app", "/d"], filesHash=want)
    for change in (
        lambda: (ctx / "app" / "a.txt").write_text("HELLO\n"),
        lambda: (ctx / "app" / "run.sh").chmod(0o700),
        lambda: (ctx / "app" / "new").write_text(""),
    ):
        change()
        with sdk.tar_file_stream("app", str(ctx), [], False, True) as f:
            (tmp_path / "up.tar").write_bytes(f.read())
        out = tmp_path / f"out-{os.urandom(4).hex()}"
        out.mkdir()
        with pytest.raises(UploadMismatchError):
            unpack_upload(tmp_path / "up.tar", out, step)
