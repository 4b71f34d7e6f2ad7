"""What the parser fuzz tests (``test_fuzz_*.py``) share: bounded hypothesis
settings and strategies that mutate real inputs.

A target is run with :func:`fuzz_settings` (a fixed number of examples,
derandomized: CI runs the same inputs every time, no example database, no
deadline: a hang shows as the test's timeout); ``WEENV_FUZZ_SCALE=N`` runs N
times the examples (a longer search, outside CI).  Inputs are real ones (built
by the test from weenv's own writers, or kept in ``tests/fuzz/corpus/``) mutated
byte by byte (:func:`mutated`), numbers in them set to edge values, tar
headers' checksums fixed after the mutation so that ``tarfile`` reads past them
(:func:`tar_mutated`), and JSON documents with a value replaced
(:func:`json_mutated`)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import tarfile
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

SCALE = int(os.environ.get("WEENV_FUZZ_SCALE", "1"))
"""Times the examples of every target (1 in CI)."""
CORPUS = Path(__file__).resolve().parents[1] / "fuzz" / "corpus"
"""Small real inputs kept in the repository (each file a seed), by target: ``CORPUS / TARGET / *``."""


def fuzz_settings(examples: int) -> settings:
    """``examples`` inputs (times :data:`SCALE`), the same ones every run."""
    return settings(
        max_examples=examples * SCALE,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )


@contextlib.contextmanager
def expect_only(*allowed: type[BaseException]):
    """The block may raise only ``allowed`` (weenv's own errors): any other
    exception is the finding, and fails the example with its traceback."""
    try:
        yield
    except allowed:
        pass


def corpus(target: str) -> list[bytes]:
    """The seeds kept for ``target`` (none if its folder is absent)."""
    folder = CORPUS / target
    return [p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()] if folder.is_dir() else []


EDGE_NUMBERS = (
    b"0",
    b"-1",
    b"1",
    b"7",
    b"77777777777",
    b"99999999999999999999",
    b"18446744073709551617",
    b"2147483648",
    b"+1",
    b"1e9",
    b"0x10",
    b" ",
    b"",
)
"""Numbers (and non-numbers) a size, length or count field is set to."""
_DIGITS = re.compile(rb"[0-9]+")


@st.composite
def _mutate(draw, seeds: list[bytes], max_ops: int) -> bytes:
    data = bytearray(draw(st.sampled_from(seeds)))
    for _ in range(draw(st.integers(1, max_ops))):
        op = draw(st.sampled_from(("flip", "byte", "insert", "delete", "truncate", "splice", "number", "repeat")))
        pos = draw(st.integers(0, max(len(data) - 1, 0)))
        if op == "flip" and data:
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "byte" and data:
            data[pos] = draw(
                st.sampled_from((0, 0xFF, 0x7F, 0x80, 0x0A, 0x20, 0x22, 0x2F, 0x3D, 0x5C)) | st.integers(0, 255)
            )
        elif op == "insert":
            data[pos:pos] = draw(st.binary(max_size=64))
        elif op == "delete":
            del data[pos : pos + draw(st.integers(1, 600))]
        elif op == "truncate":
            del data[pos:]
        elif op == "splice":
            other = draw(st.sampled_from(seeds))
            start = draw(st.integers(0, max(len(other) - 1, 0)))
            data[pos:pos] = other[start : start + draw(st.integers(1, 1024))]
        elif op == "number":
            runs = list(_DIGITS.finditer(data))
            if runs:
                m = runs[draw(st.integers(0, len(runs) - 1))]
                data[m.start() : m.end()] = draw(st.sampled_from(EDGE_NUMBERS))
        elif op == "repeat" and data:
            piece = data[pos : pos + draw(st.integers(1, 16))]
            data[pos:pos] = piece * draw(st.integers(1, 64))
    return bytes(data)


def mutated(seeds: list[bytes], *, max_ops: int = 6, raw_size: int = 1024) -> st.SearchStrategy[bytes]:
    """A seed with 1..``max_ops`` mutations, or (one in five) arbitrary bytes."""
    return st.one_of(
        _mutate(seeds, max_ops),
        _mutate(seeds, max_ops),
        _mutate(seeds, max_ops),
        _mutate(seeds, max_ops),
        st.binary(max_size=raw_size),
    )


def fix_tar_checksums(data: bytes) -> bytes:
    """``data`` with the checksum of every block that looks like a ustar
    header recomputed, so ``tarfile`` parses the mutated fields behind it."""
    out = bytearray(data)
    for at in range(0, len(out) - tarfile.BLOCKSIZE + 1, tarfile.BLOCKSIZE):
        block = out[at : at + tarfile.BLOCKSIZE]
        if block[257:262] == b"ustar":
            chksum = 256 + sum(block[:148]) + sum(block[156:])
            out[at + 148 : at + 156] = b"%06o\0 " % chksum
    return bytes(out)


def tar_mutated(seeds: list[bytes]) -> st.SearchStrategy[bytes]:
    """Tars mutated as by :func:`mutated`, with their headers' checksums fixed
    (four in five) so the mutation reaches the fields."""
    return st.tuples(mutated(seeds, raw_size=2048), st.integers(0, 4)).map(
        lambda t: fix_tar_checksums(t[0]) if t[1] else t[0]
    )


JSON_EDGES = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from((-1, 0, 2**31, 2**63, 2**64 + 1, 10**30, -(10**30), 1e308, -0.0)),
    st.integers(),
    st.floats(allow_nan=False),
    st.text(max_size=20),
    st.sampled_from(("", "\x00", "..", "/", "sha256:" + "0" * 64, "sha256:" + "g" * 64, "\ud800", "a" * 300)),
)
"""JSON values a mutated document's field is set to."""
_JSON_VALUES = st.recursive(
    JSON_EDGES,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)


def _paths(doc, prefix=()) -> list[tuple]:
    """Every path (keys and indexes) into ``doc``, the root's first."""
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, prefix + (i,))
    return out


@st.composite
def _json_mutate(draw, seeds: list[bytes]) -> bytes:
    doc = json.loads(draw(st.sampled_from(seeds)))
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(doc)
        path = draw(st.sampled_from(paths[1:] or paths))
        if not path:
            doc = draw(_JSON_VALUES)
            continue
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        action = draw(st.sampled_from(("set", "set", "delete", "rekey")))
        if action == "delete":
            del parent[path[-1]]
        elif action == "rekey" and isinstance(parent, dict):
            parent[draw(st.text(max_size=12))] = parent.pop(path[-1])
        else:
            parent[path[-1]] = draw(_JSON_VALUES)
    text = json.dumps(doc, ensure_ascii=draw(st.booleans()))
    return text.encode("utf-8", "surrogatepass")


def json_mutated(seeds: list[bytes]) -> st.SearchStrategy[bytes]:
    """JSON documents with fields replaced, removed or renamed (mostly), or their bytes mutated."""
    return st.one_of(_json_mutate(seeds), _json_mutate(seeds), mutated(seeds))
