import unittest

from bundles import choose


class ChooseTest(unittest.TestCase):
    def test_pairs(self):
        self.assertEqual(choose("abc", 2), [["a", "b"], ["a", "c"], ["b", "c"]])

    def test_singles(self):
        self.assertEqual(choose([1, 2, 3], 1), [[1], [2], [3]])

    def test_all_of_them(self):
        self.assertEqual(choose("xy", 2), [["x", "y"]])

    def test_pick_nothing(self):
        self.assertEqual(choose("abc", 0), [[]])

    def test_too_many(self):
        self.assertEqual(choose("ab", 3), [])

    def test_negative(self):
        with self.assertRaises(ValueError):
            choose("ab", -1)


if __name__ == "__main__":
    unittest.main()
