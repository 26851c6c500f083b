import unittest
from datetime import datetime, timezone

from logstats.parse import parse_line, parse_lines


class ParseTest(unittest.TestCase):
    def test_a_line(self):
        h = parse_line('10.0.0.7 - - [12/Aug/2024:09:00:01 +0000] "GET /api/orders HTTP/1.1" 200 512')
        self.assertEqual((h.ip, h.method, h.path, h.status, h.size), ("10.0.0.7", "GET", "/api/orders", 200, 512))
        self.assertEqual(h.time, datetime(2024, 8, 12, 9, 0, 1, tzinfo=timezone.utc))

    def test_no_size(self):
        self.assertEqual(parse_line('1.2.3.4 - - [12/Aug/2024:09:00:01 +0000] "GET / HTTP/1.1" 304 -').size, 0)

    def test_junk_is_skipped(self):
        self.assertEqual(list(parse_lines(["junk", ""])), [])


if __name__ == "__main__":
    unittest.main()
