"""The host's Linux primitives that packaging and the node share: the mount
table and mount(2) (``mounts.py``), a program run in a mount namespace holding
only the mounts it needs (``mountns.py``), file access confined under a root directory
(``rootfs.py``, openat2 ``RESOLVE_IN_ROOT``).  They import nothing of weenv's but
:mod:`weenv.errors`."""
