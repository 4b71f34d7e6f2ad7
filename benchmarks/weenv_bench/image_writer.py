"""``weenv bench image-writer``: weenv's EROFS writer against Debian's mkfs.erofs.

For each source tree (default: ``/usr/lib/python3`` and the tests' Debian
root), each tool writes the uncompressed image of the tree ``runs`` times
into a fresh temporary directory; measured: wall seconds (median and min),
the image's bytes, the tree's inodes.  Both read the same tree from the page
cache (one untimed read of every file first; ``bytes_read_warm``).  The images are deleted as soon as measured.
mkfs.erofs 1.5 refuses trees with a 255-byte name: its row then says so.

Returns (and writes as JSON with ``json_path``) ``{"summary": [row per tree],
"machine": ...}``; a row: ``tree``, ``inodes``, ``writer_s``, ``writer_min_s``,
``writer_bytes``, ``mkfs_s``, ``mkfs_min_s``, ``mkfs_bytes`` (or
``writer_error`` / ``mkfs_error``), ``ratio`` (writer median / mkfs median).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from weenv.errors import WeenvError
from weenv.packaging.erofs import count_inodes
from weenv.packaging.erofs_writer import WRITER, tree_from_dir, write_image
from weenv_bench import machine
from weenv_bench.mkfs_erofs import DEFAULT_UUID, mkfs_erofs, mkfs_version


def _warm(src: Path) -> int:
    """Read every regular file of ``src`` once (so neither tool pays for a cold
    disk); the bytes read."""
    total = 0
    for dirpath, _dirs, files in os.walk(src):
        for name in files:
            path = os.path.join(dirpath, name)
            try:
                if not os.path.isfile(path) or os.path.islink(path):
                    continue
                with open(path, "rb") as f:
                    while piece := f.read(1 << 20):
                        total += len(piece)
            except OSError:
                continue
    return total


def _writer(src: Path, image: Path) -> None:
    with open(image, "wb") as out:
        write_image(tree_from_dir(src), out, uuid=DEFAULT_UUID)


def _mkfs(src: Path, image: Path) -> None:
    mkfs_erofs(src, image, uuid=DEFAULT_UUID)


def _time(
    tools: dict[str, Callable[[Path, Path], None]], src: Path, runs: int, workdir: Path
) -> dict[str, tuple[list[float], int] | str]:
    """Per tool: seconds of each of ``runs`` writes of ``src``'s image and the image's
    bytes, or the first line of its error.  The tools take turns, the first one
    alternating run by run, so a load that comes and goes weighs on both alike."""
    out: dict[str, tuple[list[float], int] | str] = {name: ([], 0) for name in tools}
    for turn in range(runs):
        names = list(tools) if turn % 2 == 0 else list(reversed(tools))  # neither always goes first
        for name in names:
            fn = tools[name]
            if isinstance(out[name], str):
                continue
            with tempfile.TemporaryDirectory(dir=workdir, prefix=".weenv-bench-img-") as tmp:
                image = Path(tmp) / "image.erofs"
                t0 = time.monotonic()
                try:
                    fn(src, image)
                except WeenvError as exc:
                    out[name] = str(exc).splitlines()[0]
                    continue
                out[name][0].append(time.monotonic() - t0)
                out[name] = (out[name][0], image.stat().st_size)
    return out


def run(
    trees: list[Path],
    *,
    runs: int = 3,
    workdir: Path | None = None,
    json_path: Path | None = None,
    log: Callable[[str], None] = lambda _m: None,
) -> dict:
    """Benchmark both writers on each of ``trees`` (see the module doc)."""
    workdir = Path(workdir or tempfile.gettempdir())
    rows = []
    for src in trees:
        src = Path(src).resolve()
        inodes = count_inodes(src)  # also brings the tree's metadata into the page cache
        row: dict = {"tree": str(src), "inodes": inodes, "bytes_read_warm": _warm(src)}
        log(f"{src}: {inodes} inodes, {WRITER} and mkfs.erofs {mkfs_version()} taking turns")
        timed = _time({"writer": _writer, "mkfs": _mkfs}, src, runs, workdir)
        for name, got in timed.items():
            if isinstance(got, str):
                row[f"{name}_error"] = got
                continue
            row[f"{name}_s"], row[f"{name}_min_s"] = round(statistics.median(got[0]), 3), round(min(got[0]), 3)
            row[f"{name}_bytes"] = got[1]
        if "writer_s" in row and "mkfs_s" in row:
            row["ratio"] = round(row["writer_s"] / row["mkfs_s"], 2)
        rows.append(row)
    result = {
        "summary": rows,
        "runs": runs,
        "writer": WRITER,
        "mkfs": f"mkfs.erofs {mkfs_version()}",
        "machine": machine(),
    }
    if json_path is not None:
        Path(json_path).write_text(json.dumps(result, indent=2) + "\n")
    return result
