import unittest
from datetime import datetime, timezone

from logstats.filters import by_method, by_prefix, by_status, top_paths
from logstats.parse import Hit

T = datetime(2024, 8, 12, tzinfo=timezone.utc)


def hit(path, status=200, method="GET"):
    return Hit("10.0.0.1", T, method, path, status, 100)


HITS = [hit("/a"), hit("/a", 404), hit("/b", 500, "POST"), hit("/api/x", 503), hit("/api/x", 201, "POST")]


class FilterTest(unittest.TestCase):
    def test_method(self):
        self.assertEqual([h.path for h in by_method(HITS, "post")], ["/b", "/api/x"])

    def test_prefix(self):
        self.assertEqual(len(list(by_prefix(HITS, "/api/"))), 2)

    def test_top(self):
        self.assertEqual(top_paths(HITS, 2), [("/a", 2), ("/api/x", 2)])

    def test_status_exact(self):
        self.assertEqual([h.path for h in by_status(HITS, "404")], ["/a"])

    def test_status_class(self):
        self.assertEqual([h.status for h in by_status(HITS, "5xx")], [500, 503])

    def test_status_list(self):
        self.assertEqual([h.status for h in by_status(HITS, "404,5xx")], [404, 500, 503])


if __name__ == "__main__":
    unittest.main()
