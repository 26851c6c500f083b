"""Merging closed integer intervals [start, end]."""

from __future__ import annotations


def merge(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Merge overlapping or touching intervals; the result is sorted and disjoint."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(intervals):
        if start > end:
            raise ValueError(f"empty interval [{start}, {end}]")
        if out and start <= out[-1][1] + 1:
            out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def total_length(intervals: list[tuple[int, int]]) -> int:
    """How many integers the intervals cover together."""
    return sum(end - start + 1 for start, end in merge(intervals))
