"""Template resolution: a template name or digest to the digest a create
starts, with its manifests (containerd's image service, for weenv's templates).

The store names a template's digest; the node remembers the digest each name
last resolved to (:class:`~weenv.node.manifests.KnownNames`) and keeps the
manifests it read (:class:`~weenv.node.manifests.NodeManifests`), so a warm
create asks the store one question, overlapped with the create, and a create
during a store outage starts the last known digest (:meth:`Resolver.resolve`
gives the staleness rule).  Template listing for clients is here too
(:meth:`Resolver.templates`, :meth:`Resolver.template`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Literal

from weenv.api.models import TemplateInfo
from weenv.errors import NotFoundError, StoreUnavailableError
from weenv.formats.manifest import GroupManifest, TemplateManifest, check_digest
from weenv.node.manifests import KnownNames, NodeManifests
from weenv.packaging.group import load_group
from weenv.packaging.template import load_template
from weenv.store import Store

log = logging.getLogger(__name__)

RESOLVE_WAIT_S = 1.0
"""Seconds from the start of a store's lookup of a template name after which a
create that is otherwise ready starts the name's last known digest (see :meth:`Resolver.resolve`)."""


@dataclass
class Resolved:
    """The digest a create starts and who named it (:meth:`Resolver.resolve`)."""

    digest: str
    asking: Future | None = None
    """The store's answer for the name, under way (checked by :meth:`Resolver.confirm`); None: the store named it."""
    source: Literal["store", "node"] = "store"
    """``node``: the store did not answer; the node's last known digest (or manifest) is started."""
    age_s: float | None = None
    """With ``node`` for a name: seconds since the store last named ``digest``."""


class RefMoved(Exception):
    """A create started a template name's previous digest; the name moved."""


