import io
import unittest
from decimal import Decimal

from ledger import read_entries, totals_by_category
from ledger.__main__ import main

HEADER = "date,category,amount,note\n"


class HiddenFirstRowTest(unittest.TestCase):
    def test_a_single_entry_is_read(self):
        [e] = read_entries(io.StringIO(HEADER + "2024-02-29,books,19.99,novel\n"))
        self.assertEqual((e.category, e.amount), ("books", Decimal("19.99")))

    def test_header_only_is_empty(self):
        self.assertEqual(list(read_entries(io.StringIO(HEADER))), [])

    def test_line_numbers_still_point_at_the_file(self):
        with self.assertRaisesRegex(Exception, "line 2"):
            list(read_entries(io.StringIO(HEADER + "2024-02-30,books,1,\n")))

    def test_the_sample_totals(self):
        with open("data/sample.csv", newline="") as f:
            totals = totals_by_category(read_entries(f))
        self.assertEqual(sum(totals.values()), Decimal("1056.90"))
        self.assertEqual(totals["groceries"], Decimal("127.65"))

    def test_the_command(self):
        out = io.StringIO()
        import contextlib

        with contextlib.redirect_stdout(out):
            self.assertEqual(main(["data/sample.csv", "--month", "2024-03"]), 0)
        self.assertEqual(out.getvalue().splitlines()[-1].split(), ["total", "922.35"])


if __name__ == "__main__":
    unittest.main()
