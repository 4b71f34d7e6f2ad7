"""``sudo`` inside an environment in a user namespace (issue 17 item 5).

Real runc 1.1.5 over an overlay whose lowers are idmapped clones
(:mod:`weenv.node.runtime.idmap`) of the cached Debian tree and of a layer holding
Debian's ``sudo`` package, with a ``user`` account (uid 1000) given
``NOPASSWD: ALL``.  No mocks.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from weenv.errors import InvalidInputError
from weenv.formats.manifest import Resources, RuntimeConfig
from weenv.host.mounts import MS_NOSUID, MountSpec, mount, mount_erofs, overlay_escape, umount
from weenv.node.runtime import idmap
from weenv.node.runtime.bundle import DOCKER_DEFAULT_CAPS, write_bundle
from weenv.node.runtime.runtime import NodeRuntime

pytestmark = pytest.mark.usefixtures("leak_check")

HOST_ID = 200_000
"""The host range's first id (uid and gid 0 inside)."""
SUDO_CACHE = Path(os.environ.get("WEENV_CACHE", "/var/cache/weenv")) / "sudo-layer"


def sudo_layer(debian_root: Path) -> Path:
    """A layer with Debian's ``sudo`` (``apt-get download``, cached) and a ``user``
    account that may run anything as root without a password."""
    layer = SUDO_CACHE / "tree"
    if layer.exists():
        return layer
    tmp = SUDO_CACHE / f".tmp-{uuid.uuid4().hex[:8]}"
    (tmp / "tree").mkdir(parents=True)
    r = subprocess.run(["apt-get", "download", "sudo"], cwd=tmp, capture_output=True, text=True)
    debs = list(tmp.glob("sudo_*.deb"))
    if not debs:
        shutil.rmtree(tmp)
        pytest.skip(f"cannot download Debian's sudo: {r.stderr.strip()[-200:]}")
    subprocess.run(["dpkg-deb", "-x", str(debs[0]), str(tmp / "tree")], check=True)
    if (tmp / "tree/lib").is_dir():  # merged /usr: the Debian tree's /lib is a link to usr/lib
        shutil.copytree(tmp / "tree/lib", tmp / "tree/usr/lib", dirs_exist_ok=True, symlinks=True)
        shutil.rmtree(tmp / "tree/lib")
    etc = tmp / "tree/etc"
    for name, line in (
        ("passwd", "user:x:1000:1000::/home/user:/bin/sh\n"),
        ("group", "user:x:1000:\n"),
        ("shadow", "user:*:19000:0:99999:7:::\n"),
    ):
        (etc / name).write_text((debian_root / "etc" / name).read_text() + line)
    os.chmod(etc / "shadow", 0o640)
    (etc / "sudoers.d/user").write_text("user ALL=(ALL:ALL) NOPASSWD: ALL\n")
    os.chmod(etc / "sudoers.d/user", 0o440)
    (tmp / "tree/home/user").mkdir(parents=True)
    os.chown(tmp / "tree/home/user", 1000, 1000)
    os.rename(tmp / "tree", layer)
    shutil.rmtree(tmp)
    return layer


@pytest.fixture
def base():
    """A directory the range's root can traverse (mode 0711 like every parent: runc's
    init, already in the namespace, binds the rootfs by its path); pytest's tmp dirs
    are 0700.  Checked for leftover mounts at the end."""
    d = Path(tempfile.mkdtemp(prefix="weenv-userns-"))
    os.chmod(d, 0o711)
    yield d
    with open("/proc/mounts") as f:
        left = [line.split()[1] for line in f if line.split()[1].startswith(str(d))]
    shutil.rmtree(d, ignore_errors=True)
    assert not left, f"leaked mounts: {left}"


