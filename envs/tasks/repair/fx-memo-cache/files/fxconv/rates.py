"""Reference rates: how many units of each currency one unit of the base buys."""

from __future__ import annotations

from decimal import Decimal
from typing import Mapping


class UnknownCurrency(KeyError):
    pass


class RateTable:
    def __init__(self, base: str, rates: Mapping[str, str | Decimal]) -> None:
        self.base = base.upper()
        self._rates = {code.upper(): Decimal(rate) for code, rate in rates.items()}
        self._rates[self.base] = Decimal(1)
        for code, rate in self._rates.items():
            if rate <= 0:
                raise ValueError(f"rate for {code} must be positive")

    @classmethod
    def parse(cls, text: str) -> RateTable:
        """``base EUR`` then ``USD 1.0832`` lines."""
        base, rates = None, {}
        for line in text.splitlines():
            parts = line.split()
            if not parts or parts[0].startswith("#"):
                continue
            if parts[0].lower() == "base":
                base = parts[1]
            else:
                rates[parts[0]] = parts[1]
        if base is None:
            raise ValueError("no 'base' line")
        return cls(base, rates)

    def __contains__(self, code: str) -> bool:
        return code.upper() in self._rates

    def rate(self, src: str, dst: str) -> Decimal:
        """Units of ``dst`` one unit of ``src`` buys (a cross rate via the base)."""
        try:
            return self._rates[dst.upper()] / self._rates[src.upper()]
        except KeyError as exc:
            raise UnknownCurrency(exc.args[0]) from None
