import unittest
from datetime import date

from timesheet import hours_by_day, hours_by_person, overlaps, parse_shift, parse_sheet

SHEET = """
# week 10
alice 2024-03-04T09:00+01:00 2024-03-04T17:30+01:00
bob   2024-03-04T22:00-05:00 2024-03-05T06:00-05:00   # night shift, New York
carol 2024-03-04T09:00Z      2024-03-04T13:00Z
"""


class ReportTest(unittest.TestCase):
    def test_same_zone_duration(self):
        self.assertEqual(parse_shift("alice 2024-03-04T09:00+01:00 2024-03-04T17:30+01:00").hours, 8.5)

    def test_mixed_zone_duration(self):
        # Clocked in in Berlin, clocked out after flying to London.
        shift = parse_shift("dan 2024-03-04T09:00+01:00 2024-03-04T12:00+00:00")
        self.assertEqual(shift.hours, 4.0, "09:00+01:00 to 12:00+00:00 is four hours")

    def test_hours_by_person(self):
        self.assertEqual(hours_by_person(parse_sheet(SHEET.splitlines())), {"alice": 8.5, "bob": 8.0, "carol": 4.0})

    def test_night_shift_split_at_utc_midnight(self):
        # bob works 03:00-11:00 UTC on the 5th: nothing on the 4th UTC.
        days = hours_by_day(parse_sheet(SHEET.splitlines()))
        self.assertEqual(days, {date(2024, 3, 4): 12.5, date(2024, 3, 5): 8.0})

    def test_overlap_across_zones(self):
        shifts = parse_sheet([
            "erin 2024-03-04T09:00+02:00 2024-03-04T11:00+02:00",
            "erin 2024-03-04T09:30Z 2024-03-04T11:00Z",
            "erin 2024-03-04T10:45Z 2024-03-04T12:00Z",
        ])
        found = [(a.start.hour, a.start.minute, b.start.hour, b.start.minute) for a, b in overlaps(shifts)]
        self.assertEqual(found, [(9, 30, 10, 45)], "07:00-09:00 UTC and 09:30-11:00 UTC do not overlap")


if __name__ == "__main__":
    unittest.main()