@pytest.fixture
def userns_root(base, debian_root, request):
    """An overlay over idmapped clones of the Debian tree and the sudo layer, upper owned by the range's root."""
    tmp_path = base
    lowers = [debian_root, sudo_layer(debian_root)]
    mounted: list[Path] = []
    upper, work, root = tmp_path / "upper", tmp_path / "work", tmp_path / "rootfs"
    for d in (upper, work, root):
        d.mkdir()
    idmap.own_upper(upper, work, HOST_ID)
    try:
        with idmap.UserNamespace(HOST_ID) as ns:
            for i, lower in enumerate(lowers):
                target = tmp_path / f"lower{i}"
                target.mkdir()
                idmap.idmapped_clone(lower, target, ns)
                mounted.append(target)
        lowerdir = ":".join(overlay_escape(p) for p in reversed(mounted))
        mount(
            MountSpec(
                "overlay",
                "overlay",
                os.fspath(root),
                f"lowerdir={lowerdir},upperdir={upper},workdir={work}",
                getattr(request, "param", 0),
            )
        )
        mounted.append(root)
        yield root, upper
    finally:
        for m in reversed(mounted):
            umount(m)


def test_idmapped_lower_shows_host_ids_shifted(userns_root):
    root, _ = userns_root
    st = (root / "etc/passwd").stat()
    assert (st.st_uid, st.st_gid) == (HOST_ID, HOST_ID)
    assert (root / "home/user").stat().st_uid == HOST_ID + 1000
    assert (root / "usr/bin/sudo").stat().st_mode & 0o4000


def start_user_env(root: Path, tmp_path: Path) -> tuple[NodeRuntime, str, Path]:
    """The node's OCI runtime (``WEENV_RUNTIME``: crun or runc) runs ``sleep
    infinity`` as uid 1000 over ``root`` in the range's namespace, with no
    capabilities but Docker's bounding set (what sudo's root gets)."""
    runc = NodeRuntime.for_setting(None, {"runc": tmp_path / "runc-state", "crun": tmp_path / "crun-state"})
    cid = "u" + uuid.uuid4().hex[:12]
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    runtime = RuntimeConfig(user="1000:1000")
    path = write_bundle(
        bundle,
        root,
        runtime,
        hostname="box-" + cid,
        cgroups_path=f"/weenv-{cid}",
        resources=Resources(cpus=0.5, memory_bytes=256 << 20, pids=200),
        capabilities=DOCKER_DEFAULT_CAPS,
        userns=(HOST_ID, idmap.ID_RANGE),
    )
    config = json.loads(path.read_text())
    caps = config["process"]["capabilities"]
    for k in ("effective", "permitted", "ambient"):  # user holds nothing; sudo's root gets the bounding set
        caps[k] = []
    path.write_text(json.dumps(config))
    assert config["process"]["noNewPrivileges"] is False
    runc.run_detached(cid, bundle)
    return runc, cid, bundle


@pytest.mark.parametrize("userns_root", [MS_NOSUID], indirect=True)
def test_nosuid_overlay_keeps_sudo_out(userns_root, tmp_path):
    """runc binds the rootfs with its flags: on a ``nosuid`` overlay sudo's setuid bit does not count."""
    runc, cid, _ = start_user_env(userns_root[0], tmp_path)
    try:
        r = runc.exec(cid, ["sudo", "id", "-u"])
        assert r.exit_code != 0 and b"nosuid" in r.stderr, r
    finally:
        runc.delete(cid, force=True)


