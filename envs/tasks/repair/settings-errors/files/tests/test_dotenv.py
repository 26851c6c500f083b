import unittest

from appconfig import parse_dotenv


class DotenvTest(unittest.TestCase):
    def test_parse(self):
        text = 'export A=1\n# comment\nB = "two words"\nC=x # trailing\nD=\'$raw\'\n\nE="line\\nbreak"\n'
        self.assertEqual(parse_dotenv(text), {"A": "1", "B": "two words", "C": "x", "D": "$raw", "E": "line\nbreak"})

    def test_bad_line(self):
        with self.assertRaisesRegex(ValueError, "line 2"):
            parse_dotenv("A=1\nnot a setting\n")


if __name__ == "__main__":
    unittest.main()
