import unittest
from decimal import Decimal

from fxconv import Converter, RateTable, UnknownCurrency

RATES = """\
base EUR
USD 1.0800
GBP 0.8500
JPY 160.00
"""


class ConvertTest(unittest.TestCase):
    def setUp(self):
        self.table = RateTable.parse(RATES)

    def test_cross_rate(self):
        self.assertEqual(self.table.rate("USD", "GBP"), Decimal("0.85") / Decimal("1.08"))
        with self.assertRaises(UnknownCurrency):
            self.table.rate("EUR", "CHF")

    def test_quote_with_fee(self):
        conv = Converter(self.table, fee="0.01")
        self.assertEqual(conv.quote(Decimal("100"), "EUR", to="USD"), Decimal("106.92"))

    def test_price_list(self):
        conv = Converter(self.table)
        self.assertEqual(conv.price_list(Decimal("100"), "EUR", ["USD", "GBP", "JPY"]),
                         {"USD": "108.00", "GBP": "85.00", "JPY": "16000"})

    def test_quotes_in_a_row(self):
        conv = Converter(self.table, fee="0.01")
        usd = conv.quote(Decimal("50"), "EUR", to="USD")
        gbp = conv.quote(Decimal("50"), "EUR", to="GBP")
        self.assertEqual((usd, gbp), (Decimal("53.46"), Decimal("42.08")))
        self.assertEqual(conv.quote(Decimal("50"), "EUR", to="GBP", with_fee=False), Decimal("42.50"))


if __name__ == "__main__":
    unittest.main()