def test_sudo_as_user_in_user_namespace(userns_root, tmp_path):
    root, upper = userns_root
    runc, cid, bundle = start_user_env(root, tmp_path)
    try:
        state = runc.state(cid)
        pid = state["pid"]
        assert pid, (state, (bundle / "init.log").read_text()[-2000:])
        host_uid = int(Path(f"/proc/{pid}/status").read_text().split("Uid:")[1].split()[0])
        assert host_uid == HOST_ID + 1000  # uid 1000 inside is the range's 1000 on the host
        r = runc.exec(
            cid,
            [
                "sh",
                "-c",
                "id -u; sudo id -u; sudo touch /made-by-root; sudo sh -c 'echo $$ > /tmp/p; sleep 30' & sleep 1; cat /tmp/p",
            ],
        )
        assert r.exit_code == 0, r.stderr
        out = r.stdout.decode().split()
        assert out[:2] == ["1000", "0"], r.stdout
        # root inside is the unprivileged range's first id on the host
        for p in Path("/proc").iterdir():
            if p.name.isdigit() and (p / "cmdline").exists():
                try:
                    if (p / "cmdline").read_bytes().startswith(b"sleep\x0030"):
                        assert int((p / "status").read_text().split("Uid:")[1].split()[1]) == HOST_ID
                        break
                except OSError:
                    continue
        else:
            pytest.fail("sudo's sleep not found on the host")
        st = (upper / "made-by-root").stat()
        assert (st.st_uid, st.st_gid) == (HOST_ID, HOST_ID)
        assert runc.exec(cid, ["stat", "-c", "%u", "/made-by-root"]).stdout == b"0\n"
        # user cannot write root's files without sudo
        assert runc.exec(cid, ["sh", "-c", "echo x > /etc/passwd"]).exit_code != 0
    finally:
        runc.delete(cid, force=True)
    assert runc.list() == []
    assert not list(Path("/sys/fs/cgroup").glob(f"weenv-{cid}"))
    deadline = time.monotonic() + 5  # SIGKILLed exec'd processes are reaped after runc delete returns
    while range_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not range_processes(), "processes of the range outlived the environment"


def range_processes(first: int = HOST_ID, size: int = idmap.ID_RANGE) -> list[int]:
    """Host pids whose real uid lies in ``first..first+size-1`` (default: the environment's range)."""
    pids = []
    for p in Path("/proc").iterdir():
        try:
            uid = int((p / "status").read_text().split("Uid:")[1].split()[0]) if p.name.isdigit() else -1
        except (OSError, IndexError):
            continue
        if first <= uid < first + size:
            pids.append(int(p.name))
    return pids


def test_bad_ranges_refused_before_anything_is_made():
    for host_id, size in ((0, idmap.ID_RANGE), (1, 0), (2**32 - 5, idmap.ID_RANGE)):
        with pytest.raises(InvalidInputError):
            idmap.UserNamespace(host_id, size)


def test_user_namespaces_made_at_once_by_many_threads_all_finish():
    """Fork children, environments of a pool or a burst of creates make their
    user namespaces in threads at once.  A helper made by ``fork`` inherited
    the other threads' pipes: each waited for an end of file another held,
    and both creates hung for good."""
    done: list[int] = []
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch between any two steps, as on a busy node

    def make(i: int) -> None:
        for _ in range(20):
            with idmap.UserNamespace(idmap.RANGE_BASE + (4000 + i) * idmap.ID_RANGE) as ns:
                assert os.readlink(f"/proc/self/fd/{ns.fd}").startswith("user:[")
        done.append(i)

    threads = [threading.Thread(target=make, args=(i,), daemon=True) for i in range(8)]
    for t in threads:
        t.start()
    try:
        for t in threads:
            t.join(timeout=60)
    finally:
        sys.setswitchinterval(interval)
    assert sorted(done) == list(range(8))


def test_erofs_group_mount_can_be_idmapped(base):
    """The node's lowers are EROFS group mounts: their idmapped clone shifts owners too."""
    tree = base / "tree"
    (tree / "etc").mkdir(parents=True)
    (tree / "etc/f").write_text("x")
    os.chown(tree / "etc/f", 1000, 1000)
    image = base / "g.erofs"
    subprocess.run(["mkfs.erofs", str(image), str(tree)], check=True, capture_output=True)
    group, clone = base / "group", base / "clone"
    group.mkdir()
    clone.mkdir()
    mount_erofs(image, group)
    try:
        with idmap.UserNamespace(HOST_ID) as ns:
            idmap.idmapped_clone(group, clone, ns)
        try:
            assert (clone / "etc/f").stat().st_uid == HOST_ID + 1000
            assert (clone / "etc").stat().st_uid == HOST_ID and (group / "etc/f").stat().st_uid == 1000
        finally:
            umount(clone)
    finally:
        umount(group)
