import contextlib
import io
import unittest

from logstats.__main__ import main


def run(*args):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(list(args))
    return code, [line.split() for line in out.getvalue().splitlines()]


class CliTest(unittest.TestCase):
    def test_top(self):
        code, rows = run("logs/access.log", "--top", "3")
        self.assertEqual(code, 0)
        self.assertEqual(len(rows), 3)

    def test_status_filter(self):
        code, rows = run("logs/access.log", "--status", "5xx")
        self.assertEqual(code, 0)
        self.assertEqual(sum(int(c) for c, _ in rows), 4)


if __name__ == "__main__":
    unittest.main()
