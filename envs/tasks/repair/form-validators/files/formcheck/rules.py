"""Rules: each takes a field's raw value (a string, or None when absent) and
returns an error message, or None when the value is acceptable.

Every rule except ``required`` accepts a missing or empty value, so that
optional fields only need ``required`` left out.
"""

from __future__ import annotations

import re
from typing import Callable, Optional

Rule = Callable[[Optional[str]], Optional[str]]


def _blank(value: str | None) -> bool:
    return value is None or value.strip() == ""


def required() -> Rule:
    def rule(value: str | None) -> str | None:
        return "is required" if _blank(value) else None
    return rule


def min_len(n: int) -> Rule:
    def rule(value: str | None) -> str | None:
        if _blank(value) or len(value.strip()) >= n:
            return None
        return f"must be at least {n} characters"
    return rule


def max_len(n: int) -> Rule:
    def rule(value: str | None) -> str | None:
        if _blank(value) or len(value.strip()) <= n:
            return None
        return f"must be at most {n} characters"
    return rule


def matches(pattern: str, message: str = "has an invalid format") -> Rule:
    compiled = re.compile(pattern)
    def rule(value: str | None) -> str | None:
        if _blank(value) or compiled.fullmatch(value.strip()):
            return None
        return message
    return rule


def one_of(*choices: str) -> Rule:
    def rule(value: str | None) -> str | None:
        if _blank(value) or value.strip() in choices:
            return None
        return "must be one of " + ", ".join(choices)
    return rule


def is_int(lo: int | None = None, hi: int | None = None) -> Rule:
    def rule(value: str | None) -> str | None:
        if _blank(value):
            return None
        try:
            n = int(value.strip())
        except ValueError:
            return "must be a whole number"
        if lo is not None and n < lo:
            return f"must be at least {lo}"
        if hi is not None and n > hi:
            return f"must be at most {hi}"
        return None
    return rule
