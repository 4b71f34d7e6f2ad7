"""``weenv import``: real images built by a private dockerd (Debian's docker.io,
data under a temporary directory), imported from a ``docker save`` archive, an
OCI layout, an OCI archive and a loopback registry (Debian's docker-registry,
through skopeo), then compared with ``docker run`` of the same image.

The test image (:data:`DOCKERFILE`) is the cached Debian tree (``docker
import`` of ``debian_root``) plus layers that delete and recreate files and
directories of the base and of each other, hold hardlinks across directories,
setuid/setgid binaries, a ``security.capability`` file, relative/absolute/
dangling symlinks, a sparse file, a fifo, a device node and empty directories.
Docker's init layer and mounts (``/.dockerenv``, ``/etc/mtab``, ``/etc/hosts``,
``/etc/hostname``, ``/etc/resolv.conf``, ``/dev``, ``/proc``, ``/sys``) are
not the image's and are left out.  One listing script (:data:`LISTING`: path, type, mode, uid/gid, size, sha256
of the content (MiB blocks tagged, one of zeros by its tag alone: the sparse file's 4 GiB of holes, real zeros in
docker, are not hashed),
link target, device numbers, xattrs, hardlink groups) runs inside both.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import stat
import subprocess
import sys
import tarfile
from pathlib import Path

import httpx
import pytest

from registry_fixture import oci_registry  # noqa: F401 - a fixture
from weenv.errors import DigestMismatchError, InvalidInputError, NotFoundError
from weenv.packaging.importer import import_image
from weenv.progress import Progress
from weenv.store.file import FileStore
from weenv_bench.extracting_import import import_extracting
from weenv_bench.import_image import DiskMeter, used_bytes
from weenv_bench.services.dockerd import Dockerd
from weenv_bench.services.process import alive
from weenv_bench.services.registry import Registry

BASE = "weenv-import-base:1"
IMAGE = "weenv-import-test:1"
NOBODY = "weenv-import-test:nobody"
SMALL = "weenv-import-small:1"
CAP_NET_RAW = "0100000200200000000000000000000000000000"  # VFS_CAP v2, effective, cap_net_raw

DOCKERFILE = f"""\
FROM {BASE}
RUN set -e; \\
    mkdir -p /data/keep /data/gone/sub /data/empty /data/tmp /data/hl /opt/hl; \\
    echo keep > /data/keep/k; echo old > /data/gone/old; echo oldsub > /data/gone/sub/s; \\
    echo shared > /data/hl/a; ln /data/hl/a /opt/hl/b; ln /data/hl/a /data/hl/c; \\
    echo pair > /data/keep/p1; ln /data/keep/p1 /etc/p2; \\
    cp /bin/true /usr/local/bin/suid-true; chmod 4755 /usr/local/bin/suid-true; \\
    cp /bin/true /usr/local/bin/sgid-true; chown 0:50 /usr/local/bin/sgid-true; chmod 2711 /usr/local/bin/sgid-true; \\
    cp /bin/true /usr/local/bin/ping-like; chmod 1777 /data/tmp; \\
    python3 -c "import os; os.setxattr('/usr/local/bin/ping-like', 'security.capability', bytes.fromhex('{CAP_NET_RAW}')); os.setxattr('/data/keep/k', 'user.note', b'kept')"; \\
    ln -s ../keep/k /data/rel; ln -s /data/keep/k /data/abs; ln -s /nonexistent/target /data/dangling; \\
    python3 -c "f = open('/data/sparse', 'wb'); f.truncate(8 << 20); f.seek(4 << 20); f.write(b'middle'); f.close()"; \\
    mkfifo /data/fifo; mknod /data/null c 1 3; \\
    echo torm > /data/torm; echo x > /data/f2d; chown -R 1000:1000 /data/keep; chmod 0600 /data/keep/p1
RUN rm -rf /data/gone /data/torm /etc/p2 /etc/apt/apt.conf.d /etc/debian_version /etc/dpkg/origins \\
    && echo file-now > /etc/dpkg/origins && rm /data/f2d && mkdir /data/f2d && echo c > /data/f2d/c
RUN mkdir -p /data/gone /etc/apt/apt.conf.d && echo new > /data/gone/new \\
    && echo new > /etc/apt/apt.conf.d/new && echo 13 > /etc/debian_version
RUN rm -rf /data/keep /etc/skel && mkdir /data/keep /etc/skel && echo k2 > /data/keep/k2 \\
    && echo new > /etc/skel/new && mkdir /data/empty2
RUN rm /etc/dpkg/origins && mkdir /etc/dpkg/origins && echo again > /etc/dpkg/origins/again
ENV IMPORT_TEST=1 LANG=C.UTF-8
WORKDIR /data
ENTRYPOINT ["/bin/sh", "-c"]
CMD ["echo hello"]
"""

LISTING = r"""
import hashlib, json, os, stat, sys
SKIP = {"/proc", "/sys", "/dev", "/.dockerenv", "/etc/hostname", "/etc/hosts", "/etc/resolv.conf", "/etc/mtab"}
ZERO = bytes(1 << 20)
out, inodes = {}, {}
def xattrs(p):
    try:
        names = os.listxattr(p, follow_symlinks=False)
    except OSError as e:
        return "error %d" % e.errno
    r = {}
    for n in sorted(names):
        try:
            r[n] = os.getxattr(p, n, follow_symlinks=False).hex()
        except OSError as e:
            r[n] = "error %d" % e.errno
    return r
def visit(p):
    st = os.lstat(p)
    m = st.st_mode
    e = {"type": stat.S_IFMT(m), "mode": oct(stat.S_IMODE(m)), "uid": st.st_uid, "gid": st.st_gid,
         "xattrs": xattrs(p)}
    if stat.S_ISREG(m):
        e["size"] = st.st_size
        try:
            h = hashlib.sha256()  # of the MiB blocks, each tagged; one of zeros hashed as its tag alone
            with open(p, "rb") as f:
                for b in iter(lambda: f.read(1 << 20), b""):
                    h.update(b"z" if b == ZERO else b"d" + b)
            e["sha256"] = h.hexdigest()
        except OSError as ex:
            e["sha256"] = "error %d" % ex.errno
        if st.st_nlink > 1:
            inodes.setdefault((st.st_dev, st.st_ino), []).append(p)
    elif stat.S_ISLNK(m):
        e["target"] = os.readlink(p)
    elif stat.S_ISCHR(m) or stat.S_ISBLK(m):
        e["rdev"] = [os.major(st.st_rdev), os.minor(st.st_rdev)]
    out[p] = e
    return stat.S_ISDIR(m)
visit("/")
stack = ["/"]
while stack:
    d = stack.pop()
    for n in sorted(os.listdir(d)):
        p = os.path.join(d, n)
        if p not in SKIP and visit(p):
            stack.append(p)
