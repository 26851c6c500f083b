import unittest

from pollkit import TimedOut, call_with_retry, wait_until


class Flaky:
    def __init__(self, failures):
        self.failures = failures
        self.calls = 0

    def __call__(self):
        self.calls += 1
        if self.calls <= self.failures:
            raise ConnectionError("nope")
        return "ok"


class RetryTest(unittest.TestCase):
    def test_succeeds_after_failures(self):
        slept = []
        fn = Flaky(2)
        self.assertEqual(call_with_retry(fn, attempts=5, base=1, sleep=slept.append), "ok")
        self.assertEqual((fn.calls, slept), (3, [1, 2]))

    def test_gives_up(self):
        fn = Flaky(10)
        with self.assertRaises(ConnectionError):
            call_with_retry(fn, attempts=3, sleep=lambda s: None)
        self.assertEqual(fn.calls, 3)

    def test_other_errors_are_not_retried(self):
        def boom():
            raise KeyError("x")

        with self.assertRaises(KeyError):
            call_with_retry(boom, sleep=lambda s: None)


class WaitTest(unittest.TestCase):
    def test_times_out(self):
        now = [0.0]
        with self.assertRaises(TimedOut):
            wait_until(lambda: False, 1.0, clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))


if __name__ == "__main__":
    unittest.main()
