#!/usr/bin/env python3
"""Generate the SDK's blocking face, ``src/weenv/sdk/_sync.py``, from its asyncio
face, ``src/weenv/sdk/_async.py`` (the one source), with unasync.

unasync drops ``async`` and ``await`` and renames tokens (names and one-word
strings): its own table (``__aenter__`` -> ``__enter__``, ``AsyncIterator`` ->
``Iterator``, ...) and :data:`REPLACEMENTS`.  Comments and docstrings are kept as
they are, except the module docstring, which becomes :data:`DOCSTRING`.

    python3 scripts/gen_sync.py          # write _sync.py
    python3 scripts/gen_sync.py --check  # exit 1 if _sync.py is not what it generates

``tests/unit/test_sdk_generated.py`` runs the same check in the unit tier.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import tokenize_rt
import unasync

SDK = Path(__file__).resolve().parents[1] / "src" / "weenv" / "sdk"
ASYNC = SDK / "_async.py"
SYNC = SDK / "_sync.py"

REPLACEMENTS = {
    # the SDK's classes: the blocking face has the plain names
    "AsyncSandbox": "Sandbox",
    "AsyncCommands": "Commands",
    "AsyncCommandHandle": "CommandHandle",
    "AsyncFiles": "Files",
    "AsyncNodeClient": "NodeClient",
    # httpx's pairs
    "AsyncClient": "Client",
    "AsyncHTTPTransport": "HTTPTransport",
    "aclose": "close",
    "aread": "read",
    "aiter_lines": "iter_lines",
    "aiter_bytes": "iter_bytes",
    # this module's own
    "_aiter": "_iter",
}

GROUPS_ASYNC = SDK / "_groups_async.py"
GROUPS_SYNC = SDK / "_groups_sync.py"
GROUPS_REPLACEMENTS = {
    **REPLACEMENTS,
    "_async": "_sync",
    "AsyncGroup": "Group",
    "AsyncTree": "Tree",
    "async_rollout_group": "rollout_group",
    "async_release_task": "release_task",
}
"""The RL groups' faces (:mod:`weenv.sdk.groups`): the same generation, with their own names."""

HEADER = "# Generated from _async.py by scripts/gen_sync.py: do not edit; edit _async.py and run it.\n"

DOCSTRING = '''"""The blocking face of the SDK: :class:`Sandbox` on ``httpx.Client``.

Generated from :mod:`weenv.sdk._async` (the one source of both faces) by
``scripts/gen_sync.py``; the logic is in :mod:`weenv.sdk._core`.
"""'''


def generate(
    async_source: str, *, replacements: dict[str, str] = REPLACEMENTS, docstring: str = DOCSTRING, header: str = HEADER
) -> str:
    """The text of ``_sync.py`` for ``async_source``, the text of ``_async.py``
    (or another pair's: ``replacements``, ``docstring``, ``header``).

    Raises :class:`ValueError` if ``async_source`` does not start with a docstring."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "_async" / "face.py"
        src.parent.mkdir()
        src.write_text(async_source)
        unasync.unasync_files([str(src)], [unasync.Rule("/_async/", "/_sync/", replacements)])
        text = (Path(tmp) / "_sync" / "face.py").read_text()
    tokens = tokenize_rt.src_to_tokens(text)
    first = next((i for i, t in enumerate(tokens) if t.name not in tokenize_rt.NON_CODING_TOKENS), None)
    if first is None or tokens[first].name != "STRING":
        raise ValueError("_async.py must start with its module docstring")
    tokens[first] = tokens[first]._replace(src=docstring)
    return header + tokenize_rt.tokens_to_src(tokens)


GROUPS_DOCSTRING = '''"""RL groups and tree search on the blocking face (see :mod:`weenv.sdk.groups`):
``rollout_group``, ``release_task``, :class:`Group`, :class:`Tree`.

Generated from :mod:`weenv.sdk._groups_async` by ``scripts/gen_sync.py``.
"""'''


def generate_groups(async_source: str) -> str:
    """The text of ``_groups_sync.py`` for ``async_source``, the text of ``_groups_async.py``."""
    return generate(
        async_source,
        replacements=GROUPS_REPLACEMENTS,
        docstring=GROUPS_DOCSTRING,
        header=HEADER.replace("_async.py", "_groups_async.py"),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if _sync.py is stale, write nothing")
    args = parser.parse_args(argv)
    faces = [(SYNC, generate(ASYNC.read_text())), (GROUPS_SYNC, generate_groups(GROUPS_ASYNC.read_text()))]
    if args.check:
        stale = [path for path, text in faces if not path.exists() or path.read_text() != text]
        for path in stale:
            print(f"{path} is stale: run scripts/gen_sync.py", file=sys.stderr)
        return 1 if stale else 0
    for path, text in faces:
        path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
