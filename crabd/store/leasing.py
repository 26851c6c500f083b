"""Checkpoints being read by a restore, fork or export, in the shared database (coordinator/leases.py).

Table::

    leases(id TEXT PK,              -- random, one per hold
           shard INT,               -- the crabd process that holds it
           checkpoint_id TEXT)      -- what retention must not delete meanwhile

In the database, not in memory, because retention in one crabd process may
thin the checkpoints of a uid whose restore runs in another (``[daemon]
workers``).  A hold and a deletion are both write transactions, so one of
them comes first: either the lease is there when the deletion chooses, or
the checkpoint is gone when the hold looks it up.  A process that dies
leaves its rows; its successor drops them before it serves
(:func:`drop_shard`).  Group-committed (store/db.py): a lease lost to a
power loss belonged to an operation that died with the host.
"""

from __future__ import annotations

import secrets
import sqlite3

SCHEMA = """
CREATE TABLE IF NOT EXISTS leases(id TEXT PRIMARY KEY, shard INTEGER NOT NULL, checkpoint_id TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS leases_checkpoint ON leases(checkpoint_id);
"""


def add(conn: sqlite3.Connection, shard: int, checkpoint_id: str) -> str:
    """Inside the caller's transaction: a lease on ``checkpoint_id``; returns its id."""
    lid = secrets.token_hex(8)
    conn.execute("INSERT INTO leases(id, shard, checkpoint_id) VALUES(?,?,?)", (lid, shard, checkpoint_id))
    return lid


def remove(conn: sqlite3.Connection, lease_id: str) -> None:
    conn.execute("DELETE FROM leases WHERE id=?", (lease_id,))


def held(conn: sqlite3.Connection) -> set[str]:
    """Every process's leased checkpoints (read inside the deleting transaction to act on it)."""
    return {str(r[0]) for r in conn.execute("SELECT DISTINCT checkpoint_id FROM leases")}


def drop_shard(conn: sqlite3.Connection, shard: int | None) -> int:
    """A dead process's leases (None: every process's, no other being alive)."""
    if shard is None:
        return int(conn.execute("DELETE FROM leases").rowcount)
    return int(conn.execute("DELETE FROM leases WHERE shard=?", (shard,)).rowcount)
