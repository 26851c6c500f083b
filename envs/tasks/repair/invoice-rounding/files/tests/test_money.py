import unittest
from decimal import Decimal

from invoicing import format_amount, parse_amount, round_money


class MoneyTest(unittest.TestCase):
    def test_parse(self):
        self.assertEqual(parse_amount(" 1,234.50 "), Decimal("1234.50"))
        with self.assertRaises(ValueError):
            parse_amount("12.3.4")

    def test_round_plain(self):
        self.assertEqual(round_money(Decimal("2.344")), Decimal("2.34"))
        self.assertEqual(round_money(Decimal("2.346")), Decimal("2.35"))

    def test_round_half_cent_goes_up(self):
        self.assertEqual(round_money(Decimal("0.125")), Decimal("0.13"), "half a cent rounds away from zero")
        self.assertEqual(round_money(Decimal("1.425")), Decimal("1.43"), "half a cent rounds away from zero")

    def test_format(self):
        self.assertEqual(format_amount(Decimal("-1234.5")), "-1,234.50 EUR")
        self.assertEqual(format_amount(Decimal("0.045"), "USD"), "0.05 USD")


if __name__ == "__main__":
    unittest.main()
