"""Waiting for a condition to become true."""

from __future__ import annotations

import time
from collections.abc import Callable


class TimedOut(TimeoutError):
    pass


def wait_until(
    predicate: Callable[[], bool],
    timeout: float,
    interval: float = 0.25,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Until ``predicate()`` is true; TimedOut after ``timeout`` seconds."""
    deadline = clock() + timeout
    while not predicate():
        left = deadline - clock()
        if left <= 0:
            raise TimedOut(f"condition not met within {timeout:g} s")
        sleep(min(interval, left))
