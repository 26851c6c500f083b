"""migrate.py DB DIR [--status]: apply the pending migrations DIR/NNN_name.sql to the SQLite DB.

Each migration runs in its own transaction and is recorded in
schema_migrations (version, name, sha256 of the file).  An applied migration
whose file changed afterwards is an error.
"""

import hashlib
import os
import re
import sqlite3
import sys

db_path, mdir = sys.argv[1], sys.argv[2]
db = sqlite3.connect(db_path, isolation_level=None)
db.execute("CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY, name TEXT NOT NULL, sha256 TEXT NOT NULL)")
applied = {v: (n, h) for v, n, h in db.execute("SELECT version, name, sha256 FROM schema_migrations")}
files = sorted(f for f in os.listdir(mdir) if re.fullmatch(r"\d{3}_[a-z0-9_]+\.sql", f))
pending = []
for f in files:
    v, text = int(f[:3]), open(os.path.join(mdir, f)).read()
    h = hashlib.sha256(text.encode()).hexdigest()
    if v in applied:
        if applied[v][1] != h:
            sys.exit(f"migration {f} was changed after it was applied")
        continue
    pending.append((v, f, text, h))
if "--status" in sys.argv:
    for v, (n, _) in sorted(applied.items()):
        print(f"applied  {v:03d} {n}")
    for v, f, _, _ in pending:
        print(f"pending  {f}")
    sys.exit(0)
for v, f, text, h in pending:
    try:
        db.execute("BEGIN")
        for stmt in [s for s in text.split(";") if s.strip()]:
            db.execute(stmt)
        db.execute("INSERT INTO schema_migrations VALUES (?, ?, ?)", (v, f, h))
        db.execute("COMMIT")
    except sqlite3.Error as e:
        db.execute("ROLLBACK")
        sys.exit(f"{f}: {e}")
    print(f"applied {f}")
