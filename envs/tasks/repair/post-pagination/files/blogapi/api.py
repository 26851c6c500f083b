"""The ``GET /posts`` handler: query parameters in, a JSON-ready dict out."""

from __future__ import annotations

from typing import Mapping

from blogapi.links import nav_links
from blogapi.paginate import paginate

DEFAULT_PER_PAGE = 10
MAX_PER_PAGE = 50


class BadRequest(ValueError):
    """A query parameter the client got wrong (answered with HTTP 400)."""


def _int_param(query: Mapping[str, str], name: str, default: int) -> int:
    raw = query.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise BadRequest(f"{name} must be an integer, not {raw!r}") from None
    if value < 1:
        raise BadRequest(f"{name} must be at least 1")
    return value


def list_posts(posts: list[dict], query: Mapping[str, str], base: str = "/posts") -> dict:
    """One page of ``posts`` (newest first), with paging metadata and links.

    Raises BadRequest for malformed parameters and PageNotFound (HTTP 404)
    for a page past the end.
    """
    number = _int_param(query, "page", 1)
    per_page = min(_int_param(query, "per_page", DEFAULT_PER_PAGE), MAX_PER_PAGE)
    ordered = sorted(posts, key=lambda p: (p["published"], p["id"]), reverse=True)
    page = paginate(ordered, number, per_page)
    return {
        "items": [{"id": p["id"], "title": p["title"]} for p in page.items],
        "page": page.number,
        "pages": page.pages,
        "total": page.total,
        "showing": [page.first_index, page.last_index],
        "links": nav_links(page, base),
    }
