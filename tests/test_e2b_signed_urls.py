"""Signed file URLs (issue 17, item 4) through the official ``e2b`` SDK against
a real ``weenv serve``: ``download_url`` and ``upload_url`` fetched with no
token, as a browser or ``curl`` would, with and without an expiry; expired,
tampered, another path's, another user's and another sandbox's signatures are
refused.  The daemon fixture is test_e2b's (one per module)."""

from __future__ import annotations

import time
import urllib.parse

import httpx
import pytest

e2b = pytest.importorskip("e2b")

from e2b import Sandbox

from test_e2b import TEMPLATE, daemon  # noqa: F401  (the module's daemon fixture)


@pytest.fixture(scope="module")
def two(daemon):  # noqa: F811
    a = Sandbox.create(TEMPLATE, timeout=300)
    b = Sandbox.create(TEMPLATE, timeout=300)
    yield a, b
    a.kill()
    b.kill()


def _with(url: str, **changes: str) -> str:
    """``url`` with query fields replaced (None: removed)."""
    parts = urllib.parse.urlsplit(url)
    query = dict(urllib.parse.parse_qsl(parts.query))
    for k, v in changes.items():
        if v is None:
            query.pop(k, None)
        else:
            query[k] = v
    return urllib.parse.urlunsplit(parts._replace(query=urllib.parse.urlencode(query, quote_via=urllib.parse.quote)))


def test_signed_urls_read_and_write_without_a_token(two):
    a, b = two
    a.files.write("/tmp/signed.txt", "from a\n")
    b.files.write("/tmp/signed.txt", "from b\n")
    url = a.download_url("/tmp/signed.txt")
    assert "signature=v1_" in url
    r = httpx.get(url, timeout=30)  # no X-Access-Token, no sandbox header: the signature names the sandbox
    assert (r.status_code, r.content) == (200, b"from a\n"), r.text
    assert httpx.get(b.download_url("/tmp/signed.txt"), timeout=30).content == b"from b\n"

    up = a.upload_url("/tmp/uploaded.bin")
    body = bytes(range(256)) * 4096  # 1 MiB: past the keyless body limit, so the signature is the credential
    r = httpx.post(up, files={"file": ("uploaded.bin", body)}, timeout=60)
    assert r.status_code == 200, r.text
    assert a.files.read("/tmp/uploaded.bin", format="bytes") == body
    assert not b.files.exists("/tmp/uploaded.bin")

    timed = a.download_url("/tmp/signed.txt", use_signature_expiration=120)
    assert "signature_expiration=" in timed
    assert httpx.get(timed, timeout=30).content == b"from a\n"


def test_bad_signatures_are_refused(two):
    a, b = two
    a.files.write("/tmp/secret.txt", "secret\n")
    good = a.download_url("/tmp/secret.txt", use_signature_expiration=120)
    expiry = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(good).query))["signature_expiration"]
    sig = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(good).query))["signature"]
    tampered = sig[:-2] + ("AA" if sig[-2:] != "AA" else "BB")
    cases = {
        "tampered": _with(good, signature=tampered),
        "another path": _with(good, path="/etc/shadow"),
        "another user": _with(good, username="root"),
        "expiry moved": _with(good, signature_expiration=str(int(expiry) + 3600)),
        "expiry dropped": _with(good, signature_expiration=None),
        "not a v1 signature": _with(good, signature="x" * 5000),
        "not a time": _with(good, signature_expiration="tomorrow"),
        "a read signature to write": _with(good, path="/tmp/secret.txt"),
    }
    for what, url in cases.items():
        r = (
            httpx.post(url, files={"file": ("x", b"overwritten")}, timeout=30)
            if what == "a read signature to write"
            else httpx.get(url, timeout=30)
        )
        assert r.status_code == 401, (what, r.status_code, r.text)
        assert b"secret" not in r.content, what
    assert a.files.read("/tmp/secret.txt") == "secret\n"  # the write was refused

    expired = a.download_url("/tmp/secret.txt", use_signature_expiration=1)
    time.sleep(2.1)
    r = httpx.get(expired, timeout=30)
    assert r.status_code == 401 and "expired" in r.json()["message"], r.text

    # a's signature is no credential for b, even naming b through the Host form
    r = httpx.get(good, headers={"E2b-Sandbox-Id": b.sandbox_id}, timeout=30)
    assert r.status_code == 401, r.text

    gone = a.download_url("/tmp/secret.txt")
    a_id = a.sandbox_id
    Sandbox.kill(a_id)
    r = httpx.get(gone, timeout=30)
    assert r.status_code == 401, r.text  # a killed sandbox's signatures match no running sandbox
