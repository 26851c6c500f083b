import io
import unittest
from decimal import Decimal

from ledger import format_table, read_entries, totals_by_category

SAMPLE = """date,category,amount,note
2024-03-01,Groceries,54.20,market
2024-03-02,transport,2.90,bus
2024-03-02,groceries,12.35,bakery
2024-04-01,groceries,61.10,market
"""


class TotalsTest(unittest.TestCase):
    def totals(self, month=""):
        return totals_by_category(read_entries(io.StringIO(SAMPLE)), month)

    def test_totals_per_category(self):
        self.assertEqual(self.totals(), {"groceries": Decimal("127.65"), "transport": Decimal("2.90")})

    def test_one_month(self):
        self.assertEqual(self.totals("2024-04"), {"groceries": Decimal("61.10")})

    def test_table_ends_with_the_total(self):
        table = format_table(self.totals("2024-03"))
        self.assertEqual(table.splitlines()[-1].split(), ["total", "69.45"])


if __name__ == "__main__":
    unittest.main()
