import unittest

from buildgraph import CycleError, build_order, needs_rebuild, parse_rules

RULES = """\
app: main.o util.o
main.o: main.c util.h
util.o: util.c util.h
"""


class OrderTest(unittest.TestCase):
    def test_chain(self):
        self.assertEqual(build_order({"c": ["b"], "b": ["a"]}), ["a", "b", "c"])

    def test_shared_dependency(self):
        # util.h is needed by both objects: that is not a cycle.
        self.assertEqual(build_order(parse_rules(RULES.splitlines())),
                         ["main.c", "util.c", "util.h", "main.o", "util.o", "app"])

    def test_diamond(self):
        self.assertEqual(build_order({"top": ["left", "right"], "left": ["base"], "right": ["base"]}),
                         ["base", "left", "right", "top"])

    def test_cycle(self):
        with self.assertRaises(CycleError) as cm:
            build_order({"a": ["b"], "b": ["c"], "c": ["a"], "d": []})
        self.assertEqual(cm.exception.stuck, ["a", "b", "c"])

    def test_rebuild(self):
        graph = parse_rules(RULES.splitlines())
        mtimes = {"main.c": 1, "util.c": 1, "util.h": 5, "main.o": 2, "util.o": 6, "app": 7}
        self.assertEqual(needs_rebuild(graph, mtimes), ["main.o", "app"])


if __name__ == "__main__":
    unittest.main()
