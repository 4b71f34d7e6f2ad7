"""A real ``weenv serve`` seen as E2B clients see it, for the template and Harbor tests."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path

import httpx

from conftest import system_snapshot
from daemon_fixture import environ, start_daemon
from weenv.store.file import FileStore


class E2B:
    """The daemon, its E2B URLs and key, and what a build may leave behind."""

    def __init__(self, daemon, registry):
        self.daemon = daemon
        self.key = "e2b_" + daemon.key
        self.api_url = daemon.url + "/e2b"
        self.sandbox_url = daemon.url + "/e2b/envd"
        self.registry = registry

    def api(self) -> httpx.Client:
        return httpx.Client(base_url=self.api_url, headers={"x-api-key": self.key}, timeout=120)

    def environment_ids(self) -> list[str]:
        with self.daemon.http() as c:
            return [e["id"] for e in c.get("/environments").json()]

    def leftovers(self) -> dict:
        """Build environments, mounts and work dirs a build may leave."""
        build = self.daemon.home / "build"
        with open("/proc/mounts") as f:
            mounts = [line.split()[1] for line in f if line.split()[1].startswith(str(build))]
        cgroups = sorted(str(p) for p in Path("/sys/fs/cgroup").glob("*/weenv-*") if p.is_dir())
        return {
            "mounts": mounts,
            "work": sorted(p.name for p in build.iterdir()) if build.is_dir() else [],
            "environments": self.environment_ids(),
            "cgroups": cgroups,
        }

    def build_runs(self) -> list[list[str]]:
        """Per build, oldest first, the steps it ran (not from the cache), as
        their Dockerfile lines: the build logs' ``[builder N/M] LINE`` entries."""
        out = []
        with self.api() as c:
            builds = sorted(
                (b["createdAt"], t["templateID"], b["buildID"])
                for t in c.get("/templates").json()
                for b in c.get(f"/templates/{t['templateID']}").json()["builds"]
            )
            for _, tid, bid in builds:
                entries, offset = [], 0
                while page := c.get(f"/templates/{tid}/builds/{bid}/status", params={"logsOffset": offset}).json()[
                    "logEntries"
                ]:
                    entries += page
                    offset += len(page)
                out.append(
                    [
                        m.split("] ", 1)[1]
                        for m in (e["message"] for e in entries)
                        if re.match(r"^\[builder \d+/\d+\] (RUN|COPY|WORKDIR|USER) ", m) and ": done in" not in m
                    ]
                )
        return out


@contextlib.contextmanager
def e2b_daemon(root: Path, registry, store_url: str | None = None, **daemon_env: str) -> Iterator[E2B]:
    """A daemon with home and store under ``root`` (``store_url``: another
    store; ``daemon_env``: variables it starts with), the ``e2b`` SDK's
    variables pointing at it for the block; at the end it is stopped and
    nothing of it may be left (mounts, loops, cgroups, FUSE connections,
    interfaces)."""
    before = system_snapshot(root)
    with environ(**daemon_env):
        d = E2B(start_daemon(root / "home", store_url or FileStore(root / "store").url), registry)
    try:
        with environ(E2B_API_URL=d.api_url, E2B_SANDBOX_URL=d.sandbox_url, E2B_API_KEY=d.key):
            yield d
    finally:
        d.daemon.stop()
        after = system_snapshot(root)
        for kind in after:
            assert not set(after[kind]) - set(before[kind]), f"leaked {kind}"
