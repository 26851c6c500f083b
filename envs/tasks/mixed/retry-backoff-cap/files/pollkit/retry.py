"""Calling something flaky until it works, or the tries run out."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from pollkit.backoff import delays

T = TypeVar("T")
log = logging.getLogger("pollkit")


def call_with_retry(
    fn: Callable[[], T],
    *,
    attempts: int = 5,
    base: float = 0.2,
    factor: float = 2.0,
    cap: float = 5.0,
    retry_on: tuple[type[BaseException], ...] = (OSError,),
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """``fn()``; on one of ``retry_on``, sleep (see backoff.delays) and try again, up to ``attempts`` tries."""
    waits = delays(base, factor, cap, attempts)
    while True:
        try:
            return fn()
        except retry_on as exc:
            wait = next(waits, None)
            if wait is None:
                raise
            log.info("retrying in %.2f s after %r", wait, exc)
            sleep(wait)
