"""An environment's OCI bundle: the ``config.json`` runc runs (Linux only).

:func:`build_config` turns a template's :class:`RuntimeConfig` into an OCI
runtime-spec config (runtime-spec v1.0.2, ``config.md`` and ``config-linux.md``)
as plain data; :func:`write_bundle` writes it to ``BUNDLE/config.json``.  Neither
touches anything else on the host.

What an environment gets (the defaults of ``runc spec`` from runc 1.1.5 unless
said otherwise):

- its own pid, mount, ipc, uts and network namespaces, never the host's: a new
  network namespace holding only loopback, or with ``runtime.network`` the one
  at ``netns`` (made by :mod:`weenv.node.runtime.network`: a veth pair to the host,
  NATed out, the host and other environments unreachable) and a read-only bind
  of ``resolv_conf`` (its own name server, :mod:`weenv.node.runtime.nameserver`; default the
  host's ``/etc/resolv.conf``) at ``/etc/resolv.conf``;
- runc's default capabilities (:data:`RUNC_DEFAULT_CAPS`: ``CAP_AUDIT_WRITE``,
  ``CAP_KILL``, ``CAP_NET_BIND_SERVICE``; ``capabilities=`` chooses others, e.g.
  :data:`DOCKER_DEFAULT_CAPS`), ``noNewPrivileges``;
- runc's masked and read-only paths under ``/proc`` and ``/sys``;
- mounts: ``/proc``, a ``/dev`` tmpfs, ``/dev/pts``, ``/dev/shm``,
  ``/dev/mqueue``, read-only ``/sys`` and read-only ``/sys/fs/cgroup``;
- a writable root file system (the environment's overlay);
- cgroup limits: a CPU quota of ``cpus * 100000`` µs per 100000 µs period, a
  memory limit in bytes, a pids limit; no device but runc's defaults
  (``/dev/null``, ``zero``, ``full``, ``random``, ``urandom``, ``tty``, ``ptmx``).

Where weenv differs from ``runc spec``, and why:

- ``RLIMIT_NOFILE`` is soft 1024, hard 524288 (``runc spec``: 1024/1024), as
  systemd and containerd do: programs that need many files raise their own soft
  limit; ones that loop over every possible descriptor stay fast.  Both are
  capped at the caller's own hard limit (:func:`default_nofile`): without
  ``CAP_SYS_RESOURCE`` runc cannot raise it, and ``runc create`` fails with
  "error setting rlimit type 7: operation not permitted".
- A seccomp filter (``runc spec`` has none): everything is allowed except a
  short deny list (:data:`SECCOMP_DENY`) of calls an agent's workload does not
  need and that are the usual kernel attack surface: creating user namespaces
  (``unshare``/``clone`` with ``CLONE_NEWUSER``; ``clone3``, whose flags cannot
  be inspected, answers ``ENOSYS`` so that libc falls back to ``clone``), kernel
  keyrings, bpf, perf events, userfaultfd, io_uring, modules, kexec, mount,
  swap, reboot.  Docker's default profile blocks all of these too for a
  container without extra capabilities, so what runs under Docker's default
  runs here.  ``seccomp=False`` leaves the filter out.
- No user namespace: uid 0 inside is uid 0 on the host, held to three
  capabilities, seccomp and ``noNewPrivileges``; what it makes reaches no host
  user (mounts ``nosuid,nodev`` on the host side, the home's ``node/`` 0700).
  Measured here (runc 1.1.5, kernel 6.18): a userns adds ~2 ms to ``runc run``
  of ``true`` (36.5 -> 38.6 ms median), but the groups' files, owned by host
  root, then show as 65534 and root inside cannot write ``/etc``; an idmapped
  clone of each EROFS group mount fixes that (0.13 ms per group, plus ~2 ms to
  make the userns), while a ``chown -R`` through the overlay copies the whole
  tree up (5.2 s, 228 MB).  A template with ``runtime.sudo`` takes it (every
  environment does on a node with ``WEENV_USERNS=on``):
  ``userns=`` (the namespace, its mappings, and no ``noNewPrivileges`` so that
  ``sudo`` works) over lowers idmapped by :mod:`weenv.node.runtime.idmap`, with a
  host id range per environment (:class:`~weenv.node.runtime.container.Containers`,
  :class:`~weenv.node.snapshotter.Snapshotter`; ``tests/test_e2b_sudo.py``).
- Optionally (``init=``) a reaping init as the first process: a static binary
  of the host (Debian's ``tini-static``) bind-mounted read-only at
  :data:`INIT_PATH` (in the ``/dev`` tmpfs, so the root file system gets no
  trace of it), running ``INIT_PATH -- command...``.  Without it the command is
  pid 1 and, if it is ``sleep infinity``, never reaps: every process orphaned
  inside (a killed command's children, ``cmd &`` left behind) stays a zombie and
  counts against the pids limit until the environment is destroyed.
- Optionally (``agent=``) the exec agent (:mod:`weenv.node.runtime.agent`), a static
  binary bind-mounted read-only at :data:`AGENT_PATH` (also in ``/dev``), in
  front of everything: ``AGENT_PATH -- [INIT_PATH --] command...``.  It starts
  its server and execs the init (or the command), which stays pid 1; the
  server becomes the init's child.
- The first process is weenv's own, never a program of the image: a template
  whose command is :data:`HOLD_COMMAND` (``sleep infinity``, the default,
  which only holds the environment open) runs, with the agent, as
  ``AGENT_PATH -u ... -c ... --``: the agent itself stays pid 1, reaps
  orphans and holds the environment (no init needed), so an image without
  ``sleep`` or a shell (distroless, ``FROM scratch`` with one static binary)
  starts.  Without the agent (no compiler, ``exec_agent=False``) the node has
  no process of its own to hold with, and ``sleep`` comes from the image.
"""