links = sorted(sorted(v) for v in inodes.values() if len(v) > 1)
json.dump({"entries": out, "hardlinks": links}, sys.stdout, sort_keys=True)
"""


# --- fixtures: a private dockerd, the images, their docker run listing -----------------
@pytest.fixture(scope="module")
def dockerd():
    with Dockerd() as d:
        yield d


@pytest.fixture(scope="module")
def images(dockerd, debian_root, tmp_path_factory):
    """Build the images; return paths of their ``docker save`` archives and the
    listing of ``docker run IMAGE``."""
    work = tmp_path_factory.mktemp("images")
    tar = subprocess.run(["tar", "-C", str(debian_root), "--xattrs", "-c", "."], capture_output=True, check=True)
    dockerd.docker("import", "-", BASE, input=tar.stdout)
    ctx = work / "ctx"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text(DOCKERFILE)
    dockerd.docker("build", "-q", "-t", IMAGE, str(ctx))
    (ctx / "Dockerfile").write_text(f"FROM {IMAGE}\nUSER nobody:nogroup\n")
    dockerd.docker("build", "-q", "-t", NOBODY, str(ctx))
    small = work / "small"
    (small / "tree" / "etc").mkdir(parents=True)
    (small / "tree" / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (small / "tree" / "hello.txt").write_text("hello-import\n" * 100)
    (small / "more").mkdir()
    (small / "more" / "data.bin").write_bytes(os.urandom(50_000))
    (small / "Dockerfile").write_text('FROM scratch\nCOPY tree/ /\nCOPY more/ /more/\nCMD ["/hello"]\n')
    dockerd.docker("build", "-q", "-t", SMALL, str(small))
    archives = {}
    for tag, file in ((IMAGE, "image.tar"), (NOBODY, "nobody.tar"), (SMALL, "small.tar")):
        archives[tag] = work / file
        dockerd.docker("save", "-o", str(work / file), tag)
    listing = json.loads(
        dockerd.docker(
            "run", "--rm", "--network", "none", "--user", "0:0", "--entrypoint", "python3", IMAGE, "-c", LISTING
        ).stdout
    )
    return {"archives": archives, "docker_listing": listing, "work": work}


@pytest.fixture(scope="module")
def import_store(tmp_path_factory):
    """One store for the module's imports: identical layers are then stored once."""
    return FileStore(tmp_path_factory.mktemp("import-store") / "store")


def _weenv_listing(paths, store, template: str) -> dict:
    from weenv.node.node import Node

    with Node(paths, store=store) as node:
        info = node.create(template)
        r = node.exec(info.id, ["python3", "-c", LISTING], timeout=300)
        assert r.exit_code == 0, r.stderr.decode()
        node.destroy(info.id)
    # This environment's own cgroup is gone (leak_check also sees other sessions' ones).
    assert not list(Path("/sys/fs/cgroup").glob(f"*/*{info.id}*"))
    return json.loads(r.stdout)


def _assert_same_tree(weenv: dict, docker: dict) -> None:
    w, d = weenv["entries"], docker["entries"]
    missing, extra = sorted(set(d) - set(w)), sorted(set(w) - set(d))
    assert not missing and not extra, f"only in docker: {missing[:20]}; only in weenv: {extra[:20]}"
    differ = {p: (w[p], d[p]) for p in d if w[p] != d[p]}
    assert not differ, f"{len(differ)} entries differ, e.g. {list(differ.items())[:5]}"
    assert weenv["hardlinks"] == docker["hardlinks"]


def _check_listing_has_the_cases(listing: dict) -> None:
    """The docker run listing shows what the Dockerfile set out to make."""
    e = listing["entries"]
    assert "/data/gone/new" in e and "/data/gone/old" not in e and "/data/gone/sub" not in e
    assert "/etc/apt/apt.conf.d/new" in e and len([p for p in e if p.startswith("/etc/apt/apt.conf.d/")]) == 1
    assert [p for p in e if p.startswith("/etc/skel/")] == ["/etc/skel/new"]
    assert [p for p in e if p.startswith("/etc/dpkg/origins/")] == ["/etc/dpkg/origins/again"]
    assert [p for p in e if p.startswith("/data/keep/")] == ["/data/keep/k2"]
    assert e["/usr/local/bin/suid-true"]["mode"] == "0o4755"
    assert e["/usr/local/bin/sgid-true"]["mode"] == "0o2711" and e["/usr/local/bin/sgid-true"]["gid"] == 50
    assert e["/usr/local/bin/ping-like"]["xattrs"] == {"security.capability": CAP_NET_RAW}
    assert e["/data/rel"]["target"] == "../keep/k" and e["/data/dangling"]["target"] == "/nonexistent/target"
    assert e["/data/sparse"]["size"] == 8 << 20 and e["/data/null"]["rdev"] == [1, 3]
    assert e["/data/tmp"]["mode"] == "0o1777" and "/data/empty" in e and "/data/empty2" in e
    assert ["/data/hl/a", "/data/hl/c", "/opt/hl/b"] in listing["hardlinks"]
    assert "/etc/p2" not in e and "/etc/debian_version" in e


@pytest.fixture(scope="module")
def imgtest(images, import_store, tmp_path_factory):
    """The test image's ``docker save`` archive imported as ``imgtest`` (its
    work directory empty afterwards); the registry test compares with it."""
    work = tmp_path_factory.mktemp("imgtest-work")
    r = import_image(str(images["archives"][IMAGE]), import_store, name="imgtest", workdir=work)
    assert os.listdir(work) == []
    return r


# --- the tree inside an environment equals the tree inside docker run -------------------
def test_docker_archive_tree_matches_docker_run(images, imgtest, import_store, paths, leak_check):
    _check_listing_has_the_cases(images["docker_listing"])
    r = imgtest
    assert r.group_layers == [[0], [1], [2], [3], [4], [5]]
    assert [g.manifest.name for g in r.groups] == [f"imgtest.{k}" for k in range(6)]
    stats = r.layer_stats
    assert sum(s.whiteouts for s in stats) >= 5 and sum(s.opaque_dirs for s in stats) >= 2
    rt = r.template.runtime
    assert rt.command == ["sleep", "infinity"]
    assert rt.default_command == ["/bin/sh", "-c", "echo hello"]
    assert rt.working_dir == "/data" and rt.user == "0:0"
    assert rt.env["IMPORT_TEST"] == "1" and rt.env["HOME"] == "/root" and rt.env["PATH"].startswith("/usr/local")
    _assert_same_tree(_weenv_listing(paths, import_store, "imgtest"), images["docker_listing"])


def test_merged_small_layers_tree_matches_docker_run(images, import_store, paths, leak_check):
    """All five small layers in one group: deletions between them are applied in
    the tree, and what they delete from the base becomes whiteouts/opaque dirs."""
    r = import_image(str(images["archives"][IMAGE]), import_store, name="imgmerged", merge_small=16 << 20)
    assert r.group_layers == [[0], [1, 2, 3, 4, 5]]
    _assert_same_tree(_weenv_listing(paths, import_store, "imgmerged"), images["docker_listing"])


