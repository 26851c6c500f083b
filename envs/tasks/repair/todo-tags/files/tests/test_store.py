import unittest
from datetime import date

from tasklist import TodoList, format_item, parse_item

TEXT = """\
[ ] Buy milk #home #errand !2
[x] File taxes #admin @2024-04-15
[ ] Fix bike @2024-05-01
[ ] Book dentist #health !1
"""


class StoreTest(unittest.TestCase):
    def test_parse_line(self):
        item = parse_item("[ ] Buy milk #Home !2 @2024-05-01")
        self.assertEqual((item.title, item.tags, item.priority, item.due), ("Buy milk", ["home"], 2, date(2024, 5, 1)))

    def test_round_trip(self):
        self.assertEqual(TodoList.loads(TEXT).dumps(), TEXT)

    def test_by_tag(self):
        todo = TodoList.loads(TEXT)
        self.assertEqual([i.title for i in todo.by_tag("#home")], ["Buy milk"])
        self.assertEqual([i.title for i in todo.by_tag("health")], ["Book dentist"])

    def test_tag_counts(self):
        self.assertEqual(TodoList.loads(TEXT).tags(), {"admin": 1, "errand": 1, "health": 1, "home": 1})

    def test_open_items_order(self):
        titles = [i.title for i in TodoList.loads(TEXT).open_items()]
        self.assertEqual(titles, ["Book dentist", "Buy milk", "Fix bike"])

    def test_format(self):
        self.assertEqual(format_item(parse_item("[X] Done thing #a")), "[x] Done thing #a")


if __name__ == "__main__":
    unittest.main()
