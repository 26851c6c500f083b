"""Totals over shifts, by person and by UTC calendar day."""

from __future__ import annotations

from collections import defaultdict
from datetime import date, datetime, time, timedelta, timezone
from typing import Iterable

from timesheet.entries import Shift


def hours_by_person(shifts: Iterable[Shift]) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for s in shifts:
        out[s.person] += s.hours
    return {k: round(v, 2) for k, v in sorted(out.items())}


def hours_by_day(shifts: Iterable[Shift]) -> dict[date, float]:
    """Hours worked per UTC day; a shift over midnight UTC is split between the days."""
    out: dict[date, float] = defaultdict(float)
    for s in shifts:
        cursor = s.start
        while cursor < s.end:
            next_midnight = datetime.combine(cursor.date() + timedelta(days=1), time(), tzinfo=timezone.utc)
            chunk_end = min(next_midnight, s.end)
            out[cursor.date()] += (chunk_end - cursor).total_seconds() / 3600
            cursor = chunk_end
    return {k: round(v, 2) for k, v in sorted(out.items())}


def overlaps(shifts: Iterable[Shift]) -> list[tuple[Shift, Shift]]:
    """Pairs of shifts of the same person that overlap in time (double clock-ins)."""
    last: dict[str, Shift] = {}
    found = []
    for s in sorted(shifts):
        prev = last.get(s.person)
        if prev is not None and s.start < prev.end:
            found.append((prev, s))
        if prev is None or s.end > prev.end:
            last[s.person] = s
    return found
