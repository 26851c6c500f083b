"""Client for dbshell.py.

    dbq.py 'SQL'          one statement; rows are printed tab-separated
    dbq.py -f FILE|-      a script (several statements), no rows
    dbq.py --csv TABLE FILE   insert every row of a CSV file (header = column names)

Socket: $DBSHELL_SOCK, default /tmp/dbshell.sock.  Exit status 1 on an SQL error.
"""

import csv
import json
import os
import socket
import sys

SOCK = os.environ.get("DBSHELL_SOCK", "/tmp/dbshell.sock")


def call(req: dict) -> dict:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(SOCK)
    s.sendall(json.dumps(req).encode())
    s.shutdown(socket.SHUT_WR)
    data = b""
    while True:
        b = s.recv(65536)
        if not b:
            break
        data += b
    s.close()
    return json.loads(data)


args = sys.argv[1:]
if args[:1] == ["-f"]:
    text = sys.stdin.read() if args[1] == "-" else open(args[1]).read()
    replies = [call({"sql": text, "script": True})]
elif args[:1] == ["--csv"]:
    table, fname = args[1], args[2]
    with open(fname, newline="") as f:
        rows = list(csv.reader(f))
    cols = ",".join(rows[0])
    marks = ",".join("?" * len(rows[0]))
    replies = [call({"sql": f"INSERT INTO {table} ({cols}) VALUES ({marks})", "params": r}) for r in rows[1:]]
    print(f"{len(rows) - 1} rows sent")
else:
    replies = [call({"sql": " ".join(args)})]
for r in replies:
    if not r["ok"]:
        sys.exit(f"error: {r['error']}")
    for row in r["rows"]:
        print("\t".join("" if v is None else str(v) for v in row))
if replies and replies[-1]["in_transaction"]:
    print("(transaction open)", file=sys.stderr)
