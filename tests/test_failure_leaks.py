"""Creates with network that fail leave nothing behind (root, real nft, runc).

Each create here asks for network with allow/deny lists (its own nft table,
network namespace, veth and name server) and fails at one step it can be made
to fail at: admission (``max_environments``, the provisioner's reservation),
an unknown template, a command missing from the file system, no free /30 for its link.  After each: no ``weenv-*`` nft
table but those of the live environments (nor the shared ``weenv`` table once
none has network), no name server serving it, no socket more in this process,
no reservation held, no environment directory; at the end ``leak_check``'s
mounts (the namespace files are bind mounts), cgroups and veths.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from weenv.errors import CapacityError, NotFoundError, RuntimeFailedError
from weenv.formats.manifest import RuntimeConfig
from weenv.node.node import Node
from weenv.node.provision.models import ProvisionConfig
from weenv.node.runtime import network
from weenv.packaging.template import create_template
from weenv.store.file import FileStore

LISTS = {"network": True, "allow_out": ["198.19.7.0/30", "svc.weenv.test"], "deny_out": ["0.0.0.0/0"]}
"""A create's network: internet closed, a CIDR and a name allowed (its table has sets, its name server a policy)."""


def _tables() -> set[str]:
    out = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True, check=True).stdout
    return {line.split()[-1] for line in out.splitlines() if line.split()[-1].startswith("weenv")}


def _sockets() -> int:
    """Sockets this process holds (a name server's are made in an environment's namespace and kept here)."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return n


def _check_nothing_left(node: Node, sockets: int) -> None:
    """Only the live environments' network, name servers, reservations and directories remain."""
    live = set(node.ids())
    networked = {e.id for e in node.list() if e.address is not None}
    expected = {network.env_table(i) for i in networked} | ({network.TABLE} if networked else set())
    assert _tables() == expected
    assert set(node.containers.dns._envs) == networked
    assert {t for t in node.provisioner._envs} == live
    assert set(os.listdir(node.paths.environments)) - {"disk"} <= live, os.listdir(node.paths.environments)
    assert _sockets() == sockets


@pytest.fixture
def templates(shared_store, tmp_path):
    """A copy of the shared store (hard links) with templates whose environments
    fail as they start: ``missing`` names a program its file system lacks
    (refused before the container).  Not the shared store itself: tests listing
    its templates would see them."""
    root = tmp_path / "store"
    subprocess.run(["cp", "-al", str(shared_store.root), str(root)], check=True)
    store = FileStore(root)
    create_template(store, "leaks-missing", ["base", "task"], runtime=RuntimeConfig(command=["/no/such"]))
    return store


def test_failed_creates_with_network_leave_nothing(paths, templates, leak_check):
    memory = 512 << 20
    cfg = ProvisionConfig(mode="static", memory_capacity=2 * memory, memory_overcommit=1.0)
    with Node(paths, store=templates, provisioning=cfg, pool_size=0) as node:
        sockets = _sockets()
        res = {"cpus": 0.5, "memory_bytes": memory}
        with pytest.raises(NotFoundError):
            node.create("leaks-no-such-template", **LISTS)
        _check_nothing_left(node, sockets)
        with pytest.raises(RuntimeFailedError, match="not in its file system"):
            node.create("leaks-missing", resources=res, **LISTS)
        _check_nothing_left(node, sockets)

        first = node.create("task", resources=res, **LISTS)
        sockets = _sockets()
        _check_nothing_left(node, sockets)
        node.create("task", resources=res)  # the node's memory is all reserved now
        with pytest.raises(CapacityError, match="cannot admit"):  # the provisioner's reservation
            node.create("task", resources=res, **LISTS)
        _check_nothing_left(node, sockets)
        node.destroy(first.id)
        sockets = _sockets()
        _check_nothing_left(node, sockets)


def test_no_free_link_and_max_environments_leave_nothing(paths, shared_store, monkeypatch, leak_check):
    monkeypatch.setenv(network.CIDR_ENV, "10.231.77.0/30")  # room for one environment with network
    with Node(paths, store=shared_store, max_environments=2, pool_size=0) as node:
        one = node.create("task", **LISTS)
        sockets = _sockets()
        with pytest.raises(CapacityError, match="every /30"):  # its table was made, then no link
            node.create("task", **LISTS)
        _check_nothing_left(node, sockets)
        node.create("task")
        with pytest.raises(CapacityError, match="at most 2"):  # admission: max_environments
            node.create("task", **LISTS)
        _check_nothing_left(node, sockets)
        node.destroy(one.id)
        _check_nothing_left(node, _sockets())
