"""Streaming de-duplicator.

    python3 dedup.py FIFO OUTDIR

Reads JSON events (one per line, each with an "id") from the named pipe FIFO,
which it opens read-write so that writers may come and go.  The first event
with a given id is appended to OUTDIR/unique.jsonl; later ones are dropped.
The set of ids seen lives in memory.  A line {"control": "flush"} makes it
write OUTDIR/stats.json: {"seen": N, "unique": N, "duplicates": N}.
"""

import json
import os
import sys

fifo, outdir = sys.argv[1], sys.argv[2]
os.makedirs(outdir, exist_ok=True)
seen: set[str] = set()
stats = {"seen": 0, "unique": 0, "duplicates": 0}
out = open(os.path.join(outdir, "unique.jsonl"), "a")
with open(os.open(fifo, os.O_RDWR), "r") as f:
    for line in f:
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if ev.get("control") == "flush":
            tmp = os.path.join(outdir, ".stats.tmp")
            with open(tmp, "w") as s:
                json.dump(stats, s, sort_keys=True)
            os.replace(tmp, os.path.join(outdir, "stats.json"))
            continue
        stats["seen"] += 1
        if ev["id"] in seen:
            stats["duplicates"] += 1
            continue
        seen.add(ev["id"])
        stats["unique"] += 1
        out.write(json.dumps(ev, sort_keys=True) + "\n")
        out.flush()
