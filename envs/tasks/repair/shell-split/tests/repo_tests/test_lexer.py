import unittest

from cmdline import join, quote, split


class SplitTest(unittest.TestCase):
    def test_words(self):
        self.assertEqual(split("  ls   -la\t/tmp "), ["ls", "-la", "/tmp"])

    def test_single_quotes(self):
        self.assertEqual(split("echo 'a  b' 'it''s'"), ["echo", "a  b", "its"])

    def test_double_quotes(self):
        self.assertEqual(split('grep "hello world" notes.txt'), ["grep", "hello world", "notes.txt"])

    def test_backslash_outside_quotes(self):
        self.assertEqual(split(r"cat my\ file \"x\""), ["cat", "my file", '"x"'])

    def test_escaped_quote_inside_double_quotes(self):
        self.assertEqual(split(r'echo "say \"hi\" now"'), ["echo", 'say "hi" now'])

    def test_other_backslash_inside_double_quotes_is_kept(self):
        self.assertEqual(split(r'dir "C:\temp\new folder"'), ["dir", r"C:\temp\new folder"])

    def test_concatenation_and_empty(self):
        self.assertEqual(split("""a"b c"'d' "" x"""), ["ab cd", "", "x"])

    def test_unterminated(self):
        for bad in ('echo "abc', "echo 'abc", "echo abc\\"):
            with self.assertRaises(ValueError, msg=bad):
                split(bad)


class QuoteTest(unittest.TestCase):
    def test_quote(self):
        self.assertEqual(quote("plain-word.txt"), "plain-word.txt")
        self.assertEqual(quote("two words"), "'two words'")
        self.assertEqual(quote(""), "''")
        self.assertEqual(quote("it's"), "'it'\"'\"'s'")

    def test_join_round_trip(self):
        argv = ["printf", "%s\n", "it's", 'a "b"', ""]
        self.assertEqual(split(join(argv)), argv)


if __name__ == "__main__":
    unittest.main()
