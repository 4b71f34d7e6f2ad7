"""The OCI bundle's config.json as data (:func:`weenv.node.runtime.bundle.build_config`):
no runc, nothing mounted."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from weenv.errors import InvalidInputError
from weenv.formats.manifest import Resources, RuntimeConfig
from weenv.node.runtime.bundle import DOCKER_DEFAULT_CAPS, RUNC_DEFAULT_CAPS, build_config, write_bundle


def test_bundle_config(tmp_path):
    rt = RuntimeConfig(user="1000:100", env={"A": "1", "PATH": "/bin"}, working_dir="/work")
    path = write_bundle(tmp_path, Path("rel/rootfs"), rt, hostname="h1", cgroups_path="/weenv-x")
    assert path == tmp_path / "config.json" and sorted(os.listdir(tmp_path)) == ["config.json"]
    c = json.loads(path.read_text())
    p = c["process"]
    assert p["args"] == ["sleep", "infinity"] and p["terminal"] is False
    assert p["user"] == {"uid": 1000, "gid": 100} and p["cwd"] == "/work"
    assert p["env"] == ["A=1", "PATH=/bin"] and p["noNewPrivileges"] is True
    assert all(p["capabilities"][k] == list(RUNC_DEFAULT_CAPS) for k in ("bounding", "effective", "permitted"))
    assert p["rlimits"][0]["type"] == "RLIMIT_NOFILE"
    assert c["root"] == {"path": str(Path("rel/rootfs").absolute()), "readonly": False}
    assert c["hostname"] == "h1"
    lx = c["linux"]
    assert lx["cgroupsPath"] == "/weenv-x"
    assert {n["type"] for n in lx["namespaces"]} == {"pid", "mount", "ipc", "uts", "network"}
    assert lx["resources"]["cpu"] == {"quota": 100000, "period": 100000}
    assert lx["resources"]["memory"] == {"limit": 2 << 30} and lx["resources"]["pids"] == {"limit": 1024}
    assert "/proc/kcore" in lx["maskedPaths"] and "/proc/sys" in lx["readonlyPaths"]
    assert lx["seccomp"]["defaultAction"] == "SCMP_ACT_ALLOW"
    dests = [m["destination"] for m in c["mounts"]]
    assert dests == ["/proc", "/dev", "/dev/pts", "/dev/shm", "/dev/mqueue", "/sys", "/sys/fs/cgroup"]

    net = build_config(
        Path("/r"),
        RuntimeConfig(network=True),
        hostname="h",
        cgroups_path="/c",
        resources=Resources(cpus=2.5, memory_bytes=1 << 30, pids=7),
        seccomp=False,
        netns=Path("/e/netns"),
    )
    assert {"type": "network", "path": "/e/netns"} in net["linux"]["namespaces"]  # never the host's
    for network, netns in ((True, None), (False, Path("/e/netns"))):
        with pytest.raises(InvalidInputError):
            build_config(Path("/r"), RuntimeConfig(network=network), hostname="h", cgroups_path="/c", netns=netns)
    assert net["mounts"][-1]["destination"] == "/etc/resolv.conf" and "ro" in net["mounts"][-1]["options"]
    assert net["linux"]["resources"]["cpu"]["quota"] == 250000 and "seccomp" not in net["linux"]
    assert net["linux"]["resources"]["pids"] == {"limit": 7}
    wide = build_config(
        Path("/r"),
        RuntimeConfig(),
        hostname="h",
        cgroups_path="/c",
        capabilities=DOCKER_DEFAULT_CAPS,
        init=Path("/usr/bin/tini-static"),
    )
    assert "CAP_CHOWN" in wide["process"]["capabilities"]["effective"]
    assert wide["process"]["args"] == ["/dev/weenv-init", "--", "sleep", "infinity"]
    assert wide["mounts"][-1]["source"] == "/usr/bin/tini-static"

    for bad in (dict(user="root"), dict(user="1:x"), dict(working_dir="rel"), dict(env={"A=B": "1"})):
        with pytest.raises(ValueError):  # refused by the model (a template with it is never made) ...
            RuntimeConfig(**bad)
        with pytest.raises(InvalidInputError):  # ... and by build_config, should one get through
            build_config(Path("/r"), RuntimeConfig.model_construct(**bad), hostname="h", cgroups_path="/c")
    with pytest.raises(InvalidInputError):
        build_config(Path("/r"), RuntimeConfig(), hostname="bad host", cgroups_path="/c")


def test_the_agent_holds_the_environment_in_place_of_sleep():
    """With the agent, the default command (``sleep infinity``) is never the
    image's: the agent alone is pid 1 (no init, no command after ``--``)."""
    from weenv.node.runtime.bundle import AGENT_PATH, INIT_PATH

    agent, init = Path("/x/weenv-agent"), Path("/usr/bin/tini-static")
    held = build_config(Path("/r"), RuntimeConfig(), hostname="h", cgroups_path="/c", init=init, agent=agent)
    assert held["process"]["args"] == [AGENT_PATH, "-u", "0:0", "-c", "20000420", "--"]
    assert INIT_PATH not in [m["destination"] for m in held["mounts"]]
    own = build_config(
        Path("/r"), RuntimeConfig(command=["/app", "serve"]), hostname="h", cgroups_path="/c", init=init, agent=agent
    )
    assert own["process"]["args"][-4:] == [INIT_PATH, "--", "/app", "serve"]
    alone = build_config(Path("/r"), RuntimeConfig(), hostname="h", cgroups_path="/c", init=init)
    assert alone["process"]["args"] == [INIT_PATH, "--", "sleep", "infinity"]  # no agent: nothing of weenv's to hold


def test_user_namespace_is_opt_in_and_only_then_drops_no_new_privs():
    plain = build_config(Path("/r"), RuntimeConfig(), hostname="h", cgroups_path="/c")
    assert "uidMappings" not in plain["linux"] and plain["process"]["noNewPrivileges"] is True
    assert all(n["type"] != "user" for n in plain["linux"]["namespaces"])
    c = build_config(Path("/r"), RuntimeConfig(), hostname="h", cgroups_path="/c", userns=(200000, 65536))
    lx = c["linux"]
    assert lx["namespaces"][0] == {"type": "user"}
    assert lx["uidMappings"] == lx["gidMappings"] == [{"containerID": 0, "hostID": 200000, "size": 65536}]
    assert c["process"]["noNewPrivileges"] is False and "seccomp" in lx
    for bad in ((0, 65536), (200000, 0), (2**32 - 10, 65536)):  # host root, empty, past 32-bit ids
        with pytest.raises(InvalidInputError, match="user namespace"):
            build_config(Path("/r"), RuntimeConfig(), hostname="h", cgroups_path="/c", userns=bad)
