"""What a node knows of templates without asking the store: manifests by digest,
and the digest each template name last resolved to.  Both live in the node's
home, so a restarted daemon knows them too.

Layout under ``root`` (``$WEENV_HOME/node/known``)::

    manifests/sha256/HEX     a template or group manifest's bytes, as the store gave them
    names.json               {"store": URL, "names": {NAME: {"digest": DIGEST, "at": UNIX TIME}}}

**Manifests** are content-addressed, so a copy is as good as the store's: a
node reads one from memory (the most recently used, up to
:data:`MEMORY_MANIFEST_BYTES` of their JSON), else from disk (the last
:data:`DISK_MANIFESTS` fetched or used, by file time), else from the store
(then writes it to both), once per node however many creates want it at once
(the others wait for that fetch: a batch's cold creates of one template on a
node asked the store for the same manifests each).  A file read back is checked like
the store's bytes (size limit, sha256, kind, fields); a bad one is removed and
fetched again.

**Names** (:class:`KnownNames`): the digest a name resolved to the last time the
store answered, and when (``at``).  The file is rewritten (atomically) when a
name's digest changes, or its time is older than :data:`NAME_TOUCH_S`; a file
written for another store URL is ignored.  How a create uses it (the staleness
rule) is :meth:`weenv.node.resolver.Resolver.resolve`'s.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from weenv.errors import InvalidInputError, WeenvError
from weenv.formats.limits import MAX_MANIFEST_BYTES
from weenv.formats.manifest import (
    GroupManifest,
    TemplateManifest,
    check_digest,
    manifest_kind,
    parse_group_manifest,
    parse_template_manifest,
    sha256_digest,
)
from weenv.store.base import Store
from weenv.store.file import atomic_write

log = logging.getLogger(__name__)

MEMORY_MANIFEST_BYTES = 64 << 20
"""Bytes of manifest JSON whose parsed manifests a node keeps in memory, by digest
(least recently used go).  Parsed, a manifest takes ~3.8 times its JSON (a group
manifest of :data:`~weenv.formats.limits.MAX_CHUNKS` chunks: 13.8 MB of JSON,
52 MB of Python objects), so this is ~250 MiB; a manifest larger than it is
kept alone, until the next one is read."""
DISK_MANIFESTS = 1024
"""Manifests a node keeps on disk (least recently fetched or used go)."""
NAME_TOUCH_S = 60.0
"""A name's time in ``names.json`` is refreshed at most this often (seconds) while its digest stays."""
MAX_NAMES = 4096
"""Names kept (least recently resolved go)."""

_PARSE = {"template": parse_template_manifest, "group": parse_group_manifest}


