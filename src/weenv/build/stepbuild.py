"""A template built from a base and E2B's step list, each step its own cached layer group.

This is weenv's packaging claim applied to E2B builds (``Template().from_image(...)
.run_cmd(...)...``, or a Dockerfile the SDK turned into steps):

- **The base.**  ``from_image`` (a registry reference) is imported as the
  image's layer groups (:func:`~weenv.packaging.importer.import_image`, through
  skopeo); ``from_template`` starts from a template's groups and runtime.
  Images get E2B's ``user`` account first (an implicit ``USER user true``
  step, as E2B's builder does), created when the image lacks it.
- **Each step** (:mod:`weenv.packaging.steps`) runs in a build environment of
  a private in-process :class:`~weenv.node.node.Node` (its own home under
  ``$WEENV_HOME/build``) composed of the groups so far: ``RUN`` as the step's
  user (the environment's runtime user), in the context's working dir, with its
  variables; ``COPY``, ``USER`` and ``WORKDIR`` change the tree through the
  overlay, confined to it.  What the step changed (the environment's overlay
  upper dir, cleaned, :func:`~weenv.packaging.upperdir.clean_upper`) becomes one
  group; a step that changed nothing adds none; ``ENV`` never needs an
  environment.
- **The cache.**  Step ``i``'s key is the sha256 of step ``i-1``'s key and the
  step (type, arguments, files hash): a chain from the base image's manifest
  digest, as E2B's and Docker's are.  The store's build cache index
  (:mod:`weenv.packaging.buildcache`, ref ``buildcache/<key>``) maps a key to a
  small *state* template manifest: the groups after that step, and the uid,
  gid and home of the context's user.  A step whose key is there (its groups and
  chunks present) is not run again; a build sharing its first steps with another
  shares those groups; changing the last step re-runs that step alone.  A
  ``force`` step (the SDK's ``skip_cache()``) and every later one are rebuilt.

Nothing is published under a name here: :func:`build_template` returns the
new template manifest's digest, and the caller moves its refs.  On a failing
step (:class:`StepFailedError`, naming it), a cancel (:class:`BuildCancelledError`)
or any error, the build environments, their mounts and cgroups, scratch
manifests and the work dir are removed; groups of the steps that succeeded
stay in the build cache, as Docker keeps the layers before a failed ``RUN``.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import subprocess
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

from weenv.config import Paths, settings
from weenv.errors import (
    ClosedError,
    InvalidInputError,
    NotFoundError,
    RuntimeFailedError,
    ToolMissingError,
    WeenvError,
)
from weenv.formats.manifest import Resources, RuntimeConfig, TemplateManifest, canonical_json
from weenv.host.rootfs import RootFS
from weenv.node.runtime.bundle import DOCKER_DEFAULT_CAPS, parse_user
from weenv.packaging import buildcache
from weenv.packaging.group import build_group, load_group
from weenv.packaging.importer.source import _is_loopback
from weenv.packaging.steps import (
    DEFAULT_USER,
    ROOT,
    Account,
    Context,
    Step,
    advance,
    copy_archive,
    create_account,
    find_account,
    make_workdir,
    unpack_upload,
    workdir_path,
)
from weenv.packaging.template import load_template
from weenv.packaging.upperdir import clean_upper
from weenv.progress import Progress
from weenv.store.base import Store
from weenv.store.lease import Lease, LeasedStore, covered

FORMAT = 1
"""Bumped when the same steps would build other trees (part of every key)."""
RUN_TIMEOUT_S = 3600.0
"""Seconds one RUN step may take."""
BUILD_MEMORY_BYTES = 8 << 30
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
DEFAULT_REGISTRY = "docker.io"
"""Where an image named without a registry host (``ubuntu:22.04``) is pulled from
(``WEENV_E2B_REGISTRY`` overrides it)."""
SKOPEO_TIMEOUT_S = 120.0


MAX_LINE_BYTES = 4096
"""Bytes of one line of a step's output kept (as it is read: the rest is counted, not held)."""


class BuildLog(Protocol):
    def __call__(self, message: str, *, level: str = "info", step: str | None = None, output: bool = False) -> None:
        """Hear a log line; ``output``: a line a step's command printed (the rest: the builder's own)."""


