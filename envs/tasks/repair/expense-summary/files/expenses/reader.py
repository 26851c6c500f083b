"""Reading the card portal's CSV export, one expense at a time."""

from __future__ import annotations

import csv
from dataclasses import dataclass
from datetime import date
from decimal import Decimal, InvalidOperation
from typing import Iterator, TextIO

COLUMNS = ("date", "category", "amount", "note")


@dataclass(frozen=True)
class Expense:
    day: date
    category: str
    amount: Decimal
    note: str = ""


def read_expenses(stream: TextIO) -> Iterator[Expense]:
    """Yield the expenses of a CSV export, lazily (exports can be large).

    Categories are normalised (``" Travel "`` -> ``"travel"``); rows with
    an unparseable date or amount raise ValueError naming the line.
    """
    reader = csv.DictReader(stream)
    missing = [c for c in COLUMNS if c not in (reader.fieldnames or ())]
    if missing:
        raise ValueError(f"missing columns: {', '.join(missing)}")
    for row in reader:
        try:
            day = date.fromisoformat(row["date"].strip())
            amount = Decimal(row["amount"].strip())
        except (ValueError, InvalidOperation):
            raise ValueError(f"line {reader.line_num}: bad row {row!r}") from None
        yield Expense(day, row["category"].strip().lower() or "other", amount, row["note"].strip())
