"""Live access-log aggregator: reads log lines on stdin, keeps counters in memory.

    tail -n 0 -F access.log | python3 logagg.py --socket /tmp/logagg.sock

Each line: IP METHOD PATH STATUS BYTES.  Send `stats` (one line) to the socket
and it answers with the counters as JSON; `reset` clears them.
"""

import argparse
import json
import os
import socket
import sys
import threading

ap = argparse.ArgumentParser()
ap.add_argument("--socket", required=True)
args = ap.parse_args()

lock = threading.Lock()
stats = {"lines": 0, "bytes": 0, "status": {}, "paths": {}, "bad": 0}


def serve() -> None:
    if os.path.exists(args.socket):
        os.unlink(args.socket)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(args.socket)
    srv.listen(8)
    while True:
        conn, _ = srv.accept()
        with conn:
            cmd = conn.makefile().readline().strip()
            with lock:
                if cmd == "reset":
                    stats.update(lines=0, bytes=0, status={}, paths={}, bad=0)
                reply = json.dumps(stats, sort_keys=True) if cmd in ("stats", "reset") else '{"error": "unknown"}'
            conn.sendall(reply.encode() + b"\n")


threading.Thread(target=serve, daemon=True).start()
for line in sys.stdin:
    parts = line.split()
    with lock:
        if len(parts) != 5 or not parts[3].isdigit() or not parts[4].isdigit():
            stats["bad"] += 1
            continue
        _, _, path, status, size = parts
        stats["lines"] += 1
        stats["bytes"] += int(size)
        stats["status"][status] = stats["status"].get(status, 0) + 1
        stats["paths"][path] = stats["paths"].get(path, 0) + 1