class StepFailedError(RuntimeFailedError):
    """A step failed; ``step`` names it as E2B does (``"base"``, ``"1"``... ,
    ``"finalize"``) and ``output`` holds the tail of what it printed."""

    def __init__(self, message: str, *, step: str, output: str = ""):
        super().__init__(message)
        self.step = step
        self.output = output


class BuildCancelledError(ClosedError):
    """The build was cancelled (its template deleted) and undone."""


@dataclass(frozen=True)
class BuildSpec:
    """What to build (E2B's ``TemplateBuildStartV2``)."""

    steps: list[Step]
    from_image: str | None = None
    """A registry reference (``HOST:PORT/REPO:TAG``; without a host, :data:`DEFAULT_REGISTRY`)."""
    from_template: str | None = None
    """A weenv template digest."""
    force: bool = False
    start_command: str | None = None
    ready_command: str | None = None
    resources: Resources = field(default_factory=Resources)


@dataclass(frozen=True)
class BuildOutcome:
    template_digest: str
    manifest: TemplateManifest
    steps_run: list[str]
    """Labels of the steps that ran (``"base"`` for the image import or the user account)."""
    steps_cached: list[str]


@dataclass(frozen=True)
class _State:
    groups: tuple[str, ...]
    account: Account
    """The context user's account in this tree."""


def docker_reference(image: str) -> str:
    """``image`` as a full registry reference: ``HOST/REPO:TAG`` (or ``@DIGEST``).
    Raises :class:`InvalidInputError` for an empty or malformed one."""
    ref = image.removeprefix("docker://").strip()
    if not ref or any(c.isspace() for c in ref) or ref.startswith("/") or ".." in ref:
        raise InvalidInputError(f"fromImage {image!r} is not an image reference")
    first, _, rest = ref.partition("/")
    if not rest or not ("." in first or ":" in first or first == "localhost"):
        registry = settings().build.e2b_registry
        ref = f"{registry}/{'library/' if not rest and registry == DEFAULT_REGISTRY else ''}{ref}"
    last = ref.rsplit("/", 1)[-1]
    if ":" not in last and "@" not in last:
        ref += ":latest"
    return ref


