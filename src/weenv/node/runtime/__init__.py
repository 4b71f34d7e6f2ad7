"""One container and its commands.

``bundle.py`` (OCI bundle), ``container.py``, ``runtime.py`` (the OCI
runtime: crun or runc) / ``runc.py`` (their command line), ``launcher.py`` with
the exec agent (``agent/``) and the runtime as backends, ``commands.py`` /
``process.py`` (commands and their output), ``users.py``, ``idmap.py`` (user
namespace ranges), ``envs_dir.py`` (where environments' directories live when
user namespaces need them searchable), ``network.py`` / ``owned_netns.py`` /
``nameserver.py`` (per-environment network namespace, owned by the
environment's user namespace when it has one; nft rules; name server).

Imports only the floor below (``home``, ``table``, ``disk``, ``cgroups``,
``manifests``), never :mod:`weenv.node.data` nor :mod:`weenv.node.state`.
"""
