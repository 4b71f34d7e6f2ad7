"""The data path: group images read lazily on this node.

``cache.py`` (the chunk cache), ``peers.py`` (chunks from other nodes),
``prefetch.py`` (recorded access order, packs), ``lazyfs.py`` / ``fuse/`` (a
group image served as one file, its missing ranges fetched on a read),
``groups.py`` (one EROFS mount per group per node).

Imports only the floor below (``home``, ``table``, ``disk``, ``cgroups``,
``manifests``), never :mod:`weenv.node.runtime` nor :mod:`weenv.node.state`.
"""
