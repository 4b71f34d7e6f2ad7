"""The lazy FUSE file system: each registered group image is one read-only file.

``MOUNTPOINT/<hex of group digest>.img`` is a regular file of ``image_size``
bytes.  A read maps its byte range to chunks (chunk ``i`` covers image bytes
``[i * chunk_size, (i + 1) * chunk_size)``) and returns their bytes from the
:class:`~weenv.node.cache.ChunkCache`, which fetches missing chunks from the
store (verified, single-flight).  The file is the source of a file-backed EROFS
mount (:mod:`weenv.node.groups`), so the kernel parses metadata and keeps read
ranges in its page cache; Python only sees reads of ranges not read before.

Threads.  pyfuse3 runs on trio; :meth:`LazyFS.start` runs ``trio.run(pyfuse3.main)``
in its own thread ("weenv-lazyfs").  Every cache access (fetch *and* local read)
happens in a trio worker thread (``trio.to_thread.run_sync``), so the FUSE
thread never blocks on the store or the disk.  The public methods may be
called from any thread except the FUSE thread; they take one short lock.
Never call mount(2) of an image, or anything else that reads through this
file system, from the FUSE thread: it would wait for itself.  Nor touch an
``mmap`` of a file under a group mount from Python in the daemon process: the
page fault happens while the thread holds the GIL, which the FUSE thread needs
to answer it (seen: a deadlock).  ``os.read``/``open().read()`` release the GIL
and are fine; a subprocess may do anything.

Concurrency.  A read stuck in a slow store fetch must not hold up reads the
node cache can answer.  Three bounds sit in front of a read; each is sized so
that stuck fetches cannot take all of it: the kernel's FUSE background queue
(EROFS reads its backing file asynchronously, so its reads are FUSE
*background* requests: at most ``max_background`` in flight, 12 by default;
measured here, 12 reads stuck in the store stopped every other group's reads),
raised to :data:`MAX_BACKGROUND` through the connection's ``fusectl`` files
(:func:`set_connection_limits`); pyfuse3's request tasks (``max_tasks``, above
that); and the worker threads, two pools: chunks already cached are read in
:data:`LOCAL_THREADS` threads of their own, fetches wait in up to
:data:`FETCH_THREADS` (trio's default is one pool of 40 for everything).

Errors.  Any failure to produce a range's bytes (a chunk whose content does not
match its digest, a store that cannot be reached, a short chunk) answers the
read with ``EIO``; wrong bytes are never returned.  The last error per group is
kept for :meth:`LazyFS.last_error`.

pyfuse3 keeps its session in module globals: one :class:`LazyFS` can run per
process at a time (:meth:`start` raises :class:`MountError` otherwise).

Never a short read.  EROFS treats a short read of its backing file as the
end of data and zero-fills the rest (fs/erofs/fileio.c,
``erofs_fileio_ki_complete``), so a read is answered in full (only the image's
end stops it) or with EIO.  When the kernel splits one EROFS request into
several FUSE reads (a 2 MiB huge-page folio became two 1 MiB reads here), an
error in any of them fails the whole request: FUSE's asynchronous direct I/O,
which libfuse enables by default, reports the first error rather than the bytes
before it (tests/test_lazy.py probes this with ``MADV_HUGEPAGE``).

Options: entry/attr timeouts of a day (images are immutable by digest);
``allow_other``; ``ro``; ``fsname=weenv``, ``subtype=weenv`` (``fuse.weenv`` in
/proc/mounts).  Files are opened with ``direct_io`` (the default), measured on
kernel 6.18 with 8 MiB files read through the EROFS mount: without it, EROFS
reads the FUSE file through its page cache, so every byte read is cached twice
(``fincore`` showed 16 MiB cached on the FUSE file after 16 MiB read through
EROFS); with it, nothing is cached there and throughput is the same or better.
The size of the reads LazyFS sees is set by EROFS's readahead (its
``erofs-N`` bdi, 128 KiB by default, raised by :mod:`weenv.node.groups`) and
capped at 1 MiB by FUSE (libfuse's 256 pages); ``max_read`` plays no part.
``keep_cache`` is set as well; it only matters with ``direct_io=False``.
"""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pyfuse3
import trio

from weenv.errors import InvalidInputError, MountError
from weenv.node.cache import ChunkCache
from weenv.node.mounts import _unescape, is_mounted, umount
from weenv.packaging.manifest import GroupManifest, check_digest

log = logging.getLogger(__name__)

