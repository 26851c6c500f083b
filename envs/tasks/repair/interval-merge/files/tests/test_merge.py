import unittest

from intervals import merge, total_length


class MergeTest(unittest.TestCase):
    def test_disjoint(self):
        self.assertEqual(merge([(5, 6), (1, 2)]), [(1, 2), (5, 6)])

    def test_touching(self):
        self.assertEqual(merge([(1, 2), (3, 4)]), [(1, 4)])

    def test_contained(self):
        self.assertEqual(merge([(1, 10), (2, 3)]), [(1, 10)])

    def test_length(self):
        self.assertEqual(total_length([(1, 10), (2, 3), (20, 20)]), 11)


if __name__ == "__main__":
    unittest.main()
