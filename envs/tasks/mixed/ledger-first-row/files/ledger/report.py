"""Totals per category, and the table the command prints."""

from __future__ import annotations

from collections import defaultdict
from decimal import Decimal
from typing import Iterable

from ledger.io import Entry


def totals_by_category(entries: Iterable[Entry], month: str = "") -> dict[str, Decimal]:
    """Sum of the amounts per category, optionally of one month (``YYYY-MM``), largest first."""
    sums: dict[str, Decimal] = defaultdict(Decimal)
    for e in entries:
        if month and e.day.isoformat()[:7] != month:
            continue
        sums[e.category] += e.amount
    return dict(sorted(sums.items(), key=lambda kv: (-kv[1], kv[0])))


def format_table(totals: dict[str, Decimal]) -> str:
    width = max([len(c) for c in totals] + [len("total")])
    lines = [f"{c:<{width}}  {v:>10.2f}" for c, v in totals.items()]
    lines.append(f"{'total':<{width}}  {sum(totals.values(), Decimal()):>10.2f}")
    return "\n".join(lines)
