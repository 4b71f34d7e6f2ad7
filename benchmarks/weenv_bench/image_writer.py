"""``weenv bench image-writer``: weenv's EROFS writer against Debian's mkfs.erofs.

For each source tree (default: ``/usr/lib/python3`` and the tests' Debian
root), each tool writes the uncompressed image of the tree ``runs`` times
into a fresh temporary directory; measured: wall seconds (median and min),
the image's bytes, the tree's inodes.  Both read the same tree from the page
cache (one untimed walk first).  The images are deleted as soon as measured.
mkfs.erofs 1.5 refuses trees with a 255-byte name: its row then says so.

Returns (and writes as JSON with ``json_path``) ``{"summary": [row per tree],
"machine": ...}``; a row: ``tree``, ``inodes``, ``writer_s``, ``writer_min_s``,
``writer_bytes``, ``mkfs_s``, ``mkfs_min_s``, ``mkfs_bytes`` (or
``mkfs_error``), ``ratio`` (writer median / mkfs median).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from weenv_bench import machine

from weenv.errors import WeenvError
from weenv.packaging.erofs import DEFAULT_UUID, count_inodes, mkfs_erofs, mkfs_version
from weenv.packaging.erofs_writer import WRITER, tree_from_dir, write_image


def _writer(src: Path, image: Path) -> None:
    with open(image, "wb") as out:
        write_image(tree_from_dir(src), out, uuid=DEFAULT_UUID)


def _mkfs(src: Path, image: Path) -> None:
    mkfs_erofs(src, image, uuid=DEFAULT_UUID)


def _time(fn: Callable[[Path, Path], None], src: Path, runs: int, workdir: Path) -> tuple[list[float], int]:
    """Seconds of each of ``runs`` writes of ``src``'s image, and the image's bytes."""
    times, size = [], 0
    for _ in range(runs):
        with tempfile.TemporaryDirectory(dir=workdir, prefix=".weenv-bench-img-") as tmp:
            image = Path(tmp) / "image.erofs"
            t0 = time.monotonic()
            fn(src, image)
            times.append(time.monotonic() - t0)
            size = image.stat().st_size
    return times, size


def run(trees: list[Path], *, runs: int = 3, workdir: Path | None = None, json_path: Path | None = None,
        log: Callable[[str], None] = lambda _m: None) -> dict:  # fmt: skip
    """Benchmark both writers on each of ``trees`` (see the module doc)."""
    workdir = Path(workdir or tempfile.gettempdir())
    rows = []
    for src in trees:
        src = Path(src).resolve()
        inodes = count_inodes(src)  # also brings the tree's metadata into the page cache
        row: dict = {"tree": str(src), "inodes": inodes}
        log(f"{src}: {inodes} inodes, {WRITER}")
        t, row["writer_bytes"] = _time(_writer, src, runs, workdir)
        row["writer_s"], row["writer_min_s"] = round(statistics.median(t), 3), round(min(t), 3)
        log(f"{src}: mkfs.erofs {mkfs_version()}")
        try:
            t, row["mkfs_bytes"] = _time(_mkfs, src, runs, workdir)
            row["mkfs_s"], row["mkfs_min_s"] = round(statistics.median(t), 3), round(min(t), 3)
            row["ratio"] = round(row["writer_s"] / row["mkfs_s"], 2)
        except WeenvError as exc:
            row["mkfs_error"] = str(exc).splitlines()[0]
        rows.append(row)
    result = {"summary": rows, "runs": runs, "writer": WRITER, "mkfs": f"mkfs.erofs {mkfs_version()}",
              "machine": machine()}  # fmt: skip
    if json_path is not None:
        Path(json_path).write_text(json.dumps(result, indent=2) + "\n")
    return result

