import unittest

from logscan import count_by, parse_duration, parse_lines, select, slowest

LOG = '''\
ts=2024-05-01T10:00:00Z level=info msg="request done" path=/ dur=12ms
ts=2024-05-01T10:00:01Z level=error msg="db timeout" path="/orders" dur=1.5s
ts=2024-05-01T10:00:02Z level=info msg="request done" path="/orders" dur=340ms
ts=2024-05-01T10:00:03Z level=warn msg="slow \\"orders\\" query" path="/orders" dur=1m2s
'''


class QueryTest(unittest.TestCase):
    def setUp(self):
        self.records = list(parse_lines(LOG.splitlines()))

    def test_durations(self):
        self.assertEqual(parse_duration("12ms"), 12.0)
        self.assertEqual(parse_duration("1m2s"), 62000.0)
        with self.assertRaises(ValueError):
            parse_duration("12 ms")

    def test_select(self):
        self.assertEqual([r["ts"][-3:-1] for r in select(self.records, path="/orders")], ["01", "02", "03"])

    def test_count_by_level(self):
        self.assertEqual(count_by(self.records, "level"), {"info": 2, "error": 1, "warn": 1})

    def test_slowest(self):
        self.assertEqual([r["msg"] for r in slowest(self.records, 2)], ['slow "orders" query', "db timeout"])


if __name__ == "__main__":
    unittest.main()
