"""E2B's v1 file-URL signature (weenv.server.e2b.signed) against the SDK's own
``get_signature``, and the checks made before any hashing."""

from __future__ import annotations

import pytest

from weenv.server.e2b import signed

e2b_signature = pytest.importorskip("e2b.sandbox.signature")


@pytest.mark.parametrize(
    "path,op,user,exp",
    [
        ("/tmp/a.txt", "read", None, None),
        ("/home/user/ü b", "write", "user", 1_900_000_000),
        ("rel", "read", "root", 5),
    ],
)
def test_the_signature_is_the_sdks(path, op, user, exp):
    sdk = e2b_signature.get_signature(path, op, user, "tok" * 10, None)
    assert signed.signature(path, op, user or "", "tok" * 10, None) == sdk["signature"]
    if exp is not None:  # the SDK takes seconds from now; the URL carries the Unix second
        raw = e2b_signature.get_signature(path, op, user, "tok" * 10, 1000)
        assert signed.signature(path, op, user or "", "tok" * 10, raw["expiration"]) == raw["signature"]


def test_the_signer_is_found_among_candidates_and_only_by_its_token():
    tokens = {f"sb{i}": f"token-{i}" for i in range(50)}
    sig = signed.signature("/p", "read", "", tokens["sb31"], None)
    assert signed.signer(sig, "/p", "read", "", None, tokens, tokens.__getitem__) == "sb31"
    for changed in (("/q", "read", ""), ("/p", "write", ""), ("/p", "read", "root")):
        with pytest.raises(signed.SignatureError, match="invalid signature"):
            signed.signer(sig, *changed, None, tokens, tokens.__getitem__)
    with pytest.raises(signed.SignatureError, match="invalid signature"):
        signed.signer(sig, "/p", "read", "", None, [k for k in tokens if k != "sb31"], tokens.__getitem__)


def test_malformed_are_refused_before_hashing():
    calls = []

    def token_of(sid):
        calls.append(sid)
        return "t"

    for bad in ("", "v2_abc", "v1_" + "A" * 100):
        with pytest.raises(signed.SignatureError, match="v1_"):
            signed.signer(bad, "/p", "read", "", None, ["a"], token_of)
    assert calls == []
    for bad in ("soon", "1e9", "9" * 30):
        with pytest.raises(signed.SignatureError, match="Unix time"):
            signed.expiration_of(bad)
    assert signed.expiration_of("300") == 300 and signed.expiration_of(None) is None


def test_expiry_is_checked_after_the_signature_as_envd_does():
    """envd's words: a signature no token made is "invalid signature" whether
    or not its time has passed; a right one past its time is "signature is
    already expired"."""
    tokens = {"a": "token-a"}
    sig = signed.signature("/p", "read", "", "token-a", 100)
    assert signed.signer(sig, "/p", "read", "", 100, tokens, tokens.__getitem__, now=99) == "a"
    with pytest.raises(signed.SignatureError, match=r"^signature is already expired$"):
        signed.signer(sig, "/p", "read", "", 100, tokens, tokens.__getitem__, now=101)
    with pytest.raises(signed.SignatureError, match=r"^invalid signature$"):
        signed.signer(sig, "/p", "read", "", 101, tokens, tokens.__getitem__, now=200)
