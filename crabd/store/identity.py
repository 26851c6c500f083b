"""The ledger of sandbox ids: every id ever used on this host, and the one uid it belongs to.

A sandbox id names a lineage: turn numbers, the head, retention policies,
failure records and "the sandbox's newest checkpoint" are all looked up by
it.  Checkpoints outlive their sandbox (``keep_checkpoints``, archives), so
an id that no sandbox uses now may still name another tenant's history.
The ledger remembers who each id belongs to, for ever, so that an id that
arrives from outside (an archive record, ``ImportSandbox``, a bucket
object) can be compared with it (``crabd/trust/identity.py``).

Table (created and backfilled idempotently by ``store/db.py``)::

    sandbox_ids(id TEXT PK, owner_uid INT, first_seen REAL,
                source TEXT)      -- create | fork | arrive | import | fetch | backfill

Rules:

1. a row is written when an id is first used here (a sandbox row is
   inserted, a checkpoint is adopted from an archive or the bucket), in the
   same transaction as that use;
2. a row is never updated nor deleted (removing a sandbox, deleting its
   checkpoints and gc leave it);
3. at migration, ids already in ``sandboxes``, ``checkpoints`` and
   ``remote_index`` are backfilled, the earliest use deciding the owner.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterable

from crabd.errors import PermissionDenied
from crabd.store.db import Database


def claim(conn: sqlite3.Connection, sandbox_id: str, owner_uid: int, source: str) -> None:
    """Record that ``owner_uid`` uses ``sandbox_id`` (inside the caller's transaction).

    Raises :class:`PermissionDenied` when the id belongs to another uid:
    the caller's transaction then rolls back, and nothing was changed.
    """
    conn.execute(
        "INSERT OR IGNORE INTO sandbox_ids(id, owner_uid, first_seen, source) VALUES(?,?,?,?)",
        (sandbox_id, owner_uid, time.time(), source),
    )
    row = conn.execute("SELECT owner_uid FROM sandbox_ids WHERE id=?", (sandbox_id,)).fetchone()
    if row is not None and int(row[0]) != owner_uid:
        raise PermissionDenied(
            f"sandbox id {sandbox_id} belongs to another uid on this host; uid {owner_uid} cannot use it",
            uid=owner_uid,
            sandbox=sandbox_id,
            hint="Nothing was changed.  Sandbox ids are never reused across owners; import or fork the"
            " checkpoint as a new sandbox instead.",
        )


class SandboxIds:
    """Reads of the ledger (writes go through :func:`claim`, inside the write that uses an id)."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def owner(self, sandbox_id: str) -> int | None:
        """The uid ``sandbox_id`` belongs to, or None if this host never saw it."""
        with self.db.lock:
            row = self.db.conn.execute("SELECT owner_uid FROM sandbox_ids WHERE id=?", (sandbox_id,)).fetchone()
        return None if row is None else int(row[0])

    def live_owner(self, sandbox_id: str) -> int | None:
        """The owner of the sandbox ``sandbox_id`` if one exists here now."""
        with self.db.lock:
            row = self.db.conn.execute("SELECT owner_uid FROM sandboxes WHERE id=?", (sandbox_id,)).fetchone()
        return None if row is None else int(row[0])

    def owners(self, sandbox_id: str) -> set[int]:
        """Every uid this host associates with ``sandbox_id``: the ledger's, any sandbox's or checkpoint's,
        and any the remote tier's catalog lists (what the bucket knows)."""
        with self.db.lock:
            rows = self.db.conn.execute(
                "SELECT owner_uid FROM sandbox_ids WHERE id=:s"
                " UNION SELECT owner_uid FROM sandboxes WHERE id=:s"
                " UNION SELECT owner_uid FROM checkpoints WHERE sandbox_id=:s"
                " UNION SELECT owner_uid FROM remote_index WHERE sandbox_id=:s",
                {"s": sandbox_id},
            ).fetchall()
        return {int(r[0]) for r in rows}

    def taken(self, sandbox_ids: Iterable[str]) -> set[str]:
        """Which of ``sandbox_ids`` this host knows at all (under any owner)."""
        out: set[str] = set()
        with self.db.lock:
            for sid in set(sandbox_ids):
                if self.db.conn.execute(
                    "SELECT 1 FROM sandbox_ids WHERE id=:s UNION SELECT 1 FROM checkpoints WHERE sandbox_id=:s"
                    " UNION SELECT 1 FROM remote_index WHERE sandbox_id=:s",
                    {"s": sid},
                ).fetchone():
                    out.add(sid)
        return out
