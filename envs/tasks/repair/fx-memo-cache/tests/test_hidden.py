import unittest
from decimal import Decimal

from fxconv import Converter, RateTable, memoize


class HiddenCacheKeyTest(unittest.TestCase):
    def test_all_keyword_combinations(self):
        calls = []

        @memoize
        def f(a, b=0, *, c=0, d=0):
            calls.append((a, b, c, d))
            return (a, b, c, d)

        combos = [dict(c=c, d=d) for c in range(3) for d in range(3)]
        for kw in combos:
            self.assertEqual(f(1, **kw), (1, 0, kw["c"], kw["d"]))
        for kw in combos:
            self.assertEqual(f(1, **kw), (1, 0, kw["c"], kw["d"]))
        self.assertEqual(len(calls), 9)
        self.assertEqual(f(1, d=2, c=1), (1, 0, 1, 2))
        self.assertEqual(f(1, b=5), (1, 5, 0, 0))
        self.assertEqual(f(1, b=6), (1, 6, 0, 0))
        self.assertEqual(f.cache_info()["hits"] >= 9, True)

    def test_converter_still_cached(self):
        table = RateTable("EUR", {"USD": "1.25", "CHF": "0.95", "KWD": "0.333"})
        conv = Converter(table, fee="0.02")
        Converter.quote.cache_clear()
        prices = [conv.quote(Decimal("80"), "EUR", to=code) for code in ("USD", "CHF", "KWD", "USD", "CHF")]
        self.assertEqual(prices, [Decimal("98.00"), Decimal("74.48"), Decimal("26.107"), Decimal("98.00"), Decimal("74.48")])
        info = Converter.quote.cache_info()
        self.assertEqual((info["misses"], info["hits"]), (3, 2))
        self.assertEqual(conv.quote(Decimal("80"), "EUR", to="USD", with_fee=False), Decimal("100.00"))
        self.assertEqual(conv.quote(Decimal("80"), "EUR", with_fee=False, to="CHF"), Decimal("76.00"))

    def test_two_converters(self):
        table = RateTable("USD", {"EUR": "0.5"})
        cheap, dear = Converter(table, fee="0"), Converter(table, fee="0.1")
        self.assertEqual(cheap.quote(Decimal("10"), "USD", to="EUR"), Decimal("5.00"))
        self.assertEqual(dear.quote(Decimal("10"), "USD", to="EUR"), Decimal("4.50"))


if __name__ == "__main__":
    unittest.main()
