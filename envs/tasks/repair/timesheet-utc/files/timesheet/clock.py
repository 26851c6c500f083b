"""Timestamps: ISO 8601 in, timezone-aware UTC datetimes out."""

from __future__ import annotations

from datetime import datetime, timezone


def to_utc(dt: datetime) -> datetime:
    """The same instant as an aware datetime in UTC.

    Naive datetimes are taken to be UTC already (our clock-in terminals
    without a configured zone send UTC).
    """
    return dt.replace(tzinfo=timezone.utc)


def parse_timestamp(text: str) -> datetime:
    """``2024-03-04T09:00+01:00`` (or ``...Z``, or naive) -> aware UTC datetime."""
    text = text.strip()
    if text.endswith(("Z", "z")):
        text = text[:-1] + "+00:00"
    try:
        dt = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"bad timestamp: {text!r}") from None
    return to_utc(dt)