class NodeManifests:
    """Manifests of ``store`` kept in memory (up to ``memory_bytes`` of their
    JSON) and under ``root`` (created; up to ``disk`` files).  Thread-safe."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        store: Store,
        *,
        memory_bytes: int = MEMORY_MANIFEST_BYTES,
        disk: int = DISK_MANIFESTS,
    ):
        self.root = Path(root) / "manifests" / "sha256"
        self.root.mkdir(parents=True, exist_ok=True)
        self.store = store
        self.memory_bytes, self.disk = memory_bytes, disk
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, tuple[TemplateManifest | GroupManifest, int]] = OrderedDict()
        self._cached_bytes = 0  # the JSON sizes of what _cache holds
        self._fetching: dict[str, Future] = {}  # digest -> its store fetch under way (its bytes)

    @property
    def memory_used(self) -> tuple[int, int]:
        """``(manifests, bytes of their JSON)`` kept in memory."""
        with self._lock:
            return len(self._cache), self._cached_bytes

    def template(self, digest: str) -> TemplateManifest:
        """Template manifest ``digest``.  Raises what :func:`weenv.packaging.template.load_template`
        does (:class:`InvalidInputError` if it is a group's)."""
        return self._get("template", digest)

    def group(self, digest: str) -> GroupManifest:
        """Group manifest ``digest``; raises as :func:`weenv.packaging.group.load_group`."""
        return self._get("group", digest)

    def groups(self, digests: list[str]) -> list[GroupManifest]:
        """The group manifests ``digests`` in order; those the node lacks are
        fetched from the store at once (a registry answers in ~5 ms each)."""
        missing = [g for g in dict.fromkeys(digests) if not self.has(g)]
        if len(missing) > 1:
            with ThreadPoolExecutor(min(len(missing), 8), thread_name_prefix="weenv-manifest") as pool:
                list(pool.map(self.group, missing))
        return [self.group(g) for g in digests]

    def adopt(self, digest: str, data: bytes) -> bool:
        """Take ``data`` as group manifest ``digest`` (given by a prefetch
        profile rather than fetched), checked as the store's bytes are: size
        limit, sha256, kind, fields; kept in memory and on disk.  False, and
        nothing kept, if it is not that group manifest (logged: the store's
        copy is fetched when it is needed, this one is never used); True if
        kept or known already."""
        if self.has(digest):
            return True
        try:
            if len(data) > MAX_MANIFEST_BYTES or sha256_digest(data) != check_digest(digest):
                raise InvalidInputError("its bytes do not have that digest")
            found = self._parse("group", digest, data)
        except WeenvError as exc:
            log.warning("group manifest %s given by a prefetch profile refused (%s); the store's is used", digest, exc)
            return False
        self._to_disk(digest, data)
        self._keep(digest, found, len(data))
        return True

    def has(self, digest: str) -> bool:
        """Whether manifest ``digest`` is here, in memory or on disk (no store request)."""
        with self._lock:
            if digest in self._cache:
                return True
        return self._path(digest).is_file()

    def _path(self, digest: str) -> Path:
        return self.root / check_digest(digest).split(":", 1)[1]

    def _get(self, kind: str, digest: str):
        check_digest(digest)
        with self._lock:
            cached = self._cache.get(digest)
            if cached is not None:
                self._cache.move_to_end(digest)
        if cached is not None:
            found = cached[0]
            if not isinstance(found, GroupManifest if kind == "group" else TemplateManifest):
                raise InvalidInputError(f"{digest} is not a {kind} manifest")
            return found
        found, size = self._from_disk(kind, digest)
        if found is None:
            data = self._fetch(digest)
            found, size = self._parse(kind, digest, data), len(data)
        self._keep(digest, found, size)
        return found

    def _fetch(self, digest: str) -> bytes:
        """Manifest ``digest``'s bytes from the store (verified, at most
        MAX_MANIFEST_BYTES; written to the node's disk), or those of the fetch of
        it under way (its error raised here too): one request however many ask."""
        with self._lock:
            future = self._fetching.get(digest)
            mine = future is None
            if mine:
                future = self._fetching[digest] = Future()
        if not mine:
            return future.result()
        try:
            data = self.store.get_manifest(digest)
            self._to_disk(digest, data)
            future.set_result(data)
            return data
        except BaseException as exc:
            future.set_exception(exc)
            raise
        finally:
            with self._lock:
                del self._fetching[digest]

    def _keep(self, digest: str, manifest: TemplateManifest | GroupManifest, size: int) -> None:
        """Keep ``manifest`` (``size`` bytes of JSON) in memory; the least recently
        used go while more than ``memory_bytes`` are kept (never the newest)."""
        with self._lock:
            old = self._cache.pop(digest, None)
            if old is not None:  # another thread read it meanwhile
                self._cached_bytes -= old[1]
            self._cache[digest] = (manifest, size)
            self._cached_bytes += size
            while self._cached_bytes > self.memory_bytes and len(self._cache) > 1:
                _digest, (_manifest, gone) = self._cache.popitem(last=False)
                self._cached_bytes -= gone

    @staticmethod
    def _parse(kind: str, digest: str, data: bytes):
        actual = manifest_kind(data)
        if actual != kind:
            raise InvalidInputError(f"{digest} is a {actual} manifest, not a {kind}")
        return _PARSE[kind](data, digest)

    def _from_disk(self, kind: str, digest: str) -> tuple[TemplateManifest | GroupManifest | None, int]:
        """The node's copy of manifest ``digest`` and its size, or ``(None, 0)``."""
        path = self._path(digest)
        try:
            with open(path, "rb") as f:
                data = f.read(MAX_MANIFEST_BYTES + 1)
            with contextlib.suppress(OSError):
                os.utime(path)  # recently used: pruned last
        except FileNotFoundError:
            return None, 0
        except OSError as exc:
            log.warning("cannot read the node's copy of manifest %s: %s", digest, exc)
            return None, 0
        if len(data) > MAX_MANIFEST_BYTES or sha256_digest(data) != digest:
            log.warning("the node's copy of manifest %s is damaged; fetching it again", digest)
            path.unlink(missing_ok=True)
            return None, 0
        return self._parse(kind, digest, data), len(data)  # a bad kind or fields: what the store's copy would raise

    def _to_disk(self, digest: str, data: bytes) -> None:
        try:
            atomic_write(self._path(digest), data, durable=False)  # checked when read back
            self._prune()
        except OSError as exc:  # the node works without its copy
            log.warning("cannot keep manifest %s on the node: %s", digest, exc)

    def _prune(self) -> None:
        entries = []
        for p in self.root.iterdir():
            with contextlib.suppress(OSError):
                entries.append((p.stat().st_mtime_ns, p))
        if len(entries) <= self.disk:
            return
        entries.sort()
        for _mtime, p in entries[: len(entries) - self.disk]:
            p.unlink(missing_ok=True)

    def clear(self) -> None:
        """Forget every manifest (memory and disk)."""
        with self._lock:
            self._cache.clear()
            self._cached_bytes = 0
            for p in self.root.iterdir():
                p.unlink(missing_ok=True)


class KnownNames:
    """Template name -> the digest and time the store last named it, in
    ``root/names.json`` for store ``store_url``.  Thread-safe."""

    def __init__(self, root: str | os.PathLike[str], store_url: str):
        self.path = Path(root) / "names.json"
        self.store_url = store_url
        self._lock = threading.Lock()
        self._names: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._load()

    def _load(self) -> None:
        try:
            with open(self.path, "rb") as f:
                doc = json.loads(f.read(MAX_MANIFEST_BYTES + 1))
            if doc.get("store") != self.store_url:
                return  # another store's names
            for name, entry in doc.get("names", {}).items():
                self._names[name] = (check_digest(entry["digest"]), float(entry["at"]))
        except FileNotFoundError:
            return
        except (OSError, ValueError, TypeError, KeyError, AttributeError, WeenvError) as exc:
            log.warning("ignoring the node's known template names %s: %s", self.path, exc)
            self._names.clear()

    def get(self, name: str) -> tuple[str, float] | None:
        """``(digest, unix time the store last named it)``, or None."""
        with self._lock:
            return self._names.get(name)

    def remember(self, name: str, digest: str) -> None:
        """The store named ``name`` ``digest`` just now."""
        now = time.time()
        with self._lock:
            old = self._names.get(name)
            self._names[name] = (digest, now)
            self._names.move_to_end(name)
            while len(self._names) > MAX_NAMES:
                self._names.popitem(last=False)
            if old is not None and old[0] == digest and now - old[1] < NAME_TOUCH_S:
                self._names[name] = old  # unchanged: keep the file as it is
                return
            self._save_locked()

    def forget(self, name: str) -> None:
        with self._lock:
            if self._names.pop(name, None) is not None:
                self._save_locked()

    def clear(self) -> None:
        with self._lock:
            self._names.clear()
            self.path.unlink(missing_ok=True)

    def _save_locked(self) -> None:
        doc = {"store": self.store_url, "names": {n: {"digest": d, "at": at} for n, (d, at) in self._names.items()}}
        try:
            atomic_write(self.path, json.dumps(doc, sort_keys=True).encode(), durable=False)
        except OSError as exc:  # the node works without it (a restart then needs the store)
            log.warning("cannot keep the known template names in %s: %s", self.path, exc)
