import unittest

from intervals import merge, total_length


class HiddenMergeTest(unittest.TestCase):
    def test_many_nested(self):
        self.assertEqual(merge([(0, 100), (10, 20), (30, 40), (99, 105)]), [(0, 105)])

    def test_empty_interval_rejected(self):
        with self.assertRaises(ValueError):
            merge([(3, 1)])

    def test_length_nested(self):
        self.assertEqual(total_length([(0, 9), (2, 4), (5, 5)]), 10)
