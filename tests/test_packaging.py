"""Groups and templates: build, publish, assemble, mount, compare (real mkfs.erofs, real mounts)."""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import stat
import struct
import subprocess
import time
from pathlib import Path

import pytest

from weenv.errors import (
    DigestMismatchError,
    InvalidInputError,
    NotFoundError,
    RuntimeFailedError,
    ToolMissingError,
)
from weenv.formats.manifest import (
    RuntimeConfig,
    TemplateManifest,
    canonical_json,
    parse_group_manifest,
    parse_template_manifest,
    sha256_digest,
)
from weenv.host.mounts import erofs_spec, mount, umount
from weenv.packaging.erofs import count_inodes
from weenv.packaging.erofs_writer import WRITER, tree_from_dir, write_image
from weenv.packaging.group import assemble_image, build_group, load_group
from weenv.packaging.template import create_template, load_template
from weenv_bench.mkfs_erofs import mkfs_erofs, mkfs_version

KIB = 1024
MIB = 1024 * KIB
SMALL_CHUNK = 64 * KIB


# --- a source tree with every kind of file ---------------------------------------------


def _acl_xattr(entries: list[tuple[int, int, int]]) -> bytes:
    """Raw ``system.posix_acl_access`` value: version 2, then (tag, perm, id) entries."""
    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", t, p, i) for t, p, i in entries)


ACL_UNDEFINED_ID = 0xFFFFFFFF
ACL = _acl_xattr(
    [
        (0x01, 7, ACL_UNDEFINED_ID),  # USER_OBJ rwx
        (0x02, 5, 1000),  # USER 1000 r-x
        (0x04, 5, ACL_UNDEFINED_ID),  # GROUP_OBJ r-x
        (0x10, 5, ACL_UNDEFINED_ID),  # MASK r-x
        (0x20, 4, ACL_UNDEFINED_ID),  # OTHER r--
    ]
)
# VFS_CAP_REVISION_2 with CAP_NET_RAW (13) permitted and effective.
RAW_CAPABILITY = struct.pack("<IIIII", 0x02000001, 1 << 13, 0, 0, 0)


def _set_capability(path: Path) -> None:
    setcap = shutil.which("setcap") or shutil.which("setcap", path="/usr/sbin:/sbin")
    if setcap:
        subprocess.run([setcap, "cap_net_raw+ep", str(path)], check=True, capture_output=True)
    else:
        os.setxattr(path, "security.capability", RAW_CAPABILITY)


