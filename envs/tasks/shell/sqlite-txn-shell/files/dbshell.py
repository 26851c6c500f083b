"""A database console that outlives its clients: one SQLite connection, served on a unix socket.

    python3 dbshell.py DBFILE SOCKET

Every request runs on the same connection, so TEMP tables and an open
transaction (BEGIN ... COMMIT) carry over from one request to the next.
The connection is in autocommit mode: nothing is in a transaction unless
you BEGIN one.  Use dbq.py to talk to it.
"""

import json
import os
import socket
import sqlite3
import sys

db, path = sys.argv[1], sys.argv[2]
conn = sqlite3.connect(db, isolation_level=None)
if os.path.exists(path):
    os.unlink(path)
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind(path)
srv.listen(4)
print(f"dbshell: {db} on {path}", flush=True)
while True:
    c, _ = srv.accept()
    with c:
        chunks = []
        while True:
            b = c.recv(65536)
            if not b:
                break
            chunks.append(b)
        req = json.loads(b"".join(chunks))
        try:
            if req.get("script"):
                conn.executescript(req["sql"])
                reply = {"ok": True, "rows": []}
            else:
                cur = conn.execute(req["sql"], req.get("params", []))
                reply = {"ok": True, "rows": cur.fetchall()}
            reply["in_transaction"] = conn.in_transaction
        except sqlite3.Error as e:
            reply = {"ok": False, "error": str(e), "in_transaction": conn.in_transaction}
        c.sendall(json.dumps(reply).encode())
