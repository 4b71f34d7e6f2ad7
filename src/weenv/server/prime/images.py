"""A prime sandbox's ``docker_image`` as a weenv template.

An image reference is looked up, in order, as:

1. an E2B template of this daemon (its id, name or ``name:tag``: what
   ``weenv serve``'s E2B template API built);
2. a weenv template of the node's store, by the reference as given, then
   without its tag (``task:latest`` -> ``task``);
3. an image in a registry on this machine's loopback (``127.0.0.1:5000/repo:tag``,
   ``localhost:5000/...``): imported into the store on its first use as
   template ``prime-<name>-<hash of the reference>``, found there afterwards.

Anything else is refused with a :class:`NotFoundError` naming the image and
what weenv looked for: weenv never pulls from a registry off this machine.
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import re
import threading
from collections.abc import Callable

from weenv.errors import (
    InvalidInputError,
    NotFoundError,
    RuntimeFailedError,
    ToolMissingError,
)
from weenv.node.node import Node
from weenv.packaging.template import load_template

log = logging.getLogger(__name__)

MAX_IMAGE_REF = 512
"""Longest image reference accepted, characters."""
_REF_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]*\Z")


def registry_host(image: str) -> str | None:
    """The registry host of ``image`` (``HOST[:PORT]`` before its first ``/``),
    None for a reference without one (``python:3.11``, ``library/ubuntu``)."""
    first, sep, _ = image.partition("/")
    if not sep or not ("." in first or ":" in first or first == "localhost"):
        return None
    return first


def is_loopback_registry(host: str) -> bool:
    """Whether the registry ``HOST[:PORT]`` is on this machine's loopback."""
    name = host.rsplit(":", 1)[0] if host.count(":") == 1 or host.startswith("[") else host
    name = name.strip("[]")
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def imported_name(image: str) -> str:
    """The template name an image of a loopback registry is imported as."""
    repo = image.rsplit("/", 1)[-1].split("@", 1)[0].split(":", 1)[0]
    repo = re.sub(r"[^a-z0-9._-]", "-", repo.lower()).strip("-._")[:40] or "image"
    return f"prime-{repo}-{hashlib.sha256(image.encode()).hexdigest()[:12]}"


class Images:
    """Image references to template refs for one daemon (thread-safe, blocking)."""

    def __init__(self, node: Node, *, resolve: Callable[[str], str | None] | None = None):
        """``resolve``: E2B's template lookup (``Templates.resolve``), if served."""
        self.node = node
        self._resolve = resolve
        self._lock = threading.Lock()
        self._importing: dict[str, threading.Lock] = {}

    def template(self, image: str) -> str:
        """The template (name or digest) ``image`` starts; imports it from a
        loopback registry on first use.  Raises :class:`InvalidInputError` for
        a malformed reference, :class:`NotFoundError` for one weenv cannot find
        or import (the message names it)."""
        if not image or len(image) > MAX_IMAGE_REF or not _REF_RE.match(image):
            raise InvalidInputError(f"docker_image {image[:MAX_IMAGE_REF]!r} is not an image reference")
        if self._resolve is not None:
            try:
                digest = self._resolve(image)
            except NotFoundError as exc:
                raise NotFoundError(f"image {image!r}: {exc}") from None
            if digest:
                return digest
        candidates = [image]
        name, sep, tag = image.rpartition(":")
        if sep and "/" not in tag:
            candidates.append(name)
        for ref in candidates:
            if self._exists(ref):
                return ref
        host = registry_host(image)
        if host is None or not is_loopback_registry(host):
            raise NotFoundError(
                f"image {image!r} is neither a weenv template (looked for {' and '.join(map(repr, candidates))}) "
                "nor in a registry on this machine's loopback: import it (weenv image import) or name a template"
            )
        return self._import(image)

    def _exists(self, ref: str) -> bool:
        try:
            load_template(self.node.store, ref)
        except (NotFoundError, InvalidInputError):
            return False
        return True

    def _import(self, image: str) -> str:
        """Import ``image`` once (concurrent creates of it wait for the first)."""
        name = imported_name(image)
        with self._lock:
            lock = self._importing.setdefault(image, threading.Lock())
        with lock:
            if self._exists(name):
                return name
            from weenv.packaging.importer import import_image

            log.info("importing %s as template %s", image, name)
            try:
                import_image(f"docker://{image}", self.node.store, name=name)
            except (NotFoundError, InvalidInputError, RuntimeFailedError, ToolMissingError) as exc:
                raise NotFoundError(f"image {image!r} could not be imported from its loopback registry: {exc}") from exc
            return name
