"""The lazy FUSE file system: each registered group image is one read-only file.

``MOUNTPOINT/<hex of group digest>.img`` is a regular file of ``image_size``
bytes.  A read maps its byte range to chunks (chunk ``i`` covers image bytes
``[i * chunk_size, (i + 1) * chunk_size)``) and returns their bytes from the
:class:`~weenv.node.data.cache.ChunkCache`, which fetches missing chunks from the
store (verified, single-flight).  The file is the source of a file-backed EROFS
mount (:mod:`weenv.node.data.groups`), so the kernel parses metadata and keeps read
ranges in its page cache; Python only sees reads of ranges not read before.

Serving.  weenv speaks the FUSE protocol itself (:mod:`weenv.node.data.fuse.session`:
pyfuse3/libfuse cannot serve a connection that another process initialized,
which a daemon restart needs).  Reader threads answer lookups and attributes
from memory; each READ runs in a worker thread of the session (it may wait
for the store).  The public methods may be called from any thread except the
FUSE threads; they take one short lock.  Never call mount(2) of an image, or
anything else that reads through this file system, from a FUSE thread: it
would wait for itself.  Nor touch an ``mmap`` of a file under a group mount
from Python in the daemon process: the page fault happens while the thread
holds the GIL, which the FUSE threads need to answer it (seen: a deadlock).
``os.read``/``open().read()`` release the GIL and are fine; a subprocess may
do anything.

Restarts.  Inode numbers and file handles derive from the group digest (the
first 60 bits of its sha256, plus 2), so they mean the same to every daemon
of a home.  With ``run_dir`` set, :meth:`LazyFS.start` also starts the home's
FUSE holder (:mod:`weenv.node.data.fuse.holder`), which keeps the connection open
if the daemon dies.  A new daemon calls :meth:`LazyFS.take_over` (the holder
hands it the connection), registers the groups still mounted
(:meth:`add_group`), then :meth:`LazyFS.start`: the kernel resends the reads
the dead daemon never answered, and reads of the group mounts go on; they
never see ENOTCONN.  While no daemon serves, reads wait.  If the daemon
serving finds the holder gone (killed), it starts a new one.

Errors.  Any failure to produce a range's bytes (a chunk whose content does not
match its digest, a store that cannot be reached, a short chunk) answers the
read with ``EIO``; wrong bytes are never returned.  The last error per group is
kept for :meth:`LazyFS.last_error`.

Never a short read.  EROFS treats a short read of its backing file as the
end of data and zero-fills the rest (fs/erofs/fileio.c,
``erofs_fileio_ki_complete``), so a read is answered in full (only the image's
end stops it) or with EIO.  When the kernel splits one EROFS request into
several FUSE reads (a 2 MiB huge-page folio became two 1 MiB reads here), an
error in any of them fails the whole request: FUSE's asynchronous direct I/O
(``FUSE_ASYNC_DIO``, which libfuse enables by default and weenv asks for)
reports the first error rather than the bytes before it (tests/test_lazy.py
probes this with ``MADV_HUGEPAGE``).

Options: entry/attr timeouts of a day (images are immutable by digest);
``allow_other``; ``ro``; source ``weenv``, type ``fuse.weenv`` in /proc/mounts.
Files are opened with ``direct_io`` (the default), measured on
kernel 6.18 with 8 MiB files read through the EROFS mount: without it, EROFS
reads the FUSE file through its page cache, so every byte read is cached twice
(``fincore`` showed 16 MiB cached on the FUSE file after 16 MiB read through
EROFS); with it, nothing is cached there and throughput is the same or better.
The size of the reads LazyFS sees is set by EROFS's readahead (its
``erofs-N`` bdi, 128 KiB by default, raised by :mod:`weenv.node.data.groups`) and
capped at 1 MiB by FUSE (``max_pages`` 256, as libfuse sets it); ``max_read``
plays no part.
``keep_cache`` is set as well; it only matters with ``direct_io=False``.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from weenv.errors import InvalidInputError, MountError
from weenv.formats.manifest import GroupManifest, check_digest
from weenv.host.mounts import MS_NODEV, MS_NOSUID, MS_RDONLY, MountSpec, is_mounted, mount, umount
from weenv.node.data.cache import ChunkCache
from weenv.node.data.fuse import holder
from weenv.node.data.fuse import protocol as P
from weenv.node.data.fuse.session import (
    Attr,
    FuseSession,
    InitState,
    Operations,
    connection_id,
    mount_options,
    open_device,
)

log = logging.getLogger(__name__)

TIMEOUT = 86400.0
"""Seconds the kernel may cache entries and attributes (images never change)."""
MAX_RANGES = 1 << 16
"""Read ranges a group keeps while a profile records (:meth:`LazyFS.read_ranges`)."""
MS_NOATIME = 0x400
FSTYPE = "fuse.weenv"


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
    ranges: list[tuple[int, int, int]] = field(default_factory=list)  # (range seq, offset, bytes) while recording


def check_manifest(digest: str, manifest: GroupManifest) -> None:
    """Raise :class:`InvalidInputError` unless ``manifest`` has digest ``digest``
    (that its chunks tile the image, the manifest model itself checks)."""
    check_digest(digest)
    if manifest.digest() != digest:
        raise InvalidInputError(f"group manifest has digest {manifest.digest()}, not {digest}")


def inode_of(digest: str) -> int:
    """The inode number (and file handle) of group ``digest``'s image: its first
    60 bits plus 2 (never the root's 1), the same in every daemon."""
    return int(check_digest(digest).split(":", 1)[1][:15], 16) + 2


class LazyFS:
    """The FUSE file system at ``mountpoint`` (a directory, created if missing).

    ``run_dir``: where the FUSE holder keeps its socket and pid file (None: no
    holder; the connection dies with this process)."""

    def __init__(
        self,
        mountpoint: str | os.PathLike[str],
        cache: ChunkCache,
        *,
        direct_io: bool = True,
        run_dir: str | os.PathLike[str] | None = None,
    ):
        self.mountpoint = Path(mountpoint).absolute()
        self.cache = cache
        self.direct_io = direct_io
        self.run_dir = Path(run_dir).absolute() if run_dir is not None else None
        self._lock = threading.Lock()  # guards the registry and stats; never held across I/O
        self._stop_lock = threading.Lock()
        self._groups: dict[int, _Group] = {}  # inode -> group shown in the directory
        self._names: dict[bytes, int] = {}  # file name -> inode of a shown group
        self._known: dict[int, _Group] = {}  # inode -> every group added (open files keep reading)
        self._range_recorders = 0  # recordings that want read ranges (record_ranges)
        self._rseq = 0
        self._seq = 0  # first reads of chunks so far, all groups (orders them across groups)
        self._mount_reads: dict[str, list[int]] = {}  # group digest -> chunks its last mount read (note_mount)
        self._fd: int | None = None
        self._resume: InitState | None = None
        self._session: FuseSession | None = None
        self._conn: int | None = None
        self._holder: subprocess.Popen | None = None
        self._watcher: threading.Thread | None = None
        self._wake_r, self._wake_w = -1, -1
        self._stopping = False
        self._started = False  # serving (until stop)
        self._ran = False  # start() succeeded once: a LazyFS runs once

    # --- the registry (any thread) -------------------------------------------------------
    def image_path(self, digest: str) -> Path:
        """``MOUNTPOINT/<hex>.img`` for group ``digest``."""
        return self.mountpoint / (check_digest(digest).split(":", 1)[1] + ".img")

    def add_group(self, digest: str, manifest: GroupManifest) -> Path:
        """Show group ``digest``'s image; return its path.  Idempotent.

        Raises :class:`InvalidInputError` if the manifest is not group ``digest``'s.
        """
        check_manifest(digest, manifest)
        inode = inode_of(digest)
        with self._lock:
            group = self._known.get(inode)
            if group is None:
                name = self.image_path(digest).name.encode()
                group = self._known[inode] = _Group(digest, manifest, inode, name, time.time_ns())
            self._groups[inode] = group
            self._names[group.name] = inode
        return self.image_path(digest)

    def remove_group(self, digest: str) -> None:
        """Stop showing group ``digest`` (no error if absent).  Files already open
        keep reading; the kernel may keep a cached name for up to :data:`TIMEOUT`,
        opening it then fails with ENOENT."""
        with self._lock:
            group = self._groups.pop(inode_of(digest), None)
            if group is not None:
                self._names.pop(group.name, None)

    def groups(self) -> list[str]:
        with self._lock:
            return sorted(g.digest for g in self._groups.values())

    def manifests(self) -> list[tuple[str, GroupManifest]]:
        """``(digest, manifest)`` of every group ever added (which groups a chunk is in)."""
        with self._lock:
            return [(g.digest, g.manifest) for g in self._known.values()]

    def stats(self, digest: str) -> GroupStats:
        """A copy of group ``digest``'s read counters (zeros if never added)."""
        with self._lock:
            group = self._known.get(inode_of(digest))
            if group is None:
                return GroupStats()
            s = group.stats
            return GroupStats(s.reads, s.bytes_read, s.errors, list(s.first_read), s.last_error)

    def read_seq(self) -> int:
        """How many first reads of a chunk (any group) happened so far: a mark for :meth:`first_reads`."""
        with self._lock:
            return self._seq

    def record_ranges(self, on: bool) -> None:
        """Start (``on``) or end one recorder of read ranges (:meth:`read_ranges`);
        when the last one ends, the ranges are dropped."""
        with self._lock:
            self._range_recorders = max(0, self._range_recorders + (1 if on else -1))
            if not self._range_recorders:
                for g in self._groups.values():
                    g.ranges.clear()

    def read_ranges(self, digests) -> list[tuple[str, int, int]]:
        """``(group digest, offset, bytes)`` of every read of the groups
        ``digests`` that reached this file system while a recorder was on, in
        order (at most :data:`MAX_RANGES` per group): page-cache misses, finer
        than chunks, so a profile can name the files a start read."""
        wanted = set(digests)
        with self._lock:
            picked = [
                (seq, g.digest, off, n) for g in self._groups.values() if g.digest in wanted for seq, off, n in g.ranges
            ]
        picked.sort()
        return [(d, off, n) for _seq, d, off, n in picked]

    def note_mount(self, digest: str, since: int) -> None:
        """Remember the chunks of group ``digest`` first read after mark
        ``since`` (:meth:`read_seq`, taken before its mount): what mounting it
        reads (:meth:`mount_reads`), kept after the group is removed."""
        reads = [i for _d, i in self.first_reads([digest], since)]
        with self._lock:
            self._mount_reads[digest] = reads

    def mount_reads(self, digest: str) -> list[int]:
        """Chunk indexes of group ``digest`` that its last mount on this node read
        (:meth:`note_mount`), in order; empty if not known."""
        with self._lock:
            return list(self._mount_reads.get(digest, ()))

    def first_reads(self, digests, since: int = 0, until: int | None = None) -> list[tuple[str, int]]:
        """``(group digest, chunk index)`` of the first reads of chunks of the groups
        ``digests`` after mark ``since`` (:meth:`read_seq`) and, with ``until``
        (another mark), not after it, in the order they happened across those
        groups (a prefetch profile's raw material)."""
        wanted = set(digests)
        with self._lock:
            picked = [
                (seq, g.digest, idx)
                for g in self._groups.values()
                if g.digest in wanted
                for seq, idx in zip(g.first_seq, g.stats.first_read)
                if seq > since and (until is None or seq <= until)
            ]
        picked.sort()
        return [(d, i) for _seq, d, i in picked]

    def drop_page_cache(self) -> int:
        """Make the kernel drop the cached pages of every group image this LazyFS
        served (``FUSE_NOTIFY_INVAL_INODE``): an EROFS mount reads its metadata
        through the page cache of its image file, and those pages outlive an
        unmount (the image keeps its inode).  For cold-start measurements, with
        the groups unmounted.  Returns how many images the kernel knew."""
        with self._lock:
            inodes = list(self._known)
        session = self._session
        if session is None:
            return 0
        known = 0
        for inode in inodes:
            try:
                known += session.invalidate_inode(inode)
            except OSError as exc:  # the pages stay: a measurement is less cold, nothing breaks
                log.warning("cannot drop the cached pages of group image inode %d: %s", inode, exc)
        return known

    def last_error(self, digest: str) -> str | None:
        """The last read error of group ``digest`` (``"ExcType: message"``), or None."""
        return self.stats(digest).last_error

    # --- life cycle ----------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._session is not None and self._session.running

    @property
    def resumed(self) -> bool:
        """Whether this LazyFS serves a connection taken over from an earlier daemon."""
        return self._resume is not None

    def in_fuse_thread(self) -> bool:
        return self._session is not None and self._session.owns_current_thread()

    def take_over(self) -> bool:
        """Take the connection an earlier daemon of this home left with the FUSE
        holder; whether there was one to take (call :meth:`start` next, after
        :meth:`add_group` of every group still mounted).  False (nothing taken)
        without ``run_dir``, without a holder, or when nothing is mounted at the
        mount point (a stale holder is stopped then)."""
        if self.run_dir is None or self._ran or self._fd is not None:
            return False
        if holder.pid_of(self.run_dir) is None:
            return False
        if not _is_fuse_mount(self.mountpoint):
            holder.release(self.run_dir)
            return False
        got = holder.take(self.run_dir)
        if got is None:
            return False
        fd, state = got
        try:
            self._resume = InitState.from_dict(state)
        except (KeyError, TypeError, ValueError):
            os.close(fd)
            log.warning("lazyfs: the FUSE holder's state is unreadable: %r", state)
            return False
        self._fd = fd
        log.info("lazyfs: took over the FUSE connection of %s from its holder", self.mountpoint)
        return True

    def start(self) -> None:
        """Mount the file system (or serve the connection :meth:`take_over` took)
        and start serving; with ``run_dir``, make sure a FUSE holder keeps the
        connection.

        Raises :class:`MountError` if this LazyFS already ran, something is
        mounted at the mount point (and nothing was taken over), or the FUSE
        mount fails.
        """
        if self._ran:
            raise MountError(errno.EBUSY, f"LazyFS at {self.mountpoint} was already started")
        if self._fd is None:
            self.mountpoint.mkdir(parents=True, exist_ok=True)
            self._mount()
        else:  # touch nothing under the mount point before serving: it would wait for us
            self._session = FuseSession(self._fd, _Ops(self), name="weenv-lazyfs")
            self._conn = connection_id(self.mountpoint)
            try:
                self._session.start(resume=self._resume)
            except OSError as exc:
                self._close_fd()
                raise MountError(exc.errno or errno.EIO, f"cannot serve the FUSE connection taken over: {exc}") from exc
        self._started = self._ran = True
        if self.run_dir is not None:
            self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC)
            self._ensure_holder()
            self._watcher = threading.Thread(target=self._watch_holder, name="weenv-lazyfs-holder", daemon=True)
            self._watcher.start()

    def _mount(self) -> None:
        if is_mounted(self.mountpoint):
            raise MountError(errno.EBUSY, f"{self.mountpoint} is already a mount point (a stale weenv daemon?)")
        try:
            fd = open_device()
        except OSError as exc:
            raise MountError(exc.errno or errno.ENODEV, f"cannot open /dev/fuse: {exc}") from exc
        self._fd = fd
        try:
            options = mount_options(fd, "default_permissions,allow_other")
            mount(
                MountSpec(FSTYPE, "weenv", str(self.mountpoint), options, MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOATIME)
            )
        except MountError as exc:
            self._close_fd()
            raise MountError(exc.errno, f"FUSE mount at {self.mountpoint} failed: {exc}") from exc
        self._conn = connection_id(self.mountpoint)
        self._session = FuseSession(fd, _Ops(self), name="weenv-lazyfs")
        self._session.start()
        if not self._session.initialized.wait(10):
            self._session.abort(self._conn)
            umount(self.mountpoint, detach=True)
            self._session.join(5)
            self._close_fd()
            raise MountError(errno.ETIMEDOUT, f"the kernel did not initialize the FUSE mount at {self.mountpoint}")

    def _close_fd(self) -> None:
        if self._fd is not None:
            if self._session is not None:
                self._session.close()
            else:
                os.close(self._fd)
            self._fd = None

    # --- the holder ----------------------------------------------------------------------
    def _ensure_holder(self) -> None:
        """Start a holder unless one runs (a taken-over connection keeps its own)."""
        if holder.pid_of(self.run_dir) is not None:
            return
        try:
            self._holder = holder.spawn(self.run_dir, self._fd, self._session.init.to_dict())
        except OSError as exc:
            log.warning("lazyfs: cannot start the FUSE holder (a daemon restart will lose the mounts): %s", exc)

    def _watch_holder(self) -> None:
        """Start a new holder whenever the one running dies (killed) while we serve."""
        while not self._stopping:
            pid = holder.pid_of(self.run_dir)
            pidfd = None
            if pid is not None:
                try:
                    pidfd = os.pidfd_open(pid)
                except OSError:
                    pidfd = None
            try:
                watch = [self._wake_r] + ([pidfd] if pidfd is not None else [])
                select.select(watch, [], [], None if pidfd is not None else 1.0)
            finally:
                if pidfd is not None:
                    os.close(pidfd)
            if self._stopping:
                return
            if self._holder is not None and self._holder.poll() is not None:
                self._holder = None  # reaped
            if holder.pid_of(self.run_dir) is None and self.running:
                log.warning("lazyfs: the FUSE holder of %s is gone; starting a new one", self.mountpoint)
                self._ensure_holder()

    def _stop_holder(self) -> None:
        if self._wake_w >= 0:
            os.write(self._wake_w, b"x")
        if self._watcher is not None:
            self._watcher.join(10)
        if self.run_dir is not None:
            holder.release(self.run_dir)
        if self._holder is not None:
            self._holder.wait(10)
            self._holder = None
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._wake_r = self._wake_w = -1

    def stop(self, timeout: float = 10.0) -> None:
        """Unmount the file system, end the connection and the holder, stop serving.
        Idempotent.

        First a plain umount(2), which ends the connection.  If something still
        holds the file system (EBUSY: a group image still mounted or open), the
        last resort is a lazy unmount (MNT_DETACH) and an abort of the
        connection: the name disappears now, and reads of a still-mounted group
        fail (ENOTCONN/EIO) instead of hanging.  Unmount groups first to avoid
        that.  Raises :class:`MountError` if the FUSE threads have not ended
        after ``timeout`` seconds.
        """
        if self.in_fuse_thread():
            raise MountError(errno.EDEADLK, "LazyFS.stop() called from the FUSE thread")
        with self._stop_lock:
            if not self._started:
                if self._fd is not None:  # taken over, never served: leave the connection to its holder
                    self._close_fd()
                return
            self._stopping = True
            aborted = False
            try:
                umount(self.mountpoint)
            except MountError as exc:
                if exc.errno == errno.EBUSY:
                    log.warning("lazyfs: %s is busy; detaching it (lazy unmount)", self.mountpoint)
                    umount(self.mountpoint, detach=True)
                    aborted = self._session.abort(self._conn)
                elif exc.errno != errno.EINVAL:  # EINVAL: not mounted any more
                    raise
            self._stop_holder()
            if not self._session.join(timeout) and not aborted:
                self._session.abort(self._conn)
                self._session.join(timeout)
            if self._session.running:
                raise MountError(errno.EBUSY, f"LazyFS threads at {self.mountpoint} did not stop")
            self._close_fd()
            self._started = False

    # --- reads (worker threads) ----------------------------------------------------------
    def _read(self, group: _Group, off: int, size: int) -> bytes:
        manifest = group.manifest
        size = max(0, min(size, manifest.image_size - off))
        if size == 0:
            return b""
        cs = manifest.chunk_size
        first, last = off // cs, (off + size - 1) // cs
        with self._lock:
            if self._range_recorders and len(group.ranges) < MAX_RANGES:
                self._rseq += 1
                group.ranges.append((self._rseq, off, size))
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
        if len(pieces) == 1:
            data = self.cache.read(*pieces[0])
        else:  # the chunks of one read in parallel (each may be a store fetch)
            parts: list[bytes] = [b""] * len(pieces)
            errors: list[Exception] = []

            def one(k: int) -> None:
                try:
                    parts[k] = self.cache.read(*pieces[k])
                except Exception as exc:
                    errors.append(exc)

            helpers = [threading.Thread(target=one, args=(k,), daemon=True) for k in range(1, len(pieces))]
            for t in helpers:
                t.start()
            one(0)
            for t in helpers:
                t.join()
            if errors:
                raise errors[0]
            data = b"".join(parts)
        if len(data) != size:
            raise InvalidInputError(f"chunks of group {group.digest} are shorter than its manifest says")
        return data

    def _attrs_root(self) -> Attr:
        return Attr(P.ROOT_ID, 0o040555, nlink=2, timeout=1.0)  # the listing changes as groups come and go

    def _attrs(self, group: _Group) -> Attr:
        m = group.manifest
        return Attr(
            group.inode, 0o100444, size=m.image_size, blksize=m.block_size, mtime_ns=group.mtime_ns, timeout=TIMEOUT
        )


