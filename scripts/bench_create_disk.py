"""Time N warm creates (create + first command, then destroy) of a Debian template on one node.

Run it once with this tree's source and once with another (e.g. a checkout
before the environments' disk, whose upper dirs are on the host file system)
to compare: ``PYTHONPATH=SRC python scripts/bench_create_disk.py [N]``.  Prints
the median and p90 of the create's total and of its overlay phase (which now
includes the subvolume and its quota), and of the destroy.  Needs root; uses a
temporary WEENV_HOME and the debootstrap cache in WEENV_CACHE.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


def main(n: int) -> None:
    with tempfile.TemporaryDirectory(prefix="weenv-bench-disk-") as tmp:
        os.environ["WEENV_HOME"] = str(Path(tmp) / "home")
        os.environ.setdefault("WEENV_CACHE", "/var/cache/weenv")
        from weenv.config import Paths
        from weenv.node.node import Node
        from weenv.node.provision import ProvisionConfig
        from weenv.packaging.debootstrap import debian_rootfs
        from weenv.packaging.group import build_group
        from weenv.packaging.template import create_template
        from weenv.store.file import FileStore

        paths = Paths.from_env()
        store = FileStore(paths.home / "store")
        build_group(debian_rootfs(paths.cache), store, name="base")
        create_template(store, "t", ["base"])
        with Node(paths, store=store, pool_size=0, provisioning=ProvisionConfig(mode="off")) as node:
            node.destroy(node.create("t").id)  # warm: chunks cached, groups mounted once
            total, overlay, destroy = [], [], []
            for _ in range(n):
                info = node.create("t")
                total.append(info.timing.total_s)
                overlay.append(info.timing.overlay_s or 0.0)
                t = time.perf_counter()
                node.destroy(info.id)
                destroy.append(time.perf_counter() - t)
        on = "btrfs" if hasattr(node, "disk") else "host file system"
        for name, xs in (("create", total), ("  overlay phase", overlay), ("destroy", destroy)):
            xs.sort()
            print(
                f"{name:16s} upper on {on}: median {statistics.median(xs) * 1e3:6.1f} ms, "
                f"p90 {xs[int(0.9 * (len(xs) - 1))] * 1e3:6.1f} ms  (n={n})"
            )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 50)
