import threading
import unittest
from decimal import Decimal, localcontext, ROUND_HALF_EVEN

from invoicing import Invoice, format_amount, round_money


class HiddenRoundingTest(unittest.TestCase):
    def test_half_cents_table(self):
        cases = {
            "0.005": "0.01", "0.015": "0.02", "0.025": "0.03", "1.005": "1.01", "2.675": "2.68",
            "-0.125": "-0.13", "-2.675": "-2.68", "-0.004": "0.00", "10": "10.00", "7.1": "7.10",
            "123456789.995": "123456790.00", "0.0049999": "0.00",
        }
        for raw, want in cases.items():
            got = round_money(Decimal(raw))
            self.assertEqual(got, Decimal(want), raw)
            self.assertEqual(got.as_tuple().exponent, -2, f"{raw} -> {got} should have exactly 2 decimals")

    def test_independent_of_thread_context(self):
        results = []
        def work():
            with localcontext() as ctx:
                ctx.rounding = ROUND_HALF_EVEN
                results.append(round_money(Decimal("0.125")))
        t = threading.Thread(target=work)
        t.start()
        t.join()
        self.assertEqual(results, [Decimal("0.13")])

    def test_many_lines(self):
        inv = Invoice("X")
        for _ in range(8):
            inv.add("Item", "1", "0.25", vat_rate="0.10")  # VAT 0.025 each
        self.assertEqual(inv.vat_total, Decimal("0.24"))
        self.assertEqual(inv.gross_total, Decimal("2.24"))

    def test_credit_note_format(self):
        self.assertEqual(format_amount(Decimal("-0.125")), "-0.13 EUR")
        self.assertEqual(format_amount(Decimal("1000000.005")), "1,000,000.01 EUR")


if __name__ == "__main__":
    unittest.main()