TIMEOUT = 86400.0
"""Seconds the kernel may cache entries and attributes (images never change)."""

MAX_BACKGROUND = 512
"""FUSE background requests (reads) the kernel lets run at once on the connection."""
FETCH_THREADS = 256
"""Worker threads for reads that fetch from the store (they may block for long)."""
LOCAL_THREADS = 16
"""Worker threads for reads of chunks already in the node cache (local disk only)."""

_SESSION = threading.Lock()
"""Held while a LazyFS runs: pyfuse3 supports one session per process."""


@dataclass
class GroupStats:
    """Read counters of one group image since it was added."""

    reads: int = 0
    """FUSE read requests answered (successfully or not)."""
    bytes_read: int = 0
    """Bytes returned to the kernel."""
    errors: int = 0
    """Reads answered with EIO."""
    first_read: list[int] = field(default_factory=list)
    """Chunk indices in the order they were first asked for (a prefetch profile)."""
    last_error: str | None = None


@dataclass
class _Group:
    digest: str
    manifest: GroupManifest
    inode: int
    name: bytes
    mtime_ns: int
    stats: GroupStats = field(default_factory=GroupStats)
    seen: set[int] = field(default_factory=set)
    first_seq: list[int] = field(default_factory=list)  # LazyFS-wide sequence number of each first_read


def check_manifest(digest: str, manifest: GroupManifest) -> None:
    """Raise :class:`InvalidInputError` unless ``manifest`` has digest ``digest``
    (that its chunks tile the image, the manifest model itself checks)."""
    check_digest(digest)
    if manifest.digest() != digest:
        raise InvalidInputError(f"group manifest has digest {manifest.digest()}, not {digest}")


