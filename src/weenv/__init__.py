"""weenv: an environment manager for agentic reinforcement learning.

Layout (a map of the architecture):

- ``weenv.packaging``: layer groups (EROFS image, chunks, manifests) and templates.
- ``weenv.store``: content-addressed stores of chunks and manifests (``file://``).
- ``weenv.node``: one machine: chunk cache, lazy FUSE daemon, mounts, runc, environments.
- ``weenv.server``: the node daemon's HTTP API and its client.
- ``weenv.sdk``: the Python SDK (``weenv.Sandbox``, ``weenv.AsyncSandbox``).
- ``weenv.cli``: the ``weenv`` command.
"""

__version__ = "0.1.0"

__all__ = ["AsyncSandbox", "Sandbox", "__version__", "meter"]


def __getattr__(name: str):
    """``weenv.Sandbox``, ``weenv.AsyncSandbox`` and ``weenv.meter`` (the
    environment tax of a batch, :mod:`weenv.sdk._meter`), imported on first use
    (the CLI does not pay for the SDK's imports)."""
    if name in ("Sandbox", "AsyncSandbox", "meter"):
        from weenv import sdk

        return getattr(sdk, name)
    raise AttributeError(f"module 'weenv' has no attribute {name!r}")
