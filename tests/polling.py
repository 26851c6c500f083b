"""Waiting until a condition holds: one polling loop for the tests and benchmarks that wait on crabd."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(what: str, check: Callable[[], bool], timeout: float = 30.0, *, interval: float = 0.1) -> None:
    """Poll ``check`` every ``interval`` seconds until it is true; TimeoutError naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(interval)
