"""A store that is down: cached templates still start (issue 13, finding 13), also
on a daemon started during the outage, and lazy reads fail fast instead of
stalling a timeout each (finding 14).

The registry is the test's own process: killed (SIGKILL: connections refused)
or frozen (SIGSTOP: connections accepted, nothing answered; SIGCONT at the end).
"""

# ruff: noqa: F811  (pytest fixtures imported from registry_fixture, used as parameters)

from __future__ import annotations

import base64
import hashlib
import os
import time

import pytest

from daemon_fixture import start_daemon
from registry_fixture import registry  # noqa: F401 (fixture)
from weenv.formats.manifest import RuntimeConfig
from weenv.node.data.cache import ChunkCache
from weenv.node.data.prefetch import LOOKUP_WAIT_S, Prefetcher
from weenv.node.node import Node
from weenv.packaging.group import build_group
from weenv.packaging.template import create_template
from weenv.packaging.transfer import copy_template
from weenv.store.file import FileStore
from weenv.store.oci import OciStore

FAST = {
    "connect_timeout": 1,
    "read_timeout": 1,
    "timeout": 3,
    "retries": 3,
    "backoff": 0.05,
    "probe_interval": 1,
    "probe_timeout": 0.5,
}
HELLO = ["python3", "hello.py"]


@pytest.mark.parametrize("fault", ["killed", "frozen"])
def test_a_daemon_started_while_the_store_is_down_starts_cached_templates(
    paths, shared_store, registry, leak_check, monkeypatch, fault
):
    """A node learns template "task" (its manifests, chunks and name); with the
    registry then killed or frozen, a daemon started on that home starts (its
    store sends nothing when it opens), creates "task" quickly from the name's
    last known digest and says so in the answer, and refuses a name it never knew."""
    url = registry.url("weenv/outage")
    oci = OciStore(url, **FAST)
    copy_template(shared_store, oci, "task")
    learning = time.time()
    with Node(paths, store=oci, pool_size=0) as node:  # a first node starts it: chunks and manifests arrive
        for _ in range(2):
            e = node.create("task")
            assert (e.timing.resolved_from, e.timing.resolved_age_s) == ("store", None)
            assert node.exec(e.id, HELLO).stdout == b"hello from the task\n"
            node.destroy(e.id)
        node.prefetch.wait_published()
    oci.close()
    learned = time.time()

    monkeypatch.setenv("WEENV_POOL_SIZE", "0")
    if fault == "killed":
        registry.kill()
    else:
        registry.pause()
    try:
        started = time.monotonic()
        daemon = start_daemon(paths.home, registry.url("weenv/outage", **FAST))
        assert time.monotonic() - started < 10, "the daemon took its store's timeout to start"
        try:
            with daemon.http() as api:
                for _ in range(2):
                    started = time.monotonic()
                    r = api.post("/environments", json={"template": "task"})
                    elapsed = time.monotonic() - started
                    assert r.status_code == 201, r.text
                    info = r.json()
                    daemon.track(info["id"])
                    assert elapsed < 5, f"a create with the store {fault} took {elapsed:.1f} s"
                    timing = info["timing"]
                    assert timing["resolved_from"] == "node", timing  # the answer says the digest may be stale
                    assert time.time() - learned <= timing["resolved_age_s"] <= time.time() - learning, timing
                    out = api.post(f"/environments/{info['id']}/commands", json={"command": HELLO}).json()
                    assert base64.b64decode(out["stdout"]) == b"hello from the task\n", out
                    assert api.delete(f"/environments/{info['id']}").status_code == 204
                started = time.monotonic()
                r = api.post("/environments", json={"template": "never-seen"})
                assert r.status_code == 503 and r.json()["error"]["kind"] == "store_unavailable", r.text
                assert "'never-seen'" in r.json()["error"]["message"] and "never started it" in r.text
                assert time.monotonic() - started < FAST["timeout"] + 1
                assert api.get("/environments").json() == []
        finally:
            daemon.stop()  # checks that it left no mount, container or cgroup
    finally:
        if fault == "frozen":
            registry.resume()


def test_a_profile_lookup_without_begin_early_waits_at_most_its_bound(paths, registry):
    """Prefetcher.begin of a template whose profile it never looked up (no
    begin_early before it) returns within LOOKUP_WAIT_S with the registry frozen
    (it waited the store's timeout)."""
    oci = OciStore(registry.url("weenv/lookup"), **FAST)
    template = "sha256:" + "ab" * 32
    prefetch = Prefetcher(ChunkCache(paths.home / "chunks", oci), oci, lazyfs=None)  # no recording reaches lazyfs
    registry.pause()
    try:
        assert not oci.breaker.is_open  # the store is not known to be down yet: the lookup must wait
        started = time.monotonic()
        prefetch.begin("env-1", template, [])
        elapsed = time.monotonic() - started
        assert elapsed < LOOKUP_WAIT_S + 0.5, f"begin waited {elapsed:.1f} s for a frozen store"
        assert template not in prefetch._profiles  # no answer is not 'no profile'
    finally:
        registry.resume()
        prefetch.close()
        oci.close()


def test_reads_with_a_frozen_store_fail_fast_and_succeed_once_it_is_back(paths, debian_root, registry, leak_check):
    """Eight files that are not on the node: with the registry frozen, the first
    read waits one store timeout and the seven others fail at once (they waited a
    timeout each: 96 s for one pass); after SIGCONT, a probe closes the breaker."""
    fast = FAST | {"probe_interval": 0.5}  # probes between the reads below, which never wait for one
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
    oci = OciStore(registry.url("weenv/frozen"), **fast)
    copy_template(local, oci, "files")
    read_all = [
        "python3",
        "-c",
        (
            "import hashlib, sys, time\n"
            "for i in range(8):\n"
            "    t = time.monotonic()\n"
            "    try:\n"
            "        h = hashlib.sha256(open(f'/data/f{i}', 'rb').read()).hexdigest()\n"
            "    except OSError as exc:\n"
            "        h = f'errno{exc.errno}'\n"
            "    print(f'/data/f{i}', h, round(time.monotonic() - t, 2), flush=True)\n"
            "    time.sleep(float(sys.argv[1]))\n"
        ),
    ]
    apart = 1.5 * fast["probe_interval"]  # reads spread over the outage, as a process's are
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
                assert seconds[0] < fast["timeout"] + 1 and max(seconds[1:]) < 0.5, r
                assert elapsed < fast["timeout"] + 8 * apart + 2, f"8 reads with the store frozen took {elapsed:.1f} s"
            finally:
                registry.resume()
            deadline = time.monotonic() + fast["probe_interval"] + fast["probe_timeout"] + 2
            while oci.breaker.is_open and time.monotonic() < deadline:
                time.sleep(0.05)
            r = node.exec(e.id, [*read_all, "0"], timeout=120)
            lines = r.stdout.decode().split()
            assert dict(zip(lines[0::3], lines[1::3])) == digests, r
            node.destroy(e.id)
    finally:
        oci.close()
