"""One machine's environments: :class:`weenv.node.node.Node` is a facade of
short scripts over the parts below, each a module named after what it holds.

Floors, bottom first (``tests/unit/test_layers.py`` checks them; a module
imports only its own floor or those below it, and the two wings of one floor
never import each other):

1. Below the wings: ``home.py`` (the home's lock and layout), ``table.py``
   (the environment table and reaper), ``disk.py`` (the node's btrfs disk:
   upper dirs as subvolumes with quotas), ``cgroups/`` (v1 and v2 behind one
   interface), ``manifests.py`` (manifests the node last resolved).
2. The wings, side by side:

   - ``data/``: group images read lazily: ``cache.py`` (the chunk cache),
     ``peers.py`` (chunks from other nodes), ``prefetch.py`` (recorded access
     order, packs; ``replay.py`` its replay, a pack streamed once for every
     job reading it), ``lazyfs.py`` / ``fuse/`` (a group image as one file, its
     missing ranges fetched on a read), ``groups.py`` (one EROFS mount per group).
   - ``runtime/``: one container and its commands: ``bundle.py`` (OCI bundle),
     ``container.py``, ``runtime.py`` (the OCI runtime: crun or runc) /
     ``runc.py`` (their command line), ``launcher.py`` with the exec agent
     (``agent/``) and the runtime as backends, ``commands.py`` / ``process.py``
     (commands and their output), ``spec.py`` (a command as asked: :class:`~weenv.node.runtime.spec.CommandSpec`), ``users.py``, ``idmap.py`` (user namespace
     ranges), ``envs_dir.py`` (environments' directories where a user
     namespace can reach them), ``network.py`` / ``owned_netns.py`` /
     ``nameserver.py`` (network namespace, owned by the environment's user
     namespace when it has one; nft rules, name server).

3. Operations over environments: ``state/`` (``snapshot.py``, ``fork.py``,
   ``reset.py``, ``pause.py``, ``resize.py`` (live, within admission),
   ``handoff.py`` (a memory-released pause published for any node to resume),
   ``recovery.py`` after a crash, ``pool.py`` / ``warm.py``: environments
   created ahead), and beside it ``snapshotter.py``
   (mount plans: overlay of groups + upper dir), ``resolver.py`` (template name
   -> digest, with the node's last known digest while the store is down),
   ``admission.py``, ``provision/`` (CPU quota and memory limit that follow
   observed usage).
4. ``node/``: the :class:`~weenv.node.node.Node` facade (its collaborators,
   start and close, the table, destroy), made of the parts beside it in that
   package: the create script, commands with templates and files, and the
   operations (snapshot, fork, reset, pause, stats).

The request and response models the node speaks are :mod:`weenv.api`'s; builds
run in node environments are :mod:`weenv.build`'s.
"""
