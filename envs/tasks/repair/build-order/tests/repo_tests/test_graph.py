import unittest

from buildgraph import parse_rules, sources


class ParseTest(unittest.TestCase):
    def test_rules(self):
        text = "app: main.o util.o  # link\nmain.o: main.c util.h\nutil.o: util.c \\\n  util.h\napp: main.o libz.a\n"
        self.assertEqual(parse_rules(text.splitlines()), {
            "app": ["main.o", "util.o", "libz.a"],
            "main.o": ["main.c", "util.h"],
            "util.o": ["util.c", "util.h"],
        })

    def test_sources(self):
        self.assertEqual(sources({"a": ["b", "x"], "b": ["y"]}), {"x", "y"})

    def test_errors(self):
        with self.assertRaisesRegex(ValueError, "line 2"):
            parse_rules(["a: b", "no colon here"])
        with self.assertRaisesRegex(ValueError, "itself"):
            parse_rules(["a: a"])


if __name__ == "__main__":
    unittest.main()
