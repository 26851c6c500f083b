"""Shifts: who worked from when to when."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Iterable

from timesheet.clock import parse_timestamp

MAX_SHIFT = timedelta(hours=16)


@dataclass(frozen=True, order=True)
class Shift:
    start: datetime  # aware, UTC
    end: datetime  # aware, UTC
    person: str

    @property
    def duration(self) -> timedelta:
        return self.end - self.start

    @property
    def hours(self) -> float:
        return self.duration.total_seconds() / 3600


def parse_shift(line: str) -> Shift:
    """``alice 2024-03-04T09:00+01:00 2024-03-04T17:30+01:00`` -> Shift."""
    parts = line.split()
    if len(parts) != 3:
        raise ValueError(f"expected 'person start end', got {line!r}")
    person, start_text, end_text = parts
    start, end = parse_timestamp(start_text), parse_timestamp(end_text)
    if end <= start:
        raise ValueError(f"{person}: shift ends before it starts ({line!r})")
    if end - start > MAX_SHIFT:
        raise ValueError(f"{person}: shift longer than {MAX_SHIFT} ({line!r})")
    return Shift(start, end, person)


def parse_sheet(lines: Iterable[str]) -> list[Shift]:
    """Every shift in a sheet, sorted by start; blank lines and # comments are skipped."""
    shifts = []
    for number, line in enumerate(lines, 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            shifts.append(parse_shift(line))
        except ValueError as exc:
            raise ValueError(f"line {number}: {exc}") from None
    return sorted(shifts)
