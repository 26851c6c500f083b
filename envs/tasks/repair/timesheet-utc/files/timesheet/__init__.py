"""Work-shift timesheets from a distributed team, reported in UTC."""

from timesheet.clock import parse_timestamp, to_utc
from timesheet.entries import Shift, parse_shift, parse_sheet
from timesheet.report import hours_by_day, hours_by_person, overlaps

__all__ = [
    "Shift", "hours_by_day", "hours_by_person", "overlaps", "parse_sheet", "parse_shift",
    "parse_timestamp", "to_utc",
]
