import unittest
from decimal import Decimal

from invoicing import Invoice


class InvoiceTest(unittest.TestCase):
    def test_simple_totals(self):
        inv = Invoice("2024-001")
        inv.add("Consulting", "2", "150.00")
        self.assertEqual(inv.net_total, Decimal("300.00"))
        self.assertEqual(inv.vat_total, Decimal("60.00"))
        self.assertEqual(inv.gross_total, Decimal("360.00"))

    def test_vat_rounded_half_up_per_line(self):
        inv = Invoice("2024-002")
        inv.add("Cable", "3", "4.75", vat_rate="0.10")  # net 14.25, VAT 1.425
        inv.add("Plug", "1", "2.25", vat_rate="0.10")   # net 2.25, VAT 0.225
        self.assertEqual(inv.vat_total, Decimal("1.66"), "each line's VAT is 1.43 + 0.23")
        self.assertEqual(inv.gross_total, Decimal("18.16"))

    def test_discount(self):
        inv = Invoice("2024-003")
        line = inv.add("Licence", "1", "99.90", discount="0.15")  # 84.915
        self.assertEqual(line.net, Decimal("84.92"))

    def test_render(self):
        inv = Invoice("2024-004")
        inv.add("Widget", "5", "1.25", vat_rate="0.10")
        text = inv.render()
        self.assertIn("6.25 EUR", text)
        self.assertIn("VAT 10%", text)
        self.assertEqual(text.splitlines()[-1].split(), ["Total", "6.88", "EUR"], "VAT of 0.625 is 0.63")


if __name__ == "__main__":
    unittest.main()
