"""Invoices with per-line VAT, in exact decimal money."""

from invoicing.invoice import Invoice, LineItem
from invoicing.money import format_amount, parse_amount, round_money

__all__ = ["Invoice", "LineItem", "format_amount", "parse_amount", "round_money"]
