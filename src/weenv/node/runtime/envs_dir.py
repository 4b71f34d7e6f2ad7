"""Where a node keeps its environments' directories (Linux only).

By default ``node/envs`` of its home (:attr:`weenv.config.Paths.environments`),
where the node's disk is mounted (:mod:`weenv.node.disk`).  An environment
in a user namespace (:mod:`weenv.node.runtime.idmap`) needs every directory above its
rootfs searchable by others: the runtime's init opens the rootfs by its path
once it is in the namespace, as the range's root, an unprivileged host id
for which a host-root-owned 0700 directory is closed (``CAP_DAC_OVERRIDE``
inside the namespace does not reach inodes whose owner it does not map).
A home below such a directory (``/root/...``, a private ``$HOME``) would
then refuse every such environment; opening the directory to others would
change a mode weenv does not own.

So when every environment runs in a user namespace (``WEENV_USERNS``) and a
directory above the home does not let others search it, the
environments' directory is one under :data:`ALIAS_ROOT` (``/run``, 0711 up
to it) named after the home, and ``node/envs`` is a symbolic link to it for
people and tools that look there.  Every path the node hands to the runtime
(rootfs, bundle, namespace files) is then below ``/run``; the disk is mounted
there, so the environments' own mounts are made there too, and a node
restarted on the same home finds them at the same place.  The decision is
kept while the disk stays mounted at ``node/envs`` (an older node's, adopted
as it is).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path

from weenv.config import Paths
from weenv.node.runtime import idmap

ALIAS_ROOT = Path("/run/weenv-envs")
"""Parent of the environments' directories of homes below a directory others cannot search."""
ALIAS_MODE = 0o711
"""Others may search :data:`ALIAS_ROOT`, never list it."""


def searchable_above(path: Path) -> bool:
    """Whether every existing directory above ``path`` lets others search it (``o+x``)."""
    for parent in Path(path).absolute().parents:
        try:
            if not os.stat(parent).st_mode & 0o001:
                return False
        except FileNotFoundError:
            continue  # made later by weenv, with the default mode
    return True


def alias_of(paths: Paths) -> Path:
    """The directory under :data:`ALIAS_ROOT` for the home of ``paths``."""
    return ALIAS_ROOT / hashlib.sha256(os.fsencode(paths.environments.absolute())).hexdigest()[:16]


def environments_dir(paths: Paths) -> Path:
    """The directory holding the environments of the home of ``paths`` (see the
    module docstring): ``node/envs`` where not every environment has a user
    namespace, the directories above the node's own (``node/``, opened by the
    node itself) are searchable by others or the disk is already mounted
    there, else :func:`alias_of`."""
    envs = paths.environments.absolute()
    if envs.is_symlink():
        return alias_of(paths)
    if os.path.ismount(envs) or not idmap.userns_from_env() or searchable_above(paths.node):
        return envs
    return alias_of(paths)


def prepare(paths: Paths, envs: Path) -> None:
    """Make ``envs`` (and, for an alias, :data:`ALIAS_ROOT` and the link at
    ``node/envs``); idempotent."""
    if envs == paths.environments.absolute():
        envs.mkdir(parents=True, exist_ok=True)
        return
    ALIAS_ROOT.mkdir(mode=ALIAS_MODE, parents=True, exist_ok=True)
    os.chmod(ALIAS_ROOT, ALIAS_MODE)
    envs.mkdir(mode=0o700, exist_ok=True)
    link = paths.environments
    if not link.is_symlink():
        with contextlib.suppress(OSError):
            link.rmdir()  # an empty directory a node without the alias left
        link.symlink_to(envs)


def release(paths: Paths, envs: Path) -> None:
    """After the node's close: remove an alias directory left empty (its link stays
    in the home, dangling until the next start makes the directory again)."""
    if envs != paths.environments.absolute():
        with contextlib.suppress(OSError):
            envs.rmdir()
