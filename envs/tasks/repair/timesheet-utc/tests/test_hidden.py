import unittest
from datetime import date, datetime, timedelta, timezone

from timesheet import hours_by_day, parse_shift, parse_timestamp, to_utc


class HiddenTimezoneTest(unittest.TestCase):
    def test_various_offsets(self):
        cases = {
            "2024-06-30T23:30+05:30": datetime(2024, 6, 30, 18, 0, tzinfo=timezone.utc),
            "2024-01-01T00:15-03:45": datetime(2024, 1, 1, 4, 0, tzinfo=timezone.utc),
            "2023-12-31T22:00-09:00": datetime(2024, 1, 1, 7, 0, tzinfo=timezone.utc),
            "2024-03-04T09:00:30+00:00": datetime(2024, 3, 4, 9, 0, 30, tzinfo=timezone.utc),
            "2024-03-04T09:00z": datetime(2024, 3, 4, 9, 0, tzinfo=timezone.utc),
        }
        for text, want in cases.items():
            got = parse_timestamp(text)
            self.assertEqual(got, want, text)
            self.assertEqual(got.utcoffset(), timedelta(0), text)

    def test_to_utc_keeps_the_instant(self):
        tz = timezone(timedelta(hours=-7))
        dt = datetime(2024, 5, 1, 20, 0, tzinfo=tz)
        self.assertEqual(to_utc(dt), dt)
        self.assertEqual(to_utc(dt).hour, 3)
        self.assertEqual(to_utc(datetime(2024, 5, 1, 20, 0)), datetime(2024, 5, 1, 20, 0, tzinfo=timezone.utc))

    def test_shift_crossing_date_line(self):
        shift = parse_shift("kim 2024-03-04T20:00+09:00 2024-03-04T18:00-08:00")
        self.assertEqual(shift.hours, 15.0)
        self.assertEqual(hours_by_day([shift]), {date(2024, 3, 4): 13.0, date(2024, 3, 5): 2.0})

    def test_shift_split_over_utc_midnight(self):
        shift = parse_shift("lee 2024-03-04T21:00-04:00 2024-03-05T01:00-04:00")
        self.assertEqual(hours_by_day([shift]), {date(2024, 3, 5): 4.0})
        shift = parse_shift("lee 2024-03-04T22:00+02:00 2024-03-05T04:00+02:00")
        self.assertEqual(hours_by_day([shift]), {date(2024, 3, 4): 4.0, date(2024, 3, 5): 2.0})

    def test_too_long_when_converted(self):
        with self.assertRaises(ValueError):
            parse_shift("max 2024-03-04T08:00+10:00 2024-03-04T09:00-10:00")


if __name__ == "__main__":
    unittest.main()