class _Ops(Operations):
    """The file system's answers: the root directory and one file per group."""

    def __init__(self, fs: LazyFS):
        self.fs = fs

    def _group(self, inode: int, *, shown: bool = False) -> _Group:
        with self.fs._lock:
            group = (self.fs._groups if shown else self.fs._known).get(inode)
        if group is None:
            raise OSError(errno.ENOENT, "no such group")
        return group

    def lookup(self, parent: int, name: bytes) -> Attr:
        if parent != P.ROOT_ID:
            raise OSError(errno.ENOENT, "not a directory")
        if name in (b".", b".."):
            return self.fs._attrs_root()
        with self.fs._lock:
            inode = self.fs._names.get(name, 0)
        return self.fs._attrs(self._group(inode, shown=True))  # an error reply is not cached as a negative entry

    def getattr(self, ino: int) -> Attr:
        if ino == P.ROOT_ID:
            return self.fs._attrs_root()
        return self.fs._attrs(self._group(ino))

    def opendir(self, ino: int) -> int:
        if ino != P.ROOT_ID:
            raise OSError(errno.ENOTDIR, "not a directory")
        return 0

    def readdir(self, fh: int, offset: int) -> list[tuple[int, int, bytes, int]]:
        with self.fs._lock:
            groups = sorted(self.fs._groups.values(), key=lambda g: g.inode)
        # the cookie of an entry is its inode: stable across adds and removes
        return [(g.inode, g.inode, g.name, P.DT_REG) for g in groups if g.inode > offset]

    def open(self, ino: int, flags: int) -> tuple[int, int]:
        if flags & os.O_ACCMODE != os.O_RDONLY:
            raise OSError(errno.EROFS, "read-only")
        group = self._group(ino, shown=True)
        return group.inode, P.FOPEN_KEEP_CACHE | (P.FOPEN_DIRECT_IO if self.fs.direct_io else 0)

    def read(self, fh: int, offset: int, size: int) -> bytes:
        group = self._group(fh)  # the handle is the inode: valid in every daemon
        try:
            data = self.fs._read(group, offset, size)
        except Exception as exc:
            message = f"{type(exc).__name__}: {exc}"
            with self.fs._lock:
                group.stats.reads += 1
                group.stats.errors += 1
                repeated, group.stats.last_error = group.stats.last_error == message, message
            # The kernel retries failed reads; log an error once, not per retry.
            log.log(
                logging.DEBUG if repeated else logging.ERROR,
                "lazyfs: read of %s [%d, +%d) failed: %s",
                group.digest,
                offset,
                size,
                message,
            )
            raise OSError(errno.EIO, message) from None
        with self.fs._lock:
            group.stats.reads += 1
            group.stats.bytes_read += len(data)
        return data


def _is_fuse_mount(point: Path) -> bool:
    from weenv.host.mounts import mounts_under

    return any(t == FSTYPE and p == str(point) for t, p in mounts_under(point))
