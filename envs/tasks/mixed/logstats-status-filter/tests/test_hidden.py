import contextlib
import io
import re
import unittest
from datetime import datetime, timezone

from logstats.__main__ import main
from logstats.filters import by_status
from logstats.parse import Hit

T = datetime(2024, 8, 12, tzinfo=timezone.utc)


def hits(*codes):
    return [Hit("10.0.0.1", T, "GET", f"/{c}", c, 1) for c in codes]


def expected(log, keep):
    rows = {}
    for line in open(log):
        m = re.search(r'"([A-Z]+) (\S+) [^"]*" (\d{3}) ', line)
        if m and keep(m[1], int(m[3])):
            rows[m[2]] = rows.get(m[2], 0) + 1
    return rows


def cli(*args):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(list(args))
    return code, {p: int(c) for c, p in (line.split() for line in out.getvalue().splitlines())}


class HiddenStatusTest(unittest.TestCase):
    def test_classes_and_codes(self):
        hs = hits(200, 201, 299, 301, 404, 418, 500, 599)
        self.assertEqual([h.status for h in by_status(hs, "2xx")], [200, 201, 299])
        self.assertEqual([h.status for h in by_status(hs, "4xx,301")], [301, 404, 418])
        self.assertEqual([h.status for h in by_status(hs, "599")], [599])
        self.assertEqual(list(by_status(hs, "302")), [])

    def test_order_and_laziness_kept(self):
        hs = hits(500, 200, 502)
        kept = by_status(iter(hs), "5xx")
        self.assertEqual([h.status for h in kept], [500, 502])

    def test_cli_combines_filters(self):
        code, rows = cli("logs/access.log", "--status", "404,5xx", "--method", "GET", "--top", "100")
        self.assertEqual(code, 0)
        self.assertEqual(rows, expected("logs/access.log", lambda m, s: m == "GET" and (s == 404 or s >= 500)))

    def test_cli_without_status_is_unchanged(self):
        code, rows = cli("logs/access.log", "--top", "100")
        self.assertEqual(rows, expected("logs/access.log", lambda m, s: True))


if __name__ == "__main__":
    unittest.main()
