import unittest

from inventory.store import Inventory, Item


def sample():
    return Inventory([
        Item("B-2", "bolt", "fasteners", 0, 10),
        Item("A-1", "awl", "tools", 3, 500),
    ])


class StoreTest(unittest.TestCase):
    def test_get(self):
        self.assertEqual(sample().get("A-1").name, "awl")

    def test_unknown_sku_is_a_key_error(self):
        with self.assertRaises(KeyError):
            sample().get("Z-9")

    def test_search(self):
        inv = sample()
        self.assertEqual([i.sku for i in inv.search()], ["A-1", "B-2"])
        self.assertEqual([i.sku for i in inv.search(category="fasteners")], ["B-2"])
        self.assertEqual([i.sku for i in inv.search(in_stock=True)], ["A-1"])

    def test_load_the_shipped_data(self):
        self.assertEqual(len(Inventory.load("data/items.json")), 5)


if __name__ == "__main__":
    unittest.main()