# --- every tree kind, in layers written here, against docker load + docker run -----------
LONG = "n" * 255
BIN_XATTR = b"\x00bin\x00\xff\x01\x00"


def _kinds_tree(root: Path) -> None:
    """Layer 1's tree: 255-byte names, binary xattrs, a 300-level deep tree, every file type."""
    (root / "kinds" / LONG).mkdir(parents=True)
    (root / "kinds" / LONG / LONG).write_bytes(b"long name\n")
    f = root / "kinds" / "xattrs"
    f.write_bytes(b"x\n")
    os.setxattr(f, "user.bin", BIN_XATTR)
    os.setxattr(f, "user.big", bytes(range(256)) * 12)
    deep = root / "kinds" / "deep"
    for _ in range(300):
        deep = deep / "d"
    deep.mkdir(parents=True)
    (deep / "bottom").write_bytes(b"bottom\n")
    os.mkfifo(root / "kinds" / "fifo")
    os.mknod(root / "kinds" / "blk", 0o640 | 0o060000, os.makedev(7, 200))
    os.mknod(root / "kinds" / "chr", 0o600 | 0o020000, os.makedev(1, 5))
    (root / "kinds" / "hl1").write_bytes(b"hard\n" * 1000)
    os.link(root / "kinds" / "hl1", root / "kinds" / LONG / "hl2")
    os.symlink(LONG + "/" + LONG, root / "kinds" / "to-long")
    os.chown(root / "kinds" / "fifo", 123, 456)


HUGE = (4 << 30) + (1 << 20) + 123
"""The sparse file's size: past 4 GiB (offsets and sizes beyond 32 bits), by little
(docker load writes its holes as zeros, and both listings hash all of it)."""


def _sparse_tree(root: Path) -> None:
    """Layer 2's tree: a sparse file over 4 GiB (data at 1 MiB, at 4 GiB and at its end)."""
    (root / "kinds").mkdir(parents=True)
    with open(root / "kinds" / "huge", "wb") as f:
        f.truncate(HUGE)
        for at in (1 << 20, 4 << 30, HUGE - 23):
            f.seek(at)
            f.write(b"data at %d\n" % at)


