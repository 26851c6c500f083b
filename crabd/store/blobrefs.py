"""The blob reference DAG of the checkpoint catalog: which blobs are live, and who holds them.

**References** form a DAG.  An *owner* holds direct references: a checkpoint
(``ck:<id>``: its index, delta and session blobs) or a sandbox head
(``head:<sandbox>``: the stat index written after a restore).  A blob that
names other blobs (an index names its pages, a page the file contents) has
*edges* to them.  ``blob_refs.refcount`` counts live referrers, owners and
live parents alike; a blob becoming live takes references on its children,
a blob dropping to zero releases them, and its row disappears.  So
``blob_refs`` holds exactly the live blobs, every checkpoint is
self-contained, and any checkpoint can be deleted without touching the
others (its children are re-parented to its parent).

Tables are documented in ``store/db.py``; the per-uid charges that follow
the same references are ``store/charges.py``.  :class:`BlobRefs` is the
part of :class:`~crabd.store.catalog.Catalog` that keeps and reads these
counts; the catalog takes and releases references in the same transactions
that publish, adopt and delete checkpoints and move heads.
"""

from __future__ import annotations

import sqlite3
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from crabd.models import CheckpointRecord
from crabd.store import charges
from crabd.store.db import Database

#: Children of a blob that is becoming live (supplied by whoever wrote it).
ChildrenOf = Callable[[str], Iterable[str]]
#: (content size, bytes on disk) of a blob that is becoming live.
SizeOf = Callable[[str], tuple[int, int]]


@dataclass(frozen=True)
class LiveBlob:
    """A blob some checkpoint still references (a row of ``blob_refs``)."""

    refcount: int
    #: Its size, and the bytes its file takes in the blob store (``BlobStore.stored_size``).
    size: int
    stored: int


#: Parameters per "IN (...)" query (SQLite allows at least 999).
_BATCH = 500


def _select_in(conn: sqlite3.Connection, sql: str, keys: list[str], *, columns: int = 1) -> list[Any]:
    """Run ``sql`` (with one "{}" for the placeholders) over ``keys`` in batches; rows, or values if one column."""
    out: list[Any] = []
    for i in range(0, len(keys), _BATCH):
        chunk = keys[i : i + _BATCH]
        rows = conn.execute(sql.format(",".join("?" * len(chunk))), chunk).fetchall()
        out.extend(rows if columns > 1 else (r[0] for r in rows))
    return out


def ck_owner(ckpt_id: str) -> str:
    return f"ck:{ckpt_id}"


def head_owner(sandbox_id: str) -> str:
    return f"head:{sandbox_id}"


def direct_refs(rec: CheckpointRecord) -> set[str]:
    return {b for b in (rec.index_blob, rec.delta_blob, rec.session_blob, rec.process_blob) if b}


