"""The checkpoint catalog: checkpoints, lineage, heads and blob reference counts.

Tables are documented in ``store/db.py``.  The rules:

**Publication** (a checkpoint is complete and verified, or absent):

1. every blob the checkpoint names is in the blob store;
2. the ones not already live are made durable (``BlobStore.sync``);
3. ONE transaction inserts the checkpoint row, takes its references and
   moves the sandbox's head to it.

A crash before 3 leaves only unreferenced blob files, which gc removes.

**References** form a DAG of owners (checkpoints, sandbox heads) and blobs;
``blob_refs`` holds exactly the live blobs, so any checkpoint can be deleted
without touching the others.  The counting is ``store/blobrefs.py``
(:class:`~crabd.store.blobrefs.BlobRefs`, which :class:`Catalog` extends);
this module takes and releases references in the transactions that publish,
adopt and delete checkpoints and move heads.

**Heads**: ``heads(sandbox, checkpoint, stat_blob)`` says what a sandbox's
filesystem currently descends from: its next checkpoint's parent, and the
index its next delta is computed against (``stat_blob`` when a restore wrote
one — same content as the checkpoint, the new files' inode numbers and
ctimes — else the checkpoint's own index).
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from crabd.errors import CheckpointNotFound
from crabd.models import CheckpointKind, CheckpointRecord
from crabd.store import identity
from crabd.store.blobrefs import BlobRefs, ChildrenOf, LiveBlob, SizeOf, ck_owner, direct_refs, head_owner
from crabd.store.db import Database, sandbox_owner_filter

# The reference DAG's vocabulary stays importable from here, where the catalog's callers have always found it.
__all__ = [
    "Catalog",
    "CheckpointFailure",
    "ChildrenOf",
    "Head",
    "LiveBlob",
    "SizeOf",
    "ck_owner",
    "direct_refs",
    "head_owner",
]

_NCOLS = 21
_COLS = (
    "id, sandbox_id, sandbox_name, owner_uid, parent_id, branch, turn, kind, created_at, label, image, spec_json,"
    " index_blob, delta_blob, session_blob, process_blob, racy_ns, kept, stats_json, pinned, provenance"
)


def _rec(row: tuple[Any, ...]) -> CheckpointRecord:
    return CheckpointRecord(
        id=str(row[0]),
        sandbox_id=str(row[1]),
        sandbox_name=str(row[2]),
        owner_uid=int(row[3]),
        parent_id=None if row[4] is None else str(row[4]),
        branch=int(row[5]),
        turn=int(row[6]),
        kind=CheckpointKind(str(row[7])),
        created_at=float(row[8]),
        label=str(row[9]),
        image=str(row[10]),
        spec_json=str(row[11]),
        index_blob=str(row[12]),
        delta_blob=str(row[13]),
        session_blob=None if row[14] is None else str(row[14]),
        process_blob=None if row[15] is None else str(row[15]),
        racy_ns=int(row[16]),
        kept=bool(row[17]),
        stats=json.loads(row[18]),
        pinned=bool(row[19]),
        provenance=str(row[20] or ""),
    )


def _row(rec: CheckpointRecord) -> tuple[Any, ...]:
    """``rec`` as the values of :data:`_COLS`."""
    return (
        rec.id,
        rec.sandbox_id,
        rec.sandbox_name,
        rec.owner_uid,
        rec.parent_id,
        rec.branch,
        rec.turn,
        rec.kind,
        rec.created_at,
        rec.label,
        rec.image,
        rec.spec_json,
        rec.index_blob,
        rec.delta_blob,
        rec.session_blob,
        rec.process_blob,
        rec.racy_ns,
        int(rec.kept),
        json.dumps(rec.stats, sort_keys=True),
        int(rec.pinned),
        rec.provenance,
    )


@dataclass(frozen=True)
class CheckpointFailure:
    """One checkpoint that failed (``crabctl checkpoint failures``)."""

    sandbox_id: str
    turn: int
    kind: CheckpointKind
    at: float
    error: str
    #: The CRIU log of a failed process dump ("" if none).
    log_path: str


@dataclass(frozen=True)
class Head:
    """What a sandbox's files descend from (see the module doc)."""

    checkpoint: CheckpointRecord | None
    stat_blob: str | None
    racy_ns: int

    @property
    def index_blob(self) -> str:
        """The index the next delta is computed against."""
        if self.stat_blob:
            return self.stat_blob
        assert self.checkpoint is not None
        return self.checkpoint.index_blob


