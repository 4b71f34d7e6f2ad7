"""mkdocs hook: the reference pages (command line, HTTP routes, settings, errors,
metrics), generated from this checkout's code at every build by
``scripts/gen_docs_reference.py``, so the site cannot drift from the code."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[2]


def _generator():
    spec = importlib.util.spec_from_file_location("gen_docs_reference", ROOT / "scripts" / "gen_docs_reference.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def on_files(files, config):
    for uri, text in _generator().pages().items():
        files.append(File.generated(config, uri, content=text))
    return files
