"""Seconds each named step of a sequence took: where a slow create or start-up spends its time."""

from __future__ import annotations

import time


class Laps:
    """``lap(name)`` at the end of each step; ``took`` maps each step to its seconds, in order."""

    def __init__(self) -> None:
        self.took: dict[str, float] = {}
        self._last = time.monotonic()

    def lap(self, name: str) -> float:
        """Record the seconds since the previous lap (or since this was made) as step ``name``; return them."""
        now = time.monotonic()
        self.took[name] = now - self._last
        self._last = now
        return self.took[name]
