import io
import unittest
from datetime import date
from decimal import Decimal

from expenses import Expense, read_expenses, summarize

EXPORT = """\
date,category,amount,note
2024-01-05,Travel,120.50,train Paris
2024-01-17, meals ,23.40,lunch client
2024-02-02,travel,310.00,flight Berlin
2024-02-09,,9.99,usb cable
"""

LIST = [
    Expense(date(2024, 1, 5), "travel", Decimal("120.50"), "train Paris"),
    Expense(date(2024, 1, 17), "meals", Decimal("23.40"), "lunch client"),
    Expense(date(2024, 2, 2), "travel", Decimal("310.00"), "flight Berlin"),
    Expense(date(2024, 2, 9), "other", Decimal("9.99"), "usb cable"),
]


class ReaderTest(unittest.TestCase):
    def test_rows(self):
        self.assertEqual(list(read_expenses(io.StringIO(EXPORT))), LIST)

    def test_bad_amount(self):
        with self.assertRaisesRegex(ValueError, "line 2"):
            list(read_expenses(io.StringIO("date,category,amount,note\n2024-01-01,x,12x,y\n")))

    def test_missing_column(self):
        with self.assertRaisesRegex(ValueError, "missing columns: note"):
            list(read_expenses(io.StringIO("date,category,amount\n")))


class SummaryTest(unittest.TestCase):
    def check(self, s):
        self.assertEqual(s.total, Decimal("463.89"))
        self.assertEqual(s.count, 4)
        self.assertEqual(s.by_category, {"meals": Decimal("23.40"), "other": Decimal("9.99"), "travel": Decimal("430.50")})
        self.assertEqual(s.by_month, {"2024-01": Decimal("143.90"), "2024-02": Decimal("319.99")})
        self.assertEqual(s.largest.note, "flight Berlin")

    def test_from_list(self):
        self.check(summarize(LIST))

    def test_straight_from_csv(self):
        self.check(summarize(read_expenses(io.StringIO(EXPORT))))

    def test_render(self):
        text = summarize(read_expenses(io.StringIO(EXPORT))).render()
        self.assertEqual(text.splitlines()[:2], ["4 expenses, total 463.89", "  travel            430.50   92.8%"])

    def test_empty(self):
        s = summarize([])
        self.assertEqual((s.count, s.total, s.largest), (0, Decimal("0.00"), None))


if __name__ == "__main__":
    unittest.main()
