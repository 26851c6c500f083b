"""Converting amounts, as a teller would quote them."""

from __future__ import annotations

from decimal import ROUND_HALF_EVEN, Decimal

from fxconv.cache import memoize
from fxconv.rates import RateTable

# Minor units per currency (default 2).
_EXPONENT = {"JPY": 0, "KRW": 0, "BHD": 3, "KWD": 3}


def _quantum(code: str) -> Decimal:
    return Decimal(1).scaleb(-_EXPONENT.get(code.upper(), 2))


class Converter:
    """Converts with a fee (a fraction of the amount, taken in the target currency)."""

    def __init__(self, table: RateTable, fee: str = "0") -> None:
        self.table = table
        self.fee = Decimal(fee)

    # Quotes are looked up a lot (every product page shows several); cache them.
    @memoize
    def quote(self, amount: Decimal, src: str, *, to: str, with_fee: bool = True) -> Decimal:
        """``amount`` of ``src`` in currency ``to``, rounded to its minor unit."""
        raw = Decimal(amount) * self.table.rate(src, to)
        if with_fee:
            raw -= raw * self.fee
        return raw.quantize(_quantum(to), rounding=ROUND_HALF_EVEN)

    def price_list(self, amount: Decimal, src: str, targets: list[str]) -> dict[str, str]:
        """``{"USD": "108.32", ...}`` for showing one price in several currencies, fee-free."""
        return {code: str(self.quote(amount, src, to=code, with_fee=False)) for code in targets}
