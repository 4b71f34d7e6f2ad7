"""E2B's list pages: ``limit`` items from the start ``nextToken`` names, the
next page's token in the ``X-Next-Token`` header (none on the last page).  A
token is the index of the page's first item, as decimal digits."""

from __future__ import annotations

from starlette.datastructures import QueryParams
from starlette.responses import JSONResponse

from weenv.errors import InvalidInputError

NEXT_TOKEN_HEADER = "x-next-token"


def page_start(token: str | None) -> int:
    """The index a ``nextToken`` names (0 without one).  Raises :class:`InvalidInputError` for one that is not digits."""
    if not token:
        return 0
    if not token.isdigit():
        raise InvalidInputError(f"bad nextToken {token!r}")
    return int(token)


def next_token_of(start: int, limit: int, total: int) -> str | None:
    """The token of the page after ``items[start : start + limit]`` of ``total`` items, None after the last."""
    return str(start + limit) if start + limit < total else None


def page_of(query: QueryParams, *, max_limit: int) -> tuple[int, int]:
    """``(start, limit)`` of the page ``query`` asks (``limit``, default 100, at
    most ``max_limit``; ``nextToken``: the start).  Raises :class:`InvalidInputError`."""
    limit_raw = query.get("limit", "100")
    if not limit_raw.isdigit() or not 1 <= int(limit_raw) <= max_limit:
        raise InvalidInputError(f"limit: {limit_raw!r} is not a number from 1 to {max_limit}")
    return page_start(query.get("nextToken")), int(limit_raw)


def page_answer(items: list, start: int, limit: int) -> JSONResponse:
    """``items[start : start + limit]``, ``X-Next-Token`` naming the next page if there is one."""
    response = JSONResponse(items[start : start + limit])
    token = next_token_of(start, limit, len(items))
    if token is not None:
        response.headers[NEXT_TOKEN_HEADER] = token
    return response
