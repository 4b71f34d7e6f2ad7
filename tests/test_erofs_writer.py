"""weenv's EROFS writer, read back cold by the kernel: every byte of every file.

One source tree holds what stresses the format (255-byte names, sparse files,
a file over 4 GiB made of holes, sizes at the inline and block boundaries,
binary xattrs, hard links, a deep tree, several dirent blocks, every file
type).  Its group is read back twice, each time from a fresh mount with an
empty page cache: through the lazy FUSE path (chunks fetched on demand from
the store) and through a direct mount of the assembled image; both must
match the source tree, attribute for attribute and byte for byte.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import socket
import stat
import struct
from pathlib import Path

import pytest

from weenv.host.mounts import erofs_spec, mount, umount
from weenv.node.data.cache import ChunkCache
from weenv.node.data.groups import GroupMounts
from weenv.node.data.lazyfs import LazyFS
from weenv.packaging.group import assemble_image, build_group
from weenv.store.file import FileStore

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
HUGE = "huge-holes"
"""A file of 5 GiB + 123 bytes, nearly all holes: compared in windows, not whole."""
HUGE_SIZE = 5 * GIB + 123
HUGE_DATA = {0: b"head", 4 * GIB - 2: b"across 4 GiB", 5 * GIB: b"tail" * 30}
"""Offset -> bytes written into the huge file (the rest is holes)."""
WINDOW = 64 * KIB


def _rand(n: int, seed: int) -> bytes:
    out, i = bytearray(), 0
    while len(out) < n:
        out += hashlib.sha256(b"%d:%d" % (seed, i)).digest()
        i += 1
    return bytes(out[:n])


def make_hard_tree(src: Path) -> None:
    """Fill ``src`` with every tree shape the writer must store."""
    src.mkdir()
    sizes = src / "sizes"  # every boundary of the inline / block / block-map layouts
    sizes.mkdir()
    for n in (0, 1, 2047, 2048, 2049, 4000, 4095, 4096, 4097, 8191, 8192, 12289, 3 * MIB + 5):
        (sizes / f"s{n}").write_bytes(_rand(n, n))
    (sizes / "zeros-then-byte").write_bytes(bytes(3 * 4096) + b"!")  # two holes, data in the last block
    with open(src / "sparse", "wb") as f:  # holes at the start, between data and at the end
        f.truncate(10 * MIB + 7)
        for at in (1 * MIB + 100, 4 * MIB, 4 * MIB + 4096 * 3):
            f.seek(at)
            f.write(_rand(5000, at))
    with open(src / HUGE, "wb") as f:
        f.truncate(HUGE_SIZE)
        for at, data in HUGE_DATA.items():
            f.seek(at)
            f.write(data)
    long = "L" * 255
    (src / long).mkdir()
    (src / long / ("f" * 255)).write_bytes(b"a file with a 255-byte name under a 255-byte dir\n")
    (src / long / ("s" * 255)).symlink_to("f" * 255)
    many = src / "many"  # several dirent blocks, long names in each
    many.mkdir()
    for i in range(300):
        (many / f"{i:03d}{'n' * (20 + i % 233)}").write_bytes(b"%d" % i)
    deep = src
    for i in range(120):
        deep = deep / f"d{i}"
    deep.mkdir(parents=True)
    (deep / "leaf").write_text("leaf\n")
    links = src / "links"
    links.mkdir()
    (links / "short").symlink_to("../sizes/s1")
    (links / "long").symlink_to("x/" * 1500)  # 3,000 bytes: its own data block
    (links / "dangling").symlink_to("nowhere")
    big = sizes / f"s{3 * MIB + 5}"
    for target, names in ((sizes / "s1", ("h1", "h2")), (big, ("big-a", "big-b")), (src / "sparse", ("sp",))):
        for name in names:
            os.link(target, links / name)
    special = src / "special"
    special.mkdir()
    os.mknod(special / "whiteout", stat.S_IFCHR | 0o600, os.makedev(0, 0))
    os.mknod(special / "char", stat.S_IFCHR | 0o640, os.makedev(1, 3))
    os.mknod(special / "block", stat.S_IFBLK | 0o600, os.makedev(259, 70000 & 0xFFFFF))
    os.mkfifo(special / "fifo", 0o604)
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.bind(os.fspath(special / "sock"))
    finally:
        sock.close()
    xa = src / "xattrs"
    xa.mkdir()
    os.setxattr(xa, "trusted.overlay.opaque", b"y")
    (xa / "f").write_bytes(_rand(9000, 9))
    os.setxattr(xa / "f", "user.nul", b"\0a\0b\0")
    os.setxattr(xa / "f", "user." + "k" * 200, _rand(3000, 3))
    os.setxattr(xa / "f", "security.capability", bytes.fromhex("0100000200200000000000000000000000000000"))
    os.setxattr(xa / "f", "trusted.t", b"")
    (xa / "small").write_bytes(b"inline data beside xattrs")
    os.setxattr(xa / "small", "user.a", _rand(1500, 15))  # inode + xattrs + tail near one block
    odd = src / "odd"
    odd.mkdir()
    (odd / "suid").write_bytes(b"#!/bin/true\n")
    os.chmod(odd / "suid", 0o4755)
    os.chown(odd / "suid", 12345, 54321)
    os.chmod(odd, 0o1777)
    for p in [*src.rglob("*"), src]:
        os.utime(p, ns=(1_600_000_000_000_000_000, 1_600_000_000_987_654_321), follow_symlinks=False)


def _content(path: Path, size: int) -> str:
    """sha256 of a regular file's bytes; for the huge file, of its windows around the data."""
    h = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY)
    try:
        if path.name == HUGE:
            for at in [*HUGE_DATA, size - WINDOW]:
                start = max(0, at - WINDOW // 2)
                h.update(os.pread(fd, WINDOW, start))
        else:
            while piece := os.read(fd, MIB):
                h.update(piece)
    finally:
        os.close(fd)
    return h.hexdigest()


def tree_record(root: Path) -> dict[str, tuple]:
    """Path -> (mode, uid, gid, mtime_ns, nlink, size, rdev, link target,
    xattrs, first path of its inode, content digest), the root as '.'."""
    first: dict[int, str] = {}
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [".", *sorted(dirnames), *sorted(filenames)]:
            p = Path(dirpath) if name == "." else Path(dirpath) / name
            rel = str(p.relative_to(root))
            if name == "." and rel != ".":
                continue
            st = os.lstat(p)
            kind = stat.S_IFMT(st.st_mode)
            names = sorted(os.listxattr(p, follow_symlinks=False))
            xattrs = {k: os.getxattr(p, k, follow_symlinks=False) for k in names}
            out[rel] = (
                oct(st.st_mode),
                st.st_uid,
                st.st_gid,
                st.st_mtime_ns,
                st.st_nlink,
                st.st_size if kind != stat.S_IFDIR else None,
                st.st_rdev if kind in (stat.S_IFCHR, stat.S_IFBLK) else None,
                os.readlink(p) if kind == stat.S_IFLNK else None,
                xattrs,
                first.setdefault(st.st_ino, rel),
                _content(p, st.st_size) if kind == stat.S_IFREG else None,
            )
    return out


FS_IOC_FIEMAP = 0xC020660B


def mapped_extents(path: Path) -> int:
    """Extents the kernel reports for the file (FIEMAP with no room for them: only the count)."""
    buf = bytearray(struct.pack("=QQIIII", 0, 2**64 - 1, 0, 0, 0, 0))
    with open(path, "rb") as f:
        fcntl.ioctl(f.fileno(), FS_IOC_FIEMAP, buf)
    return struct.unpack_from("=QQIIII", buf)[3]


def _diff(a: dict, b: dict) -> dict:
    return {k: (a.get(k), b.get(k)) for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)}


