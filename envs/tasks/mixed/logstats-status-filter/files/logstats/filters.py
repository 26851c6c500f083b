"""Filters over hits; each takes hits and returns the hits it keeps, lazily."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator

from logstats.parse import Hit


def by_method(hits: Iterable[Hit], method: str) -> Iterator[Hit]:
    """Hits with this HTTP method (any case)."""
    want = method.upper()
    return (h for h in hits if h.method == want)


def by_prefix(hits: Iterable[Hit], prefix: str) -> Iterator[Hit]:
    """Hits whose path starts with ``prefix``."""
    return (h for h in hits if h.path.startswith(prefix))


def top_paths(hits: Iterable[Hit], n: int = 10) -> list[tuple[str, int]]:
    """The ``n`` most requested paths, ties in path order."""
    counts = Counter(h.path for h in hits)
    return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:n]
