import unittest
from datetime import datetime, timezone

from timesheet import parse_timestamp


class ClockTest(unittest.TestCase):
    def test_zulu(self):
        self.assertEqual(parse_timestamp("2024-03-04T09:00Z"), datetime(2024, 3, 4, 9, 0, tzinfo=timezone.utc))

    def test_naive_is_utc(self):
        self.assertEqual(parse_timestamp("2024-03-04T09:00"), datetime(2024, 3, 4, 9, 0, tzinfo=timezone.utc))

    def test_offset_is_converted(self):
        self.assertEqual(
            parse_timestamp("2024-03-04T09:00+01:00"),
            datetime(2024, 3, 4, 8, 0, tzinfo=timezone.utc),
            "09:00 at UTC+1 is 08:00 UTC",
        )

    def test_result_is_utc(self):
        self.assertEqual(parse_timestamp("2024-03-04T09:00-05:00").utcoffset().total_seconds(), 0)


if __name__ == "__main__":
    unittest.main()
