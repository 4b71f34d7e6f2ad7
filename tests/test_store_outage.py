"""A store that is down: cached templates still start (issue 13, finding 13), and
lazy reads fail fast instead of stalling a timeout each (finding 14).

The registry is the test's own process: killed (SIGKILL: connections refused)
or frozen (SIGSTOP: connections accepted, nothing answered; SIGCONT at the end).
"""

# ruff: noqa: F811  (pytest fixtures imported from registry_fixture, used as parameters)

from __future__ import annotations

import hashlib
import os
import time

import pytest
from registry_fixture import registry  # noqa: F401 (fixture)

from weenv.errors import StoreUnavailableError
from weenv.node.node import Node
from weenv.packaging.group import build_group
from weenv.packaging.manifest import RuntimeConfig
from weenv.packaging.template import create_template
from weenv.store.file import FileStore
from weenv.store.oci import OciStore
from weenv.store.transfer import copy_template

FAST = {"connect_timeout": 1, "read_timeout": 1, "timeout": 3, "retries": 3, "backoff": 0.05,
        "probe_interval": 1, "probe_timeout": 0.5}  # fmt: skip
HELLO = ["python3", "hello.py"]


@pytest.mark.parametrize("fault", ["killed", "frozen"])
def test_a_cached_template_starts_while_the_store_is_down(paths, shared_store, registry, leak_check, fault):
    url = registry.url("weenv/outage")
    oci = OciStore(url, **FAST)
    copy_template(shared_store, oci, "task")
    with Node(paths, store=oci, pool_size=0) as node:  # a first daemon starts it: chunks and manifests arrive
        for _ in range(2):
            e = node.create("task")
            assert node.exec(e.id, HELLO).stdout == b"hello from the task\n"
            node.destroy(e.id)
        node.prefetch.wait_published()
    oci.close()

    oci = OciStore(url, **FAST)
    try:
        with Node(paths, store=oci, pool_size=0) as node:  # restarted: it knows "task" from its home only
            if fault == "killed":
                registry.kill()
            else:
                registry.pause()
            try:
                for _ in range(2):
                    started = time.monotonic()
                    e = node.create("task")
                    elapsed = time.monotonic() - started
                    assert elapsed < 5, f"a create with the store {fault} took {elapsed:.1f} s"
                    assert node.exec(e.id, HELLO).stdout == b"hello from the task\n"
                    node.destroy(e.id)
                started = time.monotonic()
                with pytest.raises(StoreUnavailableError, match="'never-seen'.*never started it"):
                    node.create("never-seen")
                assert time.monotonic() - started < FAST["timeout"] + 1
                assert node.list() == []
            finally:
                if fault == "frozen":
                    registry.resume()
    finally:
        oci.close()


def test_reads_with_a_frozen_store_fail_fast_and_succeed_once_it_is_back(paths, debian_root, registry, leak_check):
    """Eight files that are not on the node: with the registry frozen, the first
    read waits one store timeout and the seven others fail at once (they waited a
    timeout each: 96 s for one pass); after SIGCONT, a probe closes the breaker."""
    local = FileStore(paths.home / "build-store")
    files = paths.home / "files"
    (files / "data").mkdir(parents=True)
    digests = {}
    for i in range(8):
        data = os.urandom(3 << 20)  # spans chunks of its own
        (files / "data" / f"f{i}").write_bytes(data)
        digests[f"/data/f{i}"] = hashlib.sha256(data).hexdigest()
    build_group(debian_root, local, name="base")
    build_group(files, local, name="files")
    create_template(local, "files", ["base", "files"], runtime=RuntimeConfig(working_dir="/"))
    oci = OciStore(registry.url("weenv/frozen"), **FAST)
    copy_template(local, oci, "files")
    read_all = ["python3", "-c", (
        "import hashlib, sys, time\n"
        "for i in range(8):\n"
        "    t = time.monotonic()\n"
        "    try:\n"
        "        h = hashlib.sha256(open(f'/data/f{i}', 'rb').read()).hexdigest()\n"
        "    except OSError as exc:\n"
        "        h = f'errno{exc.errno}'\n"
        "    print(f'/data/f{i}', h, round(time.monotonic() - t, 2), flush=True)\n"
        "    time.sleep(float(sys.argv[1]))\n"
    )]  # fmt: skip
    apart = 1.5 * FAST["probe_interval"]  # reads spread over the outage, as a process's are
    try:
        with Node(paths, store=oci, pool_size=0) as node:
            e = node.create("files", prefetch=False)
            warm = ["python3", "-c", "import hashlib, os, sys, time; os.stat('/data/f7')"]  # all but the files' data
            assert node.exec(e.id, warm).exit_code == 0
            registry.pause()
            try:
                started = time.monotonic()
                r = node.exec(e.id, [*read_all, str(apart)], timeout=120)
                elapsed = time.monotonic() - started
                lines = r.stdout.decode().split()
                results = dict(zip(lines[0::3], lines[1::3]))
                assert set(results) == set(digests), r
                assert set(results.values()) == {"errno5"}, r  # EIO, for every file
                # one store timeout for the first file (and the kernel's retries), the others at once
                seconds = [float(x) for x in lines[2::3]]
                assert seconds[0] < FAST["timeout"] + 1 and max(seconds[1:]) < 0.5, r
                assert elapsed < FAST["timeout"] + 8 * apart + 2, f"8 reads with the store frozen took {elapsed:.1f} s"
            finally:
                registry.resume()
            deadline = time.monotonic() + FAST["probe_interval"] + FAST["probe_timeout"] + 2
            while oci.breaker.is_open and time.monotonic() < deadline:
                time.sleep(0.05)
            r = node.exec(e.id, [*read_all, "0"], timeout=120)
            lines = r.stdout.decode().split()
            assert dict(zip(lines[0::3], lines[1::3])) == digests, r
            node.destroy(e.id)
    finally:
        oci.close()
