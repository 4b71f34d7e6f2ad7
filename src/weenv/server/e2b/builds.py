"""E2B templates on a weenv node: their names, tags and builds, the uploads of
their COPY steps, and the builds running in background threads.

An E2B *template* has an id (20 random characters), one name, tags (``default``
unless others are asked for) each pointing at a build, and builds; a build that
succeeded is a weenv template manifest (:mod:`weenv.build.stepbuild`), and
the store's ref ``templates/NAME`` follows the template's latest ready build, so
``weenv`` itself, ``Sandbox.create("NAME")``, ``"NAME:TAG"``, ``"ID"`` and
``"NAME:BUILD_ID"`` all start it.  That ref is the template's only while it
points at one of its builds (or is absent): a build never moves a ref it does
not own, so a new E2B template cannot take the name of a store template that
is not one of this node's E2B templates (a built ``task``, a snapshot, another
node's E2B template: :class:`BusyError`, HTTP 409, at the build request), and a
build whose name was taken meanwhile ends as an error, the ref unmoved
(:meth:`Templates.owns_ref`).  The records are kept in
``$WEENV_HOME/e2b/templates.json`` (written atomically on every change; a build
still running when the daemon stopped reads back as failed); build logs are kept
in memory only, bounded in bytes per build (:mod:`weenv.server.e2b.buildlog`) and
for all builds (:data:`MAX_LOGS_BYTES`: the oldest finished builds' logs go first).

COPY uploads, one per ``filesHash`` (E2B's are team-wide too), their tokens,
checks and lifetimes are :mod:`weenv.server.e2b.uploads`'s (``Templates.uploads``):
a build holds the uploads its COPY steps name from its start to its end.

At most :data:`MAX_CONCURRENT_BUILDS` builds run at once (others wait, status
``waiting``).  Deleting a template cancels its builds and waits for them to
be undone (environments, mounts, cgroups, work dirs) before it answers.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field

from weenv.build.stepbuild import MAX_LINE_BYTES, BuildOutcome, BuildSpec, StepFailedError, TemplateBuild
from weenv.errors import BusyError, InvalidInputError, NotFoundError, WeenvError
from weenv.formats.manifest import DEFAULT_DISK_BYTES, MAX_DISK_BYTES, Resources
from weenv.node.node import Node
from weenv.server.e2b.buildlog import BuildLogBook, cut_line
from weenv.server.e2b.uploads import Uploads

MAX_CONCURRENT_BUILDS = 2
MAX_LOGS_BYTES = 256 << 20
"""Bytes of the logs of all builds; past it the oldest finished builds' logs are dropped."""
MAX_TEMPLATES = 10_000
CANCEL_WAIT_S = 120.0
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,127}$")
TAG_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
DEFAULT_TAG = "default"


@dataclass
class Build:
    id: str
    status: str = "waiting"
    """E2B's: ``waiting`` (until started), ``building``, ``ready``, ``error``."""
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    finished_at: float | None = None
    digest: str | None = None
    """The weenv template manifest, once ready."""
    reason: dict | None = None
    """E2B's ``BuildStatusReason`` of a failed build."""
    cpu_count: int = 2
    memory_mb: int = 2048
    disk_mb: int = DEFAULT_DISK_BYTES >> 20
    """The disk quota of its sandboxes, MiB (``Resources.disk_bytes``): the default, or
    what ``minFreeDiskMB`` asked when more (a sandbox's writable layer starts empty,
    so its free space is its quota)."""
    steps_run: list[str] = field(default_factory=list)
    steps_cached: list[str] = field(default_factory=list)


@dataclass
class TemplateRecord:
    id: str
    name: str
    tags: dict[str, dict] = field(default_factory=dict)
    """tag -> ``{"build": build id, "at": unix time}``."""
    builds: list[Build] = field(default_factory=list)
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    spawn_count: int = 0
    public: bool = False
    """E2B's ``public`` flag (``PATCH /v2/templates/{id}``): kept and reported; a weenv
    daemon has one team (one API key), so it changes who may start it in nothing."""

    def build(self, build_id: str) -> Build:
        for b in self.builds:
            if b.id == build_id:
                return b
        raise NotFoundError(f"template {self.id!r} has no build {build_id!r}")

    def latest_ready(self) -> Build | None:
        ready = [b for b in self.builds if b.status == "ready"]
        return max(ready, key=lambda b: b.finished_at or 0) if ready else None


def split_name(name: str) -> tuple[str, str | None]:
    """``NAME[:TAG]`` -> ``(NAME, TAG or None)``; :class:`InvalidInputError` if malformed."""
    base, sep, tag = name.partition(":")
    if not NAME_RE.match(base):
        raise InvalidInputError(f"template name {base!r}: lowercase letters, digits, '-', '_' and '.' (at most 128)")
    if sep and not TAG_RE.match(tag):
        raise InvalidInputError(f"tag {tag!r}: letters, digits, '-', '_' and '.' (at most 128)")
    return base, (tag if sep else None)


