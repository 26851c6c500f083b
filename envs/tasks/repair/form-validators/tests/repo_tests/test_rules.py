import unittest

from formcheck import is_int, matches, max_len, min_len, one_of, required


class RuleTest(unittest.TestCase):
    def test_required(self):
        self.assertEqual(required()(None), "is required")
        self.assertEqual(required()("  "), "is required")
        self.assertIsNone(required()("x"))

    def test_lengths(self):
        self.assertEqual(min_len(3)("ab"), "must be at least 3 characters")
        self.assertIsNone(min_len(3)(None))
        self.assertEqual(max_len(2)("abc"), "must be at most 2 characters")

    def test_matches_and_choices(self):
        self.assertIsNone(matches(r"\d{5}")("12345"))
        self.assertEqual(matches(r"\d{5}", "bad zip")("1234"), "bad zip")
        self.assertEqual(one_of("a", "b")("c"), "must be one of a, b")

    def test_is_int(self):
        self.assertEqual(is_int()("1.5"), "must be a whole number")
        self.assertEqual(is_int(0, 10)("11"), "must be at most 10")
        self.assertIsNone(is_int(0, 10)(" 7 "))


if __name__ == "__main__":
    unittest.main()
