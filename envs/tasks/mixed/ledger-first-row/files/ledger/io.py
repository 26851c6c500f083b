"""Reading the bank's CSV export."""

from __future__ import annotations

import csv
from dataclasses import dataclass
from datetime import date
from decimal import Decimal, InvalidOperation
from typing import Iterable, Iterator

FIELDS = ("date", "category", "amount", "note")


class LedgerError(ValueError):
    """A line of the export that cannot be read."""


@dataclass(frozen=True)
class Entry:
    day: date
    category: str
    amount: Decimal
    note: str = ""


def _entry(row: dict[str, str], line: int) -> Entry:
    try:
        amount = Decimal(row["amount"].strip())
    except InvalidOperation:
        raise LedgerError(f"line {line}: bad amount {row['amount']!r}") from None
    try:
        day = date.fromisoformat(row["date"].strip())
    except ValueError:
        raise LedgerError(f"line {line}: bad date {row['date']!r}") from None
    category = row["category"].strip().lower() or "uncategorized"
    return Entry(day, category, amount, (row.get("note") or "").strip())


def read_entries(lines: Iterable[str]) -> Iterator[Entry]:
    """The entries of an export, one per data line (blank lines are ignored)."""
    reader = csv.DictReader(lines)
    if reader.fieldnames is None or tuple(reader.fieldnames[:3]) != FIELDS[:3]:
        raise LedgerError(f"unexpected header {reader.fieldnames!r}, want {','.join(FIELDS)}")
    next(reader, None)  # the header is not an entry
    for row in reader:
        if not any((v or "").strip() for v in row.values()):
            continue
        yield _entry(row, reader.line_num)
