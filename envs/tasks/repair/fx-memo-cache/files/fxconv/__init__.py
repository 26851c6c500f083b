"""Currency conversion from a table of reference rates, with memoised quotes."""

from fxconv.cache import memoize
from fxconv.convert import Converter
from fxconv.rates import RateTable, UnknownCurrency

__all__ = ["Converter", "RateTable", "UnknownCurrency", "memoize"]
