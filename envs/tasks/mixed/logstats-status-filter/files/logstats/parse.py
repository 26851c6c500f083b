"""Common Log Format lines into Hit records."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime

_LINE = re.compile(
    r'^(?P<ip>\S+) \S+ \S+ \[(?P<time>[^\]]+)\] "(?P<method>[A-Z]+) (?P<path>\S+) [^"]*" '
    r"(?P<status>\d{3}) (?P<size>\d+|-)$"
)


@dataclass(frozen=True)
class Hit:
    ip: str
    time: datetime
    method: str
    path: str
    status: int
    size: int


def parse_line(line: str) -> Hit | None:
    """The hit on one line, or None for a line that is not in the format."""
    m = _LINE.match(line.strip())
    if m is None:
        return None
    return Hit(
        m["ip"],
        datetime.strptime(m["time"], "%d/%b/%Y:%H:%M:%S %z"),
        m["method"],
        m["path"],
        int(m["status"]),
        0 if m["size"] == "-" else int(m["size"]),
    )


def parse_lines(lines: Iterable[str]) -> Iterator[Hit]:
    for line in lines:
        hit = parse_line(line)
        if hit is not None:
            yield hit