from __future__ import annotations

import json
import os
import platform
import re
import resource
from pathlib import Path
from typing import Any

from weenv.errors import InvalidInputError
from weenv.formats.manifest import Resources, RuntimeConfig

OCI_VERSION = "1.0.2-dev"
CPU_PERIOD_US = 100_000
"""CFS period in microseconds; the quota is ``cpus * CPU_PERIOD_US``."""
MIN_CPU_QUOTA_US = 1_000
"""The kernel refuses a CFS quota below 1 ms."""
NOFILE_SOFT, NOFILE_HARD = 1024, 524288

RUNC_DEFAULT_CAPS = ("CAP_AUDIT_WRITE", "CAP_KILL", "CAP_NET_BIND_SERVICE")
"""The capability set ``runc spec`` emits (bits 29, 5, 10: CapEff ``0x20000420``).
With it root inside cannot chown(2), setgroups(2) (``su``, apt's sandbox user)
or bypass file permissions."""
DOCKER_DEFAULT_CAPS = (
    "CAP_AUDIT_WRITE",
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_KILL",
    "CAP_MKNOD",
    "CAP_NET_BIND_SERVICE",
    "CAP_NET_RAW",
    "CAP_SETFCAP",
    "CAP_SETGID",
    "CAP_SETPCAP",
    "CAP_SETUID",
    "CAP_SYS_CHROOT",
)
"""Docker's (moby ``oci/caps/defaults.go``) default set, for ``capabilities=``:
what package managers and installers running as root expect."""

