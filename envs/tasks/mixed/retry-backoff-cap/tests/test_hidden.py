import unittest

from pollkit import call_with_retry, delays


class Failing:
    def __init__(self):
        self.calls = 0

    def __call__(self):
        self.calls += 1
        raise TimeoutError("down")


class HiddenCapTest(unittest.TestCase):
    def test_cap_holds_for_any_factor(self):
        for factor in (1.5, 2, 3, 10):
            ds = list(delays(0.3, factor, 2.5, 12))
            self.assertEqual(len(ds), 11)
            self.assertLessEqual(max(ds), 2.5)
            self.assertEqual(ds[-1], 2.5)

    def test_values_below_the_cap_are_exact(self):
        self.assertEqual(list(delays(1, 3, 10, 5)), [1, 3, 9, 10])

    def test_base_above_the_cap(self):
        self.assertEqual(list(delays(8, 2, 5, 3)), [5, 5])

    def test_factor_one_is_constant(self):
        self.assertEqual(list(delays(0.7, 1, 5, 4)), [0.7, 0.7, 0.7])

    def test_retry_sleeps_are_capped(self):
        slept = []
        fn = Failing()
        with self.assertRaises(TimeoutError):
            call_with_retry(fn, attempts=8, base=0.5, factor=2, cap=3, sleep=slept.append)
        self.assertEqual(fn.calls, 8)
        self.assertEqual(slept, [0.5, 1, 2, 3, 3, 3, 3])


if __name__ == "__main__":
    unittest.main()