class LazyFS:
    """The FUSE file system at ``mountpoint`` (a directory, created if missing)."""

    def __init__(self, mountpoint: str | os.PathLike[str], cache: ChunkCache, *, direct_io: bool = True):
        self.mountpoint = Path(mountpoint).absolute()
        self.cache = cache
        self.direct_io = direct_io
        self._lock = threading.Lock()  # guards the registry and stats; never held across I/O
        self._stop_lock = threading.Lock()
        self._groups: dict[int, _Group] = {}  # inode -> registered group
        self._inodes: dict[str, int] = {}  # digest -> inode, never reused for other content
        self._names: dict[bytes, int] = {}  # file name -> inode of a registered group
        self._handles: dict[int, _Group] = {}  # open file handle -> group (survives remove_group)
        self._next_fh = 1
        self._seq = 0  # first reads of chunks so far, all groups (orders them across groups)
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._scope: trio.CancelScope | None = None
        self._serving = False
        self._unmounted = False  # stop() took the mount down itself
        self._fetch_threads: trio.CapacityLimiter | None = None  # made in the trio thread
        self._local_threads: trio.CapacityLimiter | None = None

    # --- the registry (any thread) -------------------------------------------------------
    def image_path(self, digest: str) -> Path:
        """``MOUNTPOINT/<hex>.img`` for group ``digest``."""
        return self.mountpoint / (check_digest(digest).split(":", 1)[1] + ".img")

    def add_group(self, digest: str, manifest: GroupManifest) -> Path:
        """Show group ``digest``'s image; return its path.  Idempotent.

        Raises :class:`InvalidInputError` if the manifest is not group ``digest``'s.
        """
        check_manifest(digest, manifest)
        with self._lock:
            inode = self._inodes.setdefault(digest, pyfuse3.ROOT_INODE + 1 + len(self._inodes))
            if inode not in self._groups:
                name = self.image_path(digest).name.encode()
                self._groups[inode] = _Group(digest, manifest, inode, name, time.time_ns())
                self._names[name] = inode
        return self.image_path(digest)

    def remove_group(self, digest: str) -> None:
        """Stop showing group ``digest`` (no error if absent).  Files already open
        keep reading; the kernel may keep a cached name for up to :data:`TIMEOUT`,
        opening it then fails with ENOENT."""
        with self._lock:
            inode = self._inodes.get(digest)
            group = self._groups.pop(inode, None) if inode is not None else None
            if group is not None:
                self._names.pop(group.name, None)

    def groups(self) -> list[str]:
        with self._lock:
            return sorted(g.digest for g in self._groups.values())

    def stats(self, digest: str) -> GroupStats:
        """A copy of group ``digest``'s read counters (zeros if never added)."""
        with self._lock:
            inode = self._inodes.get(digest)
            group = self._groups.get(inode) if inode is not None else None
            if group is None:
                group = next((g for g in self._handles.values() if g.digest == digest), None)
            if group is None:
                return GroupStats()
            s = group.stats
            return GroupStats(s.reads, s.bytes_read, s.errors, list(s.first_read), s.last_error)

    def read_seq(self) -> int:
        """How many first reads of a chunk (any group) happened so far: a mark for :meth:`first_reads`."""
        with self._lock:
            return self._seq

    def first_reads(self, digests, since: int = 0) -> list[tuple[str, int]]:
        """``(group digest, chunk index)`` of the first reads of chunks of the groups
        ``digests`` after mark ``since`` (:meth:`read_seq`), in the order they
        happened across those groups (a prefetch profile's raw material)."""
        wanted = set(digests)
        with self._lock:
            picked = [
                (seq, g.digest, idx)
                for g in self._groups.values() if g.digest in wanted
                for seq, idx in zip(g.first_seq, g.stats.first_read) if seq > since
            ]  # fmt: skip
        picked.sort()
        return [(d, i) for _seq, d, i in picked]

    def last_error(self, digest: str) -> str | None:
        """The last read error of group ``digest`` (``"ExcType: message"``), or None."""
        return self.stats(digest).last_error

    # --- life cycle ----------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def in_fuse_thread(self) -> bool:
        return self._thread is not None and threading.current_thread() is self._thread

    def _options(self) -> set[str]:
        return {"fsname=weenv", "subtype=weenv", "ro", "allow_other", "default_permissions", "noatime"}

    def start(self) -> None:
        """Mount the file system and start its thread.

        Raises :class:`MountError` if this LazyFS already ran, another LazyFS runs
        in this process, something is mounted at the mount point, or the FUSE
        mount fails.
        """
        if self._thread is not None:
            raise MountError(errno.EBUSY, f"LazyFS at {self.mountpoint} was already started")
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        if is_mounted(self.mountpoint):
            raise MountError(errno.EBUSY, f"{self.mountpoint} is already a mount point (a stale weenv daemon?)")
        if not _SESSION.acquire(blocking=False):
            raise MountError(errno.EBUSY, "another LazyFS runs in this process (pyfuse3 allows one)")
        self._thread = threading.Thread(target=self._run, name="weenv-lazyfs", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._start_error is not None:
            error, self._start_error = self._start_error, None
            self._thread.join()
            self._thread = None
            self._ready.clear()
            raise MountError(errno.EIO, f"FUSE mount at {self.mountpoint} failed: {error}") from error
        set_connection_limits(self.mountpoint, MAX_BACKGROUND)

    def _run(self) -> None:
        try:
            try:
                pyfuse3.init(_Ops(self), str(self.mountpoint), self._options())
            except BaseException as exc:
                self._start_error = exc
                if "fuse_session_mount" in str(exc):  # a session exists; free it
                    pyfuse3.close(unmount=False)
                return
            try:
                trio.run(self._trio_main)
            except BaseException:
                log.exception("lazyfs: FUSE main loop failed")
            finally:
                # Closing /dev/fuse aborts the connection: reads of a still-mounted
                # group fail (EIO) from then on, never hang.  If the mount is still
                # there (the loop died on its own), libfuse also detaches it
                # (umount2 MNT_DETACH, as root).
                pyfuse3.close(unmount=not self._unmounted)
        finally:
            self._ready.set()
            _SESSION.release()

    async def _trio_main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._fetch_threads = trio.CapacityLimiter(FETCH_THREADS)
        self._local_threads = trio.CapacityLimiter(LOCAL_THREADS)
        with trio.CancelScope() as scope:
            self._scope = scope
            self._serving = True
            self._ready.set()
            try:
                await pyfuse3.main(min_tasks=2, max_tasks=MAX_BACKGROUND + 64)
            finally:
                self._serving = False

    def _terminate(self) -> None:  # in the trio thread only
        if self._serving:
            pyfuse3.terminate()

    def _in_loop(self, fn) -> None:
        try:
            trio.from_thread.run_sync(fn, trio_token=self._token)
        except trio.RunFinishedError:
            pass

    def stop(self, timeout: float = 10.0) -> None:
        """Unmount the file system and join its thread.  Idempotent.

        First a plain umount(2), while the loop still answers.  If something still
        holds the file system (EBUSY: a group image still mounted or open), the
        last resort is a lazy unmount (MNT_DETACH): the name disappears now, and
        once the loop ends the connection is aborted, so reads of a still-mounted
        group fail (ENOTCONN/EIO) instead of hanging; its FUSE connection is freed
        when the last holder goes.  Unmount groups first to avoid that.  A read
        stuck in a fetch for more than ``timeout`` seconds is cancelled.
        Raises :class:`MountError` if the thread has not ended after ``2 * timeout``.
        """
        if self.in_fuse_thread():
            raise MountError(errno.EDEADLK, "LazyFS.stop() called from the FUSE thread")
        with self._stop_lock:
            thread = self._thread
            if thread is None or not thread.is_alive():
                return
            try:
                umount(self.mountpoint)
            except MountError as exc:
                if exc.errno == errno.EBUSY:
                    log.warning("lazyfs: %s is busy; detaching it (lazy unmount)", self.mountpoint)
                    umount(self.mountpoint, detach=True)
                elif exc.errno != errno.EINVAL:  # EINVAL: not mounted any more
                    raise
            self._unmounted = True
            self._in_loop(self._terminate)
            thread.join(timeout)
            if thread.is_alive():
                log.warning("lazyfs: reads still running after %.0f s; cancelling them", timeout)
                self._in_loop(self._scope.cancel)
                thread.join(timeout)
            if thread.is_alive():
                raise MountError(errno.EBUSY, f"LazyFS thread at {self.mountpoint} did not stop")

    # --- reads (trio thread) -------------------------------------------------------------
    async def _read(self, group: _Group, off: int, size: int) -> bytes:
        manifest = group.manifest
        size = max(0, min(size, manifest.image_size - off))
        if size == 0:
            return b""
        cs = manifest.chunk_size
        first, last = off // cs, (off + size - 1) // cs
        with self._lock:
            for i in range(first, last + 1):
                if i not in group.seen:
                    group.seen.add(i)
                    group.stats.first_read.append(i)
                    self._seq += 1
                    group.first_seq.append(self._seq)
        pieces = []
        for i in range(first, last + 1):
            start = max(off, i * cs)
            end = min(off + size, (i + 1) * cs)
            pieces.append((manifest.chunks[i], start - i * cs, end - start))
        def threads(chunk) -> trio.CapacityLimiter:  # cached chunks never wait behind fetches
            return self._local_threads if self.cache.has(chunk.digest) else self._fetch_threads

        if len(pieces) == 1:
            data = await trio.to_thread.run_sync(self.cache.read, *pieces[0], abandon_on_cancel=True,
                                                 limiter=threads(pieces[0][0]))
        else:
            parts: list[bytes] = [b""] * len(pieces)
            errors: list[Exception] = []

            async def one(k: int) -> None:
                try:
                    parts[k] = await trio.to_thread.run_sync(self.cache.read, *pieces[k], abandon_on_cancel=True,
                                                             limiter=threads(pieces[k][0]))
                except Exception as exc:  # reported below, without an ExceptionGroup around it
                    errors.append(exc)

            async with trio.open_nursery() as nursery:  # the chunks of one read in parallel
                for k in range(len(pieces)):
                    nursery.start_soon(one, k)
            if errors:
                raise errors[0]
            data = b"".join(parts)
        if len(data) != size:
            raise InvalidInputError(f"chunks of group {group.digest} are shorter than its manifest says")
        return data

    def _attrs_root(self) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = pyfuse3.ROOT_INODE
        a.st_mode = 0o040555
        a.st_nlink = 2
        a.entry_timeout = a.attr_timeout = 1.0  # the listing changes as groups come and go
        return a

    def _attrs(self, group: _Group) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = group.inode
        a.st_mode = 0o100444
        a.st_nlink = 1
        a.st_size = group.manifest.image_size
        a.st_blksize = group.manifest.block_size
        a.st_blocks = (group.manifest.image_size + 511) // 512
        a.st_mtime_ns = a.st_ctime_ns = a.st_atime_ns = group.mtime_ns
        a.entry_timeout = a.attr_timeout = TIMEOUT
        return a


class _Ops(pyfuse3.Operations):
    """pyfuse3 handlers.  pyfuse3 lets only FUSEError out of a handler (anything
    else ends the main loop), so each handler maps every error to an errno."""

    def __init__(self, fs: LazyFS):
        super().__init__()
        self.fs = fs

    def _group(self, inode: int) -> _Group:
        with self.fs._lock:
            group = self.fs._groups.get(inode)
        if group is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return group

    async def lookup(self, parent_inode, name, ctx=None):
        if parent_inode != pyfuse3.ROOT_INODE:
            raise pyfuse3.FUSEError(errno.ENOENT)
        if name in (b".", b".."):
            return self.fs._attrs_root()
        with self.fs._lock:
            group = self.fs._groups.get(self.fs._names.get(name, 0))
        if group is None:
            raise pyfuse3.FUSEError(errno.ENOENT)  # an error reply is not cached as a negative entry
        return self.fs._attrs(group)

    async def getattr(self, inode, ctx=None):
        if inode == pyfuse3.ROOT_INODE:
            return self.fs._attrs_root()
        return self.fs._attrs(self._group(inode))

    async def opendir(self, inode, ctx):
        if inode != pyfuse3.ROOT_INODE:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return inode

    async def readdir(self, fh, start_id, token):
        with self.fs._lock:
            groups = sorted(self.fs._groups.values(), key=lambda g: g.inode)
        for group in groups:
            if group.inode > start_id:  # next_id = inode: stable across adds and removes
                if not pyfuse3.readdir_reply(token, group.name, self.fs._attrs(group), group.inode):
                    break

    async def releasedir(self, fh):
        pass

    async def open(self, inode, flags, ctx):
        if flags & os.O_ACCMODE != os.O_RDONLY:
            raise pyfuse3.FUSEError(errno.EROFS)
        group = self._group(inode)
        with self.fs._lock:
            fh = self.fs._next_fh
            self.fs._next_fh += 1
            self.fs._handles[fh] = group
        return pyfuse3.FileInfo(fh=fh, keep_cache=True, direct_io=self.fs.direct_io)

    async def read(self, fh, off, size):
        with self.fs._lock:
            group = self.fs._handles.get(fh)
        if group is None:
            raise pyfuse3.FUSEError(errno.EBADF)
        try:
            data = await self.fs._read(group, off, size)
        except Exception as exc:
            message = f"{type(exc).__name__}: {exc}"
            with self.fs._lock:
                group.stats.reads += 1
                group.stats.errors += 1
                repeated, group.stats.last_error = group.stats.last_error == message, message
            # The kernel retries failed reads; log an error once, not per retry.
            log.log(logging.DEBUG if repeated else logging.ERROR,
                    "lazyfs: read of %s [%d, +%d) failed: %s", group.digest, off, size, message)
            raise pyfuse3.FUSEError(errno.EIO) from None
        with self.fs._lock:
            group.stats.reads += 1
            group.stats.bytes_read += len(data)
        return data

    async def release(self, fh):
        with self.fs._lock:
            self.fs._handles.pop(fh, None)

    async def statfs(self, ctx):
        s = pyfuse3.StatvfsData()
        s.f_bsize = s.f_frsize = 4096
        s.f_namemax = 255
        return s


_FUSECTL = Path("/sys/fs/fuse/connections")


def set_connection_limits(mountpoint: str | os.PathLike[str], max_background: int) -> bool:
    """Set the FUSE connection mounted at ``mountpoint`` to allow ``max_background``
    background requests at once (``congestion_threshold``: three quarters of it,
    the kernel's own ratio); whether it worked.

    The connection's files are ``/sys/fs/fuse/connections/N/`` (fusectl, N the
    minor device number of the mount, Linux ``Documentation/filesystems/fuse.rst``).
    Where fusectl is not mounted (containers), it is mounted in a private mount
    namespace of a short-lived ``unshare --mount`` child, so the host sees nothing.
    Best effort (root only): a failure is logged and costs only concurrency.
    """
    target = os.fspath(Path(mountpoint).absolute())
    minor = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if _unescape(fields[4]) == target:
                minor = fields[2].split(":")[1]
    if minor is None:
        log.warning("lazyfs: %s is not mounted; FUSE limits left as they are", target)
        return False
    values = {"max_background": max_background, "congestion_threshold": max_background * 3 // 4}
    conn = _FUSECTL / minor
    try:
        if conn.is_dir():
            for name, value in values.items():
                (conn / name).write_text(str(value))
            return True
        script = ('mount -t fusectl fusectl "$1" && cd "$1/$2" '
                  '&& echo "$3" > max_background && echo "$4" > congestion_threshold')
        subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh",
                        str(_FUSECTL), minor, *map(str, values.values())],
                       check=True, capture_output=True, timeout=10)  # fmt: skip
        return True
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        log.warning("lazyfs: cannot raise the FUSE background limit of %s: %s %s", target, exc,
                    detail.decode(errors="replace").strip())
        return False
