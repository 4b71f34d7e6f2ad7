"""One machine's environments: :class:`weenv.node.node.Node` is a facade of
short scripts over the parts below, each a module named after what it holds.

- Resolving and admitting: ``resolver.py`` (template name -> digest, with the
  node's last known digest while the store is down), ``admission.py``,
  ``provision/`` (CPU quota and memory limit that follow observed usage).
- Assembling a rootfs: ``groups.py`` and ``lazyfs.py`` / ``fuse/`` (group
  images read lazily, chunks from ``cache.py``, ``prefetch.py``),
  ``snapshotter.py`` (mount plans: overlay of groups + upper dir), ``disk.py``
  (the node's btrfs disk: upper dirs as subvolumes with quotas).
- Running: ``bundle.py`` (OCI bundle), ``container.py``, ``runtime.py``
  (the OCI runtime: crun or runc) / ``runc.py`` (their command line),
  ``launcher.py`` with the exec agent (``agent/``) and the runtime as backends,
  ``commands.py`` / ``process.py`` (commands and their output), ``users.py``,
  ``network.py`` (per-environment network namespace and nft rules),
  ``cgroups/``.
- State: ``table.py`` (the environment table and reaper), ``home.py`` (the
  home's lock and layout), ``recovery.py`` (after a crash), ``pool.py`` /
  ``warm.py`` (environments created ahead), ``snapshot.py``, ``fork.py``,
  ``reset.py``, ``pause.py``; ``buildenv.py`` / ``stepbuild.py`` (build steps
  run in node environments).
"""