def make_tree(root: Path) -> None:
    """Populate ``root`` (an empty directory) with every file kind EROFS must keep."""

    def write(rel: str, data: bytes, mode: int = 0o644) -> Path:
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        os.chmod(p, mode)
        return p

    # Regular files: empty, odd sizes, block-sized, several chunks, sparse.
    write("empty", b"")
    write("one-byte", b"x")
    write("odd", os.urandom(4097))
    write("block", os.urandom(4096))
    write("hello.txt", b"hello, world\n")
    write("big.bin", os.urandom(3 * MIB + 12345))
    with open(root / "sparse", "wb") as f:
        f.seek(MIB)
        f.write(b"tail")
    write("dir/sub/deep/file", b"deep\n")
    write("spaces and ünïcode ✓", b"name\n")
    write("n" * 254, b"long name\n")  # 255 bytes: see test_name_max_is_refused_by_erofs_utils_1_5
    for i in range(300):  # a directory spanning several blocks
        write(f"many/entry-{i:04d}", f"{i}\n".encode())

    # Ownership and special mode bits (chmod after chown: chown clears setuid).
    owned = write("owned", b"owned\n")
    os.chown(owned, 1234, 5678)
    os.chmod(owned, 0o640)
    bigid = write("big-ids", b"big ids\n")
    os.chown(bigid, 100000, 200000)
    suid = write("bin/suid", b"#!/bin/sh\n")
    os.chown(suid, 0, 50)
    os.chmod(suid, 0o4755)
    sgid = write("bin/sgid", b"#!/bin/sh\n")
    os.chmod(sgid, 0o2711)
    write("bin/none", b"", 0o000)
    (root / "tmp").mkdir()
    os.chmod(root / "tmp", 0o1777)
    (root / "private").mkdir()
    os.chown(root / "private", 1000, 1000)
    os.chmod(root / "private", 0o2750)

    # Symlinks: absolute, relative, dangling, long, to a directory.
    os.symlink("/etc/passwd", root / "abs-link")
    os.symlink("../hello.txt", root / "dir" / "rel-link")
    os.symlink("nowhere/at/all", root / "dangling")
    os.symlink("t" * 1000, root / "long-link")
    os.symlink("dir/sub", root / "dir-link")
    os.lchown(root / "dangling", 42, 43)

    # Hardlinks: three names of one inode, across directories.
    os.link(root / "hello.txt", root / "hard1")
    os.link(root / "hello.txt", root / "dir" / "hard2")
    os.link(root / "owned", root / "owned-link")

    # Device nodes, fifo, socket.
    os.mknod(root / "chr", stat.S_IFCHR | 0o620, os.makedev(4, 64))
    os.mknod(root / "blk", stat.S_IFBLK | 0o660, os.makedev(8, 1))
    os.mknod(root / "bigdev", stat.S_IFCHR | 0o600, os.makedev(300, 70000))
    os.chown(root / "chr", 0, 5)
    os.mkfifo(root / "fifo", 0o600)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(os.fspath(root / "sock"))
    finally:
        sock.close()

    # Overlay-style whiteout and opaque directory.
    os.mknod(root / "deleted", stat.S_IFCHR | 0o000, os.makedev(0, 0))
    (root / "opaque").mkdir()
    (root / "opaque" / "kept").write_bytes(b"kept\n")
    os.setxattr(root / "opaque", "trusted.overlay.opaque", b"y")

    # Xattrs: user, trusted, security.capability, POSIX ACL; shared by many inodes.
    x = write("xattrs", b"x\n")
    os.setxattr(x, "user.comment", b"hello")
    os.setxattr(x, "user.binary", bytes(range(256)))
    os.setxattr(x, "user.empty", b"")
    os.setxattr(x, "trusted.weenv", b"\x00\x01\x02")
    os.setxattr(root / "dir", "user.on-dir", b"dir")
    os.setxattr(root / "abs-link", "trusted.on-link", b"link", follow_symlinks=False)
    os.setxattr(root / "chr", "trusted.on-dev", b"dev")
    for i in range(5):
        os.setxattr(root / "many" / f"entry-{i:04d}", "user.shared", b"same value")
    _set_capability(write("bin/cap", b"cap\n", 0o755))
    acl = write("acl", b"acl\n")
    os.setxattr(acl, "system.posix_acl_access", ACL)

    # Distinct mtimes with nanoseconds, children before parents, the root last.
    paths = sorted(root.rglob("*"), key=lambda p: len(p.parts), reverse=True)
    base = 1_600_000_000_000_000_000
    for i, p in enumerate(paths):
        os.utime(p, ns=(base, base + i * 1_000_000_007), follow_symlinks=False)
    os.utime(root, ns=(base, base - 123_456_789))


def snapshot(root: Path) -> dict[str, dict]:
    """Every attribute weenv promises to keep, per relative path ('.' for the root).

    Hardlinks are recorded as the first path (sorted) of their inode, so two
    trees compare equal only if the same names share inodes.
    """
    first_path: dict[int, str] = {}
    out: dict[str, dict] = {}
    paths = [root] + sorted(root.rglob("*"))
    for p in paths:
        rel = "." if p == root else str(p.relative_to(root))
        st = os.lstat(p)
        rec: dict = {
            "mode": oct(st.st_mode),
            "uid": st.st_uid,
            "gid": st.st_gid,
            "mtime_ns": st.st_mtime_ns,
            "nlink": st.st_nlink,
            "inode": first_path.setdefault(st.st_ino, rel),
            "xattrs": {
                k: os.getxattr(p, k, follow_symlinks=False) for k in sorted(os.listxattr(p, follow_symlinks=False))
            },
        }
        if not stat.S_ISDIR(st.st_mode):
            rec["size"] = st.st_size
        if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
            rec["rdev"] = (os.major(st.st_rdev), os.minor(st.st_rdev))
        if stat.S_ISLNK(st.st_mode):
            rec["target"] = os.readlink(p)
        if stat.S_ISREG(st.st_mode):
            rec["sha256"] = hashlib.sha256(p.read_bytes()).hexdigest()
        out[rel] = rec
    return out


@pytest.fixture
def tree(tmp_path) -> Path:
    root = tmp_path / "src"
    root.mkdir()
    make_tree(root)
    return root


def _mounted_snapshot(image: Path, target: Path) -> dict[str, dict]:
    target.mkdir()
    mount(erofs_spec(image, target))
    try:
        return snapshot(target)
    finally:
        umount(target)


def _leftovers(*dirs: Path) -> list[str]:
    return [str(p) for d in dirs if d.exists() for p in d.rglob("*") if ".tmp-" in p.name or ".weenv-build-" in p.name]


# --- groups ------------------------------------------------------------------------------


