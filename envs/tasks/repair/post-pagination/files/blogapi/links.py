"""Navigation links for a paginated listing."""

from __future__ import annotations

from urllib.parse import urlencode

from blogapi.paginate import Page


def page_window(current: int, pages: int, width: int = 5) -> list[int]:
    """Up to ``width`` consecutive page numbers around ``current``, within 1..pages."""
    width = min(width, pages)
    start = max(1, current - width // 2)
    start = min(start, pages - width + 1)
    return list(range(start, start + width))


def page_url(base: str, number: int, per_page: int) -> str:
    return f"{base}?{urlencode({'page': number, 'per_page': per_page})}"


def nav_links(page: Page, base: str) -> dict[str, object]:
    """``next``/``prev`` URLs (None at the ends) and the numbered window."""
    return {
        "prev": page_url(base, page.number - 1, page.per_page) if page.has_prev else None,
        "next": page_url(base, page.number + 1, page.per_page) if page.has_next else None,
        "window": [
            {"page": n, "url": page_url(base, n, page.per_page), "current": n == page.number}
            for n in page_window(page.number, page.pages)
        ],
    }