CAP_NAMES = (
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_DAC_READ_SEARCH",
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_KILL",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETPCAP",
    "CAP_LINUX_IMMUTABLE",
    "CAP_NET_BIND_SERVICE",
    "CAP_NET_BROADCAST",
    "CAP_NET_ADMIN",
    "CAP_NET_RAW",
    "CAP_IPC_LOCK",
    "CAP_IPC_OWNER",
    "CAP_SYS_MODULE",
    "CAP_SYS_RAWIO",
    "CAP_SYS_CHROOT",
    "CAP_SYS_PTRACE",
    "CAP_SYS_PACCT",
    "CAP_SYS_ADMIN",
    "CAP_SYS_BOOT",
    "CAP_SYS_NICE",
    "CAP_SYS_RESOURCE",
    "CAP_SYS_TIME",
    "CAP_SYS_TTY_CONFIG",
    "CAP_MKNOD",
    "CAP_LEASE",
    "CAP_AUDIT_WRITE",
    "CAP_AUDIT_CONTROL",
    "CAP_SETFCAP",
    "CAP_MAC_OVERRIDE",
    "CAP_MAC_ADMIN",
    "CAP_SYSLOG",
    "CAP_WAKE_ALARM",
    "CAP_BLOCK_SUSPEND",
    "CAP_AUDIT_READ",
    "CAP_PERFMON",
    "CAP_BPF",
    "CAP_CHECKPOINT_RESTORE",
)
"""Linux capability names by bit number (``linux/capability.h``)."""
AGENT_CAPS = ("CAP_SETGID", "CAP_SETUID", "CAP_SETPCAP")
"""What the exec agent holds beyond the environment's set, to run each command
as the user it names; every command (and the template's own) drops them."""


CAPS_ANNOTATION = "org.weenv.capabilities"
"""The bundle's annotation naming the environment's capability set (its
commands' set; the first process may hold :data:`AGENT_CAPS` besides)."""


def cap_mask(names: tuple[str, ...] | list[str]) -> int:
    """The bit mask of capability ``names``; :class:`InvalidInputError` for an unknown one."""
    mask = 0
    for name in names:
        if name not in CAP_NAMES:
            raise InvalidInputError(f"unknown capability {name!r}")
        mask |= 1 << CAP_NAMES.index(name)
    return mask


MASKED_PATHS = (
    "/proc/acpi",
    "/proc/asound",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/sys/firmware",
    "/proc/scsi",
)
READONLY_PATHS = ("/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger")

INIT_PATH = "/dev/weenv-init"
"""Where the optional init binary appears inside the environment."""
AGENT_PATH = "/dev/weenv-agent"
"""Where the optional exec agent binary appears inside the environment."""
HOLD_COMMAND = ("sleep", "infinity")
"""A template command that only holds the environment open (:class:`RuntimeConfig`'s
default): with the agent, the agent holds instead and the image's ``sleep`` is never run."""

CLONE_NEWUSER = 0x10000000
EPERM, ENOSYS = 1, 38
SECCOMP_DENY = (
    "acct",
    "add_key",
    "bpf",
    "create_module",
    "delete_module",
    "finit_module",
    "fsconfig",
    "fsmount",
    "fsopen",
    "fspick",
    "get_kernel_syms",
    "init_module",
    "io_uring_enter",
    "io_uring_register",
    "io_uring_setup",
    "ioperm",
    "iopl",
    "kexec_file_load",
    "kexec_load",
    "keyctl",
    "lookup_dcookie",
    "mount",
    "mount_setattr",
    "move_mount",
    "name_to_handle_at",
    "nfsservctl",
    "open_by_handle_at",
    "open_tree",
    "perf_event_open",
    "pivot_root",
    "query_module",
    "quotactl",
    "quotactl_fd",
    "reboot",
    "request_key",
    "swapoff",
    "swapon",
    "syslog",
    "umount",
    "umount2",
    "uselib",
    "userfaultfd",
    "vm86",
    "vm86old",
    "_sysctl",
)
"""System calls that fail with ``EPERM`` (names libseccomp does not know are skipped by runc)."""

_SECCOMP_ARCHES = {
    "x86_64": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"],
    "aarch64": ["SCMP_ARCH_AARCH64", "SCMP_ARCH_ARM"],
}
_HOSTNAME_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,62})\Z")


def parse_user(user: str) -> tuple[int, int]:
    """``"UID:GID"`` (or ``"UID"``, then GID = UID) -> ``(uid, gid)``.

    Raises :class:`InvalidInputError` for anything but decimal numbers (runc
    itself knows no user names).
    """
    m = re.fullmatch(r"(\d+)(?::(\d+))?", user or "")
    if not m:
        raise InvalidInputError(f"bad user {user!r}: want numeric 'UID:GID'")
    uid = int(m.group(1))
    return uid, int(m.group(2)) if m.group(2) is not None else uid


