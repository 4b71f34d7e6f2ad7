"""envd's directory watches over inotify, for every sandbox of the node.

Both faces of E2B's ``filesystem.Filesystem`` watch use a :class:`Watcher`:
``WatchDir`` (a server stream: a start event, then each event as it comes,
keepalives, until the client goes, its ``Connect-Timeout-Ms`` passes or the
sandbox ends) and the polling ``CreateWatcher`` / ``GetWatcherEvents`` /
``RemoveWatcher`` (events queued until read).

Events are envd's (its fsnotify mapping of inotify): ``IN_CREATE``/``IN_MOVED_TO``
-> create, ``IN_MODIFY`` -> write, ``IN_DELETE`` -> remove, ``IN_MOVED_FROM`` ->
rename, ``IN_ATTRIB`` -> chmod (one record may give several, in envd's order:
create, rename, chmod, write, remove); the watched directory itself removed or
moved gives remove/rename named ``.``.  ``name`` is the path relative to the
watched directory.  A recursive watch also watches every directory below it,
and each directory created or moved in later, with a create event for what
is already in it then (it may have come before its watch; a name can then be
reported twice); a directory moved out is no longer watched; symbolic links
are not followed.  ``include_entry`` adds the
entry's ``EntryInfo`` to create, write and chmod events, when it still exists.

Paths resolve as the files API's do (:func:`weenv.server.e2b.files.resolve`,
confined to the sandbox's root with its mounts); each directory is opened
confined (the tree below the watched one relative to its parent's descriptor,
``O_NOFOLLOW``) and watched through that descriptor, which is closed at once:
nothing holds the sandbox's mounts.  One inotify instance and one thread serve
the node (the host's ``fs.inotify.max_user_instances`` is small and shared).

Limits, checked before anything is allocated: :data:`MAX_WATCHERS` watchers
per sandbox, :data:`MAX_DIRS` watched directories per sandbox (a recursive
watch of a bigger tree is refused, ``resource_exhausted``), :data:`MAX_QUEUED`
unread events per watcher (past it the watcher fails with ``data_loss``, as
envd's fails on fsnotify's overflow, and lets go of its inotify watches).  A
sandbox that ends (its mounts go, or the node no longer has it, checked every
:data:`LIVENESS_S` seconds) ends its watchers: streams end ``unavailable``,
polling watchers are dropped.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import os
import posixpath
import secrets
import select
import threading
import time
from collections.abc import AsyncIterator

import anyio
import anyio.to_thread
from google.protobuf.message import Message

from weenv.errors import CapacityError, InvalidInputError, NotFoundError
from weenv.host import inotify as ino
from weenv.host.procroot import fs_type
from weenv.server.e2b.connect import RpcError
from weenv.server.e2b.files import Names, SandboxFS, entry_info, fs_of, resolve
from weenv.server.e2b.processes import READ_WAIT_S, keepalive_s
from weenv.server.e2b.proto import filesystem_pb

log = logging.getLogger(__name__)
_LIMITER = anyio.CapacityLimiter(1024)
"""Worker threads waiting for watch events (apart from the request handlers' pool)."""

MAX_WATCHERS = 64
"""Watchers (streams and polling ones together) one sandbox may hold at once."""
MAX_DEPTH = 256
"""Directory levels a recursive watch follows below its path (deeper: ``resource_exhausted``)."""
MAX_DIRS = 10_000
"""Directories the watchers of one sandbox may watch together (inotify watches)."""
MAX_QUEUED = 10_000
"""Unread events one watcher holds; one more and it fails (``data_loss``)."""
LIVENESS_S = 2.0
"""How often the node is asked whether the sandboxes with watchers still run, seconds."""

MASK = (
    ino.IN_CREATE
    | ino.IN_MOVED_TO
    | ino.IN_MODIFY
    | ino.IN_DELETE
    | ino.IN_DELETE_SELF
    | ino.IN_MOVED_FROM
    | ino.IN_MOVE_SELF
    | ino.IN_ATTRIB
    | ino.IN_ONLYDIR
)
ET = filesystem_pb.EventType
_TYPES = (
    (ino.IN_CREATE | ino.IN_MOVED_TO, ET.Value("EVENT_TYPE_CREATE")),
    (ino.IN_MOVED_FROM | ino.IN_MOVE_SELF, ET.Value("EVENT_TYPE_RENAME")),
    (ino.IN_ATTRIB, ET.Value("EVENT_TYPE_CHMOD")),
    (ino.IN_MODIFY, ET.Value("EVENT_TYPE_WRITE")),
    (ino.IN_DELETE | ino.IN_DELETE_SELF, ET.Value("EVENT_TYPE_REMOVE")),
)
"""inotify bits -> envd event type, in envd's order."""
_SELF = ino.IN_DELETE_SELF | ino.IN_MOVE_SELF
_WITH_ENTRY = {ET.Value("EVENT_TYPE_CREATE"), ET.Value("EVENT_TYPE_WRITE"), ET.Value("EVENT_TYPE_CHMOD")}
NETWORK_FS = {0x6969: "NFS", 0xFF534D42: "CIFS", 0x517B: "SMB", 0xFE534D42: "SMB2", 0x65735546: "FUSE"}
"""statfs(2) ``f_type`` of the file systems envd calls network mounts (watched only when allowed)."""


class Watcher:
    """One watch of a sandbox's directory ``path`` (absolute inside it).  Its
    events are :class:`filesystem_pb.FilesystemEvent` messages, taken with
    :meth:`take` or :meth:`wait`.  Thread-safe."""

    def __init__(
        self, watches: Watches, sandbox_id: str, path: str, fs: SandboxFS, *, recursive: bool, include_entry: bool
    ):
        self.id = "w" + secrets.token_hex(12)
        self.sandbox_id, self.path, self.fs = sandbox_id, path, fs
        self.recursive, self.include_entry = recursive, include_entry
        self.names = Names(fs) if include_entry else None
        self.dirs: dict[int, str] = {}
        """inotify watch -> the directory it watches, relative to :attr:`path` (``""``: itself)."""
        self.error: RpcError | None = None
        self.closed = False
        self._watches = watches
        self._events: collections.deque[Message] = collections.deque()
        self._cond = threading.Condition()

    # --- reading ------------------------------------------------------------------------
    def take(self) -> list[Message]:
        """The events queued since the last call; raises the watcher's error once it failed."""
        with self._cond:
            return self._take()

    def wait(self, timeout: float) -> list[Message]:
        """As :meth:`take`, waiting up to ``timeout`` seconds for an event."""
        with self._cond:
            self._cond.wait_for(lambda: self._events or self.error or self.closed, timeout)
            return self._take()

    def _take(self) -> list[Message]:
        if self._events:  # what came before a failure is still delivered
            out = list(self._events)
            self._events.clear()
            return out
        if self.error is not None:
            raise self.error
        if self.closed:  # stopped under a reader (the daemon closes): never an idle loop
            raise RpcError("unavailable", f"the watch of {self.path} was stopped")
        return []

    # --- the hub's side -----------------------------------------------------------------
    def fail(self, error: RpcError) -> None:
        """End the watcher with ``error`` (the first one stays)."""
        with self._cond:
            if self.error is None:
                self.error = error
            self._cond.notify_all()

    def _push(self, events: list[Message]) -> bool:
        """Queue ``events``; False (and failed) when that passes :data:`MAX_QUEUED`."""
        with self._cond:
            if self.error is not None or self.closed:
                return True
            if len(self._events) + len(events) > MAX_QUEUED:
                self.error = RpcError(
                    "data_loss",
                    f"more than {MAX_QUEUED} events of the watch of {self.path} "
                    "were not read: events were lost, the watch ended",
                )
                self._cond.notify_all()
                return False
            self._events.extend(events)
            self._cond.notify_all()
        return True

    def handle(self, ev: ino.Event, rel: str) -> None:
        """Turn the record ``ev`` of the directory ``rel`` into events (hub thread)."""
        if ev.mask & _SELF and (rel or ev.name):
            return  # a directory below the watched one: its parent reported it
        name = posixpath.join(rel, ev.name) if ev.name else (rel or ".")
        out = []
        for bits, kind in _TYPES:
            if ev.mask & bits:
                e = filesystem_pb.FilesystemEvent(name=name, type=kind)
                if self.include_entry and kind in _WITH_ENTRY:
                    entry = self._entry(name)
                    if entry is not None:
                        e.entry.CopyFrom(entry)
                out.append(e)
        if out and not self._push(out):
            self._watches._release(self)
            return
        if self.recursive and ev.mask & ino.IN_ISDIR and ev.name:
            if ev.mask & ino.IN_MOVED_FROM:
                self._watches._unwatch_tree(self, name)
            elif ev.mask & (ino.IN_CREATE | ino.IN_MOVED_TO):
                self._watches._watch_new(self, name)

    def report_created(self, names: list[str]) -> None:
        """Queue create events for ``names`` (found in a directory that just appeared)."""
        out = []
        for name in names:
            e = filesystem_pb.FilesystemEvent(name=name, type=ET.Value("EVENT_TYPE_CREATE"))
            entry = self._entry(name) if self.include_entry else None
            if entry is not None:
                e.entry.CopyFrom(entry)
            out.append(e)
        if not self._push(out):
            self._watches._release(self)

    def _entry(self, name: str) -> Message | None:
        full = posixpath.normpath(posixpath.join(self.path, name))
        try:
            return entry_info(self.fs, full, self.fs.lstat(full), self.names)
        except (NotFoundError, InvalidInputError, OSError):
            return None  # gone already (as envd: no entry then)


class Watches:
    """Every watcher of the node's sandboxes (see the module docstring).
    ``alive(sandbox_id)`` tells whether a sandbox still runs."""

    def __init__(self, node, alive=None):
        self.node = node
        self._alive = alive or self._node_has
        self._lock = threading.Lock()
        self._by_sandbox: dict[str, dict[str, Watcher]] = {}
        self._dirs: dict[str, int] = {}  # sandbox -> directories its watchers watch
        self._marks: dict[int, dict[Watcher, str]] = {}  # inotify watch -> watcher -> its directory
        self._inotify: ino.Inotify | None = None
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._closing = False

    def _node_has(self, sandbox_id: str) -> bool:
        try:
            self.node.get(sandbox_id)
        except NotFoundError:
            return False
        return True

    # --- watchers -----------------------------------------------------------------------
    def create(
        self, sb, path: str, *, recursive: bool, include_entry: bool = False, allow_network_mounts: bool = False
    ) -> Watcher:
        """A new watcher of the directory ``path`` (absolute, resolved) of ``sb``
        (blocking).  Raises :class:`RpcError`: ``not_found`` (no such path),
        ``invalid_argument`` (not a directory; on a network file system unless
        allowed), ``resource_exhausted`` (a limit of the module docstring, or the
        host's inotify limits)."""
        self._check_room(sb.id)  # before anything is allocated (the sandbox's files hold a pidfd)
        w = Watcher(self, sb.id, path, fs_of(self.node, sb), recursive=recursive, include_entry=include_entry)
        with self._lock:
            self._check_room(sb.id, locked=True)
            self._by_sandbox.setdefault(sb.id, {})[w.id] = w
        try:
            self._start(w, allow_network_mounts)
        except BaseException:
            self.remove(sb.id, w.id)
            raise
        return w

    def _check_room(self, sandbox_id: str, *, locked: bool = False) -> None:
        """Raise RpcError unless the sandbox may have one more watcher."""
        with contextlib.nullcontext() if locked else self._lock:
            if self._closing:
                raise RpcError("unavailable", "the daemon is shutting down")
            if len(self._by_sandbox.get(sandbox_id, {})) >= MAX_WATCHERS:
                raise RpcError(
                    "resource_exhausted",
                    f"sandbox {sandbox_id} already has {MAX_WATCHERS} watchers (the most it may hold): stop one first",
                )

    def get(self, sandbox_id: str, watcher_id: str) -> Watcher:
        """The polling watcher ``watcher_id`` of the sandbox; RpcError ``not_found``."""
        with self._lock:
            w = self._by_sandbox.get(sandbox_id, {}).get(watcher_id)
        if w is None:
            raise RpcError("not_found", f"watcher with id {watcher_id} not found")
        return w

    def remove(self, sandbox_id: str, watcher_id: str) -> None:
        """Stop and forget the watcher; RpcError ``not_found`` if unknown."""
        with self._lock:
            held = self._by_sandbox.get(sandbox_id, {})
            w = held.pop(watcher_id, None)
            if not held:
                self._by_sandbox.pop(sandbox_id, None)
        if w is None:
            raise RpcError("not_found", f"watcher with id {watcher_id} not found")
        with w._cond:
            w.closed = True
            w._cond.notify_all()
        self._release(w)

    def count(self, sandbox_id: str) -> tuple[int, int]:
        """``(watchers, watched directories)`` of the sandbox now."""
        with self._lock:
            return len(self._by_sandbox.get(sandbox_id, {})), self._dirs.get(sandbox_id, 0)

    def close(self) -> None:
        """Stop every watcher and the thread (the app closes)."""
        with self._lock:
            self._closing = True
            everyone = [(sid, wid) for sid, held in self._by_sandbox.items() for wid in held]
        for sid, wid in everyone:
            with contextlib.suppress(RpcError):
                self.remove(sid, wid)
        if self._wake_w < 0:
            return  # closed already
        os.write(self._wake_w, b"x")
        if self._thread is not None:
            self._thread.join(5)
        with self._lock:
            if self._inotify is not None:
                self._inotify.close()
            wake = (self._wake_r, self._wake_w)
            self._wake_r = self._wake_w = -1
        for fd in wake:  # the wake pipe: left open before, two descriptors per closed app
            os.close(fd)

    # --- setting inotify watches -------------------------------------------------------
    def _start(self, w: Watcher, allow_network_mounts: bool) -> None:
        try:
            fd = w.fs.fs._open(w.path, os.O_RDONLY | os.O_DIRECTORY)
        except NotFoundError:
            raise RpcError("not_found", f"path {w.path} not found") from None
        except InvalidInputError as exc:
            if w.fs.exists(w.path):
                raise RpcError("invalid_argument", f"path {w.path} not a directory") from None
            raise RpcError("invalid_argument", str(exc)) from None
        with fd:
            kind = fs_type(fd)
            if kind in NETWORK_FS and not allow_network_mounts:
                raise RpcError(
                    "invalid_argument", f"cannot watch path on network filesystem ({NETWORK_FS[kind]}): {w.path}"
                )
            self._mark(w, fd, "")
            if w.recursive:
                self._walk(w, fd, "")

    def _walk(self, w: Watcher, dirfd: int, rel: str, *, report: bool = False, depth: int = 0) -> None:
        """Watch every directory below the open directory ``dirfd`` (``rel``), not
        following links; with ``report`` (a directory that just appeared), queue
        a create event for each entry found there, which may have come before
        its directory was watched.  Raises RpcError ``resource_exhausted`` for a
        tree deeper than :data:`MAX_DEPTH` below the watched path."""
        if depth >= MAX_DEPTH:
            raise RpcError(
                "resource_exhausted",
                f"{posixpath.join(w.path, rel)}: the tree is deeper than "
                f"{MAX_DEPTH} directories: watch a shallower one",
            )
        try:
            with os.scandir(dirfd) as it:
                entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
        except OSError:
            return  # gone or unreadable meanwhile: nothing to watch there
        if report and entries:
            w.report_created([posixpath.join(rel, name) for name, _ in entries])
        for name in (n for n, is_dir in entries if is_dir):
            try:
                fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dirfd)
            except OSError:
                continue  # gone, or replaced by a link, meanwhile
            try:
                child = posixpath.join(rel, name)
                self._mark(w, fd, child)
                self._walk(w, fd, child, report=report, depth=depth + 1)
            finally:
                os.close(fd)

    def _mark(self, w: Watcher, fd: int, rel: str) -> None:
        """Watch the open directory ``fd`` (``rel`` below ``w.path``) for ``w``; raises RpcError."""
        with self._lock:
            if w.closed or w.error is not None:
                raise RpcError("canceled", "the watcher was stopped while it was being set")
            if self._dirs.get(w.sandbox_id, 0) >= MAX_DIRS:
                raise RpcError(
                    "resource_exhausted",
                    f"the watchers of sandbox {w.sandbox_id} would watch more than "
                    f"{MAX_DIRS} directories: watch a smaller tree",
                )
            inotify = self._instance()
            try:
                wd = inotify.add(fd, MASK)
            except CapacityError as exc:
                raise RpcError("resource_exhausted", str(exc)) from exc
            except (NotFoundError, InvalidInputError) as exc:
                raise RpcError("not_found", f"{posixpath.join(w.path, rel)}: {exc}") from exc
            if wd not in w.dirs:
                self._dirs[w.sandbox_id] = self._dirs.get(w.sandbox_id, 0) + 1
            w.dirs[wd] = rel
            self._marks.setdefault(wd, {})[w] = rel

    def _watch_new(self, w: Watcher, rel: str) -> None:
        """A directory appeared at ``rel`` in ``w``'s tree: watch it and what is below it."""
        full = posixpath.join(w.path, rel)
        try:
            fd = w.fs.fs._open(full, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except (NotFoundError, InvalidInputError, OSError):
            return  # gone again, or a link
        try:
            with fd:
                self._mark(w, fd, rel)
                self._walk(w, fd, rel, report=True, depth=rel.count("/") + 1)
        except RpcError as exc:  # a limit: the watch cannot go on complete
            w.fail(exc)
            self._release(w)
        except Exception as exc:  # never the hub's other events: this watcher alone ends
            log.exception("watching %s of sandbox %s", full, w.sandbox_id)
            w.fail(RpcError("internal", f"watching {full}: {exc}"))
            self._release(w)

    def _unwatch_tree(self, w: Watcher, rel: str) -> None:
        """The directory ``rel`` left ``w``'s tree: stop watching it and below it for ``w``."""
        with self._lock:
            gone = [wd for wd, d in w.dirs.items() if d == rel or d.startswith(rel + "/")]
            for wd in gone:
                self._unmark(w, wd)

    def _unmark(self, w: Watcher, wd: int, *, kernel_gone: bool = False) -> None:
        """(With the lock.)  ``w`` no longer watches ``wd``; the inotify watch goes with its last watcher."""
        if w.dirs.pop(wd, None) is None:
            return
        self._dirs[w.sandbox_id] = self._dirs.get(w.sandbox_id, 1) - 1
        if self._dirs[w.sandbox_id] <= 0:
            self._dirs.pop(w.sandbox_id, None)
        users = self._marks.get(wd)
        if users is not None:
            users.pop(w, None)
            if not users:
                del self._marks[wd]
                if not kernel_gone and self._inotify is not None:
                    self._inotify.remove(wd)

    def _release(self, w: Watcher) -> None:
        """Let go of every inotify watch of ``w`` (it failed or was removed)."""
        with self._lock:
            for wd in list(w.dirs):
                self._unmark(w, wd)

    def _instance(self) -> ino.Inotify:
        """(With the lock.)  The node's inotify instance and its thread, made on first use."""
        if self._inotify is None:
            try:
                self._inotify = ino.Inotify()
            except CapacityError as exc:
                raise RpcError("resource_exhausted", str(exc)) from exc
            self._thread = threading.Thread(target=self._run, name="weenv-watch", daemon=True)
            self._thread.start()
        return self._inotify

    # --- the thread ---------------------------------------------------------------------
    def _run(self) -> None:
        inotify = self._inotify
        assert inotify is not None
        poller = select.poll()
        poller.register(inotify.fileno(), select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        checked = time.monotonic()
        while not self._closing:
            try:
                ready = poller.poll(LIVENESS_S * 1000)
                if any(fd == inotify.fileno() for fd, _ in ready):
                    self._dispatch(inotify.read())
                if time.monotonic() - checked >= LIVENESS_S:
                    checked = time.monotonic()
                    self._check_sandboxes()
            except Exception:  # never let the thread die: every watch would go silent
                log.exception("directory watch thread")
                time.sleep(0.1)

    def _dispatch(self, events: list[ino.Event]) -> None:
        for ev in events:
            if ev.mask & ino.IN_Q_OVERFLOW:
                with self._lock:
                    everyone = {w for users in self._marks.values() for w in users}
                for w in everyone:
                    w.fail(
                        RpcError(
                            "data_loss", "the kernel's inotify queue overflowed: events were lost, the watch ended"
                        )
                    )
                    self._release(w)
                continue
            with self._lock:
                targets = list(self._marks.get(ev.wd, {}).items())
                if ev.mask & ino.IN_IGNORED:  # the kernel dropped the watch (deleted, unmounted)
                    for w, _rel in targets:
                        self._unmark(w, ev.wd, kernel_gone=True)
            if ev.mask & ino.IN_UNMOUNT:
                for w, _rel in targets:
                    w.fail(
                        RpcError("unavailable", f"the file system of {w.path} in sandbox {w.sandbox_id} was unmounted")
                    )
                    self._release(w)
                continue
            for w, rel in targets:
                w.handle(ev, rel)

    def _check_sandboxes(self) -> None:
        """End the watchers of sandboxes the node no longer runs."""
        with self._lock:
            sandboxes = list(self._by_sandbox)
        for sid in sandboxes:
            if self._alive(sid):
                continue
            with self._lock:
                held = self._by_sandbox.pop(sid, {})
            for w in held.values():
                w.fail(RpcError("unavailable", f"The sandbox {sid} was not found"))
                self._release(w)


class WatchService:
    """The watch handlers of ``filesystem.Filesystem`` (``WatchDir``,
    ``CreateWatcher``, ``GetWatcherEvents``, ``RemoveWatcher``) over ``watches``."""

    def __init__(self, watches: Watches):
        self.watches = watches

    async def _create(self, req, ctx) -> Watcher:
        sb = ctx.state["sandbox"]
        path = resolve(sb, req.path, ctx.state["user"])
        make = functools.partial(
            self.watches.create,
            sb,
            path,
            recursive=req.recursive,
            include_entry=req.include_entry,
            allow_network_mounts=req.allow_network_mounts,
        )
        try:
            return await anyio.to_thread.run_sync(make)
        except NotFoundError as exc:  # the sandbox went meanwhile
            raise RpcError("unavailable", str(exc)) from exc

    async def watch_dir(self, req, ctx) -> AsyncIterator[Message]:
        """The start event, then each event as it comes, keepalives (the
        ``Keepalive-Ping-Interval`` header), until the client goes, the call's
        timeout passes (``deadline_exceeded``) or the watcher fails."""
        w = await self._create(req, ctx)
        R = filesystem_pb.WatchDirResponse
        try:
            yield R(start=R.StartEvent())
            keepalive = keepalive_s(ctx)
            now = time.monotonic()
            deadline = None if ctx.timeout is None else now + ctx.timeout
            last = now
            while True:
                waits = [READ_WAIT_S]
                if keepalive is not None:
                    waits.append(keepalive - (now - last))
                if deadline is not None:
                    waits.append(deadline - now)
                events = await anyio.to_thread.run_sync(w.wait, max(0.05, min(waits)), limiter=_LIMITER)
                for e in events:
                    yield R(filesystem=e)
                now = time.monotonic()
                if events:
                    last = now
                elif keepalive is not None and now - last >= keepalive:
                    yield R(keepalive=R.KeepAlive())
                    last = now
                if deadline is not None and now >= deadline:
                    raise RpcError("deadline_exceeded", "the watch ran for its whole timeout")
        finally:  # not awaited: it must run when the client's going cancels the stream
            with contextlib.suppress(RpcError):
                self.watches.remove(w.sandbox_id, w.id)

    async def create_watcher(self, req, ctx) -> Message:
        w = await self._create(req, ctx)
        return filesystem_pb.CreateWatcherResponse(watcher_id=w.id)

    async def get_watcher_events(self, req, ctx) -> Message:
        w = self.watches.get(ctx.state["sandbox"].id, req.watcher_id)
        return filesystem_pb.GetWatcherEventsResponse(events=w.take())

    async def remove_watcher(self, req, ctx) -> Message:
        await anyio.to_thread.run_sync(self.watches.remove, ctx.state["sandbox"].id, req.watcher_id)
        return filesystem_pb.RemoveWatcherResponse()
