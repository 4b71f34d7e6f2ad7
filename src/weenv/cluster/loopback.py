"""A Ray cluster kept on loopback (tests, benchmarks, one machine): every Ray
process, weenv's node daemons and the gateway on 127.0.0.1, no traffic to the
machine's interface address.

Ray takes a node's address from ``--node-ip-address`` / ``node_ip_address``
(its servers then bind that address, not the wildcard), and weenv's node
actors and gateway take theirs from Ray's (:func:`ray.util.get_node_ip_address`).
One thing in Ray does not follow: a driver connecting to ``127.0.0.1:PORT``
has the address rewritten to the machine's "address from the perspective" of
the internet, unless ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` is ``0`` (Ray's switch
for a single-machine cluster, read when ``ray`` is imported): :func:`keep_on_loopback`
sets it, for this process and the processes it starts.
"""

from __future__ import annotations

import ipaddress
import os
import sys

LOOPBACK = "127.0.0.1"
RAY_LOCAL_ONLY = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def keep_on_loopback() -> None:
    """Make this process's Ray driver (and every process it starts) take 127.0.0.1 as
    the local node's address.  Call it before ``import ray`` where you can; after, it
    also sets the constant Ray read at import."""
    os.environ[RAY_LOCAL_ONLY] = "0"
    if "ray._private.ray_constants" in sys.modules:
        sys.modules["ray._private.ray_constants"].ENABLE_RAY_CLUSTER = False


def node_args(**args) -> dict:
    """``ray.cluster_utils.Cluster`` node arguments with the node on 127.0.0.1."""
    return {"node_ip_address": LOOPBACK, **args}


def is_loopback_address(address: str | None) -> bool:
    """Whether a Ray address (``HOST:PORT``) names a loopback host."""
    if not address or ":" not in address:
        return False
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
