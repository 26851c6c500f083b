"""Running a piece of work on a throwaway thread of its own.

Why: some kernel state is per thread, not per process (setns of a network namespace, fsuid and
securebits), so work that changes it must not run on a thread crabd goes on using.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def on_own_thread(work: Callable[[], T], name: str) -> T:
    """``work()`` run on a new thread, waited for; its result returned, its exception raised here."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = work()
        except BaseException as exc:  # handed to the caller
            box["error"] = exc

    t = threading.Thread(target=run, name=name, daemon=True)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]
