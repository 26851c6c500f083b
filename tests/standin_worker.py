"""A stand-in for ``python -m crabd.daemon.worker`` in tests/unit/test_workers_supervision.py.

It reads the configuration from stdin as a worker does, then does what
``$CRAB_STANDIN`` says, one word per start, kept in a file under
``$CRAB_STANDIN_DIR`` (a worker's life is one start): ``ready`` prints the
ready line and waits for SIGTERM; ``die`` prints it and exits at once;
``mute`` never says it is ready.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from crabd.daemon.workers import READY_LINE


def main() -> None:
    sys.stdin.buffer.read()
    shard = sys.argv[sys.argv.index("--shard") + 1]
    state = Path(os.environ["CRAB_STANDIN_DIR"]) / f"starts-{shard}"
    starts = int(state.read_text()) if state.exists() else 0
    state.write_text(str(starts + 1))
    plan = os.environ["CRAB_STANDIN"].split(",")
    what = plan[min(starts, len(plan) - 1)]
    if what == "mute":
        time.sleep(60)
        return
    sys.stdout.buffer.write(READY_LINE)
    sys.stdout.buffer.flush()
    if what == "die":
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    time.sleep(60)


if __name__ == "__main__":
    main()