class Resolver:
    """Template names to digests and manifests, for one node."""

    def __init__(self, store: Store, manifests: NodeManifests, names: KnownNames):
        self.store = store
        self.manifests = manifests
        self.names = names
        self._lock = threading.Lock()
        self._asking: dict[str, Future] = {}  # template name -> the store lookup under way

    def resolve(self, template: str) -> Resolved:
        """The digest to create ``template`` from: the one the store names now;
        or, for a name this node resolved before (also before a restart:
        :class:`~weenv.node.manifests.KnownNames`), that digest (started
        speculatively) with ``asking``, a Future of the store's answer, asked
        in a thread (one per name at a time): an ``oci://`` resolve is a
        registry request (~3 ms), which then overlaps the create instead of
        preceding it.  :meth:`confirm` checks the guess before the create
        completes.

        Staleness rule: the store is asked on every create, and its answer wins
        whenever it gives one (a moved name restarts the create on the new
        digest; a deleted one fails it).  The node's last known digest is used
        *instead* only when the store fails with :class:`StoreUnavailableError`
        (unreachable, timed out, or known to be down) or has not answered
        :data:`RESOLVE_WAIT_S` after it was asked and the create is otherwise
        ready; the create then logs a warning naming the digest and when the
        store last named it, and its answer says so (``timing.resolved_from``
        ``"node"``, ``timing.resolved_age_s``).  A store outage so stops publishing, not
        starting, for templates whose manifests and chunks are on the node.  A
        name this node never resolved, or a digest whose manifest it lacks,
        fails with :class:`StoreUnavailableError`.  Such a digest is not asked
        about here: :meth:`load` fetching its manifest is the check (one store
        round trip fewer on a cold create), and raises as the store's would.
        A name this node does not know, asked by several creates at once, is
        looked up once (the others wait for that answer)."""
        if template.startswith("sha256:"):
            if not self.manifests.has(check_digest(template)):
                # load() fetching its manifest next is the check (~3.5 ms less from a loopback registry)
                return Resolved(template)
            try:
                return Resolved(self.store.resolve("templates", template))
            except StoreUnavailableError as exc:
                if not self.manifests.has(template):
                    raise
                log.warning("template %s: the store did not answer (%s); its manifest is on the node", template, exc)
                return Resolved(template, source="node")
        known = self.names.get(template)
        if known is None:
            try:
                digest = self._answer_now(template)  # one lookup for the node's creates of it at once
            except StoreUnavailableError as exc:
                raise StoreUnavailableError(
                    f"cannot resolve template {template!r}: {exc}; this node never started it, "
                    "so it cannot without the store"
                ) from exc
            self.names.remember(template, digest)
            return Resolved(digest)
        return Resolved(known[0], asking=self._ask(template))

    def check(self, template: str, resolved: Resolved) -> None:
        """Before a create of ``resolved`` completes: raise :class:`RefMoved`
        if the store named ``template`` another digest meanwhile (the create is
        undone and restarted on it), or the store's error (see :meth:`confirm`)."""
        if resolved.asking is not None and self.confirm(template, resolved) != resolved.digest:
            raise RefMoved(template)

    def confirm(self, template: str, resolved: Resolved) -> str:
        """What the store named ``template`` during this create (remembered for
        the next one); raises the store's error (:class:`NotFoundError` if the
        ref is gone: forgotten), which undoes the create.  When the store is
        unavailable or slow (:meth:`resolve`'s staleness rule): the name's
        last known digest, with a warning, and ``resolved`` says so (``source``, ``age_s``)."""
        asking = resolved.asking
        try:
            digest = asking.result(timeout=max(0.0, asking.asked + RESOLVE_WAIT_S - time.monotonic()))
        except NotFoundError:
            self.names.forget(template)
            raise
        except (StoreUnavailableError, FutureTimeout) as exc:
            known = self.names.get(template)
            if known is None:
                raise
            why = str(exc) or f"no answer within {RESOLVE_WAIT_S:g} s"
            resolved.source, resolved.age_s = "node", max(0.0, time.time() - known[1])
            log.warning(
                "template %r: the store did not answer (%s); starting %s, which it named %.0f s ago",
                template,
                why,
                known[0],
                resolved.age_s,
            )
            return known[0]
        self.names.remember(template, digest)
        return digest

    def moved(self, template: str, resolved: Resolved) -> str | None:
        """After a failed create of ``resolved.digest`` guessed for ``template``: the
        digest the name has now if that is another (the failure may be the
        old one's, e.g. its manifests collected), else None."""
        if resolved.asking is None:
            return None
        try:
            current = self.confirm(template, resolved)
        except Exception:  # the store's own error: the create's says more
            return None
        return current if current != resolved.digest else None

    def remember(self, template: str, digest: str) -> None:
        """Take ``digest`` as what ``template`` last resolved to."""
        self.names.remember(template, digest)

    def load(
        self, digest: str, groups_hint: Sequence[str] = (), offered: Mapping[str, bytes] | None = None
    ) -> tuple[TemplateManifest, list[GroupManifest]]:
        """The manifest and group manifests of the template ``digest`` (which the
        caller resolved from a name in the store on this create: a ref may
        move), from the node when it has them (:mod:`weenv.node.manifests`:
        content-addressed, so a warm start asks the store one question, the
        resolve, instead of 2 + 2 per group, and none when the store is down),
        else from the store.  Raises as :func:`load_template` and :func:`load_group` do.

        ``groups_hint``: group digests the template is expected to list (its
        prefetch profile's, known before its manifest): when the node lacks
        the template's manifest, the hinted group manifests it lacks are
        fetched at the same time as it, not after it (one registry round
        trip less on a cold start, ~5-15 ms).  A wrong hint costs only its
        fetches (their failures are ignored; the groups the manifest lists
        are what is returned, fetched as without a hint).

        ``offered``: group manifests by digest that the profile carries
        (:meth:`weenv.node.data.prefetch.Prefetcher.known_manifests`): taken
        instead of fetched once checked (:meth:`NodeManifests.adopt`; one that
        fails the check is fetched from the store), while the template's own
        manifest is fetched (that fetch stays the check that the template
        exists).  A cold start of a template whose profile the node holds so
        reads one manifest from the store, not 1 + one per group (three reads
        at once took ~10 ms from a loopback registry on 2 cores, one ~2.7 ms)."""
        offered = offered or {}
        missing = [g for g in dict.fromkeys(groups_hint) if not self.manifests.has(g)]
        if not missing or self.manifests.has(digest):
            manifest = self.manifests.template(digest)
            self._adopt(manifest.groups, offered)
            return manifest, self.manifests.groups(manifest.groups)
        fetch = [g for g in missing if g not in offered]
        with ThreadPoolExecutor(min(len(fetch), 8) + 1, thread_name_prefix="weenv-manifest-hint") as pool:
            template = pool.submit(self.manifests.template, digest)
            hinted = [pool.submit(self.manifests.group, g) for g in fetch]
            self._adopt(missing, offered)  # parsed here while the store answers
            manifest = template.result()
            for f in hinted:  # the template's own groups among them arrive here; a wrong hint is ignored
                try:
                    f.result()
                except Exception as exc:
                    log.debug("hinted group manifest of %s: %s", digest, exc)
        self._adopt(manifest.groups, offered)  # groups the hint did not name (a profile of other groups)
        return manifest, self.manifests.groups(manifest.groups)

    def _adopt(self, digests: Sequence[str], offered: Mapping[str, bytes]) -> None:
        for g in dict.fromkeys(digests):
            if g in offered:
                self.manifests.adopt(g, offered[g])

    def clear(self) -> None:
        """Forget the manifests and names the node knows (for cold-start measurements)."""
        self.manifests.clear()
        self.names.clear()

    def templates(self) -> list[TemplateInfo]:
        """The store's templates by name (name and digest only)."""
        return [TemplateInfo(name=n, digest=d) for n, d in sorted(self.store.list_refs("templates").items())]

    def template(self, name: str) -> TemplateInfo:
        """One template (name or digest) with its groups, runtime and sizes; :class:`NotFoundError` if unknown."""
        digest, m = load_template(self.store, name)
        groups = [load_group(self.store, g) for g in m.groups]
        return TemplateInfo(
            name=m.name,
            digest=digest,
            version=m.version,
            groups=list(m.groups),
            runtime=m.runtime,
            image_bytes=sum(g.image_size for g in groups),
            stored_bytes=sum(g.stored_size for g in groups),
        )

    def _ask(self, template: str) -> Future:
        """The store's answer for name ``template``, asked in a thread unless a
        lookup of it is under way already (shared: a frozen store holds one
        thread per name, not one per create).  ``future.asked`` is its start (monotonic)."""
        future, mine = self._lookup(template)
        if mine:
            threading.Thread(target=self._answer, args=(template, future), name="weenv-resolve", daemon=True).start()
        return future

    def _answer_now(self, template: str) -> str:
        """The store's answer for name ``template``, asked in this thread unless a
        lookup of it is under way already (then that one's answer, or its error)."""
        future, mine = self._lookup(template)
        if mine:
            self._answer(template, future)
        return future.result()

    def _lookup(self, template: str) -> tuple[Future, bool]:
        """The lookup of name ``template`` under way, or a new one (True: the caller asks the store)."""
        with self._lock:
            future = self._asking.get(template)
            if future is not None:
                return future, False
            future = self._asking[template] = Future()
            future.asked = time.monotonic()
            return future, True

    def _answer(self, template: str, future: Future) -> None:
        try:
            future.set_result(self.store.resolve("templates", template))
        except BaseException as exc:
            future.set_exception(exc)
        finally:
            with self._lock:
                if self._asking.get(template) is future:
                    del self._asking[template]
