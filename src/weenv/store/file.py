"""The local-directory store (``file:///path``), the embedded default.

Layout under the root::

    chunks/sha256/ab/abcdef...      zstd frame of a chunk (address: plaintext sha256)
    manifests/sha256/abcdef...      canonical JSON of a manifest
    refs/templates/NAME             a digest, one line
    refs/groups/NAME

Writes are atomic: a temporary file in the same directory, fsync'd data, then
rename(2) over the final name.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from weenv.errors import InvalidInputError, NotFoundError
from weenv.packaging.manifest import check_digest
from weenv.store.base import Store


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (temporary file + rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


class FileStore(Store):
    """A store in a local directory ``root`` (created if missing)."""

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root).absolute()
        self.url = f"file://{self.root}"
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, space: str, digest: str) -> Path:
        hexdigest = check_digest(digest).split(":", 1)[1]
        if space == "chunks":
            return self.root / "chunks" / "sha256" / hexdigest[:2] / hexdigest
        if space == "manifests":
            return self.root / "manifests" / "sha256" / hexdigest
        raise InvalidInputError(f"unknown store space {space!r}")

    def _has(self, space: str, digest: str) -> bool:
        return self._path(space, digest).is_file()

    def _put(self, space: str, digest: str, data: bytes) -> None:
        atomic_write(self._path(space, digest), data)

    def _get(self, space: str, digest: str) -> bytes:
        try:
            return self._path(space, digest).read_bytes()
        except FileNotFoundError:
            raise NotFoundError(f"no {space[:-1]} {digest} in {self.url}") from None

    def _list(self, space: str) -> Iterator[str]:
        base = self.root / space / "sha256"
        if not base.is_dir():
            return
        for dirpath, _dirs, files in os.walk(base):
            for name in files:
                if not name.startswith(".tmp-"):
                    yield f"sha256:{name}"

    def _delete(self, space: str, digest: str) -> None:
        self._path(space, digest).unlink(missing_ok=True)

    def _ref_path(self, kind: str, name: str) -> Path:
        self._check_ref(kind, name)
        return self.root / "refs" / kind / name

    def set_ref(self, kind: str, name: str, digest: str) -> None:
        check_digest(digest)
        atomic_write(self._ref_path(kind, name), (digest + "\n").encode())

    def get_ref(self, kind: str, name: str) -> str:
        try:
            return check_digest(self._ref_path(kind, name).read_text().strip())
        except FileNotFoundError:
            raise NotFoundError(f"no {kind[:-1]} named {name!r} in {self.url}") from None

    def list_refs(self, kind: str) -> dict[str, str]:
        self._check_ref(kind, "x")
        base = self.root / "refs" / kind
        if not base.is_dir():
            return {}
        return {
            p.name: p.read_text().strip()
            for p in sorted(base.iterdir())
            if p.is_file() and not p.name.startswith(".tmp-")
        }
