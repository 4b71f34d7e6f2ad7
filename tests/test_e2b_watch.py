"""E2B's directory watch (``files.watch_dir``) driven by the official ``e2b``
SDK against a real ``weenv serve`` (issue 17): the polling watcher (sync SDK:
CreateWatcher / GetWatcherEvents / RemoveWatcher) and the streamed WatchDir
(async SDK), each event kind as envd names it, recursion, entries, the limits
(watchers and directories per sandbox, unread events), clear errors, and no
inotify watch left in the daemon after a stop, a failure or the sandbox's
end.  The daemon fixture is test_e2b's (one per module)."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

e2b = pytest.importorskip("e2b")

from e2b import AsyncSandbox, Sandbox
from e2b import FilesystemEventType as T
from e2b.exceptions import FileNotFoundException, InvalidArgumentException, SandboxException

from test_e2b import TEMPLATE, daemon  # noqa: F401  (the module's daemon fixture)
from weenv.server.e2b import watch


def inotify_watches(daemon) -> int:  # noqa: F811
    """inotify watches the daemon holds now (its instances' fdinfo)."""
    pid, n = daemon.daemon.proc.pid, 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") != "anon_inode:inotify":
                continue
            with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                n += sum(1 for line in f if line.startswith("inotify wd:"))
        except OSError:
            continue
    return n


def until(check, timeout: float = 15.0, what: str = ""):
    deadline = time.monotonic() + timeout
    while not (got := check()):
        assert time.monotonic() < deadline, what or check
        time.sleep(0.1)
    return got


def collect(handle, want: set, timeout: float = 15.0) -> list[tuple]:
    """``(type, name)`` of the polling watcher's events until ``want`` are all in."""
    seen: list[tuple] = []
    until(
        lambda: seen.extend((e.type, e.name) for e in handle.get_new_events()) or want <= set(seen),
        timeout,
        f"wanted {want}",
    )
    return seen


def watched(daemon, s: Sandbox, path: str, **kw) -> tuple[int, object]:  # noqa: F811
    """The daemon's inotify watches before, and a new watcher of ``path`` (made first)."""
    base = inotify_watches(daemon)
    s.commands.run(f"mkdir -p {path}")
    return base, s.files.watch_dir(path, **kw)


@pytest.fixture(scope="module")
def sbx(daemon):  # noqa: F811
    s = Sandbox.create(TEMPLATE, timeout=600)
    yield s
    s.kill()


def test_polling_watcher_reports_each_kind(daemon, sbx):  # noqa: F811
    s = sbx
    s.commands.run("mkdir -p /tmp/w/sub")
    base, h = watched(daemon, s, "/tmp/w")
    assert inotify_watches(daemon) == base + 1  # not recursive: the directory alone
    s.commands.run("echo x > /tmp/w/a && chmod 600 /tmp/w/a && mv /tmp/w/a /tmp/w/b && rm /tmp/w/b")
    seen = collect(
        h, {(T.CREATE, "a"), (T.WRITE, "a"), (T.CHMOD, "a"), (T.RENAME, "a"), (T.CREATE, "b"), (T.REMOVE, "b")}
    )
    assert seen.index((T.CREATE, "a")) < seen.index((T.RENAME, "a")) < seen.index((T.REMOVE, "b"))
    s.files.write("/tmp/w/up.txt", "through the files API")  # the host side's writes are seen too
    collect(h, {(T.CREATE, "up.txt"), (T.WRITE, "up.txt")})
    s.commands.run("touch /tmp/w/sub/deep && echo marker > /tmp/w/marker")
    seen = collect(h, {(T.CREATE, "marker")})
    assert not [n for _, n in seen if n.startswith("sub/")]  # not recursive
    h.stop()
    assert inotify_watches(daemon) == base


def test_recursive_watch_follows_new_directories(daemon, sbx):  # noqa: F811
    s = sbx
    base = inotify_watches(daemon)
    s.commands.run("mkdir -p /tmp/r/old/older && ln -sfn /etc /tmp/r/etc-link")
    h = s.files.watch_dir("/tmp/r", recursive=True)
    assert inotify_watches(daemon) == base + 3  # r, old, older: the link is not followed
    s.commands.run("touch /tmp/r/old/older/f && mkdir -p /tmp/r/n1/n2 && echo hi > /tmp/r/n1/n2/g")
    collect(h, {(T.CREATE, "old/older/f"), (T.CREATE, "n1"), (T.CREATE, "n1/n2/g")})
    s.commands.run("mv /tmp/r/n1 /tmp/n1-out && touch /tmp/n1-out/n2/after && mv /tmp/r/old /tmp/r/new")
    seen = collect(h, {(T.RENAME, "n1"), (T.RENAME, "old"), (T.CREATE, "new")})
    assert not [n for _, n in seen if "after" in n]  # moved out: no longer watched
    s.commands.run("touch /tmp/r/new/older/moved-in")
    collect(h, {(T.CREATE, "new/older/moved-in")})
    s.commands.run("rm -rf /tmp/r/new")
    collect(h, {(T.REMOVE, "new")})
    h.stop()
    assert until(lambda: inotify_watches(daemon) == base)


def test_bad_watches_are_refused_clearly(daemon, sbx):  # noqa: F811
    s = sbx
    with pytest.raises(FileNotFoundException, match="not found"):
        s.files.watch_dir("/tmp/no/such/dir")
    s.commands.run("echo f > /tmp/a-file")
    with pytest.raises(InvalidArgumentException, match="not a directory"):
        s.files.watch_dir("/tmp/a-file")
    with pytest.raises(SandboxException, match="not found"):  # a watcher id that is not one
        from e2b.sandbox_sync.filesystem.watch_handle import WatchHandle

        h = s.files.watch_dir("/tmp")
        WatchHandle(h._rpc, "wnosuchwatcher", h._connection_config, h._envd_version).get_new_events()
    h.stop()
    with pytest.raises(SandboxException, match="not found"):  # removed already
        h.stop()


def test_watchers_and_directories_per_sandbox_are_bounded(daemon):  # noqa: F811
    s = Sandbox.create(TEMPLATE, timeout=300)
    try:
        base = inotify_watches(daemon)
        handles = [s.files.watch_dir("/tmp") for _ in range(watch.MAX_WATCHERS)]
        with pytest.raises(SandboxException, match=f"{watch.MAX_WATCHERS} watchers"):
            s.files.watch_dir("/tmp")
        handles.pop().stop()
        handles.append(s.files.watch_dir("/tmp"))  # room again
        for h in handles:
            h.stop()
        assert inotify_watches(daemon) == base

        s.commands.run(f"mkdir -p /tmp/many && cd /tmp/many && seq {watch.MAX_DIRS} | xargs mkdir")
        with pytest.raises(SandboxException, match=f"more than {watch.MAX_DIRS} directories"):
            s.files.watch_dir("/tmp/many", recursive=True)  # the tree and /tmp/many itself: one too many
        assert inotify_watches(daemon) == base  # what it had set is let go
        h = s.files.watch_dir("/tmp/many")
        assert inotify_watches(daemon) == base + 1
        h.stop()

        # a tree deeper than the bound (Python's recursion limit broke the walk at ~1,000 levels)
        deep = "/".join(["d"] * (watch.MAX_DEPTH + 5))
        assert s.commands.run(f"mkdir -p /tmp/deep/{deep}").exit_code == 0
        with pytest.raises(SandboxException, match=f"deeper than {watch.MAX_DEPTH}"):
            s.files.watch_dir("/tmp/deep", recursive=True)
        assert inotify_watches(daemon) == base
    finally:
        s.kill()


def test_unread_events_are_bounded(daemon, sbx):  # noqa: F811
    s = sbx
    base, h = watched(daemon, s, "/tmp/flood")
    s.commands.run(f"cd /tmp/flood && seq {watch.MAX_QUEUED + 10} | xargs touch")

    def failed():
        try:
            h.get_new_events()
        except SandboxException as exc:
            return exc
        return None

    err = until(failed, 30)
    assert "events were lost" in str(err)
    assert until(lambda: inotify_watches(daemon) == base)  # the failed watcher let go of its watch
    h.stop()


def test_sandbox_end_stops_its_watchers(daemon):  # noqa: F811
    base = inotify_watches(daemon)
    s = Sandbox.create(TEMPLATE, timeout=120)
    s.commands.run("mkdir -p /tmp/x/y")
    s.files.watch_dir("/tmp/x", recursive=True)
    s.files.watch_dir("/tmp")
    assert inotify_watches(daemon) == base + 3
    s.kill()
    assert until(lambda: inotify_watches(daemon) == base, 15)


def test_streamed_watch_async(daemon):  # noqa: F811
    async def main():
        base = inotify_watches(daemon)
        s = await AsyncSandbox.create(TEMPLATE, timeout=120)
        try:
            await s.commands.run("mkdir -p /tmp/s/sub")
            events, ended = [], []
            h = await s.files.watch_dir(
                "/tmp/s", on_event=events.append, on_exit=ended.append, recursive=True, include_entry=True
            )
            await s.commands.run("echo 1 > /tmp/s/sub/f && chmod 644 /tmp/s/sub/f && rm /tmp/s/sub/f")
            deadline = time.monotonic() + 15
            while {(T.CREATE, "sub/f"), (T.REMOVE, "sub/f")} - {(e.type, e.name) for e in events}:
                assert time.monotonic() < deadline, events
                await asyncio.sleep(0.1)
            create = next(e for e in events if (e.type, e.name) == (T.CREATE, "sub/f"))
            assert create.entry is None or create.entry.path == "/tmp/s/sub/f"
            assert next(e for e in events if e.type == T.REMOVE).entry is None  # envd: none for removes
            await h.stop()
            assert ended == [None]
            deadline = time.monotonic() + 10
            while inotify_watches(daemon) != base:  # the stream's end let go of the watches
                assert time.monotonic() < deadline
                await asyncio.sleep(0.1)

            short = []
            await s.files.watch_dir("/tmp/s", on_event=events.append, on_exit=short.append, timeout=2)
            deadline = time.monotonic() + 15
            while not short:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.1)
            assert short[0] is not None  # ended by its timeout, with an error
            while inotify_watches(daemon) != base:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.1)

            killed = []
            await s.files.watch_dir("/tmp/s", on_event=events.append, on_exit=killed.append, timeout=0)
            await s.kill()
            deadline = time.monotonic() + 20
            while not killed:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.1)
            assert isinstance(killed[0], SandboxException)
        finally:
            await s.kill()
        deadline = time.monotonic() + 10
        while inotify_watches(daemon) != base:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.1)

    asyncio.run(main())