def test_group_round_trip_keeps_every_file_kind(tree, store, tmp_path, leak_check):
    work = tmp_path / "work"
    work.mkdir()
    result = build_group(tree, store, name="kinds", chunk_size=SMALL_CHUNK, workdir=work)
    m = result.manifest
    assert result.digest == m.digest() == store.get_ref("groups", "kinds")
    assert m.image_size == sum(c.size for c in m.chunks) and m.image_size % 4096 == 0
    assert len(m.chunks) == -(-m.image_size // SMALL_CHUNK) > 3 * MIB // SMALL_CHUNK
    assert all(c.size == SMALL_CHUNK for c in m.chunks[:-1])
    assert m.file_count == count_inodes(tree)
    assert m.source["path"] == str(tree) and m.source["mkfs"] == WRITER
    assert result.chunks_written == len({c.digest for c in m.chunks})
    assert result.bytes_written == sum({c.digest: c.stored_size for c in m.chunks}.values())
    assert load_group(store, result.digest) == m
    assert list(work.iterdir()) == []

    image = tmp_path / "assembled.erofs"
    assemble_image(store, load_group(store, result.digest), image)
    assert image.stat().st_size == m.image_size
    before = snapshot(tree)
    after = _mounted_snapshot(image, tmp_path / "mnt")
    assert after.keys() == before.keys()
    for rel in before:
        assert after[rel] == before[rel], rel
    # Spot checks, so a bug in snapshot() cannot hide everything.
    assert after["hard1"]["inode"] == after["dir/hard2"]["inode"] == before["hard1"]["inode"]
    assert after["hard1"]["nlink"] == 3
    assert after["deleted"]["rdev"] == (0, 0)
    assert after["opaque"]["xattrs"]["trusted.overlay.opaque"] == b"y"
    assert "security.capability" in after["bin/cap"]["xattrs"]
    assert after["acl"]["xattrs"]["system.posix_acl_access"] == ACL
    assert after["xattrs"]["xattrs"]["user.binary"] == bytes(range(256))
    assert stat.S_ISSOCK(int(after["sock"]["mode"], 8)) and stat.S_ISFIFO(int(after["fifo"]["mode"], 8))
    assert after["bigdev"]["rdev"] == (300, 70000)
    assert after["."]["mtime_ns"] % 1_000_000_000 != 0  # nanoseconds kept
    assert after["bin/suid"]["mode"] == oct(stat.S_IFREG | 0o4755)
    assert after["big.bin"]["size"] == 3 * MIB + 12345
    assert after["dangling"]["target"] == "nowhere/at/all"


def test_writer_is_deterministic_and_refuses_what_it_cannot_store(tmp_path):
    import io

    from weenv.packaging.erofs_writer import Inode, new_dir

    a, b = _same_tree_twice(tmp_path)
    images = []
    for root in (a, b):
        out = io.BytesIO()
        write_image(tree_from_dir(root), out, uuid="12345678-1234-5678-1234-567812345678")
        images.append(out.getvalue())
    assert images[0] == images[1]
    bad_cases = {
        r"bad file name \(256 bytes": {b"n" * 256: Inode(mode=stat.S_IFREG | 0o644)},
        "more than the kernel's limit": {b"x": Inode(mode=stat.S_IFREG, xattrs={"user.big": bytes(65536)})},
        "no namespace": {b"x": Inode(mode=stat.S_IFREG, xattrs={"os2.x": b"1"})},
        "its size says 10": {b"short": Inode(mode=stat.S_IFREG, size=10, data=b"abc")},
    }
    for message, children in bad_cases.items():
        root = new_dir()
        root.children.update(children)
        with pytest.raises(InvalidInputError, match=message):
            write_image(root, io.BytesIO(), uuid="12345678-1234-5678-1234-567812345678")


def test_rebuild_of_unchanged_tree_writes_no_chunks(tree, store, tmp_path):
    first = build_group(tree, store, name="same", chunk_size=SMALL_CHUNK)
    second = build_group(tree, store, name="same", chunk_size=SMALL_CHUNK)
    assert second.chunks_written == 0 and second.bytes_written == 0
    assert second.manifest.chunks == first.manifest.chunks


def _same_tree_twice(tmp_path: Path) -> tuple[Path, Path]:
    """Two equal trees ``a`` and ``b`` whose entries were created in opposite orders."""
    a, b = tmp_path / "a", tmp_path / "b"
    for root, names in ((a, "abcefg"), (b, "gfecba")):
        root.mkdir()
        for n in names:
            (root / n).write_bytes(n.encode() * 1000)
        (root / "sub").mkdir()
        for p in [*root.iterdir(), root]:
            os.utime(p, ns=(1_500_000_000_000_000_000, 1_500_000_000_123_456_789))
    return a, b


def test_mkfs_output_is_deterministic(tmp_path):
    a, b = _same_tree_twice(tmp_path)
    mkfs_erofs(a, tmp_path / "a.img")
    time.sleep(1.1)
    mkfs_erofs(b, tmp_path / "b.img")
    assert (tmp_path / "a.img").read_bytes() == (tmp_path / "b.img").read_bytes()
    mkfs_erofs(a, tmp_path / "c.img", uuid="12345678-1234-5678-1234-567812345678")
    assert (tmp_path / "a.img").read_bytes() != (tmp_path / "c.img").read_bytes()


def test_identical_chunks_across_groups_are_stored_once(tree, store):
    a = build_group(tree, store, name="one", chunk_size=SMALL_CHUNK)
    b = build_group(tree, store, name="two", chunk_size=SMALL_CHUNK)
    da = [c.digest for c in a.manifest.chunks]
    db = [c.digest for c in b.manifest.chunks]
    # Same tree, other group: only the superblock's chunk (its UUID) differs.
    assert da[1:] == db[1:] and da[0] != db[0]
    assert b.chunks_written == 1
    assert sorted(store.list_chunks()) == sorted(set(da) | set(db))


@pytest.mark.parametrize("name", ["", "Upper", "-dash", "a/b", "x" * 129, "sp ace"])
def test_build_rejects_bad_name(name, tree, store, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    with pytest.raises(InvalidInputError, match="bad name"):
        build_group(tree, store, name=name, workdir=work)
    assert list(work.iterdir()) == [] and list(store.list_chunks()) == []


@pytest.mark.parametrize("chunk_size", [0, -4096, 1000, 4096 + 1])
def test_build_rejects_bad_chunk_size(chunk_size, tree, store):
    with pytest.raises(InvalidInputError, match="chunk size"):
        build_group(tree, store, name="g", chunk_size=chunk_size)


def test_build_rejects_workdir_inside_source(tree, store):
    with pytest.raises(InvalidInputError, match="inside the source"):
        build_group(tree, store, name="g", workdir=tree / "dir")
    assert _leftovers(tree) == []


def test_mkfs_failure_and_missing_tool(tree, tmp_path):
    with pytest.raises(RuntimeFailedError, match="mkfs.erofs failed") as info:
        mkfs_erofs(tree, tmp_path / "no" / "such" / "dir" / "x.img")
    assert "\n" in str(info.value)  # the tool's own words follow
    with pytest.raises(ToolMissingError, match="erofs-utils"):
        mkfs_erofs(tree, tmp_path / "x.img", mkfs="mkfs.erofs-not-installed")
    with pytest.raises(InvalidInputError, match="UUID"):
        mkfs_erofs(tree, tmp_path / "x.img", uuid="nope")
    assert not (tmp_path / "x.img").exists()


def test_name_max_is_refused_by_erofs_utils_1_5(tmp_path):
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "d" / ("n" * 255)).write_bytes(b"")
    if mkfs_version() != "1.5":
        pytest.skip("only erofs-utils 1.5 is known to fail on 255-byte names")
    with pytest.raises(InvalidInputError, match="255 bytes"):
        mkfs_erofs(src, tmp_path / "x.img")
    assert not (tmp_path / "x.img").exists()


def test_assemble_refuses_corrupt_or_missing_chunks(tmp_path, store):
    src = tmp_path / "small"
    src.mkdir()
    (src / "f").write_bytes(os.urandom(200 * KIB))
    m = build_group(src, store, name="small", chunk_size=SMALL_CHUNK).manifest
    dest = tmp_path / "out" / "image.erofs"
    dest.parent.mkdir()

    victim = m.chunks[1].digest
    store._put("chunks", victim, b"garbage")  # the backend's raw write: bypasses checks
    with pytest.raises(DigestMismatchError):
        assemble_image(store, m, dest)
    store.delete_chunk(victim)
    with pytest.raises(NotFoundError):
        assemble_image(store, m, dest)
    assert list(dest.parent.iterdir()) == []

    # a manifest whose chunks do not tile its image is refused when parsed
    bad = m.model_dump_json().replace(f'"image_size":{m.image_size}', f'"image_size":{m.image_size + 1}')
    with pytest.raises(InvalidInputError, match="do not tile"):
        parse_group_manifest(bad.encode())


def test_load_group_errors(tree, store):
    with pytest.raises(NotFoundError):
        load_group(store, "sha256:" + "0" * 64)
    with pytest.raises(InvalidInputError):
        load_group(store, "kinds")
    g = build_group(tree, store, name="g", chunk_size=SMALL_CHUNK)
    t, _ = create_template(store, "t", [g.digest])
    with pytest.raises(InvalidInputError, match="not a group"):
        load_group(store, t)


# --- templates ---------------------------------------------------------------------------


@pytest.fixture
def two_groups(tmp_path, store) -> tuple[str, str]:
    digests = []
    for name in ("base", "tools"):
        src = tmp_path / f"src-{name}"
        src.mkdir()
        (src / name).write_bytes(name.encode())
        digests.append(build_group(src, store, name=name, chunk_size=SMALL_CHUNK).digest)
    return digests[0], digests[1]


def test_template_create_and_load(store, two_groups):
    base, tools = two_groups
    runtime = RuntimeConfig(command=["/bin/sh", "-c", "sleep 1d"], working_dir="/work", user="1000:1000")
    digest, manifest = create_template(store, "task-1", ["base", tools], runtime=runtime, version="v1")
    assert manifest.groups == [base, tools] and manifest.runtime == runtime and manifest.version == "v1"
    raw = store.get_manifest(digest)
    assert raw == canonical_json(manifest)
    assert digest == sha256_digest(raw) == "sha256:" + hashlib.sha256(raw).hexdigest()
    assert digest == manifest.digest() == store.get_ref("templates", "task-1")
    assert parse_template_manifest(raw) == manifest

    assert load_template(store, "task-1") == (digest, manifest)
    assert load_template(store, digest) == (digest, manifest)

    # Re-creating moves the ref; the old digest still loads.
    digest2, manifest2 = create_template(store, "task-1", [tools])
    assert load_template(store, "task-1") == (digest2, manifest2)
    assert load_template(store, digest)[1].groups == [base, tools]
    assert store.list_refs("templates") == {"task-1": digest2}


def test_template_errors(store, two_groups):
    base, _tools = two_groups
    with pytest.raises(NotFoundError):
        create_template(store, "t", ["base", "no-such-group"])
    with pytest.raises(NotFoundError):
        create_template(store, "t", ["sha256:" + "1" * 64])
    with pytest.raises(InvalidInputError):
        create_template(store, "t", [])
    with pytest.raises(InvalidInputError, match="twice"):
        create_template(store, "t", ["base", base])
    with pytest.raises(InvalidInputError, match="bad name"):
        create_template(store, "Bad Name", ["base"])
    with pytest.raises(InvalidInputError):
        create_template(store, "t", ["sha256:short"])
    assert store.list_refs("templates") == {}

    t, _ = create_template(store, "t", ["base"])
    with pytest.raises(InvalidInputError, match="not a group"):
        create_template(store, "t2", [t])
    with pytest.raises(InvalidInputError, match="not a template"):
        load_template(store, base)
    with pytest.raises(NotFoundError):
        load_template(store, "unknown")
    with pytest.raises(NotFoundError):
        load_template(store, "sha256:" + "2" * 64)
    assert isinstance(load_template(store, "t")[1], TemplateManifest)


# --- a real base: the debootstrap tree ---------------------------------------------------


@pytest.mark.slow
def test_group_of_debian_root(debian_root, store, tmp_path, leak_check):
    started = time.monotonic()
    first = build_group(debian_root, store, name="debian")
    first_s = time.monotonic() - started
    m = first.manifest
    found = subprocess.run(
        ["find", str(debian_root), "-printf", "%D:%i\n"], capture_output=True, text=True, check=True
    ).stdout.split()
    assert m.file_count == len(set(found)) > 5000
    assert m.image_size > 150 * MIB and len(m.chunks) == -(-m.image_size // m.chunk_size)

    started = time.monotonic()
    second = build_group(debian_root, store, name="debian")
    second_s = time.monotonic() - started
    assert second.chunks_written == 0 and second.manifest.chunks == m.chunks

    image = tmp_path / "debian.erofs"
    assemble_image(store, m, image)
    target = tmp_path / "mnt"
    target.mkdir()
    mount(erofs_spec(image, target))
    try:
        assert (target / "etc/debian_version").read_bytes() == (debian_root / "etc/debian_version").read_bytes()
        assert os.path.islink(target / "bin") == os.path.islink(debian_root / "bin")
        assert (target / "usr/bin/python3").exists()
    finally:
        umount(target)
    print(
        f"\ndebian group: {m.file_count} inodes, image {m.image_size / MIB:.0f} MiB, "
        f"{len(m.chunks)} chunks, stored {m.stored_size / MIB:.0f} MiB; "
        f"build {first_s:.1f} s, rebuild {second_s:.1f} s"
    )
