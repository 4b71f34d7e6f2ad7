"""Where weenv keeps things on a machine.

Environment variables:

- ``WEENV_HOME`` (default ``/var/lib/weenv``): the embedded store, the node's
  chunk cache, mounts, environments, the daemon's socket and log.
- ``WEENV_CACHE`` (default ``/var/cache/weenv``): big downloads that are slow to
  redo and safe to share between homes (debootstrap output, PyPI files).
- ``WEENV_STORE`` (default ``file://$WEENV_HOME/store``): the store URL.

``node/`` and ``run/`` are closed to other users (mode 0700, :func:`private_dir`):
below them are environments' root file systems and upper dirs (which hold what
code inside wrote, setuid files and device nodes included), the chunk cache,
runc's state, the daemon's socket and API key.  Only root (weenv, runc, the FUSE
holder) goes through them.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from weenv.errors import InvalidInputError


PRIVATE_MODE = 0o700


def private_dir(path: Path) -> Path:
    """Make directory ``path`` (and missing parents) and set its mode to
    :data:`PRIVATE_MODE` (an existing one too); return it."""
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, PRIVATE_MODE)
    return path


@dataclass(frozen=True)
class Paths:
    """Every on-disk location under one ``home`` (a directory path)."""

    home: Path
    cache: Path
    store_url: str

    @classmethod
    def from_env(cls) -> "Paths":
        home = Path(os.environ.get("WEENV_HOME", "/var/lib/weenv")).absolute()
        cache = Path(os.environ.get("WEENV_CACHE", "/var/cache/weenv")).absolute()
        store_url = os.environ.get("WEENV_STORE", f"file://{home / 'store'}")
        return cls(home=home, cache=cache, store_url=store_url)

    @property
    def node(self) -> Path:
        return self.home / "node"

    @property
    def chunk_cache(self) -> Path:
        """The node chunk cache (plaintext chunks by digest); never the store."""
        return self.node / "cache"

    @property
    def lazy_mountpoint(self) -> Path:
        """Where the lazy FUSE file system shows one file per group image."""
        return self.node / "lazy"

    @property
    def group_mounts(self) -> Path:
        """Parent of the shared, read-only EROFS mount of each group."""
        return self.node / "groups"

    @property
    def environments(self) -> Path:
        """Parent of each environment's bundle, upper/work dirs and rootfs."""
        return self.node / "envs"

    @property
    def run(self) -> Path:
        return self.home / "run"

    @property
    def socket(self) -> Path:
        """The node daemon's HTTP API, on a Unix socket."""
        return self.run / "weenv.sock"

    @property
    def api_key(self) -> Path:
        """The daemon's API key (hex, mode 0600), created on its first start."""
        return self.run / "api-key"

    @property
    def api_url(self) -> Path:
        """``http://HOST:PORT`` of the daemon's TCP listener while it serves one."""
        return self.run / "api-url"

    @property
    def pidfile(self) -> Path:
        return self.run / "weenv.pid"

    @property
    def daemon_log(self) -> Path:
        return self.run / "daemon.log"

    @property
    def runc_root(self) -> Path:
        """runc's state directory (``runc --root``), private to this home."""
        return self.run / "runc"

    @property
    def crun_root(self) -> Path:
        """crun's state directory (``crun --root``), private to this home."""
        return self.run / "crun"

    @property
    def runtime_roots(self) -> dict[str, Path]:
        """OCI runtime name -> its state directory."""
        return {"runc": self.runc_root, "crun": self.crun_root}


_SIZE = re.compile(r"^\s*(\d+)\s*([kmgt]?)i?b?\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """``"1073741824"``, ``"512M"``, ``"10GiB"`` -> bytes (binary units).
    Raises :class:`InvalidInputError`."""
    m = _SIZE.match(text or "")
    if not m:
        raise InvalidInputError(f"bad size {text!r}: want bytes, or a number with K, M, G or T")
    return int(m.group(1)) << (10 * " kmgt".index(m.group(2).lower() or " "))
