"""A FUSE server on a ``/dev/fuse`` file descriptor, for a small read-only file system.

Why not libfuse (pyfuse3): a libfuse session must see the connection's INIT
request first (``fuse_ll_process_buf`` answers anything else with EIO until
``got_init``), and libfuse 3.14 has no way to start a session on a connection
that another process initialized.  Taking over the connection of a daemon that
was killed (:mod:`weenv.node.data.fuse.holder`) needs exactly that, so weenv speaks
the protocol (:mod:`weenv.node.data.fuse.protocol`) itself; its file system answers
nine operations.

Threads.  ``readers`` threads block in read(2) on the descriptor (the kernel
hands each request to one of them).  READ requests go to a pool of up to
``max_workers`` worker threads (they may wait for the store); every other
request is answered by the reader at once from memory.  Replies are written
with one writev(2) each; writes from several threads are fine (the kernel
matches replies by ``unique``).  :meth:`FuseSession.owns_current_thread`
tells whether the caller is one of these threads (such a caller must never
wait for a read of this file system: it would wait for itself).

Start: :meth:`FuseSession.start` with ``resume=None`` expects the kernel's
INIT (a fresh mount) and answers it; :attr:`FuseSession.init` then holds what
was negotiated.  With ``resume=`` a previous server's :class:`InitState`, the
connection is already initialized: the session sends ``FUSE_NOTIFY_RESEND``
(Linux >= 6.9), so that requests the previous server read but never answered
(it was killed while serving them) are read again and answered now, instead of
leaving their callers waiting forever.

End: the readers stop when the connection ends: the file system is unmounted
(the kernel aborts the connection with its last mount) or
:meth:`FuseSession.abort` aborts it (through the fusectl file system,
``/sys/fs/fuse/connections/N/abort``); read(2) then fails with ENODEV or
ECONNABORTED.  Requests still pending fail with ENOTCONN in their callers.
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import tempfile
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

from weenv.errors import MountError
from weenv.host.mounts import MountSpec, _unescape, mount, umount
from weenv.node.data.fuse import protocol as P

log = logging.getLogger(__name__)

WANT_FLAGS = P.ASYNC_READ | P.ASYNC_DIO | P.PARALLEL_DIROPS | P.ABORT_ERROR | P.MAX_PAGES
"""INIT flags weenv asks for (those the kernel offers).  ASYNC_DIO as libfuse
sets it: a direct-I/O read split into several requests reports the first error
rather than the bytes before it (see :mod:`weenv.node.data.lazyfs`)."""
MAX_PAGES = 256
"""Pages per request: reads of up to 1 MiB (libfuse's default, FUSE_MAX_MAX_PAGES)."""
MAX_BACKGROUND = 256
"""Background requests (EROFS reads its backing file asynchronously: every read
of an image is one) the kernel lets run at once on the connection, set at INIT
(the kernel's default is 12: measured, 12 reads stuck in a slow store fetch
stopped every other read of every group).  The worker pool is as large, so a
read the node cache can answer never queues behind reads stuck in the store."""
WORKER_IDLE_S = 30.0
"""Seconds a read worker waits for a read before it exits."""
MAX_WRITE = 4096
"""The file system is read-only: the kernel's minimum keeps read buffers small."""
BUFFER_SIZE = 64 << 10
FUSECTL = Path("/sys/fs/fuse/connections")


@dataclass(frozen=True)
class InitState:
    """What the kernel and the server agreed at INIT, kept for a server taking over."""

    major: int
    minor: int
    max_readahead: int
    flags: int
    max_write: int
    max_pages: int

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> InitState:
        return cls(**{k: int(d[k]) for k in cls.__dataclass_fields__})


@dataclass
class Attr:
    """Attributes of one inode (the fields of ``struct fuse_attr`` a read-only fs sets)."""

    ino: int
    mode: int
    size: int = 0
    nlink: int = 1
    blksize: int = 4096
    mtime_ns: int = 0
    timeout: float = 1.0
    """Seconds the kernel may cache the entry and the attributes."""

    def pack(self) -> bytes:
        sec, nsec = divmod(self.mtime_ns, 1_000_000_000)
        blocks = (self.size + 511) // 512
        return P.ATTR.pack(
            self.ino,
            self.size,
            blocks,
            sec,
            sec,
            sec,
            nsec,
            nsec,
            nsec,
            self.mode,
            self.nlink,
            0,
            0,
            0,
            self.blksize,
            0,
        )

    def valid(self) -> tuple[int, int]:
        sec = int(self.timeout)
        return sec, int((self.timeout - sec) * 1e9)


class Operations:
    """A read-only file system.  Methods raise ``OSError`` (its errno is the
    reply's); any other exception answers EIO and is logged."""

    def lookup(self, parent: int, name: bytes) -> Attr:
        raise OSError(errno.ENOENT, "no such entry")

    def getattr(self, ino: int) -> Attr:
        raise OSError(errno.ENOENT, "no such inode")

    def open(self, ino: int, flags: int) -> tuple[int, int]:
        """``(fh, FOPEN_* flags)``."""
        raise OSError(errno.ENOENT, "no such inode")

    def read(self, fh: int, offset: int, size: int) -> bytes:
        """At most ``size`` bytes; called in a worker thread (it may block)."""
        raise OSError(errno.EBADF, "not open")

    def release(self, fh: int) -> None:
        pass

    def opendir(self, ino: int) -> int:
        raise OSError(errno.ENOTDIR, "not a directory")

    def readdir(self, fh: int, offset: int) -> list[tuple[int, int, bytes, int]]:
        """Entries after cookie ``offset``: ``(cookie, ino, name, DT_* type)`` in cookie order."""
        return []


class FuseSession:
    """Serves ``ops`` on the FUSE connection ``fd`` (the session owns it: :meth:`close`)."""

    def __init__(
        self, fd: int, ops: Operations, *, name: str = "weenv-fuse", readers: int = 2, max_workers: int = MAX_BACKGROUND
    ):
        self.fd = fd
        self.ops = ops
        self.name = name
        self.readers = readers
        self.max_workers = max_workers
        self.init: InitState | None = None
        self.initialized = threading.Event()
        self._local = threading.local()
        self._threads: list[threading.Thread] = []
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._workers = 0
        self._idle = 0
        self._wlock = threading.Lock()
        self._ended = threading.Event()
        self._fd_cond = threading.Condition()
        self._fd_closed = False
        self._writers = 0

    # --- life cycle ----------------------------------------------------------------------
    def start(self, resume: InitState | None = None) -> None:
        """Start the readers; with ``resume``, first ask the kernel to resend the
        requests a previous server left unanswered.  Raises ``OSError`` if the
        connection is gone (ENODEV, ECONNABORTED) or the kernel refuses the
        notification (EINVAL before Linux 6.9: the session serves anyway, and
        those requests stay unanswered)."""
        if resume is not None:
            self.init = resume
            self.initialized.set()
            try:
                os.write(self.fd, P.notify_resend())
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                log.warning("fuse: the kernel cannot resend requests (FUSE_NOTIFY_RESEND needs Linux 6.9)")
        for i in range(self.readers):
            t = threading.Thread(target=self._reader, name=f"{self.name}-r{i}", daemon=True)
            self._threads.append(t)
            t.start()

    @property
    def running(self) -> bool:
        return any(t.is_alive() for t in self._threads)

    def owns_current_thread(self) -> bool:
        return getattr(self._local, "mine", False)

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the readers to end (the connection ended); whether they have.
        Workers still in a read are abandoned (daemon threads; their replies fail)."""
        for t in self._threads:
            t.join(timeout)
        done = not self.running
        if done:
            with self._wlock:
                for _ in range(self._workers):
                    self._jobs.put(None)
        return done

    def abort(self, conn: int | None) -> bool:
        """Abort connection ``conn`` (its fusectl number, :func:`connection_id`);
        whether it was.  Every request pending or being served fails (ENOTCONN).
        Through ``/sys/fs/fuse/connections`` if fusectl is mounted there, else
        through a private mount of fusectl, unmounted at once."""
        if conn is None:
            return False
        if (FUSECTL / str(conn)).exists():
            return _write_abort(FUSECTL, conn)
        tmp = tempfile.mkdtemp(prefix="weenv-fusectl-")
        try:
            mount(MountSpec("fusectl", "fusectl", tmp))
        except MountError as exc:
            log.warning("fuse: cannot abort connection %s (no fusectl): %s", conn, exc)
            os.rmdir(tmp)
            return False
        try:
            return _write_abort(Path(tmp), conn)
        finally:
            umount(tmp, detach=True)
            os.rmdir(tmp)

    # --- serving -------------------------------------------------------------------------
    def _reader(self) -> None:
        self._local.mine = True
        buf = bytearray(max(BUFFER_SIZE, P.MIN_READ_BUFFER))
        view = memoryview(buf)
        while True:
            try:
                n = os.readv(self.fd, [buf])
            except OSError as exc:
                if exc.errno in (errno.EINTR, errno.EAGAIN, errno.ENOENT):
                    continue  # ENOENT: the request was interrupted before it was read
                if exc.errno not in (errno.ENODEV, errno.ECONNABORTED):
                    log.error("fuse: reading %s failed: %s", self.name, exc)
                break
            if n < P.IN_HEADER.size:
                log.error("fuse: short request (%d bytes)", n)
                continue
            length, opcode, unique, nodeid, _uid, _gid, _pid, _extlen, _pad = P.IN_HEADER.unpack_from(buf)
            body = bytes(view[P.IN_HEADER.size : min(n, length)])
            if opcode == P.READ:
                self._submit(unique, nodeid, body)
            else:
                self._dispatch(opcode, unique, nodeid, body)
        self._ended.set()

    def _submit(self, unique: int, nodeid: int, body: bytes) -> None:
        with self._wlock:
            spawn = False
            if self._idle:
                self._idle -= 1  # a waiting worker takes it
            elif self._workers < self.max_workers:
                self._workers += 1
                spawn = True
            # else: every worker is busy; the job waits for the first one free
        self._jobs.put((unique, nodeid, body))
        if spawn:
            threading.Thread(target=self._worker, name=f"{self.name}-w{self._workers}", daemon=True).start()

    def _worker(self) -> None:
        """Serve reads; exit after :data:`WORKER_IDLE_S` seconds without one (a
        burst's workers do not stay for good)."""
        self._local.mine = True
        while True:
            try:
                job = self._jobs.get(timeout=WORKER_IDLE_S)
            except queue.Empty:
                with self._wlock:
                    if self._idle > 0:  # no job was handed to an idle worker meanwhile: leave as one of them
                        self._idle -= 1
                        self._workers -= 1
                        return
                continue
            if job is None:
                return
            self._dispatch(P.READ, *job)
            with self._wlock:
                self._idle += 1

    def invalidate_inode(self, ino: int) -> bool:
        """Ask the kernel to drop inode ``ino``'s cached pages
        (``FUSE_NOTIFY_INVAL_INODE``); False if the kernel does not know the
        inode (ENOENT) or the connection is gone.  Raises other ``OSError``\\s."""
        with self._fd_cond:
            if self._fd_closed:
                return False
            self._writers += 1
        try:
            os.writev(self.fd, P.notify_inval_inode(ino))
            return True
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ENODEV, errno.ECONNABORTED):
                return False
            raise
        finally:
            with self._fd_cond:
                self._writers -= 1
                self._fd_cond.notify_all()

    def _send(self, bufs: list[bytes]) -> None:
        with self._fd_cond:
            if self._fd_closed:  # a worker abandoned at stop: its descriptor number may be another file's now
                return
            self._writers += 1
        try:
            os.writev(self.fd, bufs)
        except OSError as exc:
            # ENOENT: the request was interrupted or aborted meanwhile; nobody waits.
            if exc.errno not in (errno.ENOENT, errno.ENODEV, errno.ECONNABORTED):
                log.error("fuse: writing a reply failed: %s", exc)
        finally:
            with self._fd_cond:
                self._writers -= 1
                self._fd_cond.notify_all()

    def close(self) -> None:
        """Close the descriptor (after :meth:`join`), once no reply is being
        written; replies of workers still running are dropped.  Idempotent."""
        with self._fd_cond:
            if self._fd_closed:
                return
            self._fd_closed = True
            self._fd_cond.wait_for(lambda: self._writers == 0)
        os.close(self.fd)

    def _dispatch(self, opcode: int, unique: int, nodeid: int, body: bytes) -> None:
        if opcode in P.NO_REPLY:
            return
        try:
            payload = self._handle(opcode, nodeid, body)
        except OSError as exc:
            self._send(P.reply(unique, error=exc.errno or errno.EIO))
            return
        except Exception:
            log.exception("fuse: opcode %d failed", opcode)
            self._send(P.reply(unique, error=errno.EIO))
            return
        self._send(P.reply(unique, payload))

    def _handle(self, opcode: int, nodeid: int, body: bytes) -> bytes:
        ops = self.ops
        if opcode == P.READ:
            fh, offset, size, *_ = P.READ_IN.unpack_from(body)
            return ops.read(fh, offset, size)
        if opcode == P.LOOKUP:
            return self._entry(ops.lookup(nodeid, body.split(b"\0", 1)[0]))
        if opcode == P.GETATTR:
            a = ops.getattr(nodeid)
            sec, nsec = a.valid()
            return P.ATTR_OUT.pack(sec, nsec, 0) + a.pack()
        if opcode == P.OPEN:
            flags, _ = P.OPEN_IN.unpack_from(body)
            fh, open_flags = ops.open(nodeid, flags)
            return P.OPEN_OUT.pack(fh, open_flags, 0)
        if opcode == P.RELEASE or opcode == P.RELEASEDIR:
            fh = int.from_bytes(body[:8], "little")
            if opcode == P.RELEASE:
                ops.release(fh)
            return b""
        if opcode == P.OPENDIR:
            return P.OPEN_OUT.pack(ops.opendir(nodeid), 0, 0)
        if opcode == P.READDIR:
            fh, offset, size, *_ = P.READ_IN.unpack_from(body)
            out = bytearray()
            for cookie, ino, name, dtype in ops.readdir(fh, offset):
                entry = P.dirent(ino, cookie, name, dtype)
                if len(out) + len(entry) > size:
                    break
                out += entry
            return bytes(out)
        if opcode == P.STATFS:
            return P.KSTATFS.pack(0, 0, 0, 0, 0, 4096, 255, 4096, 0)
        if opcode == P.INIT:
            return self._init(body)
        if opcode == P.DESTROY:
            return b""
        raise OSError(errno.ENOSYS, "not implemented")  # the kernel stops asking (flush, xattrs, ...)

    @staticmethod
    def _entry(a: Attr) -> bytes:
        sec, nsec = a.valid()
        return P.ENTRY_OUT.pack(a.ino, 0, sec, sec, nsec, nsec) + a.pack()

    def _init(self, body: bytes) -> bytes:
        major, minor, max_readahead, flags = P.INIT_IN.unpack_from(body)
        if major != P.KERNEL_VERSION or minor < 23:
            raise OSError(errno.EPROTO, f"unsupported FUSE protocol {major}.{minor}")
        state = InitState(
            P.KERNEL_VERSION, min(minor, P.KERNEL_MINOR), max_readahead, flags & WANT_FLAGS, MAX_WRITE, MAX_PAGES
        )
        self.init = state
        self.initialized.set()
        return P.INIT_OUT.pack(
            state.major,
            state.minor,
            state.max_readahead,
            state.flags,
            MAX_BACKGROUND,
            MAX_BACKGROUND * 3 // 4,  # congestion: the kernel's ratio
            state.max_write,
            1,
            state.max_pages,
            0,
            0,
        )


def _write_abort(fusectl: Path, conn: int) -> bool:
    try:
        (fusectl / str(conn) / "abort").write_text("1")
        return True
    except OSError as exc:
        log.warning("fuse: cannot abort connection %s: %s", conn, exc)
        return False


def open_device() -> int:
    """A new ``/dev/fuse`` descriptor (close-on-exec).  Raises ``OSError``."""
    return os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)


def mount_options(fd: int, extra: str = "") -> str:
    """The data of a fuse mount(2) on descriptor ``fd``, owned by root."""
    opts = f"fd={fd},rootmode=40000,user_id=0,group_id=0"
    return opts + ("," + extra if extra else "")


def connection_id(mountpoint: str | os.PathLike[str]) -> int | None:
    """The fusectl number of the FUSE mount at ``mountpoint`` (its device
    number as the kernel encodes it, ``major << 20 | minor``), from
    /proc/self/mountinfo (no request to the server); None if not mounted."""
    target = os.fspath(Path(mountpoint).absolute())
    found = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if _unescape(fields[4]) == target:
                major, minor = fields[2].split(":")
                found = int(major) << 20 | int(minor)  # the last mount at the point is the visible one
    return found
