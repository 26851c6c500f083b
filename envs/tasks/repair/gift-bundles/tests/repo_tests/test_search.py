import unittest

from bundles import best_bundle, bundles_within, load_catalog
from bundles.search import describe

CATALOG = """\
# name; cents; tags
Tea sampler; 1450; food,drink
Mug; 900; kitchen,drink
Chocolate; 650; food
Notebook; 1200; office
Candle; 1100; home
"""


class SearchTest(unittest.TestCase):
    def setUp(self):
        self.products = load_catalog(CATALOG.splitlines())

    def test_load(self):
        self.assertEqual([p.name for p in self.products], ["Tea sampler", "Mug", "Chocolate", "Notebook", "Candle"])
        self.assertEqual(self.products[1].tags, frozenset({"kitchen", "drink"}))
        self.assertEqual(self.products[0].price, "14.50")

    def test_best_pair(self):
        self.assertEqual(describe(best_bundle(self.products, 2, 2500)), "Tea sampler + Mug = 23.50")

    def test_pair_with_last_product(self):
        self.assertEqual(describe(best_bundle(self.products, 2, 1800)), "Chocolate + Candle = 17.50")

    def test_count(self):
        self.assertEqual(len(bundles_within(self.products, 2, 10_000)), 10)

    def test_tagged(self):
        self.assertEqual(describe(best_bundle(self.products, 2, 5000, must_tag="drink")), "Tea sampler + Mug = 23.50")
        self.assertIsNone(best_bundle(self.products, 2, 5000, must_tag="office"))


if __name__ == "__main__":
    unittest.main()
