"""weenv: an environment manager for agentic reinforcement learning.

Layout (a map of the architecture):

- ``weenv.formats``: the manifests, digests, read limits and environment-tax records every layer shares.
- ``weenv.host``: the host's mount table and mount(2), file access confined under a root.
- ``weenv.store``: content-addressed stores of chunks and manifests (``file://``).
- ``weenv.packaging``: layer groups (EROFS image, chunks) and templates, builds, gc.
- ``weenv.node``: one machine: chunk cache, lazy FUSE daemon, mounts, runc, environments.
- ``weenv.sdk``: the Python SDK (``weenv.Sandbox``, ``weenv.AsyncSandbox``), and
  the node's API as records (``weenv.sdk.NodeClient``).
- ``weenv.server``: the node daemon's HTTP API, and starting and stopping it.
- ``weenv.adapters``: harnesses on weenv (mini-swe-agent, NeMo Gym).
- ``weenv.cli``: the ``weenv`` command.

Each imports only from those above it in this list (and ``errors``, ``config``):
``tests/unit/test_layers.py``.
"""

__version__ = "0.1.0"

__all__ = ["AsyncSandbox", "Sandbox", "__version__", "connect_cluster", "meter"]


def __getattr__(name: str):
    """``weenv.Sandbox``, ``weenv.AsyncSandbox`` and ``weenv.meter`` (the
    environment tax of a batch, :mod:`weenv.sdk._meter`), imported on first use
    (the CLI does not pay for the SDK's imports)."""
    if name in ("Sandbox", "AsyncSandbox", "meter"):
        from weenv import sdk

        return getattr(sdk, name)
    if name == "connect_cluster":  # the cluster's gateway, checked (weenv.cluster.address)
        from weenv.cluster.address import connect_cluster

        return connect_cluster
    raise AttributeError(f"module 'weenv' has no attribute {name!r}")
