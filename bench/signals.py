"""SIGTERM ends a benchmark as Ctrl-C does: its ``finally`` blocks run and remove what it made.

Why: a benchmark run under ``timeout`` (or stopped by a CI runner) gets
SIGTERM, whose default action ends Python without unwinding.  A scale run
killed that way left 468 stopped runc containers and about 1,400 mounts on
this host, and every later create paid for the longer mount table
(docs/benchmarks.md, "Creation and the host's mount table").
"""

from __future__ import annotations

import signal
from types import FrameType


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def terminate_as_interrupt() -> None:
    """From now on SIGTERM raises KeyboardInterrupt in the main thread."""
    signal.signal(signal.SIGTERM, _interrupt)
