"""Questions about parsed records."""

from __future__ import annotations

import re
from collections import Counter
from typing import Iterable

Record = dict[str, str]

_DURATION = re.compile(r"(?P<n>\d+(?:\.\d+)?)(?P<unit>ns|us|µs|ms|s|m|h)")
_SCALE = {"ns": 1e-6, "us": 1e-3, "µs": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3, "h": 3600e3}


def parse_duration(text: str) -> float:
    """``"1.5s"`` -> 1500.0 milliseconds; also ``"1m30s"``."""
    pos, total = 0, 0.0
    for m in _DURATION.finditer(text):
        if m.start() != pos:
            break
        total += float(m.group("n")) * _SCALE[m.group("unit")]
        pos = m.end()
    if pos != len(text) or not text:
        raise ValueError(f"bad duration: {text!r}")
    return total


def select(records: Iterable[Record], **conditions: str) -> list[Record]:
    """Records whose fields equal every given condition (``select(rs, level="error")``)."""
    return [r for r in records if all(r.get(k) == v for k, v in conditions.items())]


def count_by(records: Iterable[Record], key: str) -> dict[str, int]:
    """How many records have each value of ``key`` (missing -> ``"-"``), most common first."""
    counts = Counter(r.get(key, "-") for r in records)
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def slowest(records: Iterable[Record], n: int = 3, key: str = "dur") -> list[Record]:
    """The ``n`` records with the largest duration field (records without one are skipped)."""
    timed = [r for r in records if key in r]
    return sorted(timed, key=lambda r: parse_duration(r[key]), reverse=True)[:n]
