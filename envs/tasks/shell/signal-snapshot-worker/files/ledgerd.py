"""Ledger worker: applies transfer files from a spool directory to balances held in memory.

    python3 ledgerd.py SPOOL_DIR SNAPSHOT_FILE

Every 0.1 s it picks up SPOOL_DIR/*.txn (oldest name first), applies each
line "FROM TO AMOUNT" to its balances, and moves the file to SPOOL_DIR/done/.
Balances are never written to disk, except on SIGUSR1: then it writes
SNAPSHOT_FILE (JSON: {"files": N, "transfers": N, "balances": {...}}).
SIGTERM stops it.
"""

import glob
import json
import os
import signal
import sys
import time

spool, snap = sys.argv[1], sys.argv[2]
os.makedirs(os.path.join(spool, "done"), exist_ok=True)
state = {"files": 0, "transfers": 0, "balances": {}}
want_snapshot = False


def on_usr1(signum, frame):
    global want_snapshot
    want_snapshot = True


signal.signal(signal.SIGUSR1, on_usr1)
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
while True:
    for path in sorted(glob.glob(os.path.join(spool, "*.txn"))):
        b = state["balances"]
        for line in open(path):
            parts = line.split()
            if len(parts) != 3:
                continue
            src, dst, amount = parts[0], parts[1], int(parts[2])
            b[src] = b.get(src, 0) - amount
            b[dst] = b.get(dst, 0) + amount
            state["transfers"] += 1
        state["files"] += 1
        os.rename(path, os.path.join(spool, "done", os.path.basename(path)))
    if want_snapshot:
        want_snapshot = False
        with open(snap + ".tmp", "w") as f:
            json.dump(state, f, sort_keys=True, indent=1)
        os.replace(snap + ".tmp", snap)
    time.sleep(0.1)
