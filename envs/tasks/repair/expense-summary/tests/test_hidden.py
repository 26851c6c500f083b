import contextlib
import io
import os
import tempfile
import unittest
from datetime import date
from decimal import Decimal

from expenses import Expense, read_expenses, summarize
from expenses.__main__ import main


class OneShot:
    """An iterable that can be iterated only once, like a file or a generator."""

    def __init__(self, items):
        self.items = list(items)
        self.used = False

    def __iter__(self):
        if self.used:
            return iter(())
        self.used = True
        return iter(self.items)


def make(n):
    return [Expense(date(2024, 1 + i % 12, 1 + i % 28), ["a", "b", "c"][i % 3], Decimal(i) + Decimal("0.25"), f"n{i}")
            for i in range(n)]


class HiddenIterableTest(unittest.TestCase):
    def test_generator_and_one_shot(self):
        items = make(30)
        want = summarize(items)
        for source in (iter(items), (e for e in items), OneShot(items), tuple(items)):
            got = summarize(source)
            self.assertEqual(
                (got.count, got.total, got.by_category, got.by_month, got.largest),
                (want.count, want.total, want.by_category, want.by_month, want.largest),
                type(source).__name__,
            )
        self.assertEqual(want.count, 30)
        self.assertEqual(want.largest.note, "n29")

    def test_cli(self):
        with tempfile.NamedTemporaryFile("w", suffix=".csv", delete=False) as f:
            f.write("date,category,amount,note\n2024-03-01,Books,15.00,novel\n2024-03-02,books,5.00,map\n")
        try:
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                self.assertEqual(main([f.name]), 0)
        finally:
            os.unlink(f.name)
        self.assertEqual(out.getvalue().splitlines()[0], "2 expenses, total 20.00")
        self.assertIn("books", out.getvalue())
        self.assertIn("largest: 15.00 on 2024-03-01 (novel)", out.getvalue())

    def test_reader_stays_lazy(self):
        rows = read_expenses(io.StringIO("date,category,amount,note\n2024-05-05,x,1.5,y\n2024-05-06,x,oops,y\n"))
        self.assertIs(iter(rows), rows, "read_expenses should still return an iterator")
        self.assertEqual(next(rows).amount, Decimal("1.5"))
        with self.assertRaises(ValueError):
            next(rows)

    def test_file_single_row(self):
        s = summarize(read_expenses(io.StringIO("date,category,amount,note\n2024-05-05,x,1.5,y\n")))
        self.assertEqual((s.count, s.by_month, s.largest.amount), (1, {"2024-05": Decimal("1.5")}, Decimal("1.5")))


if __name__ == "__main__":
    unittest.main()
