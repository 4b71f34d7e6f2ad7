"""weenv's error answers: ``{"error": {"kind": KIND, "message": TEXT}}`` with
the status of its kind (:data:`STATUS`), as the node's ``/v1`` and the
cluster gateway's answer them (E2B's faces answer their own ``{"code", "message"}``)."""

from __future__ import annotations

import json

from fastapi.responses import JSONResponse

STATUS = {
    "not_found": 404,
    "invalid_input": 400,
    "unknown_user": 400,
    "pseudo_file": 400,
    "network_forbidden": 403,
    "authentication": 401,
    "timeout": 408,
    "output_limit": 413,
    "too_large": 413,
    "digest_mismatch": 502,
    "content_limit": 502,
    "mount": 500,
    "runtime": 500,
    "tool_missing": 500,
    "capacity": 503,
    "closed": 503,
    "busy": 409,
    "state": 409,
    "broken": 502,
    "cgroup": 500,
    "limit_refused": 409,
    "disk_full": 507,
    "store_unavailable": 503,
}


class NamesJSONResponse(JSONResponse):
    """JSON with every non-ASCII character escaped (``ensure_ascii``), so a name
    that is not UTF-8 (a ``str`` holding surrogate escapes, as ``os.fsdecode``
    makes it) is sent as ``\\udcXX`` escapes instead of failing to encode."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def error_response(kind: str, message: str, status: int | None = None) -> JSONResponse:
    headers = {"www-authenticate": "Bearer"} if kind == "authentication" else None
    # NamesJSONResponse: a message may name a path that is not UTF-8
    return NamesJSONResponse(
        status_code=status or STATUS.get(kind, 500),
        content={"error": {"kind": kind, "message": message}},
        headers=headers,
    )


def describe_errors(errors) -> str:
    """Pydantic's validation errors as one line: ``body.timeout: Input should be greater than 0``."""
    parts = []
    for e in errors[:5]:
        where = ".".join(str(x) for x in e.get("loc", ()) if x != "body") or "body"
        parts.append(f"{where}: {e.get('msg', 'invalid')}")
    more = f" (+{len(errors) - 5} more)" if len(errors) > 5 else ""
    return "; ".join(parts) + more
