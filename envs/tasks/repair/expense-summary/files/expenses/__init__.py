"""Summaries of expense exports (CSV from the company card portal)."""

from expenses.reader import Expense, read_expenses
from expenses.summary import Summary, summarize

__all__ = ["Expense", "Summary", "read_expenses", "summarize"]
