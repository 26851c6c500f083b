"""Exponential backoff with a ceiling."""

from __future__ import annotations

from collections.abc import Iterator


def delays(base: float, factor: float, cap: float, attempts: int) -> Iterator[float]:
    """The sleeps between ``attempts`` tries (``attempts - 1`` of them): base, base * factor, ..., at most cap each."""
    if base < 0 or cap < 0 or factor < 1 or attempts < 1:
        raise ValueError("want base >= 0, cap >= 0, factor >= 1 and attempts >= 1")
    delay = min(base, cap)
    for _ in range(attempts - 1):
        yield delay
        delay *= factor