class Catalog(BlobRefs):
    def __init__(self, db: Database) -> None:
        self.db = db
        #: Blobs released by head moves, for the next sweep (see :meth:`take_dropped`).
        self._dropped: list[str] = []

    def take_dropped(self) -> list[str]:
        """Blobs that head moves released since the last call (candidates for immediate removal)."""
        with self.db.lock:
            out, self._dropped = self._dropped, []
        return out

    @staticmethod
    def _head_uid(conn: sqlite3.Connection, sandbox_id: str, ckpt_id: str) -> int:
        """Whom a head's references are charged to: its sandbox's owner (else its checkpoint's; else -1)."""
        row = conn.execute("SELECT owner_uid FROM sandboxes WHERE id=?", (sandbox_id,)).fetchone()
        if row is None:
            row = conn.execute("SELECT owner_uid FROM checkpoints WHERE id=?", (ckpt_id,)).fetchone()
        return -1 if row is None else int(row[0])

    # --- publication and heads ---------------------------------------------------

    def publish(
        self, rec: CheckpointRecord, children: ChildrenOf, size_of: SizeOf, hook: Callable[[], None] | None = None
    ) -> None:
        """Make ``rec`` visible and the head of its sandbox, in one transaction.

        ``hook`` (tests only) runs inside the transaction, just before COMMIT.
        """
        with self.db.tx() as conn:
            conn.execute(f"INSERT INTO checkpoints({_COLS}) VALUES({','.join('?' * _NCOLS)})", _row(rec))
            self._take(conn, ck_owner(rec.id), rec.owner_uid, direct_refs(rec), children, size_of)
            self._set_head(conn, rec.sandbox_id, rec.id, None, rec.racy_ns, children, size_of)
            if hook is not None:
                hook()

    def adopt(self, rec: CheckpointRecord, children: ChildrenOf, size_of: SizeOf) -> None:
        """Make ``rec`` (fetched from another host; its blobs stored and durable) visible, in one transaction.

        Unlike :meth:`publish` no sandbox's head moves: the checkpoint is
        only something to restore or fork from.  Adopting one that is here
        already changes nothing.
        """
        with self.db.tx() as conn:
            if conn.execute("SELECT 1 FROM checkpoints WHERE id=?", (rec.id,)).fetchone() is not None:
                return
            identity.claim(conn, rec.sandbox_id, rec.owner_uid, "fetch")
            conn.execute(f"INSERT INTO checkpoints({_COLS}) VALUES({','.join('?' * _NCOLS)})", _row(rec))
            self._take(conn, ck_owner(rec.id), rec.owner_uid, direct_refs(rec), children, size_of)

    def _set_head(
        self,
        conn: sqlite3.Connection,
        sandbox_id: str,
        ckpt_id: str,
        stat_blob: str | None,
        racy_ns: int,
        children: ChildrenOf,
        size_of: SizeOf,
    ) -> None:
        # Take the new references before releasing the old ones, so blobs
        # shared by both never drop to zero in between.
        owner = head_owner(sandbox_id)
        old = {str(r[0]) for r in conn.execute("SELECT blob FROM refs WHERE owner=?", (owner,))}
        new = {stat_blob} if stat_blob else set()
        self._take(conn, owner, self._head_uid(conn, sandbox_id, ckpt_id), new - old, children, size_of)
        self._drop_refs(conn, owner, old - new, self._dropped)
        conn.execute(
            "INSERT INTO heads(sandbox_id, checkpoint_id, stat_blob, racy_ns) VALUES(?,?,?,?)"
            " ON CONFLICT(sandbox_id) DO UPDATE"
            " SET checkpoint_id=excluded.checkpoint_id, stat_blob=excluded.stat_blob, racy_ns=excluded.racy_ns",
            (sandbox_id, ckpt_id, stat_blob, racy_ns),
        )

    def set_head(
        self,
        sandbox_id: str,
        ckpt_id: str,
        stat_blob: str | None,
        racy_ns: int,
        children: ChildrenOf,
        size_of: SizeOf,
        conn: sqlite3.Connection | None = None,
    ) -> None:
        """Point ``sandbox_id`` at ``ckpt_id`` (joining the caller's transaction if ``conn`` is given)."""
        if conn is not None:
            self._set_head(conn, sandbox_id, ckpt_id, stat_blob, racy_ns, children, size_of)
            return
        with self.db.tx() as c:
            self._set_head(c, sandbox_id, ckpt_id, stat_blob, racy_ns, children, size_of)

    def head(self, sandbox_id: str) -> Head | None:
        """The sandbox's head, or None when it has none.

        ``Head.checkpoint`` is None when the checkpoint it stood on was
        deleted and had no parent; the stat index still describes its files.
        """
        with self.db.lock:
            row = self.db.conn.execute(
                "SELECT checkpoint_id, stat_blob, racy_ns FROM heads WHERE sandbox_id=?", (sandbox_id,)
            ).fetchone()
            if row is None:
                return None
            rec = self.find(str(row[0])) if row[0] else None
        if rec is None and not row[1]:
            return None
        return Head(rec, None if row[1] is None else str(row[1]), int(row[2]))

    #: A head and the checkpoint it stands on, if that still exists (``head`` says the same through ``find``).
    _HEAD_IDS = "SELECT h.sandbox_id, c.id FROM heads h JOIN checkpoints c ON c.id = h.checkpoint_id"

    def head_id(self, sandbox_id: str) -> str | None:
        """The id of the checkpoint the sandbox's head stands on; None: no head, or it stands on none."""
        with self.db.lock:
            row = self.db.conn.execute(f"{self._HEAD_IDS} WHERE h.sandbox_id=?", (sandbox_id,)).fetchone()
        return None if row is None else str(row[1])

    def head_ids(self) -> dict[str, str]:
        """:meth:`head_id` of every sandbox that has one, in one statement (a listing of a thousand sandboxes)."""
        with self.db.lock:
            return {str(s): str(c) for s, c in self.db.conn.execute(self._HEAD_IDS)}

    def drop_head(self, sandbox_id: str) -> list[str]:
        """Forget a sandbox's head; return the blobs that are no longer referenced."""
        dropped: list[str] = []
        with self.db.tx() as c:
            self._release(c, head_owner(sandbox_id), dropped)
            c.execute("DELETE FROM heads WHERE sandbox_id=?", (sandbox_id,))
        return dropped

    def heads_without(self, live_sandboxes: set[str]) -> list[str]:
        """Sandboxes that have a head but no longer exist (a crash came between removing one and forgetting it)."""
        with self.db.lock:
            rows = self.db.conn.execute("SELECT sandbox_id FROM heads").fetchall()
        return sorted(str(r[0]) for r in rows if str(r[0]) not in live_sandboxes)

    # --- queries ---------------------------------------------------------------------

    def find(self, ckpt_id: str) -> CheckpointRecord | None:
        with self.db.lock:
            row = self.db.conn.execute(f"SELECT {_COLS} FROM checkpoints WHERE id=?", (ckpt_id,)).fetchone()
        return None if row is None else _rec(row)

    def get(self, ckpt_id: str) -> CheckpointRecord:
        rec = self.find(ckpt_id)
        if rec is None:
            raise CheckpointNotFound(f"no checkpoint {ckpt_id!r}", checkpoint=ckpt_id)
        return rec

    def list_checkpoints(self, sandbox_id: str | None = None, owner_uid: int | None = None) -> list[CheckpointRecord]:
        where, args = sandbox_owner_filter(sandbox_id, owner_uid)
        with self.db.lock:
            rows = self.db.conn.execute(
                f"SELECT {_COLS} FROM checkpoints{where} ORDER BY created_at, rowid", args
            ).fetchall()
        return [_rec(r) for r in rows]

    def children(self, ckpt_id: str) -> list[CheckpointRecord]:
        with self.db.lock:
            rows = self.db.conn.execute(
                f"SELECT {_COLS} FROM checkpoints WHERE parent_id=? ORDER BY created_at, rowid", (ckpt_id,)
            ).fetchall()
        return [_rec(r) for r in rows]

    def lineage(self, ckpt_id: str) -> list[CheckpointRecord]:
        """``ckpt_id`` and its ancestors, root first."""
        chain: list[CheckpointRecord] = []
        seen: set[str] = set()
        cur: str | None = ckpt_id
        while cur is not None and cur not in seen:
            seen.add(cur)
            rec = self.find(cur)
            if rec is None:
                break
            chain.append(rec)
            cur = rec.parent_id
        return list(reversed(chain))

    def by_turn(self, sandbox_id: str, turn: int, owner_uid: int) -> list[CheckpointRecord]:
        """The checkpoints ``owner_uid``'s sandbox ``sandbox_id`` took at ``turn`` (another owner's
        checkpoints carrying the same sandbox id are not its own: store/identity.py)."""
        with self.db.lock:
            rows = self.db.conn.execute(
                f"SELECT {_COLS} FROM checkpoints WHERE sandbox_id=? AND turn=? AND owner_uid=?"
                " ORDER BY created_at, rowid",
                (sandbox_id, turn, owner_uid),
            ).fetchall()
        return [_rec(r) for r in rows]

    def heads_on(self, ckpt_id: str) -> list[str]:
        """Sandboxes whose head is ``ckpt_id``."""
        with self.db.lock:
            rows = self.db.conn.execute("SELECT sandbox_id FROM heads WHERE checkpoint_id=?", (ckpt_id,)).fetchall()
        return [str(r[0]) for r in rows]

    # --- failed attempts ---------------------------------------------------------------

    def record_failure(
        self, sandbox_id: str, turn: int, kind: CheckpointKind, error: str, log_path: str, owner_uid: int | None = None
    ) -> None:
        """Record a checkpoint that was not made (``owner_uid``: the sandbox's owner; None: the ledger's)."""
        with self.db.tx() as conn:
            if owner_uid is None:
                row = conn.execute("SELECT owner_uid FROM sandbox_ids WHERE id=?", (sandbox_id,)).fetchone()
                owner_uid = None if row is None else int(row[0])
            conn.execute(
                "INSERT INTO failures(sandbox_id, owner_uid, turn, kind, at, error, log_path) VALUES(?,?,?,?,?,?,?)",
                (sandbox_id, owner_uid, turn, kind, time.time(), error[:4000], log_path),
            )
            # Keep the last 100 per sandbox.
            conn.execute(
                "DELETE FROM failures WHERE sandbox_id=? AND id NOT IN"
                " (SELECT id FROM failures WHERE sandbox_id=? ORDER BY id DESC LIMIT 100)",
                (sandbox_id, sandbox_id),
            )

    def failures(
        self, sandbox_id: str | None, limit: int = 20, owner_uid: int | None = None
    ) -> list[CheckpointFailure]:
        """Recent failed checkpoints (of ``sandbox_id`` and/or ``owner_uid`` when given), newest first."""
        q = "SELECT sandbox_id, turn, kind, at, error, log_path FROM failures WHERE 1=1"
        args: list[object] = []
        if sandbox_id is not None:
            q += " AND sandbox_id=?"
            args.append(sandbox_id)
        if owner_uid is not None:
            q += " AND owner_uid=?"
            args.append(owner_uid)
        with self.db.lock:
            rows = self.db.conn.execute(q + " ORDER BY id DESC LIMIT ?", [*args, limit]).fetchall()
        return [
            CheckpointFailure(str(r[0]), int(r[1]), CheckpointKind(str(r[2])), float(r[3]), str(r[4]), str(r[5]))
            for r in rows
        ]

    # --- deletion ------------------------------------------------------------------------

    def delete(self, ckpt_id: str) -> list[str]:
        """Delete one checkpoint; return the blobs that are no longer referenced.

        Its children are re-parented to its parent; sandboxes whose head it
        was keep its index as their stat index, so their next delta stays
        small and exact.
        """
        dropped: list[str] = []
        with self.db.tx() as conn:
            rec = self.find(ckpt_id)
            if rec is None:
                raise CheckpointNotFound(f"no checkpoint {ckpt_id!r}", checkpoint=ckpt_id)
            for sid in self.heads_on(ckpt_id):
                row = conn.execute("SELECT stat_blob FROM heads WHERE sandbox_id=?", (sid,)).fetchone()
                stat = str(row[0]) if row and row[0] else rec.index_blob
                if rec.parent_id is None:
                    # Nothing left to descend from: the sandbox starts a new root, but its next
                    # delta is still computed against what it has now.
                    conn.execute("UPDATE heads SET checkpoint_id='' WHERE sandbox_id=?", (sid,))
                else:
                    conn.execute("UPDATE heads SET checkpoint_id=? WHERE sandbox_id=?", (rec.parent_id, sid))
                if not row or not row[0]:
                    uid = self._head_uid(conn, sid, ckpt_id)
                    self._take(conn, head_owner(sid), uid, [stat], lambda _b: (), lambda _b: (0, 0))
                    conn.execute("UPDATE heads SET stat_blob=?, racy_ns=? WHERE sandbox_id=?", (stat, rec.racy_ns, sid))
            conn.execute("UPDATE checkpoints SET parent_id=? WHERE parent_id=?", (rec.parent_id, ckpt_id))
            conn.execute("UPDATE sandboxes SET origin=? WHERE origin=?", (rec.parent_id or "", ckpt_id))
            self._release(conn, ck_owner(ckpt_id), dropped)
            conn.execute("DELETE FROM checkpoints WHERE id=?", (ckpt_id,))
        return dropped

    def set_kept(self, ckpt_ids: Iterable[str], kept: bool) -> None:
        with self.db.tx() as conn:
            conn.executemany("UPDATE checkpoints SET kept=? WHERE id=?", [(int(kept), c) for c in ckpt_ids])

    def ids(self) -> set[str]:
        """Every checkpoint's id (cheaper than listing the records)."""
        with self.db.lock:
            return {str(r[0]) for r in self.db.conn.execute("SELECT id FROM checkpoints")}

    def set_pinned(self, ckpt_id: str, pinned: bool) -> CheckpointRecord:
        """Pin or unpin one checkpoint (retention never thins a pinned one); its record after."""
        with self.db.tx() as conn:
            if conn.execute("UPDATE checkpoints SET pinned=? WHERE id=?", (int(pinned), ckpt_id)).rowcount == 0:
                raise CheckpointNotFound(f"no checkpoint {ckpt_id!r}", checkpoint=ckpt_id)
        return self.get(ckpt_id)

    def set_provenance(self, ckpt_id: str, provenance: str) -> bool:
        """Record the provenance of a checkpoint that has none (crabd/trust/provenance.py); whether it did."""
        with self.db.tx() as conn:
            sql = "UPDATE checkpoints SET provenance=? WHERE id=? AND provenance=''"
            return conn.execute(sql, (provenance, ckpt_id)).rowcount > 0

    def prunable(self, live_sandboxes: set[str]) -> list[str]:
        """Checkpoints nobody needs any more: their sandbox is gone, they are not kept, no checkpoint
        descends from them and no sandbox stands on them (head or origin).  Leaves first."""
        with self.db.lock:
            conn = self.db.conn
            rows = conn.execute("SELECT id, sandbox_id, parent_id, kept FROM checkpoints").fetchall()
            heads = {str(r[0]) for r in conn.execute("SELECT checkpoint_id FROM heads")}
            origins = {str(r[0]) for r in conn.execute("SELECT origin FROM sandboxes")}
        parent = {str(r[0]): (None if r[2] is None else str(r[2])) for r in rows}
        kids: dict[str, int] = {}
        for p in parent.values():
            if p is not None:
                kids[p] = kids.get(p, 0) + 1
        removable = {str(r[0]) for r in rows if str(r[1]) not in live_sandboxes and not r[3]} - heads - origins
        out: list[str] = []
        frontier = [c for c in removable if not kids.get(c)]
        while frontier:
            c = frontier.pop()
            out.append(c)
            p = parent.get(c)
            if p is not None:
                kids[p] -= 1
                if p in removable and kids[p] == 0:
                    frontier.append(p)
        return out

    # --- portable archives (coordinator/archives.py) -------------------------------------

    def adopt_all(self, recs: list[CheckpointRecord], children: ChildrenOf, size_of: SizeOf) -> list[str]:
        """Make ``recs`` (parent first; every blob stored and durable) visible in ONE transaction, as
        :meth:`adopt` does one; those already here are left as they are.  Returns the ids added."""
        added: list[str] = []
        with self.db.tx() as conn:
            for rec in recs:
                if conn.execute("SELECT 1 FROM checkpoints WHERE id=?", (rec.id,)).fetchone() is not None:
                    continue
                identity.claim(conn, rec.sandbox_id, rec.owner_uid, "import")
                conn.execute(f"INSERT INTO checkpoints({_COLS}) VALUES({','.join('?' * len(_row(rec)))})", _row(rec))
                self._take(conn, ck_owner(rec.id), rec.owner_uid, direct_refs(rec), children, size_of)
                added.append(rec.id)
        return added
