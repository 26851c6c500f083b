import itertools
import unittest

from bundles import Product, bundles_within, choose


class HiddenChooseTest(unittest.TestCase):
    def test_matches_itertools(self):
        for n in range(0, 8):
            items = list(range(n))
            for k in range(0, n + 2):
                want = [list(c) for c in itertools.combinations(items, k)]
                self.assertEqual(choose(items, k), want, (n, k))

    def test_empty(self):
        self.assertEqual(choose([], 0), [[]])
        self.assertEqual(choose("", 1), [])

    def test_tuple_input(self):
        self.assertEqual(choose(("p", "q", "r"), 3), [["p", "q", "r"]])

    def test_budget_exactly(self):
        products = [Product(f"p{i}", 100 * (i + 1)) for i in range(5)]  # 1.00 .. 5.00
        found = bundles_within(products, 3, 1200)
        self.assertEqual([tuple(p.name for p in b) for b in found[:2]], [("p2", "p3", "p4"), ("p1", "p3", "p4")])
        self.assertEqual(len(bundles_within(products, 5, 1500)), 1)
        self.assertEqual(len(bundles_within(products, 5, 1499)), 0)


if __name__ == "__main__":
    unittest.main()
