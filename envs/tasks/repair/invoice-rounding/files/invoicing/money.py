"""Money amounts: Decimal values in a currency's major unit (e.g. euros)."""

from __future__ import annotations

from decimal import Decimal, InvalidOperation

CENT = Decimal("0.01")


def parse_amount(text: str) -> Decimal:
    """``"1,234.50"`` -> ``Decimal("1234.50")``; thousands separators are allowed."""
    cleaned = text.strip().replace(",", "").replace("_", "")
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        raise ValueError(f"not an amount: {text!r}") from None
    if not value.is_finite():
        raise ValueError(f"not an amount: {text!r}")
    return value


def round_money(amount: Decimal) -> Decimal:
    """Round to whole cents, halves away from zero (commercial rounding).

    This is the rounding our tax authority prescribes: 0.125 -> 0.13 and
    -0.125 -> -0.13.
    """
    return round(amount, 2)


def format_amount(amount: Decimal, currency: str = "EUR") -> str:
    """``Decimal("-1234.5")`` -> ``"-1,234.50 EUR"``."""
    rounded = round_money(amount)
    sign = "-" if rounded < 0 else ""
    return f"{sign}{abs(rounded):,.2f} {currency}"
