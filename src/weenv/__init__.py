"""weenv: an environment manager for agentic reinforcement learning.

Layout (a map of the architecture; the docs' ``concepts/architecture.md`` says
more, and ``tests/unit/test_project_map.py`` checks both against the folders):

- ``weenv.errors``, ``weenv.config``, ``weenv.progress``: the one exception root and its kinds;
  the settings and a home's paths; the progress long work tells of itself.
- ``weenv.host``: the host's mount table and mount(2), file access confined under a root
  or through a live process's root, inotify, hole punching.
- ``weenv.formats``: the manifests, digests, read limits and environment-tax records every layer shares.
- ``weenv.api``: the wire contract: request and response models the SDK, server, node
  and cluster share.
- ``weenv.store``: content-addressed stores of chunks and manifests (``file://``,
  ``oci://``, ``s3://``), their retries and circuit breaker.
- ``weenv.packaging``: layer groups (EROFS image, chunks) and templates, prefetch
  profiles, recipes, builds, ``weenv update``, gc; ``importer``: Docker/OCI images.
- ``weenv.node``: one machine, in wings: ``data`` (chunk cache, lazy FUSE file system,
  group mounts, prefetch, peers), ``runtime`` (one container: bundle, runc/crun, the exec
  agent, commands, network), ``state`` (snapshot, fork, reset, pause, recovery, the warm
  pool); beside them cgroups (``cgroups``), elastic provisioning (``provision``), the
  environment table, the node's disk.
- ``weenv.build``: builds run in node environments (step builds, the builder's environments).
- ``weenv.sdk``: the Python SDK (``weenv.Sandbox``, ``weenv.AsyncSandbox``), and
  the node's API as records (``weenv.sdk.NodeClient``); ``weenv.meter()``.
- ``weenv.server``: the node daemon's HTTP API, and starting and stopping it;
  ``e2b``: the E2B-compatible API and envd.
- ``weenv.cluster``: many nodes on Ray: placement, node actors, the gateway, peers.
- ``weenv.adapters``: harnesses on weenv (mini-swe-agent, NeMo Gym).
- ``weenv.cli``: the ``weenv`` command; ``weenv.demo``: the demo.

Each imports only from those above it in this list: ``tests/unit/test_layers.py``.
"""

__version__ = "0.1.0"

__all__ = [
    "AsyncSandbox",
    "AsyncTree",
    "Sandbox",
    "Task",
    "Tree",
    "__version__",
    "async_release_task",
    "async_rollout_group",
    "connect_cluster",
    "meter",
    "release_task",
    "rollout_group",
]
_SDK = (
    "Sandbox",
    "AsyncSandbox",
    "meter",
    "Task",
    "rollout_group",
    "async_rollout_group",
    "release_task",
    "async_release_task",
    "Tree",
    "AsyncTree",
)


def __getattr__(name: str):
    """``weenv.Sandbox``, ``weenv.AsyncSandbox``, ``weenv.meter`` (the
    environment tax of a batch, :mod:`weenv.sdk._meter`) and the RL groups'
    ``weenv.Task``, ``weenv.rollout_group``, ``weenv.Tree`` and their async
    twins (:mod:`weenv.sdk.groups`), imported on first use (the CLI does not
    pay for the SDK's imports)."""
    if name in _SDK:
        from weenv import sdk

        return getattr(sdk, name)
    if name == "connect_cluster":  # the cluster's gateway, checked (weenv.cluster.address)
        from weenv.cluster.address import connect_cluster

        return connect_cluster
    raise AttributeError(f"module 'weenv' has no attribute {name!r}")
