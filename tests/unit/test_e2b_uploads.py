"""E2B COPY uploads on a node (:class:`weenv.server.e2b.uploads.Uploads`): tokens
that expire and open one route, uploads removed once nothing keeps them, a
bound on their total bytes, checks as the bytes arrive."""

from __future__ import annotations

import io
import tarfile
import time

import pytest

from weenv.errors import AuthenticationError, CapacityError, InvalidInputError
from weenv.server.e2b.uploads import Uploads

H1, H2 = "a" * 64, "b" * 64


def _tar(size: int = 10) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("f")
        info.size = size
        tar.addfile(info, io.BytesIO(b"x" * size))
    return buf.getvalue()


def _put(u: Uploads, tid: str, h: str, data: bytes, announce: bool = True) -> None:
    w = u.writer(tid, h, len(data) if announce else None)
    try:
        for i in range(0, len(data), 4096):
            w.write(data[i : i + 4096])
        w.finish()
    finally:
        w.abort()


@pytest.fixture
def uploads(tmp_path):
    u = Uploads(tmp_path / "files", secret=b"s" * 32, ttl_s=1.0, max_total=100_000)
    yield u
    u.close()


def test_a_token_expires_and_opens_its_own_route_only(uploads):
    tok = uploads.token("t1", H1)
    uploads.check_token(tok, "t1", H1)
    route = f"/e2b/templates/t1/files/{H1}/upload"
    assert uploads.authorises(tok, "PUT", route)
    for method, path in [
        ("POST", route),
        ("PUT", f"/e2b/templates/t1/files/{H2}/upload"),
        ("PUT", f"/e2b/templates/t2/files/{H1}/upload"),
        ("POST", "/e2b/sandboxes"),
        ("PUT", "/v1/environments/x/files"),
        ("POST", "/e2b/envd/files"),
    ]:
        assert not uploads.authorises(tok, method, path), (method, path)
    with pytest.raises(AuthenticationError, match="wrong upload token"):
        uploads.check_token(tok, "t1", H2)
    forged = tok.rsplit("/", 2)[0] + f"/{int(time.time()) + 10_000}/" + tok.rsplit("/", 1)[1]
    with pytest.raises(AuthenticationError, match="wrong upload token"):
        uploads.check_token(forged, "t1", H1)  # a later expiry needs its own MAC
    time.sleep(1.1)
    with pytest.raises(AuthenticationError, match="expired"):
        uploads.check_token(tok, "t1", H1)
    assert not uploads.authorises(tok, "PUT", route)


def test_an_upload_lives_while_claimed_or_held(uploads):
    uploads.claim("t1", H1)
    _put(uploads, "t1", H1, _tar())
    uploads.claim("t2", H2)
    _put(uploads, "t2", H2, _tar())
    uploads.hold("build-1", "t1", {H1})  # the claim of t1 becomes the build's hold
    time.sleep(1.1)
    uploads.sweep()
    assert uploads.path(H2) is None  # claimed, never built: gone after the ttl (this sweep or the sweeper's)
    assert uploads.path(H1) is not None  # held by a running build, however old
    uploads.release("build-1")  # the build ended: nothing keeps it
    assert uploads.path(H1) is None and uploads.held_bytes() == 0


def test_a_build_end_keeps_what_another_template_claimed(uploads):
    uploads.claim("t1", H1)
    _put(uploads, "t1", H1, _tar())
    uploads.claim("t2", H1)  # another template was told it is present
    uploads.hold("build-1", "t1", {H1})
    uploads.release("build-1")
    assert uploads.path(H1) is not None
    uploads.forget("t2")  # t2 deleted
    assert uploads.path(H1) is None


def test_uploads_are_bounded_in_total(uploads):
    uploads.claim("t1", H1)
    _put(uploads, "t1", H1, _tar(60_000))
    uploads.claim("t1", H2)
    with pytest.raises(CapacityError, match="100000 bytes of uploads"):
        uploads.writer("t1", H2, 60_000)  # announced: refused before a byte is written
    with pytest.raises(CapacityError):
        _put(uploads, "t1", H2, _tar(60_000), announce=False)  # chunked: refused as it passes the bound
    assert not list(uploads.dir.glob("*.part")) and uploads.path(H2) is None
    assert uploads.held_bytes() == uploads.path(H1).stat().st_size  # the refused ones' bytes given back
    time.sleep(1.1)  # the first is no longer claimed: swept to make room
    _put(uploads, "t1", H2, _tar(60_000))
    assert uploads.path(H1) is None and uploads.path(H2) is not None


def test_an_upload_is_checked_as_it_arrives(uploads):
    w = uploads.writer("t1", H1, None)
    huge = tarfile.TarInfo("pax")
    huge.type, huge.size = tarfile.XHDTYPE, 1 << 30
    with pytest.raises(InvalidInputError, match="PAX extended header"):
        w.write(huge.tobuf(format=tarfile.USTAR_FORMAT))
    w.abort()
    assert not list(uploads.dir.iterdir()) and uploads.held_bytes() == 0
    w = uploads.writer("t1", H1, None)
    w.write(b"not a tar")
    with pytest.raises(InvalidInputError, match="not a tar"):
        w.finish()
    w.abort()
    assert not list(uploads.dir.iterdir())


def test_uploads_left_on_disk_are_claimed_from_their_age(tmp_path):
    d = tmp_path / "files"
    d.mkdir()
    (d / f"{H1}.tar").write_bytes(_tar())
    (d / f".{H2}.1234.part").write_bytes(b"partial")
    u = Uploads(d, secret=b"s" * 32, ttl_s=1.0)
    try:
        assert not list(d.glob("*.part")) and u.path(H1) is not None
        time.sleep(1.1)
        u.sweep()
        assert u.path(H1) is None  # (by this sweep or the sweeper's)
    finally:
        u.close()
