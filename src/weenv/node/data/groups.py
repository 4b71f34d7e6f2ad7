"""Shared group mounts: one read-only, file-backed EROFS mount per group per node.

``root/<hex of group digest>`` is the EROFS mount of the group's image file
served by :class:`~weenv.node.data.lazyfs.LazyFS`.  Every environment using the
group shares it (it is a lower dir of their overlays).  :meth:`GroupMounts.acquire`
mounts on first use and counts references; :meth:`GroupMounts.release` only
decrements, so a warm start finds the mount in place; :meth:`unmount_unused`
and :meth:`unmount_all` take mounts down.

Locking: a short lock guards the table; each group has its own lock, held
while it is mounted or unmounted, so N concurrent acquires of one cold group
mount it once and the others wait, while other groups proceed.  mount(2) reads
the superblock through FUSE: it must never be called from the FUSE thread.

Every mount, lazy or direct, asks for EROFS's ``directio``
(:func:`~weenv.host.mounts.mount_erofs`): at an environment's memory limit a
page fault then needs no page of the image file's cache (issue 18: SIGBUS
without it; tests/test_memory_limit.py).  Over LazyFS's file, already opened
``direct_io``, it changes nothing measurable (``weenv bench start --quick``:
cold p50 0.095 s before and after).

Readahead: a file-backed EROFS mount gets its own bdi, ``/sys/class/bdi/erofs-N``,
whose ``read_ahead_kb`` (default 128) sets the size of the reads LazyFS sees.
After each mount the bdis that appeared are set to ``read_ahead_kb``
(default 1024, one chunk): measured on 8 MiB files, cold reads went from
~120 to ~185 MiB/s and reads from the chunk cache from ~140 to ~440 MiB/s
(26 FUSE requests per 8 MiB instead of 65).  A small file's readahead stops at
its end, so lazy fetching of small files is unchanged.  The kernel does not
say which bdi belongs to which mount; concurrent mounts each set every new
one, which is harmless since they all get the same value.

Off the lazy path (direct mounts).  When every chunk of a group is in the node
chunk cache, the group's image is assembled from the cache into
``images/<hex>.img`` (a temporary file, fsync, rename(2): a file under its final
name is complete) by a background thread, started when an acquire or release
finds the group complete (or by :meth:`GroupMounts.assemble`).  From then on,
the group is mounted for *new* environments straight from that file at
``root/<hex>.direct`` (file-backed EROFS, no FUSE on the read path); mounts
already in use stay as they are, and the lazy mount is unmounted when its last
reference goes.  An image whose size is not the manifest's is deleted and
assembled again; images stay across daemon restarts (outside the chunk cache's
byte bound: an image is assembled only when the disk has room for it) and are
removed by :meth:`GroupMounts.remove_images`.

Daemon restarts.  The mounts outlive a daemon killed by SIGKILL (the kernel
keeps them; the FUSE holder keeps the lazy ones readable).  The next daemon
adopts them with :meth:`GroupMounts.recover` (lazy groups shown by LazyFS
again) and counts the references of the environments it recovers with
:meth:`GroupMounts.adopt`.  :func:`clear_stale` is for the other case: the
FUSE connection died too, so the mounts cannot be read any more.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

from weenv.errors import MountError
from weenv.formats.manifest import GroupManifest, check_digest
from weenv.host.mounts import is_mounted, mount_erofs, mounts_under, umount
from weenv.node.data.lazyfs import LazyFS

log = logging.getLogger(__name__)


@dataclass
class _Entry:
    lock: threading.Lock = field(default_factory=threading.Lock)
    refs: int = 0  # references to the lazy mount
    users: int = 0  # acquires/unmounts in progress: the entry may not be dropped
    mounted: bool = False  # the lazy mount (through LazyFS)
    direct_refs: int = 0
    direct: bool = False  # the direct mount of the assembled image
    direct_failed: bool = False  # it was tried and failed (reads go through FUSE)
    manifest: GroupManifest | None = None

    @property
    def in_use(self) -> bool:
        return bool(self.refs or self.direct_refs or self.mounted or self.direct)


class GroupMounts:
    """The group mounts under ``root`` (a directory, created if missing)."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        lazyfs: LazyFS,
        *,
        read_ahead_kb: int | None = 1024,
        images: str | os.PathLike[str] | None = None,
    ):
        """``images``: where assembled group images go (None: no direct mounts)."""
        self.root = Path(root).absolute()
        self.lazyfs = lazyfs
        self.read_ahead_kb = read_ahead_kb
        self.images = Path(images).absolute() if images is not None else None
        self.root.mkdir(parents=True, exist_ok=True)
        if self.images is not None:
            self.images.mkdir(parents=True, exist_ok=True)
            for leftover in self.images.glob(".tmp-*"):
                leftover.unlink(missing_ok=True)
        self._lock = threading.Lock()  # guards _entries and the counts in it
        self._entries: dict[str, _Entry] = {}
        self._assembling: dict[str, threading.Thread] = {}
        self._closing = threading.Event()

    def path(self, digest: str) -> Path:
        """Mount point of group ``digest`` read through LazyFS: ``root/<hex>``."""
        return self.root / check_digest(digest).split(":", 1)[1]

    def direct_path(self, digest: str) -> Path:
        """Mount point of group ``digest`` mounted from its assembled image: ``root/<hex>.direct``."""
        return self.root / (check_digest(digest).split(":", 1)[1] + ".direct")

    def is_direct_point(self, path: str | os.PathLike[str]) -> bool:
        """Whether ``path`` is the mount point of a group mounted directly
        (``root/<hex>.direct``, read without FUSE) and something is mounted there."""
        real = Path(os.path.realpath(path))
        return real.parent == Path(os.path.realpath(self.root)) and real.name.endswith(".direct") and is_mounted(real)

    def image_path(self, digest: str) -> Path | None:
        """``images/<hex>.img`` (None when direct mounts are off)."""
        if self.images is None:
            return None
        return self.images / (check_digest(digest).split(":", 1)[1] + ".img")

    def _enter(self, digest: str) -> _Entry:
        with self._lock:
            entry = self._entries.setdefault(digest, _Entry())
            entry.users += 1
            return entry

    def _leave(self, digest: str, entry: _Entry) -> None:
        with self._lock:
            entry.users -= 1
            if entry.users == 0 and not entry.in_use:
                self._entries.pop(digest, None)

    def acquire(self, digest: str, manifest: GroupManifest) -> Path:
        """Mount group ``digest`` if needed, take a reference, return its mount point:
        :meth:`direct_path` once its image is assembled, else :meth:`path`.

        Blocks while another thread mounts the same group.  Raises
        :class:`MountError` (nothing left behind: no mount, no directory, no
        LazyFS entry) if the mount fails, e.g. because the superblock's chunk
        cannot be fetched or verified (EIO); a later acquire tries again.
        """
        if self.lazyfs.in_fuse_thread():
            raise MountError(errno.EDEADLK, "GroupMounts.acquire() called from the FUSE thread")
        entry = self._enter(digest)
        try:
            with entry.lock:
                entry.manifest = manifest
                if not entry.direct and self._image_ready(digest, manifest):
                    try:
                        self._mount_direct(digest, manifest)
                        entry.direct = True
                    except MountError as exc:
                        entry.direct_failed = True
                        log.warning("direct mount of group %s failed (reading it through FUSE): %s", digest, exc)
                if entry.direct:
                    with self._lock:
                        entry.direct_refs += 1
                    return self.direct_path(digest)
                if not entry.mounted:
                    self._mount(digest, manifest)
                    entry.mounted = True
                with self._lock:
                    entry.refs += 1
        finally:
            self._leave(digest, entry)
        self.assemble_if_complete(digest, manifest)
        return self.path(digest)

    def acquire_all(self, groups: list[tuple[str, GroupManifest]]) -> list[Path]:
        """:meth:`acquire` each ``(digest, manifest)``; their mount points, in order.

        Groups not mounted yet are mounted in parallel (one thread each beyond
        the first): each mount waits for its superblock's fetch, so a cold
        template of N groups waits for about one fetch, not N.  If any acquire
        fails, the others' references are released and the first error raised.
        """
        with self._lock:
            cold = [
                i
                for i, (d, _m) in enumerate(groups)
                if not ((e := self._entries.get(d)) is not None and (e.mounted or e.direct))
            ]
        points: list[Path | None] = [None] * len(groups)
        errors: list[BaseException] = []

        def one(i: int) -> None:
            try:
                points[i] = self.acquire(*groups[i])
            except BaseException as exc:  # raised below, after every thread ended
                errors.append(exc)

        threads = [
            threading.Thread(target=one, args=(i,), name=f"weenv-mount-{groups[i][0][7:19]}", daemon=True)
            for i in cold[1:]
        ]
        for t in threads:
            t.start()
        for i in range(len(groups)):
            if i not in cold[1:]:
                one(i)
        for t in threads:
            t.join()
        if errors:
            for (digest, _m), point in zip(groups, points):
                if point is not None:
                    self.release(digest, point)
            raise errors[0]
        return points  # type: ignore[return-value]

    # --- direct mounts ----------------------------------------------------------------
    def superseded(self, digest: str, point: Path, manifest: GroupManifest) -> bool:
        """Whether ``point`` is group ``digest``'s lazy mount and an :meth:`acquire`
        now would return its direct mount instead (mounted, or its image is
        assembled and mounting it has not failed)."""
        if point != self.path(digest):
            return False
        with self._lock:
            entry = self._entries.get(digest)
            direct, failed = (entry.direct, entry.direct_failed) if entry is not None else (False, False)
        return direct or (not failed and self._image_ready(digest, manifest))

    def _image_ready(self, digest: str, manifest: GroupManifest) -> bool:
        image = self.image_path(digest)
        if image is None:
            return False
        try:
            size = image.stat().st_size
        except FileNotFoundError:
            return False
        if size != manifest.image_size:
            log.warning("assembled image %s has %d bytes, not %d; removing it", image, size, manifest.image_size)
            image.unlink(missing_ok=True)
            return False
        return True

    def _mount_direct(self, digest: str, manifest: GroupManifest) -> None:
        target = self.direct_path(digest)
        if is_mounted(target):
            raise MountError(errno.EBUSY, f"{target} is already mounted (left by an earlier daemon?)")
        target.mkdir(exist_ok=True)
        try:
            bdis = _erofs_bdis()
            mount_erofs(self.image_path(digest), target)
        except BaseException:
            try:
                target.rmdir()
            except OSError:
                pass
            raise
        if self.read_ahead_kb:
            _set_read_ahead(_erofs_bdis() - bdis, self.read_ahead_kb)
        log.info("mounted group %s (%s) directly from %s", digest, manifest.name, self.image_path(digest))

    def assemble_if_complete(self, digest: str, manifest: GroupManifest) -> bool:
        """Start assembling group ``digest``'s image in the background if every
        chunk of it is cached and no image exists; whether a thread started."""
        if self.images is None or self._closing.is_set():
            return False
        if not self.lazyfs.cache.has_all(c.digest for c in manifest.chunks):
            return False
        with self._lock:
            if digest in self._assembling or self._image_ready(digest, manifest):
                return False
            t = threading.Thread(
                target=self._assemble_quietly,
                args=(digest, manifest),
                name=f"weenv-assemble-{digest[7:19]}",
                daemon=True,
            )
            self._assembling[digest] = t
        t.start()
        return True

    def _assemble_quietly(self, digest: str, manifest: GroupManifest) -> None:
        try:
            self.assemble(digest, manifest)
        except Exception as exc:
            log.warning("cannot assemble group %s from the node cache: %s", digest, exc)
        finally:
            with self._lock:
                self._assembling.pop(digest, None)

    def assemble(self, digest: str, manifest: GroupManifest) -> Path | None:
        """Write group ``digest``'s image from the chunk cache to :meth:`image_path`
        (atomically); return its path, or None when direct mounts are off, the
        disk lacks room (free space below 1.1 x the image) or the node closes.

        Chunks missing from the cache are fetched (so call it when the group is
        complete).  Raises what :meth:`ChunkCache.read` raises, ``OSError``.
        """
        image = self.image_path(digest)
        if image is None:
            return None
        if self._image_ready(digest, manifest):
            return image
        st = os.statvfs(self.images)
        if st.f_bavail * st.f_frsize < manifest.image_size * 1.1:
            log.info("not assembling group %s: %d bytes free", digest, st.f_bavail * st.f_frsize)
            return None
        cache = self.lazyfs.cache
        fd, tmp = tempfile.mkstemp(dir=self.images, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                for chunk in manifest.chunks:
                    if self._closing.is_set():
                        os.unlink(tmp)
                        return None
                    data = cache.read(chunk, 0, chunk.size)
                    if len(data) != chunk.size:
                        raise OSError(errno.EIO, f"chunk {chunk.digest} is {len(data)} bytes, not {chunk.size}")
                    f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.rename(tmp, image)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        log.info("assembled group %s (%s) into %s", digest, manifest.name, image)
        return image

    def wait_assembled(self, timeout: float = 60.0) -> None:
        """Wait for the background assemblies running now (for tests and close)."""
        with self._lock:
            threads = list(self._assembling.values())
        for t in threads:
            t.join(timeout)

    def remove_images(self) -> None:
        """Delete every assembled image not mounted (daemon idle; cold-start measurements)."""
        if self.images is None:
            return
        self.wait_assembled()
        with self._lock:
            busy = {self.image_path(d).name for d, e in self._entries.items() if e.direct}
        for image in self.images.glob("*.img"):
            if image.name not in busy:
                image.unlink(missing_ok=True)

    def _mount(self, digest: str, manifest: GroupManifest) -> None:
        target = self.path(digest)
        if is_mounted(target):
            raise MountError(errno.EBUSY, f"{target} is already mounted (left by an earlier daemon?)")
        image = self.lazyfs.add_group(digest, manifest)
        try:
            target.mkdir(exist_ok=True)
            bdis = _erofs_bdis()
            mark = self.lazyfs.read_seq()
            mount_erofs(image, target)
            self.lazyfs.note_mount(digest, mark)  # a profile recorded while it stays mounted starts with these
        except BaseException as exc:
            try:
                target.rmdir()
            except OSError:
                pass
            cause = self.lazyfs.last_error(digest)
            self.lazyfs.remove_group(digest)
            if isinstance(exc, MountError):
                why = f"; reading the image failed: {cause}" if cause else ""
                raise MountError(exc.errno, f"cannot mount group {digest} ({manifest.name}): {exc}{why}") from exc
            raise
        if self.read_ahead_kb:
            _set_read_ahead(_erofs_bdis() - bdis, self.read_ahead_kb)
        log.info("mounted group %s (%s) at %s", digest, manifest.name, target)

    def release(self, digest: str, path: str | os.PathLike[str] | None = None) -> None:
        """Drop one reference to group ``digest`` taken by the acquire that
        returned ``path`` (None: the lazy mount's if it has one, else the direct
        mount's); the mount stays (for warm starts), except a lazy mount
        superseded by a direct one, unmounted with its last reference.

        Raises :class:`MountError` (EINVAL) if ``digest`` holds no such reference.
        """
        direct = path is not None and Path(path) == self.direct_path(digest)
        with self._lock:
            entry = self._entries.get(digest)
            if entry is None:
                raise MountError(errno.EINVAL, f"group {digest} is not acquired")
            if not direct and path is None and entry.refs == 0:
                direct = True
            if (entry.direct_refs if direct else entry.refs) == 0:
                raise MountError(errno.EINVAL, f"group {digest} is not acquired")
            if direct:
                entry.direct_refs -= 1
            else:
                entry.refs -= 1
            retire = not direct and entry.refs == 0 and entry.direct and entry.mounted
            manifest = entry.manifest
        if retire:
            try:
                self._unmount(digest, force=False, lazy_only=True)
            except MountError as exc:
                log.warning("cannot unmount the superseded lazy mount of group %s: %s", digest, exc)
        elif not direct and manifest is not None:
            self.assemble_if_complete(digest, manifest)

    def mounted(self) -> dict[str, int]:
        """``{digest: references}`` of every mounted group (lazy and direct mounts together)."""
        with self._lock:
            return {d: e.refs + e.direct_refs for d, e in self._entries.items() if e.mounted or e.direct}

    def mounted_directly(self) -> dict[str, int]:
        """``{digest: references}`` of the groups mounted from an assembled image."""
        with self._lock:
            return {d: e.direct_refs for d, e in self._entries.items() if e.direct}

    def _unmount(self, digest: str, *, force: bool, lazy_only: bool = False) -> bool:
        entry = self._enter(digest)
        try:
            with entry.lock:
                done = False
                with self._lock:
                    lazy = entry.mounted and (force or not entry.refs)
                    direct = not lazy_only and entry.direct and (force or not entry.direct_refs)
                if lazy:
                    self._umount_point(digest, self.path(digest), force)
                    self.lazyfs.remove_group(digest)
                    with self._lock:
                        entry.mounted = False
                        entry.refs = 0
                    done = True
                if direct:
                    self._umount_point(digest, self.direct_path(digest), force)
                    with self._lock:
                        entry.direct = False
                        entry.direct_refs = 0
                    done = True
                if done:
                    log.info("unmounted group %s%s", digest, " (lazy mount)" if lazy_only else "")
                return done
        finally:
            self._leave(digest, entry)

    @staticmethod
    def _umount_point(digest: str, target: Path, force: bool) -> None:
        try:
            umount(target)
        except MountError as exc:
            if not (force and exc.errno == errno.EBUSY):
                raise
            log.warning("group %s is busy at %s; detaching it (lazy unmount)", digest, target)
            umount(target, detach=True)
        try:
            target.rmdir()
        except OSError as exc:
            log.warning("cannot remove %s: %s", target, exc)

    def unmount_unused(self) -> list[str]:
        """Unmount every group with no references; return their digests.

        Raises :class:`MountError` if an umount fails (e.g. EBUSY: still used
        outside weenv's counts, such as a process with its cwd inside).
        """
        with self._lock:
            digests = [
                d for d, e in self._entries.items() if (e.mounted and e.refs == 0) or (e.direct and e.direct_refs == 0)
            ]
        return [d for d in digests if self._unmount(d, force=False)]

    # --- after a daemon restart -------------------------------------------------------------
    def recover(self, load) -> list[str]:
        """Adopt the group mounts an earlier daemon of this home left under
        ``root`` (it was killed; its FUSE connection was taken over:
        :meth:`LazyFS.take_over`); return their digests.  Call before
        :meth:`LazyFS.start`, so that the reads the kernel resends find their group.

        ``load(digest) -> GroupManifest`` gives a group's manifest (from the
        store).  Each lazy mount's group is shown by LazyFS again; references
        start at 0 (:meth:`adopt` counts the environments').  A mount that is
        not a group's (or whose manifest cannot be loaded) is detached; empty
        mount point directories (a mount the dead daemon did not finish) are removed.
        """
        found = []
        for fstype, point in mounts_under(self.root):
            target = Path(point)
            if target == self.root:
                continue
            name = target.name
            direct = name.endswith(".direct")
            digest = "sha256:" + name.removesuffix(".direct")
            try:
                if fstype != "erofs" or target.parent != self.root:
                    raise MountError(errno.EINVAL, f"{fstype} mount {target} is not a group mount")
                manifest = load(check_digest(digest))
            except Exception as exc:
                log.warning("detaching %s left by an earlier daemon: %s", target, exc)
                with contextlib.suppress(MountError):
                    umount(target, detach=True)
                continue
            with self._lock:
                entry = self._entries.setdefault(digest, _Entry())
                entry.manifest = manifest
                if direct:
                    entry.direct = True
                else:
                    entry.mounted = True
            if not direct:
                self.lazyfs.add_group(digest, manifest)
            found.append(digest)
            log.info("recovered the %s mount of group %s", "direct" if direct else "lazy", digest)
        for child in self.root.iterdir():
            if child.is_dir() and not is_mounted(child):
                with contextlib.suppress(OSError):
                    child.rmdir()
        return sorted(set(found))

    def adopt(self, digest: str, path: str | os.PathLike[str]) -> None:
        """Count a reference of a recovered environment whose overlay uses mount
        point ``path`` of group ``digest`` (:meth:`path` or :meth:`direct_path`).
        Raises :class:`MountError` (EINVAL) if that mount was not recovered."""
        real = os.path.realpath(path)  # the kernel shows resolved paths; ours may hold a symlink
        direct = real == os.path.realpath(self.direct_path(digest))
        if not direct and real != os.path.realpath(self.path(digest)):
            raise MountError(errno.EINVAL, f"{path} is not a mount point of group {digest}")
        with self._lock:
            entry = self._entries.get(digest)
            if entry is None or not (entry.direct if direct else entry.mounted):
                raise MountError(errno.EINVAL, f"group {digest} is not mounted at {path}")
            if direct:
                entry.direct_refs += 1
            else:
                entry.refs += 1

    def unmount_all(self) -> None:
        """Unmount every group, referenced or not (daemon stop).  Idempotent.

        A group that is busy (an overlay or a process still uses it) is detached
        as a last resort (MNT_DETACH): gone from the namespace now, freed by the
        kernel when its last user goes, reads through it failing once LazyFS
        stops.  Call before :meth:`LazyFS.stop`.  Stops background assemblies first.
        """
        self._closing.set()
        self.wait_assembled()
        with self._lock:
            digests = [d for d, e in self._entries.items() if e.mounted or e.direct]
        for digest in digests:
            self._unmount(digest, force=True)


def clear_stale(
    group_root: str | os.PathLike[str], lazy_mountpoint: str | os.PathLike[str], *, keep_direct: bool = False
) -> list[str]:
    """Detach mounts an earlier daemon left behind; return their mount points.

    After a daemon dies without a FUSE holder keeping its connection, its lazy
    group mounts point at a connection that is gone (reads fail).  Call this at daemon start, before
    :meth:`LazyFS.start`, never while a daemon uses these paths.  Mounts under
    ``group_root`` are detached deepest first (MNT_DETACH: their users keep
    failing reads, new lookups no longer see them), then the lazy mount point.
    ``keep_direct``: leave the direct mounts (``<hex>.direct``, of assembled
    images: they never read through FUSE) for :meth:`GroupMounts.recover`.
    Empty group mount point directories are removed.
    """
    group_root, lazy_mountpoint = Path(group_root).absolute(), Path(lazy_mountpoint).absolute()
    points = [
        p
        for t, p in mounts_under(group_root)
        if p != str(group_root)
        and not (keep_direct and t == "erofs" and Path(p).parent == group_root and p.endswith(".direct"))
    ]
    points += [p for _t, p in mounts_under(lazy_mountpoint) if p != str(lazy_mountpoint)]
    points.sort(key=lambda p: p.count("/"), reverse=True)
    if is_mounted(lazy_mountpoint):
        points.append(str(lazy_mountpoint))
    for point in points:
        log.warning("detaching stale mount %s", point)
        umount(point, detach=True)
    if group_root.is_dir():
        for child in group_root.iterdir():
            try:
                child.rmdir()
            except OSError:
                pass
    return points


_BDI = Path("/sys/class/bdi")


def _erofs_bdis() -> set[str]:
    try:
        return {p.name for p in _BDI.iterdir() if p.name.startswith("erofs-")}
    except OSError:
        return set()


def _set_read_ahead(bdis: set[str], kib: int) -> None:
    """Best effort: a missing sysfs only costs speed."""
    for name in bdis:
        try:
            (_BDI / name / "read_ahead_kb").write_text(str(kib))
        except OSError as exc:
            log.debug("cannot set %s read_ahead_kb: %s", name, exc)
