"""Totals for household expense exports."""

from ledger.io import Entry, read_entries
from ledger.report import format_table, totals_by_category

__all__ = ["Entry", "format_table", "read_entries", "totals_by_category"]