def _docker_archive(base_archive: Path, layers: list[bytes], dest: Path, tag: str, *, base: int = 1) -> None:
    """A ``docker save`` archive: the base image's first ``base`` layers (0 or 1), then ``layers`` (tars)."""
    with tarfile.open(base_archive) as src:
        manifest = json.loads(src.extractfile("manifest.json").read())[0]
        config = json.loads(src.extractfile(manifest["Config"]).read())
        base_layers = [(name, src.extractfile(name).read()) for name in manifest["Layers"][:base]]
    config["rootfs"]["diff_ids"] = config["rootfs"]["diff_ids"][:base]
    config["history"] = []
    names = [name for name, _ in base_layers]
    with tarfile.open(dest, "w") as out:

        def add(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            out.addfile(info, io.BytesIO(data))

        for name, data in base_layers:
            add(name, data)
        for k, data in enumerate(layers):
            names.append(f"kinds{k}/layer.tar")
            add(names[-1], data)
            config["rootfs"]["diff_ids"].append("sha256:" + hashlib.sha256(data).hexdigest())
        cfg = json.dumps(config).encode()
        add("config.json", cfg)
        add("manifest.json", json.dumps([{"Config": "config.json", "RepoTags": [tag], "Layers": names}]).encode())


@pytest.fixture(scope="module")
def kinds(dockerd, images, tmp_path_factory):
    """A docker save archive of the base image plus a layer written by GNU tar
    with every tree kind (PAX, SCHILY xattrs) and one with a 4 GiB sparse file
    (PAX GNU sparse 1.0; dockerd 20.10 refuses the old type ``S``, which
    tests/unit/test_tartree.py covers); loaded into dockerd and listed by
    ``docker run``.  ``layers_archive``: the two layers alone (no base)."""
    work = tmp_path_factory.mktemp("kinds")
    layers = []
    for k, (make, fmt) in enumerate(
        (
            (_kinds_tree, ["--format=posix", "--xattrs", "--xattrs-include=*"]),
            (_sparse_tree, ["--format=posix", "--sparse", "--sparse-version=1.0"]),
        )
    ):
        tree = work / f"tree{k}"
        make(tree)
        out = subprocess.run(
            ["tar", "-C", str(tree), "--numeric-owner", *fmt, "-cf", "-", "."], capture_output=True, check=True
        )
        layers.append(out.stdout)
        subprocess.run(["rm", "-rf", str(tree)], check=True)
    assert len(layers[1]) < 1 << 20  # the 4 GiB file's holes are not in the tar
    archive = work / "kinds.tar"
    tag = "weenv-import-kinds:1"
    _docker_archive(images["archives"][IMAGE], layers, archive, tag)
    dockerd.docker("load", "-i", str(archive))
    listing = json.loads(
        dockerd.docker(
            "run",
            "--rm",
            "--network",
            "none",
            "--user",
            "0:0",
            "--entrypoint",
            "python3",
            tag,
            "-c",
            LISTING,
            timeout=600,
        ).stdout
    )
    dockerd.docker("rmi", tag)
    alone = work / "kinds-alone.tar"
    _docker_archive(images["archives"][IMAGE], layers, alone, "weenv-import-kinds-alone:1", base=0)
    return {"archive": archive, "docker_listing": listing, "layers_archive": alone}


def test_every_tree_kind_matches_docker_run(kinds, import_store, paths, leak_check, tmp_path):
    e = kinds["docker_listing"]["entries"]
    long_path = f"/kinds/{LONG}/{LONG}"
    assert e[long_path]["size"] == 10 and e["/kinds/xattrs"]["xattrs"]["user.bin"] == BIN_XATTR.hex()
    assert e["/kinds/huge"]["size"] == HUGE and e["/kinds/blk"]["rdev"] == [7, 200]
    assert "/kinds/deep" + "/d" * 300 + "/bottom" in e
    assert ["/kinds/hl1", f"/kinds/{LONG}/hl2"] in kinds["docker_listing"]["hardlinks"]
    r = import_image(str(kinds["archive"]), import_store, name="kinds", workdir=tmp_path)
    assert len(r.groups) == 3
    _assert_same_tree(_weenv_listing(paths, import_store, "kinds"), kinds["docker_listing"])


def _small_base_archive(images, debian_root: Path, dest: Path) -> Path:
    """The test image's layers over a small base layer instead of the whole Debian
    tree: the Debian tree's top directories, ``/etc``, ``/opt`` and ``/usr/local``,
    all that the image's layers delete, replace or add to."""
    base = subprocess.run(
        ["tar", "-C", str(debian_root), "--xattrs", "--numeric-owner", "-cf", "-", "--no-recursion", ".", "./usr",
         "--recursion", "./etc", "./opt", "./usr/local"],
        capture_output=True,
        check=True,
    ).stdout  # fmt: skip
    with tarfile.open(images["archives"][IMAGE]) as src:
        manifest = json.loads(src.extractfile("manifest.json").read())[0]
        upper = [src.extractfile(name).read() for name in manifest["Layers"][1:]]
    _docker_archive(images["archives"][IMAGE], [base, *upper], dest, "weenv-import-small-base:1", base=0)
    return dest


def test_streamed_and_extracted_imports_write_the_same_images(images, kinds, debian_root, tmp_path):
    """The streaming path and the old extracting one (now only the import
    benchmark's baseline) give the same file trees: the test image's layers over a
    small base (whiteouts and opaque directories, layer by layer and merged,
    deletions then applied in the tree) and the every-kind layers (alone: over the
    Debian base they only add the same base group again), each group apart and
    merged.  Merged groups (data spooled, laid out in tree order by both) are
    byte-identical; a group of one layer, whose data the streaming path writes in
    the layer's order, has the extracting path's tree (each group image mounted
    and listed)."""
    small = _small_base_archive(images, debian_root, tmp_path / "small-base.tar")
    for archive in (small, kinds["layers_archive"]):
        for merge in (None, 1 << 30):
            groups = []
            for extract in (False, True):
                store = FileStore(tmp_path / f"s-{extract}")
                run = import_extracting if extract else import_image
                r = run(str(archive), store, name="same", workdir=tmp_path, merge_small=merge)
                if merge is None:
                    groups.append([_image_tree(store, g.manifest, tmp_path) for g in r.groups])
                else:
                    groups.append([[c.digest for c in g.manifest.chunks] for g in r.groups])
                shutil.rmtree(tmp_path / f"s-{extract}")
            assert len(groups[0]) == len(groups[1]), (archive.name, merge)
            for k, (streamed, extracted) in enumerate(zip(*groups)):
                assert streamed == extracted, (archive.name, merge, k)


def _image_tree(store, manifest, tmp_path: Path) -> dict:
    """The tree of one group image, mounted (file-backed EROFS): path -> (type,
    mode, owner, mtime, size, content digest (MiB blocks, zero ones by a tag),
    link target, rdev, xattrs), and the hardlink groups."""
    from weenv.host import mounts
    from weenv.packaging.group import assemble_image

    image, mnt = tmp_path / "tree.erofs", tmp_path / "tree-mnt"
    mnt.mkdir()
    assemble_image(store, manifest, image)
    mounts.mount_erofs(image, mnt)
    try:
        out, inodes, zero = {}, {}, bytes(1 << 20)
        for top, dirs, files in os.walk(mnt):
            for name in sorted(dirs + files):
                p = os.path.join(top, name)
                st = os.lstat(p)
                e = [
                    stat.S_IFMT(st.st_mode),
                    stat.S_IMODE(st.st_mode),
                    st.st_uid,
                    st.st_gid,
                    st.st_mtime_ns,
                    {n: os.getxattr(p, n, follow_symlinks=False) for n in os.listxattr(p, follow_symlinks=False)},
                ]
                if stat.S_ISREG(st.st_mode):
                    h = hashlib.sha256()
                    with open(p, "rb") as f:
                        for b in iter(lambda: f.read(1 << 20), b""):
                            h.update(b"z" if b == zero else b"d" + b)
                    e += [st.st_size, h.hexdigest()]
                    inodes.setdefault(st.st_ino, []).append(os.path.relpath(p, mnt))
                elif stat.S_ISLNK(st.st_mode):
                    e.append(os.readlink(p))
                elif stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
                    e.append(st.st_rdev)
                out[os.path.relpath(p, mnt)] = e
        return {"entries": out, "hardlinks": sorted(sorted(v) for v in inodes.values() if len(v) > 1)}
    finally:
        mounts.umount(mnt)
        mnt.rmdir()
        image.unlink()


def _tar(entries: list[tuple]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        for info, data in entries:
            t.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return buf.getvalue()


def test_hardlink_to_a_file_of_an_earlier_layer(images, store, tmp_path, paths, leak_check):
    """Layer 2 links to a file of layer 1 (over the Debian base): in a group of
    its own the file is copied (overlayfs cannot link across layers), merged
    into one group with it a hardlink; the environment reads it under every name."""
    archive = tmp_path / "hl.tar"
    _docker_archive(
        images["archives"][IMAGE],
        [
            _tar([_entry("srv/", tarfile.DIRTYPE, mode=0o755), _entry("srv/a", data=b"A" * 10_000)]),
            _tar(
                [
                    _entry("srv/b", tarfile.LNKTYPE, linkname="srv/a"),
                    _entry("srv/c", tarfile.LNKTYPE, linkname="./srv/b"),
                ]
            ),
        ],
        archive,
        "hl:1",
    )
    for merge, links in ((None, 2), (1 << 20, 3)):
        name = f"hl{links}"
        r = import_image(str(archive), store, name=name, workdir=tmp_path, merge_small=merge)
        assert len(r.groups) == (3 if merge is None else 2)
        listing = _weenv_listing(paths, store, name)
        for f in ("a", "b", "c"):
            assert listing["entries"][f"/srv/{f}"]["size"] == 10_000
        assert sorted(len(g) for g in listing["hardlinks"] if g[0].startswith("/srv/")) == [links]


# --- an image without a shell or sleep starts ------------------------------------------
HELLO_C = r"""
#include <stdio.h>
int main(int argc, char **argv) {
    char buf[256] = {0};
    FILE *f = fopen("/proc/1/cmdline", "r");
    size_t n = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
    for (size_t i = 0; i < n; i++) if (!buf[i]) buf[i] = ' ';
    printf("hello from scratch, %d args, pid 1: %s\n", argc, buf);
    return 0;
}
"""


def test_distroless_image_from_the_registry_starts_and_runs(dockerd, store, paths, leak_check, tmp_path):
    """``FROM scratch`` + one static binary (no shell, no ``sleep``), pushed to a
    loopback registry and imported from it: the environment starts (its pid 1
    is weenv's exec agent, not the image's ``sleep``) and runs the binary."""
    from weenv.node.node import Node
    from weenv.node.runtime.bundle import AGENT_PATH

    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "hello.c").write_text(HELLO_C)
    subprocess.run(["cc", "-static", "-O2", "-o", str(ctx / "hello"), str(ctx / "hello.c")], check=True)
    (ctx / "Dockerfile").write_text('FROM scratch\nCOPY hello /hello\nENTRYPOINT ["/hello"]\n')
    with Registry(tmp_path / "registry") as registry:
        reference = registry.reference("weenv/distroless", "1")
        dockerd.docker("build", "-q", "-t", reference, str(ctx))
        dockerd.docker("push", reference)
        r = import_image(f"docker://{reference}", store, name="distroless")
        dockerd.docker("rmi", reference)
    assert r.template.runtime.default_command == ["/hello"]
    with Node(paths, store=store) as node:
        info = node.create("distroless")
        out = node.exec(info.id, ["/hello", "a", "b"], timeout=30)
        assert out.exit_code == 0, out.stderr
        assert out.stdout.decode().startswith(f"hello from scratch, 3 args, pid 1: {AGENT_PATH} -u 0:0")
        node.destroy(info.id)


# --- the same image from other sources gives the same groups ---------------------------
def _chunks(result) -> list[list[str]]:
    return [[c.digest for c in g.manifest.chunks] for g in result.groups]


@pytest.fixture(scope="module")
def small_reference(images, import_store):
    return import_image(str(images["archives"][SMALL]), import_store, name="small")


def test_oci_layout_and_oci_archive_give_the_same_groups(images, import_store, small_reference, tmp_path):
    archive = images["archives"][SMALL]
    layout, oci_tar = tmp_path / "layout", tmp_path / "small-oci.tar"
    for dest in (f"oci:{layout}:v1", f"oci-archive:{oci_tar}:v1"):
        subprocess.run(["skopeo", "copy", "--quiet", f"docker-archive:{archive}", dest], check=True)
    for src in (layout, oci_tar):
        r = import_image(str(src), import_store, name="small")
        assert _chunks(r) == _chunks(small_reference)
        assert r.template.runtime == small_reference.template.runtime
    assert import_image(str(layout), import_store, name="small", ref="v1").groups
    with pytest.raises(NotFoundError, match="v2"):
        import_image(str(layout), import_store, name="small", ref="v2")


def test_registry_image_over_http_and_through_skopeo(dockerd, imgtest, import_store, tmp_path, monkeypatch):
    """docker push to a loopback docker-registry; import docker://... (gzip
    layers), streamed over HTTP and (``WEENV_IMPORT_SKOPEO=1``) through skopeo:
    the same groups as from the ``docker save`` archive (``imgtest``: the
    same name, so the same group images)."""
    with Registry(tmp_path / "registry") as registry:
        reference = registry.reference("weenv/import-test", "1")
        dockerd.docker("tag", IMAGE, reference)
        before = registry.blob_bytes()
        dockerd.docker("push", reference)
        assert registry.blob_bytes() - before > 50 << 20
        archive = imgtest
        r = import_image(f"docker://{reference}", import_store, name="imgtest")
        assert _chunks(r) == _chunks(archive)
        assert r.template.runtime == archive.template.runtime
        with pytest.raises(NotFoundError):
            import_image(f"docker://{registry.reference('weenv/absent', '1')}", import_store, name="x")
        monkeypatch.setenv("WEENV_IMPORT_SKOPEO", "1")
        assert _chunks(import_image(f"docker://{reference}", import_store, name="imgtest")) == _chunks(archive)
        with pytest.raises(NotFoundError):
            import_image(f"docker://{registry.reference('weenv/absent', '1')}", import_store, name="x")
        dockerd.docker("rmi", reference)
    assert not list(tmp_path.glob("weenv-import-*"))


def test_image_user_and_config(images, import_store):
    r = import_image(str(images["archives"][NOBODY]), import_store, name="nobody")
    rt = r.template.runtime
    assert rt.user == "65534:65534" and rt.env["HOME"] == "/nonexistent"
    assert rt.working_dir == "/data" and rt.default_command == ["/bin/sh", "-c", "echo hello"]
    assert len(r.groups) == 6  # USER adds no layer


def test_cli_import(images, paths):
    from test_cli import weenv

    r = weenv(paths, "import", str(images["archives"][SMALL]), "--name", "clismall")
    assert r.stdout.strip().startswith("sha256:")
    assert "template clismall: 2 groups" in r.stderr
    assert weenv(paths, "template", "ls").stdout.startswith("clismall\tsha256:")
    bad = weenv(paths, "import", str(paths.home / "absent.tar"), check=False)
    assert bad.returncode == 1 and "weenv: error: no such image source" in bad.stderr


def test_cli_import_progress_as_lines_and_as_bars(images, paths):
    """Its progress on a pipe is plain lines, one per layer and group; on a
    terminal (a pty, through script(1)) rich bars with their counts."""
    from test_cli import weenv

    lines = weenv(paths, "import", str(images["archives"][SMALL]), "--name", "plainprog").stderr.splitlines()
    assert "layers 0/2" in lines and "groups 0/2" in lines, lines
    assert [line.split(":")[0] for line in lines if line.startswith("layers ")] == [
        "layers 0/2",
        "layers 1/2",
        "layers 2/2",
        "layers 2/2",
    ], lines
    assert "layers 2/2: done" in lines and "groups 2/2: done" in lines, lines
    assert not any("\x1b[" in line for line in lines), "escape codes in plain lines"
    command = f"{sys.executable} -m weenv import {images['archives'][SMALL]} --name barprog"
    shown = subprocess.run(
        ["script", "-q", "-e", "-c", command, "/dev/null"],
        capture_output=True,
        text=True,
        env=dict(os.environ, WEENV_HOME=str(paths.home), COLUMNS="140", TERM="xterm"),
        timeout=300,
        check=True,
    ).stdout
    assert "\x1b[" in shown and "━" in shown, shown[-2000:]  # a live display drawing bars
    assert "2/2" in shown and "layers" in shown and "groups" in shown
    assert "layers 0/2" not in shown  # the plain lines are not printed on a terminal


# --- bad inputs: clear errors, nothing published, nothing left ------------------------
def _assert_nothing_published(store, work: Path) -> None:
    assert store.list_refs("groups") == {} and store.list_refs("templates") == {}
    assert list(store.list_chunks()) == [] and list(store.list_manifests()) == []
    assert os.listdir(work) == []


@pytest.fixture
def work(tmp_path):
    w = tmp_path / "work"
    w.mkdir()
    return w


def test_truncated_archive(images, store, work, tmp_path):
    data = images["archives"][IMAGE].read_bytes()
    bad = tmp_path / "cut.tar"
    for cut in (len(data) // 2, 700):  # docker save writes manifest.json last
        bad.write_bytes(data[:cut])
        with pytest.raises(InvalidInputError, match="truncated|neither|not a readable"):
            import_image(str(bad), store, name="cut", workdir=work)
        _assert_nothing_published(store, work)
    # manifest.json and config first, then the archive cut inside the last layer.
    ordered = tmp_path / "ordered.tar"
    _repack(images["archives"][SMALL], ordered, lambda name, data: data, json_first=True)
    data = ordered.read_bytes()
    bad.write_bytes(data[: len(data) - 30_000])
    with pytest.raises(InvalidInputError, match="truncated"):
        import_image(str(bad), store, name="cut", workdir=work)
    _assert_nothing_published(store, work)
    # An intact archive whose layer.tar is only the first half of the layer.
    _repack(
        images["archives"][SMALL],
        bad,
        lambda name, data: data[: len(data) // 2] if name.endswith("layer.tar") else data,
    )
    with pytest.raises((InvalidInputError, DigestMismatchError), match="truncated|diff_id"):
        import_image(str(bad), store, name="cut", workdir=work)
    _assert_nothing_published(store, work)


def _repack(archive: Path, dest: Path, edit, *, json_first: bool = False) -> None:
    """Copy a tar archive, passing each member's (name, bytes) through ``edit``
    (``None``: drop it); ``json_first``: JSON members before the others."""
    with tarfile.open(archive) as src, tarfile.open(dest, "w") as out:
        members = src.getmembers()
        if json_first:
            members.sort(key=lambda m: not m.name.endswith(".json"))
        for m in members:
            data = src.extractfile(m).read() if m.isfile() else None
            if data is not None:
                data = edit(m.name, data)
                if data is None:
                    continue
                m.size = len(data)
            out.addfile(m, io.BytesIO(data) if data is not None else None)


def test_corrupted_layer_in_docker_archive(images, store, work, tmp_path):
    bad = tmp_path / "bad.tar"
    _repack(
        images["archives"][SMALL],
        bad,
        lambda name, data: data.replace(b"hello-import", b"jello-import") if name.endswith("layer.tar") else data,
    )
    with pytest.raises(DigestMismatchError, match="diff_id"):
        import_image(str(bad), store, name="bad", workdir=work)
    _assert_nothing_published(store, work)
    # A config whose bytes do not match its name (its digest).
    _repack(
        images["archives"][SMALL],
        bad,
        lambda name, data: data + b" " if name.endswith(".json") and name != "manifest.json" else data,
    )
    with pytest.raises(DigestMismatchError, match="config"):
        import_image(str(bad), store, name="bad", workdir=work)
    _assert_nothing_published(store, work)


@pytest.fixture
def small_layout(images, tmp_path) -> Path:
    layout = tmp_path / "layout"
    subprocess.run(
        [
            "skopeo",
            "copy",
            "--quiet",
            "--dest-compress",
            f"docker-archive:{images['archives'][SMALL]}",
            f"oci:{layout}:v1",
        ],
        check=True,
    )
    return layout


def _layout_manifest(layout: Path) -> tuple[dict, Path]:
    index = json.loads((layout / "index.json").read_text())
    path = layout / "blobs" / "sha256" / index["manifests"][0]["digest"].split(":")[1]
    return json.loads(path.read_text()), path


def test_missing_and_corrupt_blobs_in_oci_layout(small_layout, store, work):
    manifest, manifest_path = _layout_manifest(small_layout)
    layer = small_layout / "blobs" / "sha256" / manifest["layers"][1]["digest"].split(":")[1]
    good = layer.read_bytes()
    assert good[:2] == b"\x1f\x8b"  # gzip (--dest-compress)

    layer.unlink()
    with pytest.raises(InvalidInputError, match="missing"):
        import_image(str(small_layout), store, name="bad", workdir=work)
    _assert_nothing_published(store, work)

    layer.write_bytes(good[: len(good) // 2])  # truncated gzip stream
    with pytest.raises(InvalidInputError, match="truncated or corrupt"):
        import_image(str(small_layout), store, name="bad", workdir=work)
    _assert_nothing_published(store, work)

    # A valid gzip stream of the same tar and size, another header mtime: another digest.
    layer.write_bytes(good[:4] + bytes([1, 2, 3, 4]) + good[8:])
    assert gzip.decompress(layer.read_bytes()) == gzip.decompress(good)
    with pytest.raises(DigestMismatchError, match="blob digest"):
        import_image(str(small_layout), store, name="bad", workdir=work)
    _assert_nothing_published(store, work)

    layer.write_bytes(good)
    manifest_path.write_bytes(manifest_path.read_bytes().replace(b'"mediaType"', b'"mediaTypf"', 1))
    with pytest.raises(DigestMismatchError, match="expected"):
        import_image(str(small_layout), store, name="bad", workdir=work)
    _assert_nothing_published(store, work)


def test_not_an_image(store, work, tmp_path):
    junk = tmp_path / "junk.tar"
    junk.write_bytes(os.urandom(10_000))
    with pytest.raises(InvalidInputError, match="not a readable tar"):
        import_image(str(junk), store, name="junk", workdir=work)
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    with pytest.raises(InvalidInputError, match="oci-layout"):
        import_image(str(empty_dir), store, name="junk", workdir=work)
    with pytest.raises(NotFoundError):
        import_image(str(tmp_path / "absent"), store, name="junk", workdir=work)
    with pytest.raises(InvalidInputError, match="unsupported"):
        import_image("ftp://host/x", store, name="junk", workdir=work)
    _assert_nothing_published(store, work)


# --- hostile layers (an OCI layout written here, layer by layer) ---------------------
def _entry(name: str, kind: bytes = tarfile.REGTYPE, data: bytes = b"", linkname: str = "", mode: int = 0o644):
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.linkname, info.size = kind, mode, linkname, len(data)
    return info, data


def _write_layout(root: Path, layers: list[list[tuple]]) -> Path:
    """An OCI image layout of uncompressed ``layers`` (lists of :func:`_entry`, or tar bytes)."""
    blobs = root / "blobs" / "sha256"
    blobs.mkdir(parents=True)

    def put(data: bytes) -> dict:
        digest = hashlib.sha256(data).hexdigest()
        (blobs / digest).write_bytes(data)
        return {"digest": f"sha256:{digest}", "size": len(data)}

    descs, diff_ids = [], []
    for entries in layers:
        d = put(entries if isinstance(entries, bytes) else _tar(entries))
        descs.append({"mediaType": "application/vnd.oci.image.layer.v1.tar", **d})
        diff_ids.append(d["digest"])
    config = put(
        json.dumps(
            {"architecture": "amd64", "os": "linux", "config": {}, "rootfs": {"type": "layers", "diff_ids": diff_ids}}
        ).encode()
    )
    manifest = put(
        json.dumps(
            {
                "schemaVersion": 2,
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": {"mediaType": "application/vnd.oci.image.config.v1+json", **config},
                "layers": descs,
            }
        ).encode()
    )
    (root / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    (root / "index.json").write_text(
        json.dumps(
            {"schemaVersion": 2, "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json", **manifest}]}
        )
    )
    return root


def test_hostile_entries_do_not_escape(store, work, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    cases = {
        "dotdot": [[_entry("../../escaped", data=b"x")]],
        "symlink-parent": [[_entry("link", tarfile.SYMTYPE, linkname=str(outside)), _entry("link/evil", data=b"x")]],
        "relative-symlink-parent": [
            [_entry("up", tarfile.SYMTYPE, linkname="../../../../.."), _entry("up/tmp/evil", data=b"x")]
        ],
        "hardlink-out": [[_entry("h", tarfile.LNKTYPE, linkname="../../etc/passwd")]],
        "hardlink-missing": [[_entry("h", tarfile.LNKTYPE, linkname="nope")]],
    }
    for label, layers in cases.items():
        layout = _write_layout(tmp_path / label, layers)
        with pytest.raises(InvalidInputError):
            import_image(str(layout), store, name="hostile", workdir=work)
        _assert_nothing_published(store, work)
    assert os.listdir(outside) == []
    assert not (tmp_path / "escaped").exists()


def _pax(name: str, headers: dict[str, str], data: bytes = b"x") -> tuple:
    info, data = _entry(name, data=data)
    info.pax_headers = headers
    return info, data


def test_bad_layers_are_refused_naming_the_layer_and_entry(store, work, tmp_path):
    """Each refused with the layer's digest and the entry in the message, before
    anything is published; the tar's headers are bounded before tarfile reads them."""
    whole = _tar([_entry("big", data=os.urandom(100_000)), _entry("after", data=b"a")])
    cases = {
        "name of 256 bytes": ([[_entry("d/" + "x" * 256, data=b"x")]], "bad file name \\(256 bytes"),
        "xattr over the kernel's limit": ([[_pax("f", {"SCHILY.xattr.user.v": "v" * 65536})]], "kernel's limit"),
        "xattr name too long": ([[_pax("f", {"SCHILY.xattr.user." + "n" * 256: "v"})]], "longer than 255"),
        "huge PAX header": ([[_pax("f", {"comment": "c" * (2 << 20)})]], "PAX extended header of"),
        "truncated layer": ([whole[: len(whole) // 2]], "truncated"),
        "dotdot": ([[_entry("a/../../x", data=b"x")]], "climbs out"),
        "through a symlink": (
            [[_entry("l", tarfile.SYMTYPE, linkname="/etc"), _entry("l/passwd", data=b"x")]],
            "which this layer made a symlink",
        ),
        "hardlink to nothing": ([[_entry("h", tarfile.LNKTYPE, linkname="nope")]], "no such file"),
    }
    for label, (layers, message) in cases.items():
        layout = _write_layout(tmp_path / label.replace(" ", "-"), layers)
        with pytest.raises(InvalidInputError, match=message) as info:
            import_image(str(layout), store, name="bad", workdir=work)
        assert "layer 0 (sha256:" in str(info.value), (label, str(info.value))
        if label not in ("huge PAX header", "truncated layer"):
            assert "entry '" in str(info.value), (label, str(info.value))
            _assert_nothing_published(store, work)


def test_a_bad_layer_after_published_groups_leaves_nothing(store, work, tmp_path):
    """Groups are stored as soon as their layers are verified: a bad layer 2
    (a hardlink to nothing, then a truncated one) comes after groups 0 and 1
    were stored (merged: group 0, then layers 1 and 2 in one group); the import
    fails naming layer 2, and what it stored is gone (chunks, manifests), as
    are its temporary files."""
    good = [[_entry(f"big{i}", data=os.urandom(3 << 20))] for i in range(2)]
    whole = _tar([_entry("x", data=os.urandom(200_000))])
    for label, bad in (("hardlink", [_entry("h", tarfile.LNKTYPE, linkname="nope")]), ("cut", whole[:100_000])):
        layout = _write_layout(tmp_path / label, [*good, bad])
        for merge, published in ((None, ["0: layers 0..0", "1: layers 1..1"]), (4 << 20, ["0: layers 0..0"])):
            said: list[str] = []  # merged: groups [0], [1, 2] (its data spooled)
            with pytest.raises(InvalidInputError, match="layer 2 ") as info:
                import_image(
                    str(layout), store, name="bad", workdir=work, merge_small=merge, progress=Progress(said.append)
                )
            assert "no such file" in str(info.value) or "truncated" in str(info.value)
            assert [m for m in said if m.startswith("groups: bad.")] == [
                f"groups: bad.{p} published" for p in published
            ]
            _assert_nothing_published(store, work)


def test_a_failed_reimport_keeps_what_the_store_held_before(store, work, tmp_path):
    """The same image imported again under the same name, its last layer now
    corrupt: the groups it stored first are the earlier import's (same chunks,
    same manifests), so the rollback deletes nothing, and the template of the
    first import still has every manifest and chunk it needs."""
    layout = _write_layout(tmp_path / "layout", [[_entry(f"big{i}", data=os.urandom(3 << 20))] for i in range(3)])
    first = import_image(str(layout), store, name="again", workdir=work)
    chunks, manifests = sorted(store.list_chunks()), sorted(store.list_manifests())
    manifest, _ = _layout_manifest(layout)
    blob = layout / "blobs" / "sha256" / manifest["layers"][2]["digest"].split(":")[1]
    blob.write_bytes(blob.read_bytes()[: 1 << 20])
    with pytest.raises((InvalidInputError, DigestMismatchError), match="layer 2 "):
        import_image(str(layout), store, name="again", workdir=work)
    assert sorted(store.list_chunks()) == chunks and sorted(store.list_manifests()) == manifests
    assert store.get_ref("templates", "again") == first.template_digest
    for g in first.groups:
        assert all(store.has_chunk(c.digest) for c in g.manifest.chunks)
    assert os.listdir(work) == []


def test_an_import_needs_no_disk_beyond_its_stored_chunks(tmp_path):
    """A layer of 48 MiB of compressible files, imported into a store on a
    tmpfs of its own (work directory and TMPDIR there too): the file system's
    used bytes never exceed what stays (the stored chunks) by more than a few
    chunks' writes.  (Before, each group's whole image was written to disk
    before its chunks were stored.)  A merged group of two layers spools its
    data: at most that much more."""
    files = [
        _entry(f"d/f{i}", data=b"".join(b"line %d of file %d\n" % (j, i) for j in range(100_000))) for i in range(24)
    ]
    data_bytes = sum(len(d) for _, d in files)
    assert data_bytes > 40 << 20
    fs = tmp_path / "fs"
    fs.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512m", "tmpfs", str(fs)], check=True)
    try:
        for label, layers, merge in (("one", [files], None), ("merged", [files[:12], files[12:]], 1 << 30)):
            layout = _write_layout(tmp_path / label, layers)
            store_dir, work = fs / label / "store", fs / label / "work"
            work.mkdir(parents=True)
            with DiskMeter(lambda: used_bytes(fs), interval=0.001) as used:
                r = import_image(str(layout), FileStore(store_dir), name=label, workdir=work, merge_small=merge)
            stored = sum(g.bytes_written for g in r.groups)
            assert stored < data_bytes / 4 and used.final_bytes < stored + (1 << 20)
            slack = 4 << 20 if merge is None else data_bytes
            assert used.peak_bytes <= used.final_bytes + slack, (label, used.peak_bytes, used.final_bytes, data_bytes)
            assert os.listdir(work) == []
            shutil.rmtree(fs / label)
    finally:
        subprocess.run(["umount", str(fs)], check=True)


def test_symlink_from_a_lower_layer_is_shadowed_not_followed(store, work, tmp_path, paths, leak_check):
    """``link -> OUTSIDE`` in layer 0, ``link/x`` in layer 1: the entry lands in a
    real directory ``link`` of the upper group (as with one overlay layer per
    image layer), never in OUTSIDE; merged into one group the same."""
    outside = tmp_path / "outside"
    outside.mkdir()
    layers = [
        [_entry("link", tarfile.SYMTYPE, linkname=str(outside)), _entry("keep", data=b"k")],
        [_entry("link/x", data=b"x"), _entry(".wh.keep")],
    ]
    layout = _write_layout(tmp_path / "layout", layers)
    for merge in (None, 1 << 20):
        r = import_image(str(layout), store, name="shadow", workdir=work, merge_small=merge)
        assert len(r.groups) == (2 if merge is None else 1)
    assert os.listdir(outside) == []


# --- the services themselves ------------------------------------------------------------


def test_dockerd_and_registry_stop_by_pid_and_leave_nothing(debian_root, tmp_path):
    """A container still running when dockerd stops: no process, mount, cgroup or file stays."""
    from weenv.host import mounts
    from weenv_bench.services.process import pids_mentioning

    files = [
        "./usr/bin/sleep",
        "./usr/lib/x86_64-linux-gnu/libc.so.6",
        "./lib64/ld-linux-x86-64.so.2",
        "./usr/lib64/ld-linux-x86-64.so.2",
    ]
    tree = subprocess.run(
        ["tar", "-C", str(debian_root), "-c", *[f for f in files if (debian_root / f).exists()]],
        capture_output=True,
        check=True,
    ).stdout
    with Registry(tmp_path / "registry") as registry, Dockerd() as d:
        root, registry_root = d.root, registry.root
        pids = [d.pid, registry.pid]
        d.docker("import", "-", "sleeper:1", input=tree)
        d.docker("run", "-d", "--network", "none", "sleeper:1", "/usr/bin/sleep", "1000")
        assert mounts.mounts_under(root)
        cgroup_parent = d.cgroup_parent.strip("/")
        assert list(Path("/sys/fs/cgroup").glob(f"*/{cgroup_parent}"))
        reference = registry.reference("sleeper", "1")
        d.docker("tag", "sleeper:1", reference)
        d.docker("push", reference)
        assert registry.blob_bytes() > 100_000
    assert not any(alive(p) for p in pids)
    assert not mounts.mounts_under(root) and not root.exists() and not registry_root.exists()
    assert not pids_mentioning(str(root) + "/")
    assert not list(Path("/sys/fs/cgroup").glob(f"*/{cgroup_parent}"))


# --- zstd-compressed layers (OCI tar+zstd), pulled from a registry ------------------------
ZSTD_LAYER = "application/vnd.oci.image.layer.v1.tar+zstd"


def _push_zstd_image(layers: list[bytes], root: Path, address: str, repository: str) -> str:
    """An OCI layout of ``layers`` (tar bytes), each zstd-compressed with media type
    ``tar+zstd``, copied as is to ``docker://ADDRESS/REPOSITORY:1``; that reference."""
    import zstandard

    layout = _write_layout(root, layers)
    manifest, _ = _layout_manifest(layout)
    blobs = layout / "blobs" / "sha256"
    for desc in manifest["layers"]:
        raw = (blobs / desc["digest"].split(":")[1]).read_bytes()
        packed = zstandard.ZstdCompressor(level=3).compress(raw)
        digest = hashlib.sha256(packed).hexdigest()
        (blobs / digest).write_bytes(packed)
        desc.update(mediaType=ZSTD_LAYER, digest=f"sha256:{digest}", size=len(packed))  # diff_ids: the tars'
    data = json.dumps(manifest).encode()
    digest = hashlib.sha256(data).hexdigest()
    (blobs / digest).write_bytes(data)
    (layout / "index.json").write_text(
        json.dumps(
            {
                "schemaVersion": 2,
                "manifests": [
                    {
                        "mediaType": "application/vnd.oci.image.manifest.v1+json",
                        "digest": f"sha256:{digest}",
                        "size": len(data),
                        "annotations": {"org.opencontainers.image.ref.name": "1"},
                    }
                ],
            }
        )
    )
    reference = f"{address}/{repository}:1"
    subprocess.run(
        ["skopeo", "copy", "--quiet", "--dest-tls-verify=false", f"oci:{layout}:1", f"docker://{reference}"],
        check=True,
        capture_output=True,
    )
    return reference


def test_zstd_layers_from_a_registry(oci_registry, store, work, tmp_path):
    """Two tar+zstd layers pushed to the loopback registry as they are (the
    registry serves zstd frames): the import reads both, the second's whiteout
    deletes a file of the first, and each group image holds the files' bytes."""
    from registry_fixture import new_repository

    big = os.urandom(3 << 20)  # more than a chunk, and incompressible: the group's bytes are these
    reference = _push_zstd_image(
        [
            _tar(
                [
                    _entry("srv/", tarfile.DIRTYPE, mode=0o755),
                    _entry("srv/big.bin", data=big),
                    _entry("srv/gone.txt", data=b"deleted above\n"),
                    _entry("srv/kept.txt", data=b"kept\n"),
                ]
            ),
            _tar([_entry("srv/.wh.gone.txt"), _entry("srv/new.txt", data=b"from layer two\n")]),
        ],
        tmp_path / "layout",
        oci_registry.address,
        new_repository(),
    )
    # what the registry serves is zstd: the magic number of a zstd frame
    repo, tag = reference.split("/", 1)[1].rsplit(":", 1)
    served = httpx.get(
        f"http://{oci_registry.address}/v2/{repo}/manifests/{tag}",
        headers={"Accept": "application/vnd.oci.image.manifest.v1+json"},
        timeout=30,
    ).json()
    assert [d["mediaType"] for d in served["layers"]] == [ZSTD_LAYER] * 2
    first = httpx.get(f"http://{oci_registry.address}/v2/{repo}/blobs/{served['layers'][0]['digest']}", timeout=30)
    assert first.content[:4] == b"\x28\xb5\x2f\xfd"

    r = import_image(f"docker://{reference}", store, name="zstd", workdir=work)
    assert len(r.groups) == 2
    lower, upper = (_image_tree(store, g.manifest, tmp_path)["entries"] for g in r.groups)
    assert lower["srv/big.bin"][6:] == [len(big), _digest_as_image_tree(big)]
    assert lower["srv/kept.txt"][6] == 5 and "srv/gone.txt" in lower
    assert upper["srv/new.txt"][6:] == [15, _digest_as_image_tree(b"from layer two\n")]
    whiteout = upper["srv/gone.txt"]  # overlayfs's own form: a character device 0/0
    assert stat.S_ISCHR(whiteout[0]) and whiteout[6] == 0
    assert not list(work.iterdir()), "the import's work directory is left empty"


def _digest_as_image_tree(data: bytes) -> str:
    """A file's content digest as :func:`_image_tree` computes it (MiB blocks, zero ones tagged)."""
    h, zero = hashlib.sha256(), bytes(1 << 20)
    for i in range(0, len(data), 1 << 20):
        b = data[i : i + (1 << 20)]
        h.update(b"z" if b == zero else b"d" + b)
    return h.hexdigest()
