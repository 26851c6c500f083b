"""Text helpers: slugs for URLs, excerpts for the index page, reading time."""

from __future__ import annotations

import math
import re

#: Anything that is not a lowercase ASCII letter or digit separates words in a slug.
_SEPARATORS = re.compile(r"[^a-z0-9]+")
WORDS_PER_MINUTE = 220


def slugify(title: str, max_len: int = 60) -> str:
    """The URL slug of a title: lowercase ASCII words joined by dashes, at most ``max_len`` long."""
    slug = _SEPARATORS.sub("-", title.lower()).strip("-")
    return slug[:max_len].rstrip("-")


def excerpt(body: str, words: int = 30) -> str:
    """The first ``words`` words of a post's first paragraph, with an ellipsis if it was cut."""
    first = body.strip().split("\n\n", 1)[0]
    parts = first.split()
    if len(parts) <= words:
        return " ".join(parts)
    return " ".join(parts[:words]) + " …"


def reading_minutes(body: str) -> int:
    """Whole minutes to read ``body`` (at least 1)."""
    return max(1, math.ceil(len(body.split()) / WORDS_PER_MINUTE))
