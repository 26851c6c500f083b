import unittest

from logscan import parse_line, parse_lines


class ParseLineTest(unittest.TestCase):
    def test_bare_values(self):
        self.assertEqual(parse_line("level=info status=200 path=/login"),
                         {"level": "info", "status": "200", "path": "/login"})

    def test_one_quoted_value(self):
        self.assertEqual(parse_line('level=warn msg="disk almost full"'),
                         {"level": "warn", "msg": "disk almost full"})

    def test_escaped_quote(self):
        self.assertEqual(parse_line(r'msg="say \"hi\" twice"'), {"msg": 'say "hi" twice'})

    def test_two_quoted_values(self):
        self.assertEqual(
            parse_line('msg="user logged in" user="Ada Lovelace" status=200'),
            {"msg": "user logged in", "user": "Ada Lovelace", "status": "200"},
        )

    def test_quoted_then_bare(self):
        self.assertEqual(parse_line('err="timeout" retry=3 note="try again"')["err"], "timeout")

    def test_bare_key_and_empty(self):
        self.assertEqual(parse_line('cached user= msg=""'), {"cached": "true", "user": "", "msg": ""})

    def test_unterminated_quote(self):
        with self.assertRaises(ValueError):
            parse_line('msg="oops level=info')

    def test_lines(self):
        recs = list(parse_lines(["a=1", "", 'b="x y" c=2']))
        self.assertEqual(recs, [{"a": "1"}, {"b": "x y", "c": "2"}])


if __name__ == "__main__":
    unittest.main()
