"""Combinations, written out recursively so that search can prune early."""

from __future__ import annotations

from typing import Sequence, TypeVar

T = TypeVar("T")


def choose(items: Sequence[T], k: int) -> list[list[T]]:
    """Every way to pick ``k`` of ``items`` (order kept, each item at most once).

    ``choose("abc", 2) == [["a", "b"], ["a", "c"], ["b", "c"]]``; there is
    exactly one way to pick nothing, and no way to pick more than there is.
    """
    if k < 0:
        raise ValueError("k must not be negative")
    if not items:
        return []
    if k == 0:
        return [[]]
    first, rest = items[0], items[1:]
    with_first = [[first, *combo] for combo in choose(rest, k - 1)]
    without_first = choose(rest, k)
    return with_first + without_first
