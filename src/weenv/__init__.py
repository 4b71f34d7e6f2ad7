"""weenv: an environment manager for agentic reinforcement learning.

Layout (a map of the architecture):

- ``weenv.packaging``: layer groups (EROFS image, chunks, manifests) and templates.
- ``weenv.store``: content-addressed stores of chunks and manifests (``file://``).
- ``weenv.node``: one machine: chunk cache, lazy FUSE daemon, mounts, runc, environments.
- ``weenv.server``: the node daemon's HTTP API and its client.
- ``weenv.cli``: the ``weenv`` command.
"""

__version__ = "0.1.0"