@pytest.fixture
def hard_group(tmp_path, paths):
    src = tmp_path / "src"
    make_hard_tree(src)
    store = FileStore(paths.home / "store")
    result = build_group(src, store, name="hard", chunk_size=256 * KIB, workdir=tmp_path)
    return src, store, result


def test_every_byte_reads_back_cold_lazily_and_directly(hard_group, paths, tmp_path, leak_check):
    src, store, result = hard_group
    want = tree_record(src)
    assert len(want) > 450 and want["many"][4] == 2 and want[HUGE][5] == HUGE_SIZE
    assert result.manifest.image_size < 24 * MIB  # the holes are not stored

    # 1. through the lazy FUSE path: a fresh chunk cache, each block fetched on first read
    cache = ChunkCache(tmp_path / "chunks", store)
    fs = LazyFS(paths.lazy_mountpoint, cache)
    mounts = GroupMounts(paths.group_mounts, fs)
    fs.start()
    try:
        mp = mounts.acquire(result.digest, result.manifest)
        assert _diff(want, tree_record(mp)) == {}
        assert cache.chunks_fetched > 0
        mounts.release(result.digest)
    finally:
        mounts.unmount_all()
        fs.stop()

    # 2. a direct, file-backed mount of the assembled image, its page cache dropped
    image = tmp_path / "hard.erofs"
    assemble_image(store, result.manifest, image)
    fd = os.open(image, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    target = tmp_path / "mnt"
    target.mkdir()
    mount(erofs_spec(image, target))
    try:
        assert _diff(want, tree_record(target)) == {}
        # A file without holes is one run of blocks: a page fault maps it by arithmetic, with no
        # block-map read of the backing file (which fails with ENOMEM in a memory cgroup at its
        # limit with the OOM killer off: SIGBUS).  Zero blocks are data; only holes are holes.
        plain = ["sizes/s4097", "sizes/s12289", f"sizes/s{3 * MIB + 5}", "sizes/zeros-then-byte", "xattrs/f"]
        assert {p: mapped_extents(target / p) for p in plain} == dict.fromkeys(plain, 1)
        assert mapped_extents(target / "sparse") > 1
    finally:
        umount(target)