class BlobRefs:
    """Reference counting over ``refs``, ``blob_refs`` and ``blob_edges`` (see the module doc)."""

    db: Database

    # --- reference counting (inside a transaction) ---------------------------

    # Reference changes cascade through the DAG one level at a time, with one
    # statement per batch rather than per blob: a first checkpoint of a big
    # tree brings tens of thousands of file contents to life at once.

    @staticmethod
    def _incref(conn: sqlite3.Connection, blobs: Counter[str], children: ChildrenOf, size_of: SizeOf) -> None:
        """Add ``blobs[b]`` references to each ``b``; blobs coming to life take references on their children."""
        level = blobs
        while level:
            keys = list(level)
            live = set(_select_in(conn, "SELECT blob FROM blob_refs WHERE blob IN ({})", keys))
            conn.executemany(
                "UPDATE blob_refs SET refcount=refcount+? WHERE blob=?", [(level[b], b) for b in keys if b in live]
            )
            born = [b for b in keys if b not in live]
            conn.executemany(
                "INSERT INTO blob_refs(blob, refcount, size, stored) VALUES(?,?,?,?)",
                [(b, level[b], *size_of(b)) for b in born],
            )
            nxt: Counter[str] = Counter()
            edges: list[tuple[str, str]] = []
            for b in born:
                kids = set(children(b))
                edges.extend((b, k) for k in kids)
                nxt.update(kids)
            conn.executemany("INSERT OR IGNORE INTO blob_edges(parent, child) VALUES(?,?)", edges)
            level = nxt

    @staticmethod
    def _decref(conn: sqlite3.Connection, blobs: Counter[str], dropped: list[str] | None = None) -> None:
        """Remove ``blobs[b]`` references from each ``b``; blobs that reach zero release their children
        and are appended to ``dropped``."""
        level = blobs
        while level:
            keys = list(level)
            counts = {
                str(b): int(n)
                for b, n in _select_in(conn, "SELECT blob, refcount FROM blob_refs WHERE blob IN ({})", keys, columns=2)
            }
            conn.executemany(
                "UPDATE blob_refs SET refcount=refcount-? WHERE blob=?",
                [(level[b], b) for b in keys if b in counts and counts[b] > level[b]],
            )
            die = [b for b in keys if b in counts and counts[b] <= level[b]]
            conn.executemany("DELETE FROM blob_refs WHERE blob=?", [(b,) for b in die])
            kids = [
                str(c)
                for _, c in _select_in(
                    conn, "SELECT parent, child FROM blob_edges WHERE parent IN ({})", die, columns=2
                )
            ]
            conn.executemany("DELETE FROM blob_edges WHERE parent=?", [(b,) for b in die])
            if dropped is not None:
                dropped.extend(die)
            level = Counter(kids)

    def _take(
        self,
        conn: sqlite3.Connection,
        owner: str,
        uid: int,
        blobs: Iterable[str],
        children: ChildrenOf,
        size_of: SizeOf,
    ) -> None:
        """``owner`` references ``blobs``, charged to ``uid`` (``store/charges.py``)."""
        added: Counter[str] = Counter()
        for b in sorted(set(blobs)):
            if conn.execute("INSERT OR IGNORE INTO refs(owner, blob, uid) VALUES(?,?,?)", (owner, b, uid)).rowcount:
                added[b] += 1
        self._incref(conn, added, children, size_of)
        charges.take(conn, uid, added)

    def _drop_refs(
        self, conn: sqlite3.Connection, owner: str, blobs: Iterable[str] | None, dropped: list[str] | None
    ) -> None:
        """Release ``owner``'s references to ``blobs`` (None: all), uid charges first (they need the edges)."""
        rows = [(str(r[0]), r[1]) for r in conn.execute("SELECT blob, uid FROM refs WHERE owner=?", (owner,))]
        if blobs is not None:
            want = set(blobs)
            rows = [r for r in rows if r[0] in want]
        conn.executemany("DELETE FROM refs WHERE owner=? AND blob=?", [(owner, b) for b, _ in rows])
        for uid in {u for _, u in rows if u is not None}:
            charges.release(conn, int(uid), Counter(b for b, u in rows if u == uid))
        self._decref(conn, Counter(b for b, _ in rows), dropped)

    def _release(self, conn: sqlite3.Connection, owner: str, dropped: list[str] | None = None) -> None:
        self._drop_refs(conn, owner, None, dropped)

    # --- reading the counts ----------------------------------------------------------

    def becoming_live(self, roots: Iterable[str], children: ChildrenOf) -> set[str]:
        """The blobs that referencing ``roots`` would bring to life: they must be made durable first.

        A live blob was durable when it first became live and keeps its
        children live, so the walk stops at live blobs.
        """
        out: set[str] = set()
        level = set(roots)
        with self.db.lock:
            while level:
                live = self.live_among(level)
                born = level - live - out
                out |= born
                level = {k for b in born for k in children(b)} - out
        return out

    def is_live(self, blob: str) -> bool:
        with self.db.lock:
            return self.db.conn.execute("SELECT 1 FROM blob_refs WHERE blob=?", (blob,)).fetchone() is not None

    def live_among(self, blobs: Iterable[str]) -> set[str]:
        """Which of ``blobs`` are live (batched: a fetched checkpoint names thousands)."""
        with self.db.lock:
            return {
                str(b) for b in _select_in(self.db.conn, "SELECT blob FROM blob_refs WHERE blob IN ({})", list(blobs))
            }

    def live_blobs(self) -> dict[str, LiveBlob]:
        """Every live blob, by its hex id."""
        with self.db.lock:
            rows = self.db.conn.execute("SELECT blob, refcount, size, stored FROM blob_refs").fetchall()
        return {str(r[0]): LiveBlob(int(r[1]), int(r[2]), int(r[3])) for r in rows}

    def users_of(self, blob: str) -> tuple[list[str], list[str]]:
        """(checkpoints, sandbox heads) whose state needs ``blob``, found by walking edges upwards."""
        ckpts: set[str] = set()
        heads: set[str] = set()
        seen: set[str] = set()
        todo = [blob]
        with self.db.lock:
            conn = self.db.conn
            while todo:
                b = todo.pop()
                if b in seen:
                    continue
                seen.add(b)
                for (owner,) in conn.execute("SELECT owner FROM refs WHERE blob=?", (b,)):
                    kind, _, ident = str(owner).partition(":")
                    (ckpts if kind == "ck" else heads).add(ident)
                todo.extend(str(r[0]) for r in conn.execute("SELECT parent FROM blob_edges WHERE child=?", (b,)))
        return sorted(ckpts), sorted(heads)

    def owned_blobs(self, uid: int) -> set[str]:
        """Every blob a checkpoint of ``uid`` needs (its roots and what they reach): what is charged to it.

        One recursive query, so that a fetch can tell which of its blobs the
        importer already holds without a walk per blob (``crabd/trust/references.py``).
        """
        with self.db.lock:
            rows = self.db.conn.execute(
                "WITH RECURSIVE r(b) AS ("
                " SELECT refs.blob FROM refs JOIN checkpoints c ON refs.owner = 'ck:' || c.id WHERE c.owner_uid=?"
                " UNION SELECT e.child FROM blob_edges e JOIN r ON e.parent = r.b)"
                " SELECT b FROM r",
                (uid,),
            ).fetchall()
        return {str(r[0]) for r in rows}

    def reachable(self, roots: Iterable[str]) -> set[str]:
        """Every live blob reachable from ``roots`` through edges."""
        out: set[str] = set()
        todo = list(roots)
        with self.db.lock:
            while todo:
                b = todo.pop()
                if b in out:
                    continue
                out.add(b)
                todo.extend(
                    str(r[0]) for r in self.db.conn.execute("SELECT child FROM blob_edges WHERE parent=?", (b,))
                )
        return out
