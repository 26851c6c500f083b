import io
import unittest
from datetime import date
from decimal import Decimal

from ledger.io import Entry, LedgerError, read_entries

HEADER = "date,category,amount,note\n"


class ReadEntriesTest(unittest.TestCase):
    def test_every_data_line_is_an_entry(self):
        text = HEADER + "2024-01-02,Food,3.50,lunch\n2024-01-03,food,1.25,\n"
        self.assertEqual(
            list(read_entries(io.StringIO(text))),
            [
                Entry(date(2024, 1, 2), "food", Decimal("3.50"), "lunch"),
                Entry(date(2024, 1, 3), "food", Decimal("1.25"), ""),
            ],
        )

    def test_blank_lines_are_ignored(self):
        text = HEADER + "2024-01-02,food,3.50,\n,,,\n2024-01-05,rent,10,\n"
        self.assertEqual(len(list(read_entries(io.StringIO(text)))), 2)

    def test_a_wrong_header_is_an_error(self):
        with self.assertRaises(LedgerError):
            list(read_entries(io.StringIO("when,what,how much\n2024-01-02,food,3\n")))

    def test_bad_amount_names_its_line(self):
        text = HEADER + "2024-01-02,food,3.50,\n2024-01-03,food,abc,\n"
        with self.assertRaisesRegex(LedgerError, "line 3"):
            list(read_entries(io.StringIO(text)))


if __name__ == "__main__":
    unittest.main()
