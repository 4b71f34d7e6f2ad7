"""Paused environments published to the store, so that any node resumes them.

With ``WEENV_PAUSE_PUBLISH`` on (a cluster's nodes run with it,
:attr:`~weenv.cluster.config.ClusterConfig.publish_paused`), releasing a paused
environment's memory (:meth:`~weenv.node.state.pause.Pauses.release`) also
publishes its file system as snapshot ``paused-<id>``
(:meth:`~weenv.node.state.snapshot.Captures.publish`: its template's groups,
its upper dir on top as one more group), and that top group's ``source``
holds the environment's **record**: its info as it was paused (id, metadata,
variables, resources, network policy, priority, timeout, what its timeout does).

The snapshot is in the store every node reads, so the environment outlives its
node: any node resumes it from there (:meth:`Handoffs.request`, then a create
from the snapshot with the environment's own id, metadata and network policy;
``Node.resume_published``), its first process started anew over its files, as a
memory-released resume on its own node does.  The record is consumed when the
environment runs again, here or elsewhere (its ref deleted: a second resume
finds nothing), and dropped when the environment is destroyed; a node's daemon
that stops (its machine going away) leaves it.  Until then it is a snapshot
like any other (listed, deletable, collected by gc once deleted).

A file written into the environment after its memory was released (the files
API reaches a paused environment) is on its own node only: the published
snapshot holds its files as they were when the memory was released.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable
from pathlib import Path

from pydantic import ValidationError

from weenv.api.models import CreateRequest, EnvironmentInfo, SnapshotInfo
from weenv.errors import InvalidInputError, NotFoundError
from weenv.node.state.fork import request_like
from weenv.node.state.snapshot import Captures
from weenv.node.table import Environment
from weenv.packaging.group import load_group
from weenv.packaging.template import load_template
from weenv.store import Store

log = logging.getLogger(__name__)

PREFIX = "paused-"
"""A published pause's snapshot is named ``paused-<environment id>``."""
RECORD = "paused"
"""The key of the environment's record in its snapshot's top group's ``source`` (JSON)."""


def snapshot_name(env_id: str) -> str:
    return PREFIX + env_id


class Handoffs:
    """Publishing and reading paused environments' records (see the module doc).
    ``enabled``: whether a memory release publishes (``WEENV_PAUSE_PUBLISH``)."""

    def __init__(
        self,
        captures: Captures,
        store: Store,
        *,
        workdir: Path,
        publish_lock: Callable[[], contextlib.AbstractContextManager],
        enabled: bool,
    ):
        self.captures, self.store, self.workdir = captures, store, workdir
        self.publish_lock, self.enabled = publish_lock, enabled

    def publish(self, e: Environment) -> SnapshotInfo:
        """Publish the memory-released ``e`` as snapshot ``paused-<id>`` with its
        record (its capture is dropped after: nothing stays counted on this
        node's disk).  Raises what :meth:`Captures.take` and
        :meth:`Captures.publish` raise; nothing is referenced then."""
        c = self.captures.take(e)
        try:
            return self.captures.publish(
                c,
                self.store,
                snapshot_name(e.info.id),
                workdir=self.workdir,
                publish_lock=self.publish_lock,
                record={RECORD: c.info.model_dump_json(exclude={"timing"})},
            )
        finally:
            self.captures.drop(c)

    def record(self, env_id: str) -> tuple[str, EnvironmentInfo]:
        """``(its snapshot's digest, its info as paused)`` of the published pause
        of ``env_id``.  Raises :class:`NotFoundError` if the store holds none."""
        missing = NotFoundError(
            f"no environment {env_id} was paused with its memory released and published to {self.store.url}"
        )
        try:
            digest, manifest = load_template(self.store, snapshot_name(env_id))
            top = load_group(self.store, manifest.groups[-1])
        except (NotFoundError, InvalidInputError):  # no such ref, or an id no name can hold
            raise missing from None
        raw = top.source.get(RECORD)
        if raw is None or top.source.get("environment") != env_id:
            raise missing
        try:
            return digest, EnvironmentInfo.model_validate({**json.loads(raw), "timing": {}})
        except (ValueError, ValidationError) as exc:
            raise InvalidInputError(
                f"the record of paused environment {env_id} in {self.store.url} cannot be read: {exc}"
            ) from None

    def request(
        self, env_id: str, *, timeout: float | None, metadata: dict[str, str]
    ) -> tuple[str, EnvironmentInfo, CreateRequest]:
        """Its snapshot's digest, its record and the create that resumes the
        published pause of ``env_id`` (its record's fields; ``metadata`` over its
        own; ``timeout``: default its own).  Raises :class:`NotFoundError`,
        :class:`InvalidInputError`."""
        digest, info = self.record(env_id)
        try:
            info = info.model_copy(update={"metadata": {**info.metadata, **metadata}})
            return digest, info, request_like(info, digest, timeout=timeout, on_timeout=info.on_timeout)
        except ValidationError as exc:
            raise InvalidInputError(f"cannot resume environment {env_id}: {exc.errors()[0].get('msg')}") from None

    def consumed(self, env_id: str, digest: str | None = None) -> None:
        """``env_id`` runs again (or was destroyed): its record goes (if it was
        published; ``digest``: only if the ref still holds it).  Errors are logged."""
        try:
            self.store.delete_ref("templates", snapshot_name(env_id), expected=digest)
        except NotFoundError:
            pass
        except Exception as exc:  # the environment runs either way; the record is left to delete by hand
            log.warning("cannot delete paused environment %s's record %s: %s", env_id, snapshot_name(env_id), exc)
