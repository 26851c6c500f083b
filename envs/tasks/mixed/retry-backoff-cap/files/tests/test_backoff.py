import unittest

from pollkit.backoff import delays


class DelaysTest(unittest.TestCase):
    def test_doubling(self):
        self.assertEqual(list(delays(0.5, 2, 100, 4)), [0.5, 1.0, 2.0])

    def test_one_attempt_never_sleeps(self):
        self.assertEqual(list(delays(1, 2, 10, 1)), [])

    def test_never_above_the_cap(self):
        self.assertEqual(list(delays(0.5, 2, 4, 7)), [0.5, 1.0, 2.0, 4.0, 4.0, 4.0])

    def test_bad_arguments(self):
        with self.assertRaises(ValueError):
            list(delays(1, 0.5, 10, 3))


if __name__ == "__main__":
    unittest.main()
