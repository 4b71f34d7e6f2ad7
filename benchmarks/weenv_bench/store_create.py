"""Cold create from each kind of store: ``file://``, ``oci://`` (a docker-registry
on loopback) and ``s3://`` (SeaweedFS on loopback), side by side in one run.

Content: template ``bench-task``: the cached Debian bookworm minbase + python3
tree (:func:`~weenv.packaging.debootstrap.debian_rootfs`) and a small task
group, built into a file store and copied
(:func:`~weenv.packaging.transfer.copy_template`) into the two others
(:mod:`weenv_bench.services.registry`, :mod:`weenv_bench.services.seaweedfs`).

Per store, one :class:`~weenv.node.node.Node` in this process (its own home,
provisioning off, no warm pool) over that store.  **One start**: ``create``
then ``python3 -c 'print(1)'`` in it, timed from the request to the command's
end.  **First**: the first start (nothing cached; it records the prefetch
profile).  **Cold** (``--runs``, default 3): after
:meth:`~weenv.node.node.Node.drop_caches` (node chunk cache, group mounts,
page cache of the images and the node's manifests emptied), so every chunk
the start reads comes from the store again (with the profile's pack).
Figures: seconds (p50 of the cold runs, and the first), and stored bytes the
node fetched from the store per cold start.

Run (root, real mounts): ``python -m weenv_bench.store_create [--runs N] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from weenv.config import Paths
from weenv.formats.manifest import RuntimeConfig
from weenv.node.node import Node
from weenv.node.provision import ProvisionConfig
from weenv.packaging.debootstrap import debian_rootfs
from weenv.packaging.group import build_group
from weenv.packaging.template import create_template
from weenv.packaging.transfer import copy_template
from weenv.store import Store
from weenv.store.file import FileStore
from weenv.store.oci import OciStore
from weenv.store.s3 import S3Store
from weenv_bench import machine
from weenv_bench.services.registry import Registry
from weenv_bench.services.seaweedfs import CREDENTIALS, Seaweed

TEMPLATE = "bench-task"
COMMAND = ["python3", "-c", "print(1)"]


def _template(cache: Path, root: Path) -> FileStore:
    store = FileStore(root / "file-store")
    task = root / "task" / "workspace"
    task.mkdir(parents=True)
    (task / "main.py").write_text("print('task')\n")
    (task / "data.bin").write_bytes(os.urandom(8 << 20))  # read by nobody: a lazy start skips it
    build_group(debian_rootfs(cache), store, name="base")
    build_group(task.parent, store, name="task")
    create_template(store, TEMPLATE, ["base", "task"], runtime=RuntimeConfig(working_dir="/workspace"))
    return store


def _start(node: Node) -> float:
    started = time.perf_counter()
    e = node.create(TEMPLATE)
    r = node.exec(e.id, COMMAND)
    elapsed = time.perf_counter() - started
    assert r.stdout == b"1\n", r
    node.destroy(e.id)
    return elapsed


def measure(store: Store, home: Path, cache: Path, runs: int) -> dict:
    """First and cold starts of :data:`TEMPLATE` on a fresh node over ``store``."""
    paths = Paths(home=home, cache=cache, store_url=store.url)
    with Node(paths, store=store, pool_size=0, provisioning=ProvisionConfig(mode="off")) as node:
        first = _start(node)
        node.prefetch.wait_published()
        cold, fetched = [], []
        for _ in range(runs):
            node.drop_caches()
            before = node.cache.bytes_fetched
            cold.append(_start(node))
            fetched.append(node.cache.bytes_fetched - before)
    return {
        "first_s": round(first, 3),
        "cold_p50_s": round(statistics.median(cold), 3),
        "cold_s": [round(t, 3) for t in cold],
        "cold_fetched_bytes": int(statistics.median(fetched)),
    }


def run(runs: int = 3, log=print) -> dict:
    cache = Path(os.environ.get("WEENV_CACHE", "/var/cache/weenv"))
    os.environ.update(CREDENTIALS)  # the S3 server's, as a user sets them
    results = {}
    with (
        tempfile.TemporaryDirectory(prefix="weenv-bench-stores-") as tmp,
        Registry(Path(tmp) / "registry") as reg,
        Seaweed(Path(tmp) / "seaweedfs") as s3_server,
    ):
        root = Path(tmp)
        file_store = _template(cache, root)
        stores: dict[str, Store] = {
            "file": file_store,
            "oci": OciStore(f"oci://{reg.address}/bench/stores"),
            "s3": S3Store(s3_server.url("bench/stores")),
        }
        try:
            for name, store in stores.items():
                if store is not file_store:
                    copy_template(file_store, store, TEMPLATE)
                results[name] = measure(store, root / f"home-{name}", cache, runs)
                log(f"{name}: {results[name]}")
        finally:
            for store in stores.values():
                store.close()
    return {
        "summary": {
            "runs": runs,
            **{f"{name}_cold_p50_s": r["cold_p50_s"] for name, r in results.items()},
            **{f"{name}_first_s": r["first_s"] for name, r in results.items()},
            "s3_over_file_cold": round(results["s3"]["cold_p50_s"] / results["file"]["cold_p50_s"], 2),
            "s3_over_oci_cold": round(results["s3"]["cold_p50_s"] / results["oci"]["cold_p50_s"], 2),
        },
        "stores": results,
        "machine": machine(),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    result = run(args.runs, log=lambda m: print(m, file=sys.stderr))
    text = json.dumps(result, indent=2)
    if args.json:
        args.json.write_text(text + "\n")
    sys.stdout.write(text + "\n")


if __name__ == "__main__":
    main()
