import unittest
from datetime import date, timedelta

from tasklist import Item


class ItemTest(unittest.TestCase):
    def test_tag_normalised_once(self):
        item = Item("Call mum")
        item.tag("#Family")
        item.tag("family")
        self.assertEqual(item.tags, ["family"])

    def test_new_items_start_untagged(self):
        first = Item("Water plants")
        first.tag("home")
        second = Item("Pay rent")
        self.assertEqual(second.tags, [], "a new item must not inherit tags from another item")

    def test_repeat_is_independent(self):
        weekly = Item("Team sync", ["work"], priority=2, due=date(2024, 5, 6))
        nxt = weekly.repeat(timedelta(days=7))
        self.assertEqual(nxt.due, date(2024, 5, 13))
        nxt.tag("moved")
        self.assertEqual(weekly.tags, ["work"], "tagging the next occurrence changed the original")

    def test_validation(self):
        with self.assertRaises(ValueError):
            Item("  ")
        with self.assertRaises(ValueError):
            Item("x", priority=9)


if __name__ == "__main__":
    unittest.main()
