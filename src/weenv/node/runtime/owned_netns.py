"""A network namespace owned by an environment's user namespace (Linux only).

An environment in a user namespace (:mod:`weenv.node.runtime.idmap`) with network of
its own cannot join a network namespace the host's user namespace owns: the
kernel lets a process mount ``sysfs`` only when it holds ``CAP_SYS_ADMIN``
over the user namespace owning its network namespace
(``fs/sysfs/mount.c``: ``ns_capable(net->user_ns, CAP_SYS_ADMIN)``), so
runc's ``/sys`` mount fails.  The namespaces are therefore made the other
way round: one child unshares a user namespace (mapped to the environment's
host id range) and a network namespace together, so the user namespace owns
the network one, and both nsfs files are kept by bind mounts in the
environment's directory: :data:`USERNS_FILE` beside :data:`~weenv.node.runtime.network.NETNS_FILE`.
The OCI config joins both by path (``namespaces[].path``), as it joins the
network namespace alone without a user namespace; runc makes the pid, ipc,
uts and mount namespaces inside the joined user namespace.  Host root still
configures the network namespace (veth, addresses, routes) from outside: it
holds every capability over a user namespace the host's owns.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from weenv.errors import MountError
from weenv.host import mounts
from weenv.node.runtime import idmap

USERNS_FILE = "netns.owner"
"""In an environment's directory: the nsfs file of the user namespace that owns
its network namespace (a bind mount), with network and a host id range only."""
MS_BIND = 0x1000


def make(userns_file: Path, netns_file: Path, host_id: int, size: int = idmap.ID_RANGE) -> None:
    """Make a user namespace mapping ids ``0..size-1`` to host ``host_id..`` and
    a network namespace it owns, kept at ``userns_file`` and ``netns_file``
    (made here, or existing empty files).  On failure nothing is left mounted;
    raises :class:`MountError`."""
    for f in (userns_file, netns_file):
        f.touch(mode=0o600)
    with idmap.mapped_child(host_id, size, net=True) as pid:
        try:
            for kind, target in (("user", userns_file), ("net", netns_file)):
                mounts.mount(mounts.MountSpec("none", f"/proc/{pid}/ns/{kind}", str(target), flags=MS_BIND))
        except MountError:
            unpin(userns_file)
            unpin(netns_file)
            raise


def unpin(ns_file: Path) -> None:
    """Unmount and remove a namespace file kept by :func:`make`, if any; idempotent."""
    if mounts.is_mounted(ns_file):
        try:
            mounts.umount(ns_file)
        except MountError:
            mounts.umount(ns_file, detach=True)
    with contextlib.suppress(FileNotFoundError):
        ns_file.unlink()
