import unittest
from datetime import date, timedelta

from tasklist import Item, TodoList, parse_item


class HiddenTagOwnershipTest(unittest.TestCase):
    def test_many_items_untagged(self):
        items = [Item(f"item {n}") for n in range(5)]
        for n, item in enumerate(items):
            item.tag(f"t{n}")
        self.assertEqual([i.tags for i in items], [["t0"], ["t1"], ["t2"], ["t3"], ["t4"]])
        self.assertEqual(Item("fresh").tags, [])

    def test_caller_list_not_aliased(self):
        tags = ["work"]
        a = Item("a", tags)
        b = Item("b", tags)
        a.tag("urgent")
        b.untag("work")
        self.assertEqual(tags, ["work"])
        self.assertEqual(a.tags, ["work", "urgent"])
        self.assertEqual(b.tags, [])

    def test_repeat_chain(self):
        first = parse_item("Water plants #home @2024-05-01")
        second = first.repeat(timedelta(days=3))
        third = second.repeat(timedelta(days=3))
        third.untag("home")
        second.tag("garden")
        self.assertEqual((first.tags, second.tags, third.tags), (["home"], ["home", "garden"], []))
        self.assertEqual(third.due, date(2024, 5, 7))

    def test_load_twice(self):
        text = "[ ] A #x\n[ ] B\n"
        TodoList.loads(text)
        todo = TodoList.loads(text)
        self.assertEqual([i.tags for i in todo], [["x"], []])


if __name__ == "__main__":
    unittest.main()
