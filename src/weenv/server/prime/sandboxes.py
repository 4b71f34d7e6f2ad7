"""What the prime face adds to the node's environments: a prime ``Sandbox``
view of each, the fields prime keeps that weenv does not (name, image,
labels, kept in the environment's metadata under ``prime.*``), the gateway
token of each sandbox and the idempotency keys of creates.

A sandbox is a weenv environment: its lifetime is the environment's timeout
(``timeout_minutes``), its variables the environment's ``envs``
(``environment_vars`` and ``secrets``), its resources the environment's
(``cpu_cores``, ``memory_gb``, ``disk_size_gb``).  Environments made by other
clients of the node are listed too, with their template as their image.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import json
import threading

from weenv.api.models import EnvironmentInfo

NAME_KEY = "prime.name"
IMAGE_KEY = "prime.image"
LABELS_KEY = "prime.labels"
TOKEN_TTL_S = 86400
"""Seconds a gateway token is announced valid for (the client refreshes it before then)."""
STATUS = {"running": "RUNNING", "paused": "PAUSED", "creating": "PROVISIONING"}
"""weenv environment state -> prime status (any other state: ``ERROR``)."""


def iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.UTC).isoformat().replace("+00:00", "Z")


def labels_of(info: EnvironmentInfo) -> list[str]:
    try:
        labels = json.loads(info.metadata.get(LABELS_KEY, "[]"))
    except ValueError:
        return []
    return [x for x in labels if isinstance(x, str)] if isinstance(labels, list) else []


def status_of(info: EnvironmentInfo) -> str:
    return STATUS.get(info.state, "ERROR")


def view(info: EnvironmentInfo) -> dict:
    """The prime ``Sandbox`` JSON of an environment."""
    r = info.resources
    return {
        "id": info.id,
        "name": info.metadata.get(NAME_KEY, info.id),
        "dockerImage": info.metadata.get(IMAGE_KEY, info.template),
        "startCommand": None,
        "cpuCores": r.cpus,
        "memoryGB": r.memory_bytes / (1 << 30),
        "diskSizeGB": r.disk_bytes / (1 << 30),
        "diskMountPath": "/",
        "gpuCount": 0,
        "gpuType": None,
        "vm": True,
        "networkAllowlist": list(info.allow_out) or None,
        "networkDenylist": list(info.deny_out) or None,
        "status": status_of(info),
        "timeoutMinutes": max(1, round(info.timeout_s / 60)),
        "environmentVars": dict(info.envs),
        "labels": labels_of(info),
        "createdAt": iso(info.created_at),
        "updatedAt": iso(info.created_at),
        "startedAt": iso(info.created_at),
        "userId": None,
        "teamId": None,
        "region": None,
    }


class Tokens:
    """Gateway tokens: ``HMAC-SHA256(secret, "prime" + sandbox id)``, nothing
    stored, derived from the daemon's API key so they outlive a restart."""

    def __init__(self, api_key: str):
        self._secret = hmac.new(api_key.encode(), b"weenv prime gateway token", hashlib.sha256).digest()

    def token(self, sandbox_id: str) -> str:
        return hmac.new(
            self._secret, b"prime\0" + sandbox_id.encode(errors="surrogateescape"), hashlib.sha256
        ).hexdigest()

    def matches(self, sandbox_id: str, presented: str | None) -> bool:
        return hmac.compare_digest((presented or "").encode(errors="surrogateescape"), self.token(sandbox_id).encode())


class IdempotencyKeys:
    """The sandbox each create's ``idempotency_key`` made (the client retries a
    create whose answer it lost with the same key: it gets the same sandbox).
    Kept in memory, the most recent :attr:`limit`."""

    def __init__(self, limit: int = 65536):
        self.limit = limit
        self._ids: dict[str, str] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()

    def lock(self, key: str) -> threading.Lock:
        with self._lock:
            return self._locks.setdefault(key, threading.Lock())

    def get(self, key: str) -> str | None:
        with self._lock:
            return self._ids.get(key)

    def put(self, key: str, sandbox_id: str) -> None:
        with self._lock:
            self._ids[key] = sandbox_id
            self._locks.pop(key, None)
            while len(self._ids) > self.limit:
                self._ids.pop(next(iter(self._ids)))
