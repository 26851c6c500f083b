"""Totals by category and by month."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from decimal import Decimal
from typing import Iterable

from expenses.reader import Expense


@dataclass(frozen=True)
class Summary:
    count: int
    total: Decimal
    by_category: dict[str, Decimal]
    by_month: dict[str, Decimal]
    largest: Expense | None

    def render(self) -> str:
        lines = [f"{self.count} expenses, total {self.total:.2f}"]
        for cat, amount in sorted(self.by_category.items(), key=lambda kv: (-kv[1], kv[0])):
            share = amount / self.total * 100 if self.total else Decimal(0)
            lines.append(f"  {cat:<14}{amount:>10.2f}  {share:5.1f}%")
        if self.largest is not None:
            lines.append(f"largest: {self.largest.amount:.2f} on {self.largest.day} ({self.largest.note})")
        return "\n".join(lines)


def _by(expenses: Iterable[Expense], key) -> dict[str, Decimal]:
    out: dict[str, Decimal] = defaultdict(Decimal)
    for e in expenses:
        out[key(e)] += e.amount
    return dict(sorted(out.items()))


def summarize(expenses: Iterable[Expense]) -> Summary:
    """Summarise any iterable of expenses: a list, or read_expenses() straight from a file."""
    total = sum((e.amount for e in expenses), Decimal("0.00"))
    by_category = _by(expenses, lambda e: e.category)
    by_month = _by(expenses, lambda e: e.day.strftime("%Y-%m"))
    count = sum(1 for _ in expenses)
    largest = max(expenses, key=lambda e: e.amount, default=None)
    return Summary(count, total, by_category, by_month, largest)
