"""Commands at an environment's memory limit (issue 18): python3 from a group
image keeps running while the elastic provisioner holds its environment at the
limit (cgroup v1, OOM killer disabled below the ceiling) and raises it.

Before group images were mounted with EROFS's ``directio``, a page fault of a
file in the mount needed a second page in the image file's page cache; at the
limit that charge failed instead of waiting, and the process died of SIGBUS
(:mod:`weenv.host.mounts`).
"""

from __future__ import annotations

import errno
import os
import re

import pytest

from weenv.errors import MountError
from weenv.formats.manifest import Resources
from weenv.host.mounts import _DirectIO, mount_erofs, mount_info
from weenv.node.node import Node
from weenv.node.provision import ProvisionConfig
from weenv.packaging.group import load_group
from weenv.packaging.template import load_template

MIB = 1 << 20
ROUNDS = 12

# The limit grows in 16 MiB steps, one check every 0.3 s: a round's hog
# (the limit + 48 MiB, every page touched) waits at it ~1 s while python3
# starts again and again; the reclaim at the limit evicts python3's own pages,
# so each start faults them in from the group image.
PROVISIONING = dict(
    interval_s=0.3,
    check_interval_s=0.3,
    memory_initial=128 * MIB,
    memory_headroom=0.0,
    memory_min_headroom=16 * MIB,
    memory_raise_factor=1.0,
    memory_hold_s=3600,
    admission="reservations",
    memory_idle_after_s=1e9,
)
ROUND = (
    'python3 -c \'import time\nb = bytearray({hog})\nb[::4096] = b"x" * (len(b) // 4096)\n'
    "time.sleep(0.2)' &\nsleep 0.1\n"
    "for i in 1 2 3 4 5 6; do python3 -c 'import json, email.parser, http.client'; echo \"py $?\"; done\n"
    'wait $!; echo "hog $?"\n'
)


def evict_page_cache(path) -> None:
    """Drop ``path``'s clean pages from the page cache (``POSIX_FADV_DONTNEED``)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.fixture
def direct_node(paths, shared_store, leak_check):
    """A node with the fast provisioner above whose ``task`` groups are mounted
    from their assembled images (a group every chunk of which is on the node:
    a warm node's usual state)."""
    _digest, template = load_template(shared_store, "task")
    with Node(paths, store=shared_store, pool_size=0, provisioning=ProvisionConfig(**PROVISIONING)) as n:
        for g in template.groups:
            manifest = load_group(shared_store, g)
            n.lazyfs.add_group(g, manifest)
            try:
                n.lazyfs.image_path(g).read_bytes()  # every chunk into the node cache
            finally:
                n.lazyfs.remove_group(g)
            assert n.groups.assemble(g, manifest) is not None
        yield n, template.groups


def test_python3_at_the_memory_limit_never_dies_of_sigbus(direct_node):
    node, groups = direct_node
    env = node.create("task", resources=Resources(cpus=1.0, memory_bytes=4 << 30, pids=256))
    try:
        codes: list[int] = []
        for _ in range(ROUNDS):
            for g in groups:  # a busy node's page cache lets the image files go (no-op with directio)
                evict_page_cache(node.groups.image_path(g))
            limit = node.provision_stats(env.id).environments[0].memory_limit
            r = node.exec(env.id, ROUND.format(hog=limit + 48 * MIB), timeout=120)
            codes += [int(c) for c in re.findall(rb"^(?:py|hog) (\d+)$", r.stdout, re.M)]
            codes.append(r.exit_code)  # the shell's own (135 if it died of SIGBUS itself)
        sigbus = codes.count(128 + 7)
        assert sigbus == 0, f"{sigbus} of {len(codes)} processes died of SIGBUS at the memory limit: {codes}"
        assert set(codes) == {0}, codes
        stats = node.provision_stats(env.id)
        raises = [e for e in stats.events if e.kind == "raise" and "memory" in e.message]
        assert len(raises) >= ROUNDS  # every round waited at the limit for a raise
        assert stats.environments[0].oom_kills == 0
        for g in groups:
            fstype, _source, options = mount_info(node.groups.direct_path(g))
            assert fstype == "erofs" and "directio" in options.split(","), options
    finally:
        node.destroy(env.id)


def test_an_image_refused_with_and_without_directio_is_the_images_fault(tmp_path, leak_check):
    """EINVAL both ways (no EROFS superblock) raises and does not turn ``directio`` off."""
    bad, target = tmp_path / "bad.img", tmp_path / "mnt"
    bad.write_bytes(b"\0" * (64 << 10))
    target.mkdir()
    with pytest.raises(MountError) as e:
        mount_erofs(bad, target)
    assert e.value.errno == errno.EINVAL
    assert _DirectIO.supported is not False