class Templates:
    """The E2B templates of ``node`` (see the module docstring).  Thread-safe."""

    def __init__(self, node: Node, *, secret: bytes, **upload_limits):
        """``upload_limits``: :class:`~weenv.server.e2b.uploads.Uploads`'s
        ``ttl_s``, ``max_total``, ``max_upload``."""
        self.node = node
        self.store = node.store
        self.dir = node.paths.home / "e2b"
        self.uploads = Uploads(self.dir / "files", secret=secret, **upload_limits)
        self._lock = threading.RLock()
        self._slots = threading.BoundedSemaphore(MAX_CONCURRENT_BUILDS)
        self._running: dict[str, tuple[threading.Thread, TemplateBuild | None]] = {}
        self._logs: dict[str, BuildLogBook] = {}  # build id -> its log, oldest build first
        self._closed = False
        self._records: dict[str, TemplateRecord] = self._load()

    # --- records ----------------------------------------------------------------------
    def _load(self) -> dict[str, TemplateRecord]:
        path = self.dir / "templates.json"
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError):
            return {}
        records = {}
        for t in data.get("templates", []):
            builds = [Build(**b) for b in t.pop("builds", [])]
            for b in builds:
                if b.status in ("waiting", "building"):
                    b.status, b.reason = "error", {"message": "the daemon stopped during the build", "step": "base"}
            records[t["id"]] = TemplateRecord(**t, builds=builds)
        return records

    def _save(self) -> None:
        path = self.dir / "templates.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"templates": [asdict(t) for t in self._records.values()]}))
        os.replace(tmp, path)

    def find(self, ref: str) -> TemplateRecord | None:
        """The template with id or name ``ref`` (a ``:TAG`` suffix ignored)."""
        base = ref.partition(":")[0]
        with self._lock:
            t = self._records.get(base)
            if t is None:
                t = next((r for r in self._records.values() if r.name == base), None)
            return t

    def get(self, ref: str) -> TemplateRecord:
        t = self.find(ref)
        if t is None:
            raise NotFoundError(f"template {ref!r} not found")
        return t

    def list(self) -> list[TemplateRecord]:
        with self._lock:
            return sorted(self._records.values(), key=lambda t: t.created_at)

    def set_public(self, ref: str, public: bool) -> TemplateRecord:
        """Set template ``ref``'s ``public`` flag (kept in the records); raises :class:`NotFoundError`."""
        with self._lock:
            t = self.get(ref)
            t.public, t.updated_at = public, time.time()
            self._save()
            return t

    def logs(self, build_id: str) -> list[dict]:
        with self._lock:
            book = self._logs.get(build_id)
            return list(book.entries) if book else []

    def resolve(self, ref: str) -> str | None:
        """The weenv template digest ``ref`` starts (``ID``, ``NAME``, ``NAME:TAG``,
        ``NAME:BUILD_ID``), None if no E2B template has that id or name.  Raises
        :class:`NotFoundError` for a tag or build that is not (yet) ready."""
        t = self.find(ref)
        if t is None:
            return None
        _, sep, tag = ref.partition(":")
        with self._lock:
            if not sep:
                b = t.latest_ready()
            else:
                b = next((x for x in t.builds if x.id == tag), None)
                if b is None and tag in t.tags:
                    b = t.build(t.tags[tag]["build"])
            if b is None or b.status != "ready" or b.digest is None:
                raise NotFoundError(
                    f"tag '{tag or DEFAULT_TAG}' does not exist for template '{t.name}' (or its build is not ready)"
                )
            t.spawn_count += 1
            return b.digest

    # --- requests ---------------------------------------------------------------------
    def request(
        self,
        name: str,
        tags: list[str],
        *,
        cpu_count: int | None,
        memory_mb: int | None,
        min_free_disk_mb: int | None = None,
    ) -> tuple[TemplateRecord, Build, list[str]]:
        """A new build of template ``name`` (``NAME[:TAG]``; made if new), tagged
        ``tags`` (default ``default``), its sandboxes' disk quota at least
        ``min_free_disk_mb`` MiB (E2B's ``minFreeDiskMB``; the default quota when
        less or None).  Returns ``(template, build, tags)``.  Raises
        :class:`InvalidInputError` (also for a ``min_free_disk_mb`` above the
        node's environment disk), :class:`BusyError` (the name is a store
        template's that is not this E2B template's: :meth:`owns_ref`)."""
        base, tag = split_name(name)
        wanted = list(dict.fromkeys([*([tag] if tag else []), *tags])) or [DEFAULT_TAG]
        for t in wanted:
            split_name(f"{base}:{t}")
        cores = os.cpu_count() or 1
        if cpu_count is not None and not 1 <= cpu_count <= cores:
            raise InvalidInputError(f"cpuCount {cpu_count}: this node has {cores} cores")
        try:
            Resources(cpus=float(cpu_count or 1), memory_bytes=(memory_mb or 2048) << 20)
        except ValueError as exc:
            raise InvalidInputError(f"memoryMB {memory_mb}: {exc}") from None
        disk_mb = max(DEFAULT_DISK_BYTES >> 20, min_free_disk_mb or 0)
        disk_size = self.node.disk.size or MAX_DISK_BYTES
        if min_free_disk_mb and (min_free_disk_mb << 20) > min(disk_size, MAX_DISK_BYTES):
            raise InvalidInputError(
                f"minFreeDiskMB {min_free_disk_mb}: this node's environment disk holds "
                f"{disk_size >> 20} MiB in all (WEENV_DISK_BYTES)"
            )
        with self._lock:
            self._check_open()
            t = self.find(base)
            if t is None:
                if len(self._records) >= MAX_TEMPLATES:
                    raise InvalidInputError(f"this node keeps at most {MAX_TEMPLATES} templates")
                if self._ref(base) is not None:
                    raise BusyError(
                        f"template {base!r} exists in the store and is not an E2B template of "
                        f"this node: an E2B template takes a name of its own"
                    )
                t = TemplateRecord(id=_template_id(), name=base)
                self._records[t.id] = t
            elif not self.owns_ref(t):
                raise BusyError(
                    f"template name {base!r} was taken in the store by a template that is not E2B template {t.id}'s"
                )
            b = Build(id=str(uuid.uuid4()), cpu_count=cpu_count or 2, memory_mb=memory_mb or 2048, disk_mb=disk_mb)
            t.builds.append(b)
            for tg in wanted:  # E2B assigns the tags as the build starts
                t.tags[tg] = {"build": b.id, "at": time.time()}
            t.updated_at = time.time()
            self._logs[b.id] = BuildLogBook()
            self._save()
            return t, b, wanted

    def start(self, template_id: str, build_id: str, spec: BuildSpec) -> None:
        """Start build ``build_id`` (status ``waiting``) of ``spec`` in a thread."""
        with self._lock:
            self._check_open()
            t = self.get(template_id)
            if t.id != template_id:
                raise NotFoundError(f"template {template_id!r} not found (use its id)")
            b = t.build(build_id)
            if b.status != "waiting" or build_id in self._running:
                raise BusyError(f"build {build_id} was started already (status {b.status})")
            if spec.from_template is not None:
                digest = self.resolve(spec.from_template)
                if digest is not None:
                    spec = BuildSpec(**{**spec.__dict__, "from_template": digest})
            spec = BuildSpec(
                **{
                    **spec.__dict__,
                    "resources": Resources(
                        cpus=float(b.cpu_count), memory_bytes=b.memory_mb << 20, disk_bytes=b.disk_mb << 20
                    ),
                }
            )
            b.status, b.updated_at = "building", time.time()
            thread = threading.Thread(
                target=self._run, args=(t, b, spec), name=f"e2b-build-{build_id[:8]}", daemon=True
            )
            self._running[build_id] = (thread, None)
            self.uploads.hold(build_id, t.id, {s.files_hash for s in spec.steps if s.files_hash})
            self._save()
        thread.start()

    def _log(
        self,
        build_id: str,
        message: str,
        *,
        level: str = "info",
        step: str | None = None,
        output: bool = False,
        final: bool = False,
    ) -> None:
        with self._lock:
            book = self._logs.get(build_id)
            if book is None:
                book = self._logs[build_id] = BuildLogBook()
            book.add(message, level=level, step=step, output=output, final=final)

    def _forget_old_logs(self) -> None:
        """Drop the logs of the oldest finished builds while all logs hold more than :data:`MAX_LOGS_BYTES`."""
        with self._lock:
            total = sum(book.bytes for book in self._logs.values())
            for build_id in list(self._logs):
                if total <= MAX_LOGS_BYTES:
                    break
                if build_id not in self._running:
                    total -= self._logs.pop(build_id).bytes

    def _run(self, t: TemplateRecord, b: Build, spec: BuildSpec) -> None:
        def log(message: str, *, level: str = "info", step: str | None = None, output: bool = False) -> None:
            self._log(b.id, message, level=level, step=step, output=output)

        build = TemplateBuild(spec, self.store, self.node.paths, name=t.name, files=self.uploads.path, log=log)

        def publish(outcome: BuildOutcome) -> None:
            """Run by the build while its lease still names what the template reaches."""
            with self._lock:
                if not self.owns_ref(t):
                    raise StepFailedError(
                        f"template name {t.name!r} was taken in the store meanwhile by a template "
                        f"that is not this one's: its ref was left as it is",
                        step="base",
                    )
                b.status, b.digest = "ready", outcome.template_digest
                b.steps_run, b.steps_cached = outcome.steps_run, outcome.steps_cached
                b.finished_at = b.updated_at = time.time()
                if t.id in self._records and t.latest_ready() is b:
                    self.store.set_ref("templates", t.name, outcome.template_digest)
                self._save()

        try:
            with self._slots:
                with self._lock:
                    cancelled = b.id not in self._running
                    if not cancelled:
                        self._running[b.id] = (self._running[b.id][0], build)
                if cancelled:
                    raise StepFailedError("the build was cancelled (its template was deleted)", step="base")
                build.run(publish)
        except StepFailedError as exc:
            self._fail(t, b, str(exc), exc.step)
        except WeenvError as exc:
            self._fail(t, b, str(exc), "base")
        except Exception as exc:  # noqa: BLE001 - a bug must still end the build as an error
            self._fail(t, b, f"internal error: {type(exc).__name__}: {exc}", "base")
        else:
            self._log(b.id, "Build finished: ready", final=True)
        finally:
            with self._lock:
                self._running.pop(b.id, None)
            self.uploads.release(b.id)
            self._forget_old_logs()

    def _ref(self, name: str) -> str | None:
        """The digest the store's ``templates/NAME`` ref holds, None if there is none."""
        try:
            return self.store.get_ref("templates", name)
        except NotFoundError:
            return None

    def owns_ref(self, t: TemplateRecord) -> bool:
        """Whether ``t``'s builds may move the store's ref of its name: it is
        absent, or it holds one of ``t``'s builds (see the module doc)."""
        current = self._ref(t.name)
        return current is None or current in {b.digest for b in t.builds if b.digest}

    def _fail(self, t: TemplateRecord, b: Build, message: str, step: str) -> None:
        self._log(b.id, message, level="error", step=step, final=True)
        with self._lock:
            book = self._logs.get(b.id)
            tail = [e for e in (book.entries if book else []) if e.get("step") == step][-20:]
            b.status, b.reason = (
                "error",
                {"message": cut_line(message, 4 * MAX_LINE_BYTES), "step": step, "logEntries": tail},
            )
            b.finished_at = b.updated_at = time.time()
            if t.id in self._records:
                self._save()

    def assign_tags(self, target: str, tags: list[str]) -> tuple[str, list[str]]:
        """Point ``tags`` at the build ``target`` (``NAME:TAG`` or ``NAME:BUILD_ID``)
        names; ``(build id, tags)``.  Raises :class:`NotFoundError`."""
        base, tag = split_name(target)
        for tg in tags:
            split_name(f"{base}:{tg}")
        with self._lock:
            t = self.get(base)
            ref = tag or DEFAULT_TAG
            build_id = t.tags[ref]["build"] if ref in t.tags else t.build(ref).id
            for tg in tags:
                t.tags[tg] = {"build": build_id, "at": time.time()}
            self._save()
            return build_id, list(tags)

    def remove_tags(self, name: str, tags: list[str]) -> None:
        with self._lock:
            t = self.get(name)
            missing = [tg for tg in tags if tg not in t.tags]
            if missing:
                raise NotFoundError(f"template {t.name!r} has no tag {missing[0]!r}")
            for tg in tags:
                del t.tags[tg]
            self._save()

    # --- delete and close -----------------------------------------------------------------
    def delete(self, ref: str) -> None:
        """Delete template ``ref``: cancel its builds and wait until they are undone."""
        with self._lock:
            t = self.get(ref)
            self._records.pop(t.id, None)
            # a build waiting for a slot finds itself gone from _running and ends; a running one is cancelled
            waiting = [self._running.pop(b.id) for b in t.builds if b.id in self._running]
            self._save()
            try:
                if self.store.get_ref("templates", t.name) in {b.digest for b in t.builds}:
                    self.store.delete_ref("templates", t.name)
            except NotFoundError:
                pass
        self._cancel_and_wait(waiting)
        with self._lock:
            for b in t.builds:
                self._logs.pop(b.id, None)
        self.uploads.forget(t.id)

    def _cancel_and_wait(self, running: list[tuple[threading.Thread, TemplateBuild | None]]) -> None:
        for _thread, build in running:
            if build is not None:
                build.cancel()
        deadline = time.monotonic() + CANCEL_WAIT_S
        for thread, _ in running:
            thread.join(max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        """Cancel every build and wait for them (the daemon stops)."""
        with self._lock:
            self._closed = True
            running = list(self._running.values())
        self._cancel_and_wait(running)
        self.uploads.close()

    def _check_open(self) -> None:
        if self._closed:
            from weenv.errors import ClosedError

            raise ClosedError("the daemon is stopping")


def _template_id() -> str:
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
    return "".join(secrets.choice(alphabet) for _ in range(20))
