"""The SDK's blocking face is generated from its asyncio face (``scripts/gen_sync.py``,
unasync): this fails while ``src/weenv/sdk/_sync.py`` is not what ``_async.py`` generates."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load_generator():
    spec = importlib.util.spec_from_file_location("gen_sync", ROOT / "scripts" / "gen_sync.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sync_face_is_generated_from_the_async_face():
    gen = load_generator()
    expected = gen.generate(gen.ASYNC.read_text())
    assert gen.SYNC.read_text() == expected, "src/weenv/sdk/_sync.py is stale: run scripts/gen_sync.py"


def test_the_groups_sync_face_is_generated_from_their_async_face():
    gen = load_generator()
    expected = gen.generate_groups(gen.GROUPS_ASYNC.read_text())
    assert gen.GROUPS_SYNC.read_text() == expected, "src/weenv/sdk/_groups_sync.py is stale: run scripts/gen_sync.py"


def test_the_generator_notices_an_edit_of_the_async_face():
    """An edit of ``_async.py`` changes the generated face (the check can fail)."""
    gen = load_generator()
    source = gen.ASYNC.read_text()
    edited = source.replace("async def is_running(self) -> bool:", "async def is_alive(self) -> bool:")
    assert edited != source
    out = gen.generate(edited)
    assert "    def is_alive(self) -> bool:" in out and out != gen.SYNC.read_text()
    assert not re.search(r"^\s*async (def|with|for)\b|\bawait\b", out, re.M)
    assert "class Sandbox:" in out and "def close(self) -> None:" in out and "def __exit__(self" in out
