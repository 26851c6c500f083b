"""A small memoising decorator with hit/miss statistics."""

from __future__ import annotations

import functools
from typing import Any, Callable


def memoize(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Cache ``fn``'s results by its arguments (which must be hashable).

    The wrapper has ``cache_info()`` -> ``{"hits": .., "misses": .., "size": ..}``
    and ``cache_clear()``.
    """
    cache: dict[tuple, Any] = {}
    stats = {"hits": 0, "misses": 0}

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        key = args + tuple(kwargs)
        try:
            result = cache[key]
        except KeyError:
            stats["misses"] += 1
            result = cache[key] = fn(*args, **kwargs)
        else:
            stats["hits"] += 1
        return result

    def cache_info() -> dict[str, int]:
        return {**stats, "size": len(cache)}

    def cache_clear() -> None:
        cache.clear()
        stats.update(hits=0, misses=0)

    wrapper.cache_info = cache_info  # type: ignore[attr-defined]
    wrapper.cache_clear = cache_clear  # type: ignore[attr-defined]
    return wrapper