def image_digest(ref: str) -> str:
    """sha256 (hex) of the manifest ``ref`` names in its registry (``skopeo
    inspect --raw``: the manifest only, no layers).  Raises :class:`NotFoundError`
    for an image the registry does not have, :class:`ToolMissingError` without
    skopeo, :class:`RuntimeFailedError` when the registry cannot be asked."""
    program = shutil.which("skopeo")
    if program is None:
        raise ToolMissingError("skopeo is not installed (apt-get install skopeo)")
    argv = [program, "inspect", "--raw"]
    if _is_loopback(ref.split("/", 1)[0]):
        argv.append("--tls-verify=false")
    try:
        proc = subprocess.run([*argv, f"docker://{ref}"], capture_output=True, timeout=SKOPEO_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as exc:
        raise RuntimeFailedError(f"fromImage {ref}: its registry did not answer in {SKOPEO_TIMEOUT_S:g} s") from exc
    if proc.returncode != 0:
        tail = " ".join(proc.stderr.decode(errors="replace").strip().splitlines()[-3:])
        if any(s in tail for s in ("manifest unknown", "name unknown", "not found", "404")):
            raise NotFoundError(f"fromImage {ref}: no such image in its registry ({tail})")
        raise RuntimeFailedError(f"fromImage {ref}: cannot read it from its registry: {tail}")
    return hashlib.sha256(proc.stdout).hexdigest()


MAX_SUDO_ANSWERS = 1024
"""How many :meth:`TemplateBuild._has_sudo` answers the process keeps (least recently used dropped)."""
_SUDO_ANSWERS: OrderedDict[tuple[tuple[str, ...], str], bool] = OrderedDict()
"""(group digests, user) -> whether that tree lets that user run sudo: the
answer needs a build environment, and a build taken whole from the cache
gives the same tree again (group digests fix the tree)."""
_SUDO_LOCK = threading.Lock()


def step_key(previous: str, step: Step) -> str:
    """The cache key (64 hex digits) of ``step`` after the step keyed ``previous``."""
    data = {"format": FORMAT, "previous": previous, "type": step.type, "args": step.args, "files": step.files_hash}
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _state_manifest(state: _State, env: dict[str, str]) -> TemplateManifest:
    runtime = RuntimeConfig(env={"PATH": DEFAULT_PATH, **env, "HOME": state.account.home}, user=state.account.ids)
    return TemplateManifest(name="e2b-step", groups=list(state.groups), runtime=runtime)


def _record(store: Store, key: str, state: _State, env: dict[str, str] | None = None) -> None:
    """Remember that the step keyed ``key`` left ``state`` (``env``: the base's variables)."""
    data = canonical_json(_state_manifest(state, env or {}))
    buildcache.record(store, key, store.put_manifest(data))


def _stored(store: Store, digest: str) -> bool:
    """Whether template manifest ``digest``, its groups and their chunks are all in the store."""
    try:
        _, manifest = load_template(store, digest)
        return all(store.has_chunk(c.digest) for g in manifest.groups for c in load_group(store, g).chunks)
    except WeenvError:
        return False


def _reached(store: Store, digest: str) -> list[str]:
    """The groups of template manifest ``digest`` and their chunks."""
    _, manifest = load_template(store, digest)
    return [*manifest.groups, *(c.digest for g in manifest.groups for c in load_group(store, g).chunks)]


def _reuse(store: Store, lease: Lease, find: Callable[[], str | None]) -> str | None:
    """The template manifest ``find()`` names, once ``lease`` names it, its
    groups and their chunks and they are still stored (None if not)."""
    return covered(
        lease, lambda: d if (d := find()) is not None and _stored(store, d) else None, lambda d: _reached(store, d)
    )


def _lookup(store: Store, lease: Lease, key: str, user: str) -> tuple[_State, dict[str, str]] | None:
    """The state recorded for ``key`` if it and all its groups' chunks are in
    the store, once ``lease`` names them (what a gc deletes meanwhile is a miss)."""

    def find() -> str | None:
        try:
            return store.get_ref(buildcache.REF_KIND, key)
        except WeenvError:
            return None

    digest = _reuse(store, lease, find)
    if digest is None:
        return None
    try:
        _, manifest = load_template(store, digest)
    except WeenvError:
        return None
    uid, gid = parse_user(manifest.runtime.user)
    env = dict(manifest.runtime.env)
    account = Account(user, uid, gid, env.pop("HOME", "/"))
    if env.get("PATH") == DEFAULT_PATH:
        del env["PATH"]
    return _State(tuple(manifest.groups), account), env


class _Lines:
    """A command's output split into lines for ``say``, each cut to
    :data:`MAX_LINE_BYTES` as it is read (what is cut is counted, not kept);
    ``tail`` holds the last 40."""

    def __init__(self, say: Callable[[str], None]):
        self.say = say
        self.tail: list[str] = []
        self._line = bytearray()
        self._cut = 0

    def feed(self, data: bytes) -> None:
        start = 0
        while True:
            nl = data.find(b"\n", start)
            piece = data[start : nl if nl >= 0 else len(data)]
            room = max(0, MAX_LINE_BYTES - len(self._line))
            self._line += piece[:room]
            self._cut += len(piece) - min(room, len(piece))
            if nl < 0:
                return
            self._emit()
            start = nl + 1

    def _emit(self) -> None:
        text = bytes(self._line).decode(errors="replace").rstrip("\r")
        if self._cut:
            text += f" … [{self._cut} bytes cut]"
        self._line.clear()
        self._cut = 0
        self.say(text)
        self.tail = [*self.tail[-39:], text]

    def close(self) -> None:
        if self._line or self._cut:
            self._emit()


class _Session:
    """The build environments of one build: at most one alive at a time."""

    def __init__(self, store: Store, paths: Paths, work: Path, resources: Resources):
        self.store, self.paths, self.work = store, paths, work
        self.resources = resources
        self.node = None
        self.live: tuple[str, tuple[str, ...], str] | None = None  # (env id, groups, uid:gid)
        self.scratch: list[str] = []
        self.process = None
        self.cancelled = threading.Event()
        self._lock = threading.Lock()
        self.started = 0
        """How many build environments this build has created."""

    def _node(self):
        if self.node is None:
            from weenv.node.node import Node

            node = Node(
                Paths(home=self.work / "node", cache=self.paths.cache, store_url=self.store.url), store=self.store
            )
            self.node = node
            node.start()
        return self.node

    def env(self, groups: tuple[str, ...], ids: str | None = None) -> str:
        """An environment over ``groups`` (running as ``ids``; None: any)."""
        if self.live and self.live[1] == groups and ids in (None, self.live[2]):
            return self.live[0]
        self.drop()
        self.check()
        runtime = RuntimeConfig(
            network=True,
            user=ids or "0:0",
            resources=Resources(cpus=float(os.cpu_count() or 1), memory_bytes=BUILD_MEMORY_BYTES, pids=16384),
        )
        scratch = TemplateManifest(name="e2b-build", groups=list(groups), runtime=runtime)
        digest = self.store.put_manifest(canonical_json(scratch))
        self.scratch.append(digest)
        info = self._node().create(
            digest, first_command=False, capabilities=DOCKER_DEFAULT_CAPS, prefetch=False, sudo=False
        )
        self.live = (info.id, groups, ids or "0:0")
        self.started += 1
        return info.id

    def fs(self) -> RootFS:
        assert self.live is not None
        return self.node.files(self.live[0])

    def drop(self) -> None:
        if self.live is not None:
            env_id, self.live = self.live[0], None
            self.node.destroy(env_id)

    def run(self, argv: list[str], env: dict[str, str], cwd: str, say: Callable[[str], None]):
        """Run ``argv`` in the live environment, each output line to ``say``;
        ``(exit code, timed out, last lines)``."""
        assert self.live is not None
        with self._lock:
            self.check()
            p = self.node.spawn(self.live[0], argv, env=env, cwd=cwd, timeout=RUN_TIMEOUT_S, primary_reader=True)
            self.process = p
        lines = _Lines(say)
        end = None
        try:
            for ev in p.log.follow(p.primary):
                if ev.type in ("stdout", "stderr"):
                    lines.feed(ev.data or b"")
                elif ev.type == "end":
                    end = ev
        finally:
            with self._lock:
                self.process = None
        lines.close()
        tail = lines.tail
        self.check()
        if p.error is not None:
            raise p.error
        return end.exit_code, bool(end.timed_out), tail

    def collect(self, version: str) -> str | None:
        """Stop the live environment; its changes as a group (None if it changed nothing)."""
        assert self.live is not None
        env_id = self.live[0]
        upper = self.node.stop(env_id)
        try:
            clean_upper(upper)
            if not any(Path(upper).iterdir()):
                return None
            return build_group(
                upper,
                self.store,
                name="e2b-step",
                version=version,
                workdir=self.work,
                ref=False,
                source={"type": "e2b-step"},
            ).digest
        finally:
            self.live = None
            self.node.destroy(env_id)

    def check(self) -> None:
        if self.cancelled.is_set():
            raise BuildCancelledError("the build was cancelled (its template was deleted)")

    def cancel(self) -> None:
        """Cancel from another thread: the running step's command is killed."""
        self.cancelled.set()
        with self._lock:
            p = self.process
        if p is not None:
            p.kill()

    def close(self) -> None:
        try:
            if self.node is not None:
                self.node.close()
        finally:
            for digest in self.scratch:
                self.store.delete_manifest(digest)


class TemplateBuild:
    """One build; :meth:`run` builds, :meth:`cancel` (any thread) stops it."""

    def __init__(
        self,
        spec: BuildSpec,
        store: Store,
        paths: Paths,
        *,
        name: str,
        files: Callable[[str], Path | None],
        log: BuildLog,
    ):
        """``files(hash)``: the uploaded tar of a COPY's ``filesHash`` (None:
        never uploaded); ``log``: hears every log line."""
        self.spec, self.store, self.paths, self.name = spec, store, paths, name
        self.files, self.log = files, log
        self.work = paths.home / "build" / f"e2b-{secrets.token_hex(6)}"
        self.session = _Session(store, paths, self.work, spec.resources)
        self.lease: Lease | None = None

    def cancel(self) -> None:
        self.session.cancel()

    def run(self, publish: Callable[[BuildOutcome], None] | None = None) -> BuildOutcome:
        """Build, then ``publish(outcome)`` (sets the template's ref) while the
        build's write lease still names all the template reaches (groups it
        stored or reused from the cache, their chunks; weenv.store.lease).
        Raises :class:`StepFailedError`, :class:`BuildCancelledError`,
        :class:`NotFoundError` (no such image or template), :class:`InvalidInputError`,
        :class:`BusyError` (the lease was lost: nothing is published)."""
        from weenv.packaging.builder import _remove_work

        store = self.store
        with buildcache.store_lock(self.paths, exclusive=False), Lease(store, what=f"e2b build {self.name}") as lease:
            self.lease = lease
            self.store = self.session.store = LeasedStore(store, lease)
            self.work.mkdir(parents=True)
            try:
                outcome = self._build()
            finally:
                try:
                    self.session.close()
                finally:
                    _remove_work(self.work)
                    self.store = self.session.store = store
            if publish is not None:
                lease.check()
                publish(outcome)
            return outcome

    def _build(self) -> BuildOutcome:
        spec, log = self.spec, self.log
        ran: list[str] = []
        cached: list[str] = []
        key, state, ctx = self._base(ran, cached)
        steps: list[tuple[str, Step]] = [(str(i), s.check()) for i, s in enumerate(spec.steps, 1)]
        if spec.from_image is not None:
            steps.insert(0, ("base", Step(type="USER", args=[DEFAULT_USER, "true"])))
        forced = spec.force
        total = len(spec.steps)
        for label, step in steps:
            self.session.check()
            key = step_key(key, step)
            forced = forced or step.force
            where = f"[builder {label}/{total}] {step.describe()}"
            if step.type == "ENV":
                try:
                    ctx = advance(ctx, step)  # bounded: the base's variables may make it pass its limits
                except InvalidInputError as exc:
                    raise StepFailedError(f"step {label} ({step.describe()[:200]}): {exc}", step=label) from exc
                log(f"{where}", step=label)
                continue
            hit = None if forced else _lookup(self.store, self.lease, key, advance(ctx, step).user)
            if hit is not None:
                state = replace(hit[0], account=replace(hit[0].account, name=advance(ctx, step).user))
                ctx = advance(ctx, step)
                log(f"CACHED {where}", step=label)
                cached.append(label)
                continue
            log(where, step=label)
            t0 = time.monotonic()
            try:
                state = self._execute(label, step, ctx, state, key)
            except (StepFailedError, BuildCancelledError):
                raise
            except InvalidInputError as exc:
                raise StepFailedError(f"step {label} ({step.describe()}): {exc}", step=label) from exc
            ctx = advance(ctx, step)
            _record(self.store, key, state)
            ran.append(label)
            log(f"{where}: done in {time.monotonic() - t0:.1f} s", step=label)
        sudo = self._has_sudo(state)
        self.session.drop()
        return self._finish(state, ctx, ran, cached, sudo)

    def _has_sudo(self, state: _State) -> bool:
        """Whether the built tree lets its (non-root) user run ``sudo``, as E2B's
        templates do: a setuid ``/usr/bin/sudo`` and a rule ``/etc/sudoers.d/USER``
        (``USER name true``).  Then the template asks for ``runtime.sudo``
        (environments in a user namespace, README's "Security model")."""
        account = state.account
        if account.uid == 0:
            return False
        key = (state.groups, account.name)
        with _SUDO_LOCK:
            if key in _SUDO_ANSWERS:
                _SUDO_ANSWERS.move_to_end(key)
                return _SUDO_ANSWERS[key]
        self.session.env(state.groups)
        fs = self.session.fs()
        try:
            answer = fs.exists(f"/etc/sudoers.d/{account.name}") and bool(fs.stat("/usr/bin/sudo").mode & 0o4000)
        except (NotFoundError, InvalidInputError):
            answer = False
        with _SUDO_LOCK:
            _SUDO_ANSWERS[key] = answer
            while len(_SUDO_ANSWERS) > MAX_SUDO_ANSWERS:
                _SUDO_ANSWERS.popitem(last=False)
        return answer

    def _base(self, ran: list[str], cached: list[str]) -> tuple[str, _State, Context]:
        spec, log = self.spec, self.log
        if (spec.from_image is None) == (spec.from_template is None):
            raise StepFailedError("exactly one of fromImage and fromTemplate must be given", step="base")
        if spec.from_template is not None:

            def named() -> str | None:
                try:
                    return load_template(self.store, spec.from_template)[0]
                except NotFoundError:
                    return None

            digest = _reuse(self.store, self.lease, named)  # the build relies on its groups until it publishes
            if digest is None:
                raise StepFailedError(
                    f"fromTemplate {spec.from_template!r}: no such template (or not all its "
                    "groups and chunks are stored)",
                    step="base",
                )
            _, manifest = load_template(self.store, digest)
            env = dict(manifest.runtime.env)
            home = env.pop("HOME", "/")
            user = env.pop("USER", manifest.runtime.user.split(":")[0])
            uid, gid = parse_user(manifest.runtime.user)
            key = hashlib.sha256(f"{FORMAT}\0template\0{digest}".encode()).hexdigest()
            log(f"[builder base] FROM template {spec.from_template} ({digest[:19]})", step="base")
            state = _State(tuple(manifest.groups), Account(user, uid, gid, home))
            return key, state, Context(user=user, workdir=manifest.runtime.working_dir, env=env)
        try:
            ref = docker_reference(spec.from_image)
            digest = image_digest(ref)
        except (NotFoundError, InvalidInputError, RuntimeFailedError, ToolMissingError) as exc:
            raise StepFailedError(str(exc), step="base") from exc
        key = hashlib.sha256(f"{FORMAT}\0image\0{ref}\0{digest}".encode()).hexdigest()
        hit = _lookup(self.store, self.lease, key, "root")
        if hit is not None:
            log(f"CACHED [builder base] FROM {ref}", step="base")
            cached.append("base")
            return key, hit[0], Context(env=hit[1])
        log(f"[builder base] FROM {ref}: importing", step="base")
        from weenv.packaging.importer import import_image

        try:
            result = import_image(
                f"docker://{ref}",
                self.store.inner,
                name=f"e2b-base-{key[:24]}",
                workdir=self.work,
                progress=Progress(lambda m: log(m, step="base")),
            )
        except (NotFoundError, InvalidInputError, RuntimeFailedError) as exc:
            raise StepFailedError(f"fromImage {ref}: {exc}", step="base") from exc
        self.session.check()
        env = {k: v for k, v in result.template.runtime.env.items() if k not in ("HOME", "USER")}
        state = _State(tuple(result.template.groups), ROOT)
        _record(self.store, key, state, env)
        if _lookup(self.store, self.lease, key, "root") is None:  # the lease names the import's groups from here on
            raise StepFailedError(f"fromImage {ref}: its import was deleted from the store meanwhile", step="base")
        ran.append("base")
        return key, state, Context(env={k: v for k, v in env.items() if k != "PATH" or v != DEFAULT_PATH})

    def _execute(self, label: str, step: Step, ctx: Context, state: _State, key: str) -> _State:
        s = self.session
        version = key[:32]
        if step.type == "USER":
            s.env(state.groups)
            account = find_account(s.fs(), step.args[0])
            if account is not None:
                return replace(state, account=account)
            account = create_account(s.fs(), step.args[0], sudo=len(step.args) > 1 and step.args[1] == "true")
            self.log(f"created user {account.name} (uid {account.uid}, home {account.home})", step=label)
            return self._grown(state, s.collect(version), account)
        if step.type == "WORKDIR":
            s.env(state.groups)
            if not make_workdir(s.fs(), workdir_path(ctx, step.args[0]), state.account):
                return state
            return self._grown(state, s.collect(version), state.account)
        if step.type == "COPY":
            upload = self.files(step.files_hash or "")
            if upload is None:
                raise StepFailedError(
                    f"step {label} ({step.describe()}): its files (filesHash {step.files_hash}) were never "
                    "uploaded (GET /templates/{id}/files/{hash}, then PUT the tar to the link)",
                    step=label,
                )
            stage = self.work / f"copy-{label}"
            stage.mkdir()
            try:
                (stage / "files").mkdir()
                unpack_upload(upload, stage / "files", step)  # the files the step's filesHash names, or refused
                s.env(state.groups, ROOT.ids)
                owner = state.account
                if len(step.args) > 2 and step.args[2]:
                    owner = find_account(s.fs(), step.args[2])
                    if owner is None:
                        raise InvalidInputError(f"owner {step.args[2]!r} is not a user of the tree")
                into = copy_archive(stage / "files", step, ctx, owner, state.account.home, stage / "copy.tar")
                inside = f"/tmp/.weenv-copy-{secrets.token_hex(6)}.tar"
                with open(stage / "copy.tar", "rb") as src, s.fs().open_write(inside, 0o600) as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
                script = (
                    'set -e; mkdir -p "$1"; tar -xf "$2" -C "$1" --no-overwrite-dir --keep-directory-symlink '
                    '--numeric-owner --same-permissions; rm -f "$2"'
                )
                code, _, tail = s.run(
                    ["/bin/sh", "-c", script, "copy", into, inside],
                    {"PATH": DEFAULT_PATH},
                    "/",
                    lambda line: self.log(line, step=label, output=True),
                )
                if code != 0:
                    raise StepFailedError(
                        f"step {label} ({step.describe()}): extracting the files into {into} "
                        f"failed (exit {code}; the image needs tar):\n" + "\n".join(tail),
                        step=label,
                    )
            finally:
                shutil.rmtree(stage, ignore_errors=True)
            return self._grown(state, s.collect(version), state.account)
        return self._run_step(label, step, ctx, state, version)

    def _run_step(self, label: str, step: Step, ctx: Context, state: _State, version: str) -> _State:
        s = self.session
        user = step.args[1] if len(step.args) > 1 and step.args[1] else ctx.user
        if user == ctx.user:
            account = state.account
        elif user == "root":
            account = ROOT
        else:
            s.env(state.groups)
            found = find_account(s.fs(), user)
            if found is None:
                raise InvalidInputError(f"user {user!r} is not in the tree's /etc/passwd")
            account = found
        s.env(state.groups, account.ids)
        fs = s.fs()
        cwd = ctx.workdir or account.home
        if not fs.exists(cwd):
            cwd = "/"
        env = {"PATH": DEFAULT_PATH, **ctx.env, "HOME": account.home, "USER": account.name}
        code, timed_out, tail = s.run(
            ["/bin/sh", "-c", "exec 2>&1\n" + step.args[0]],
            env,
            cwd,
            lambda line: self.log(line, step=label, output=True),
        )
        if code != 0 or timed_out:
            what = f"timed out after {RUN_TIMEOUT_S:g} s" if timed_out else f"exited {code}"
            out = "\n".join(tail)
            raise StepFailedError(
                f"step {label} ({step.describe()}) {what}" + (f":\n{out}" if out else ""), step=label, output=out
            )
        refreshed = find_account(fs, ctx.user) or state.account
        return self._grown(state, s.collect(version), refreshed)

    @staticmethod
    def _grown(state: _State, digest: str | None, account: Account) -> _State:
        groups = state.groups if digest is None else (*state.groups, digest)
        return _State(groups, account)

    def _finish(self, state: _State, ctx: Context, ran: list[str], cached: list[str], sudo: bool) -> BuildOutcome:
        spec = self.spec
        account = state.account
        env = {"PATH": DEFAULT_PATH, "LANG": "C.UTF-8", **ctx.env, "HOME": account.home, "USER": ctx.user}
        runtime = RuntimeConfig(
            env=env,
            working_dir=ctx.workdir or account.home or "/",
            user=account.ids,
            resources=spec.resources,
            start_command=spec.start_command,
            ready_command=spec.ready_command,
            sudo=sudo,
        )
        manifest = TemplateManifest(name=self.name, groups=list(state.groups), runtime=runtime)
        digest = self.store.put_manifest(canonical_json(manifest))
        self.log(
            f"[builder finalize] template {self.name}: {len(state.groups)} groups, user {ctx.user}, "
            f"{len(ran)} steps run, {len(cached)} from the cache, {self.session.started} build environments",
            step="finalize",
        )
        return BuildOutcome(digest, manifest, ran, cached)