def default_nofile() -> tuple[int, int]:
    """``(soft, hard)`` RLIMIT_NOFILE for an environment: :data:`NOFILE_SOFT` and
    :data:`NOFILE_HARD`, capped at this process's hard limit."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard == resource.RLIM_INFINITY:
        return NOFILE_SOFT, NOFILE_HARD
    return min(NOFILE_SOFT, hard), min(NOFILE_HARD, hard)


def cpu_quota_us(cpus: float) -> int:
    """CFS quota in µs per :data:`CPU_PERIOD_US` for ``cpus`` cores (at least 1 ms)."""
    return max(MIN_CPU_QUOTA_US, round(cpus * CPU_PERIOD_US))


def seccomp_profile(machine: str | None = None) -> dict[str, Any]:
    """The seccomp section (runtime-spec ``config-linux.md#seccomp``) for ``machine``
    (``platform.machine()`` by default): allow all but :data:`SECCOMP_DENY` and
    user-namespace creation."""
    errno = {"action": "SCMP_ACT_ERRNO", "errnoRet": EPERM}
    newuser = {"index": 0, "value": CLONE_NEWUSER, "valueTwo": CLONE_NEWUSER, "op": "SCMP_CMP_MASKED_EQ"}
    profile: dict[str, Any] = {
        "defaultAction": "SCMP_ACT_ALLOW",
        "syscalls": [
            {"names": list(SECCOMP_DENY), **errno},
            # On x86, arm and arm64 the flags are the first argument of both calls.
            {"names": ["unshare", "clone"], **errno, "args": [newuser]},
            {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": ENOSYS},
        ],
    }
    arches = _SECCOMP_ARCHES.get(machine or platform.machine())
    if arches:
        profile["architectures"] = arches
    return profile


def _ro_binary(destination: str, source: Path) -> dict[str, Any]:
    """A read-only bind mount of a host binary (executable, but no setuid or devices)."""
    return {
        "destination": destination,
        "type": "bind",
        "source": os.fspath(Path(source).absolute()),
        "options": ["bind", "ro", "nosuid", "nodev"],
    }


def _mounts(
    network: bool, init: Path | None, agent: Path | None, resolv_conf: Path | None = None
) -> list[dict[str, Any]]:
    nse = ["nosuid", "noexec", "nodev"]
    mounts = [
        {"destination": "/proc", "type": "proc", "source": "proc"},
        {
            "destination": "/dev",
            "type": "tmpfs",
            "source": "tmpfs",
            "options": ["nosuid", "strictatime", "mode=755", "size=65536k"],
        },
        {
            "destination": "/dev/pts",
            "type": "devpts",
            "source": "devpts",
            "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"],
        },
        {"destination": "/dev/shm", "type": "tmpfs", "source": "shm", "options": [*nse, "mode=1777", "size=65536k"]},
        {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue", "options": nse},
        {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": [*nse, "ro"]},
        {"destination": "/sys/fs/cgroup", "type": "cgroup", "source": "cgroup", "options": [*nse, "relatime", "ro"]},
    ]
    if network:
        mounts.append(
            {
                "destination": "/etc/resolv.conf",
                "type": "bind",
                "source": os.fspath(resolv_conf or "/etc/resolv.conf"),
                "options": ["rbind", "ro", *nse],
            }
        )
    if init is not None:
        mounts.append(_ro_binary(INIT_PATH, init))
    if agent is not None:
        mounts.append(_ro_binary(AGENT_PATH, agent))
    return mounts


def build_config(
    rootfs: Path,
    runtime: RuntimeConfig,
    *,
    hostname: str,
    cgroups_path: str,
    resources: Resources | None = None,
    seccomp: bool = True,
    nofile: tuple[int, int] | None = None,
    init: Path | None = None,
    capabilities: tuple[str, ...] = RUNC_DEFAULT_CAPS,
    agent: Path | None = None,
    netns: Path | None = None,
    agent_user: str | None = None,
    resolv_conf: Path | None = None,
    userns: tuple[int, int] | None = None,
    userns_path: Path | None = None,
) -> dict[str, Any]:
    """The OCI ``config.json`` of an environment, as data (no I/O).

    ``rootfs``: the environment's root (made absolute); ``hostname``: its uts
    name; ``cgroups_path``: runc's ``linux.cgroupsPath``, e.g. ``"/weenv-<id>"``
    (absolute: under each hierarchy's root, so ``runc delete`` leaves no empty
    parent); ``resources``: limits, default ``runtime.resources``; ``nofile``:
    ``(soft, hard)`` RLIMIT_NOFILE, default :func:`default_nofile`; ``init``: a
    static init binary on the host (e.g. ``/usr/bin/tini-static``) to run the
    command under as pid 1, default none (the command is pid 1);
    ``capabilities``: bounding/effective/permitted/ambient set, default
    :data:`RUNC_DEFAULT_CAPS` (:data:`DOCKER_DEFAULT_CAPS` is wider);
    ``agent``: the exec agent binary on the host, run in front of the command
    (in place of it and of ``init`` when the command is :data:`HOLD_COMMAND`)
    (its listening socket is the first process's stdin, see
    :meth:`weenv.node.runtime.runc.Runc.create`), default none: it runs as root with
    ``capabilities`` and :data:`AGENT_CAPS`, and becomes ``agent_user``
    (``"UID:GID[:G1,G2...]"``, the template's user with its groups; default
    ``runtime.user``) before it starts the command; ``netns``: the
    network namespace file the environment joins, required with
    ``runtime.network`` and refused without it; ``userns``: ``(host_id, size)``
    to run in a user namespace mapping uids and gids ``0..size-1`` to the host's
    ``host_id..`` (the rootfs's lowers idmapped the same way,
    :mod:`weenv.node.idmap`), and then without ``noNewPrivileges`` so that
    setuid programs (``sudo``) work: root they make is the host's ``host_id``;
    ``userns_path``: with ``userns``, an existing user namespace of that mapping
    to join (the one owning ``netns``, :mod:`weenv.node.runtime.owned_netns`) in
    place of a new one.  Raises
    :class:`InvalidInputError` for a bad user, hostname, working dir, command,
    environment variable name or network namespace.
    """
    uid, gid = parse_user(runtime.user)
    if not _HOSTNAME_RE.match(hostname):
        raise InvalidInputError(f"bad hostname {hostname!r}")
    if not runtime.command:
        raise InvalidInputError("the environment's command is empty")
    if not runtime.working_dir.startswith("/"):
        raise InvalidInputError(f"working dir {runtime.working_dir!r} is not absolute")
    if not cgroups_path.startswith("/"):
        raise InvalidInputError(f"cgroups path {cgroups_path!r} is not absolute")
    for key in runtime.env:
        if not key or "=" in key or "\0" in key:
            raise InvalidInputError(f"bad environment variable name {key!r}")
    res = resources or runtime.resources
    soft, hard = nofile or default_nofile()
    caps = list(capabilities)
    mask = cap_mask(caps)
    prefix: list[str] = []
    hold = agent is not None and tuple(runtime.command) == HOLD_COMMAND
    if hold:
        init = None  # the agent reaps as pid 1 itself
    if agent is not None:  # root, to run each command as its own user (see weenv.node.runtime.agent)
        prefix = [AGENT_PATH, "-u", agent_user or f"{uid}:{gid}", "-c", f"{mask:x}", "--"]
        uid = gid = 0
        caps += [c for c in AGENT_CAPS if c not in caps]
    if runtime.network != (netns is not None):
        raise InvalidInputError("a network namespace (netns=) is given with runtime.network, and only then")
    namespaces = [{"type": t} for t in ("pid", "ipc", "uts", "mount")]
    namespaces.append({"type": "network", "path": os.fspath(Path(netns).absolute())} if netns else {"type": "network"})
    if userns is not None:
        host_id, size = userns
        if host_id <= 0 or size <= 0 or host_id + size > 2**32 - 1:
            raise InvalidInputError(f"bad user namespace range {host_id}+{size}")
        namespaces.insert(
            0, {"type": "user", "path": os.fspath(Path(userns_path).absolute())} if userns_path else {"type": "user"}
        )
    linux: dict[str, Any] = {
        "cgroupsPath": cgroups_path,
        "resources": {
            "devices": [{"allow": False, "access": "rwm"}],
            "memory": {"limit": res.memory_bytes},
            "cpu": {"quota": cpu_quota_us(res.cpus), "period": CPU_PERIOD_US},
            "pids": {"limit": res.pids},
        },
        "namespaces": namespaces,
        "maskedPaths": list(MASKED_PATHS),
        "readonlyPaths": list(READONLY_PATHS),
    }
    if userns is not None:
        linux["uidMappings"] = linux["gidMappings"] = [{"containerID": 0, "hostID": userns[0], "size": userns[1]}]
    if seccomp:
        linux["seccomp"] = seccomp_profile()
    return {
        "ociVersion": OCI_VERSION,
        "process": {
            "terminal": False,
            "user": {"uid": uid, "gid": gid},
            "args": prefix
            if hold
            else prefix + ([INIT_PATH, "--"] if init is not None else []) + list(runtime.command),
            "env": [f"{k}={v}" for k, v in runtime.env.items()],
            "cwd": runtime.working_dir,
            "capabilities": {k: caps for k in ("bounding", "effective", "permitted", "ambient")},
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": hard, "soft": soft}],
            "noNewPrivileges": userns is None,
        },
        "root": {"path": os.fspath(Path(rootfs).absolute()), "readonly": False},
        "annotations": {CAPS_ANNOTATION: ",".join(capabilities)},
        "hostname": hostname,
        "mounts": _mounts(runtime.network, init, agent, resolv_conf),
        "linux": linux,
    }


def write_bundle(
    bundle_dir: Path,
    rootfs: Path,
    runtime: RuntimeConfig,
    *,
    hostname: str,
    cgroups_path: str,
    resources: Resources | None = None,
    seccomp: bool = True,
    init: Path | None = None,
    capabilities: tuple[str, ...] = RUNC_DEFAULT_CAPS,
    agent: Path | None = None,
    netns: Path | None = None,
    agent_user: str | None = None,
    resolv_conf: Path | None = None,
    userns: tuple[int, int] | None = None,
    userns_path: Path | None = None,
) -> Path:
    """Write ``bundle_dir/config.json`` (see :func:`build_config`) and return its path.

    The file is written to a temporary name and renamed into place; nothing
    else is created (``bundle_dir`` must exist).  Raises :class:`InvalidInputError`.
    """
    config = build_config(
        rootfs,
        runtime,
        hostname=hostname,
        cgroups_path=cgroups_path,
        resources=resources,
        seccomp=seccomp,
        init=init,
        capabilities=capabilities,
        agent=agent,
        netns=netns,
        agent_user=agent_user,
        resolv_conf=resolv_conf,
        userns=userns,
        userns_path=userns_path,
    )
    path = Path(bundle_dir) / "config.json"
    tmp = path.with_name(".config.json.tmp")
    tmp.write_text(json.dumps(config, indent=2))
    os.replace(tmp, path)
    return path


def set_bundle_resources(bundle_dir: Path, resources: Resources) -> bool:
    """Rewrite the cgroup limits of ``bundle_dir/config.json`` to ``resources``
    (as :func:`build_config` writes them), so that a container run again from
    it (a reset, a resume after its memory was released) has them; False if
    the bundle has no config.  Written to a temporary name and renamed."""
    path = Path(bundle_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        return False
    limits = config.setdefault("linux", {}).setdefault("resources", {})
    limits["memory"] = {**limits.get("memory", {}), "limit": resources.memory_bytes}
    limits["cpu"] = {**limits.get("cpu", {}), "quota": cpu_quota_us(resources.cpus), "period": CPU_PERIOD_US}
    limits["pids"] = {**limits.get("pids", {}), "limit": resources.pids}
    tmp = path.with_name(".config.json.tmp")
    tmp.write_text(json.dumps(config, indent=2))
    os.replace(tmp, path)
    return True
