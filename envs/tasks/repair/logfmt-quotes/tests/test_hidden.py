import unittest

from logscan import parse_line


class HiddenQuotingTest(unittest.TestCase):
    def test_many_quoted(self):
        line = " ".join(f'k{i}="v {i}"' for i in range(6))
        self.assertEqual(parse_line(line), {f"k{i}": f"v {i}" for i in range(6)})

    def test_equals_and_spaces_inside_quotes(self):
        self.assertEqual(parse_line('q="a=b c=d" n=1 r="x=\\"y\\""'), {"q": "a=b c=d", "n": "1", "r": 'x="y"'})

    def test_trailing_backslash(self):
        self.assertEqual(parse_line(r'path="C:\\" user="bob"'), {"path": "C:\\", "user": "bob"})
        self.assertEqual(parse_line(r'a="\\\"" b=2'), {"a": '\\"', "b": "2"})

    def test_tabs_and_unicode(self):
        self.assertEqual(parse_line('msg="héllo wörld"\tcity="Zürich"  ok'),
                         {"msg": "héllo wörld", "city": "Zürich", "ok": "true"})

    def test_empty_quoted_between(self):
        self.assertEqual(parse_line('a="" b="" c="3"'), {"a": "", "b": "", "c": "3"})

    def test_not_logfmt(self):
        for bad in ('a="x"b', 'a="x" b="y', '"x"=1', 'a=b"c"'):
            with self.assertRaises(ValueError, msg=bad):
                parse_line(bad)


if __name__ == "__main__":
    unittest.main()
