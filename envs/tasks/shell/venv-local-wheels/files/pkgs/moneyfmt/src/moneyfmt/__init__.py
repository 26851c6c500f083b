"""Format integer cents as money: fmt(123456, "EUR") -> "EUR 1,234.56"."""

__version__ = "1.2.0"


def fmt(cents: int, currency: str = "USD") -> str:
    sign = "-" if cents < 0 else ""
    whole, frac = divmod(abs(cents), 100)
    return f"{currency} {sign}{whole:,}.{frac:02d}"
