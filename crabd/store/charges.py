"""Per-uid blob charges: what each tenant's checkpoints and live sandboxes hold in the blob store.

**The rule.**  A uid is charged, in full and once, the stored bytes
(``blob_refs.stored``: the blob's file in the store, compressed) of every
distinct blob reachable from what it owns:

* its checkpoints (``ck:<id>`` references: index, delta, session state,
  process image manifest, and through them pages, file contents and image
  pages), and
* the heads of its sandboxes (``head:<sandbox>``: the stat index a restore,
  fork or the deletion of the head checkpoint left behind, and through it
  every file the sandbox's next delta is computed against).

However many of its checkpoints share a blob, it is charged once.  A blob
two uids both reference is charged to each of them in full.  So a uid's
number is exactly "what the store would still hold for it if every other
tenant deleted everything": nobody else's deletions can raise it, nobody
else's data can lower it, and it reveals nothing about what other tenants
store (a split charge would: a cheaper checkpoint would tell that someone
else holds the same file).  Deleting a checkpoint gives back only what no
other checkpoint or head *of the same uid* still references — which is
what closes the delete-and-rewrite bypass of issue 33 (a deleted head
checkpoint's index stays live as its sandbox's stat index, and the sandbox
owner keeps being charged for it).  The sum over uids may exceed the
store's size; that is the price of independence.

**On disk** (``store/db.py``)::

    refs.uid INT                                 -- the uid an owner's reference is charged to
    uid_refs(uid INT, blob TEXT, refcount INT, PK(uid, blob))
        -- refcount: the uid's owners referencing the blob directly, plus the
        -- blob's parents (blob_edges) that are live for the uid
    uid_usage(uid INT PK, bytes INT, blobs INT)  -- SUM(stored) and COUNT over the uid's uid_refs

This is the catalog's reference counting (``store/blobrefs.py``) again,
partitioned by uid, and it is maintained the same way: incrementally, in the
same transactions that publish, adopt and delete checkpoints and move
heads, one level of the DAG per statement batch.  A blob becoming live for
a uid takes uid-references on its children (read from ``blob_edges``,
which holds the edges of every globally live blob), a blob dropping to zero
for a uid releases them.  The charge check on the turn path is one row
(``uid_usage``); what a checkpoint about to be published would add is a
walk that stops at blobs the uid already holds (:func:`would_add`), i.e.
proportional to what is new to the uid, like ``Catalog.becoming_live``.

``refs.uid`` is recorded when a reference is taken, so a release charges
back exactly the uid that was charged, whatever became of the sandbox row
meanwhile.  :func:`backfill` builds everything from ``refs`` and
``blob_edges`` once, for a database from before this table existed.
"""

from __future__ import annotations

import sqlite3
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

#: The meta key set once :func:`backfill` has built the tables (the migration runs it when absent).
BACKFILLED_KEY = "uid_charges_v1"

SCHEMA = """
CREATE TABLE IF NOT EXISTS uid_refs(uid INTEGER NOT NULL, blob TEXT NOT NULL, refcount INTEGER NOT NULL,
    PRIMARY KEY(uid, blob)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS uid_usage(uid INTEGER PRIMARY KEY, bytes INTEGER NOT NULL, blobs INTEGER NOT NULL);
"""

#: Parameters per "IN (...)" query (SQLite allows at least 999).
_BATCH = 400


def _rows(conn: sqlite3.Connection, sql: str, head: list[Any], keys: list[str]) -> list[tuple[Any, ...]]:
    """``sql`` (one "{}" for the placeholders of ``keys``, after the fixed ``head`` args) over batches."""
    out: list[tuple[Any, ...]] = []
    for i in range(0, len(keys), _BATCH):
        chunk = keys[i : i + _BATCH]
        out.extend(conn.execute(sql.format(",".join("?" * len(chunk))), [*head, *chunk]).fetchall())
    return out


def _children(conn: sqlite3.Connection, parents: list[str]) -> list[str]:
    return [str(r[1]) for r in _rows(conn, "SELECT parent, child FROM blob_edges WHERE parent IN ({})", [], parents)]


def _stored(conn: sqlite3.Connection, blobs: list[str]) -> dict[str, int]:
    return {str(b): int(s) for b, s in _rows(conn, "SELECT blob, stored FROM blob_refs WHERE blob IN ({})", [], blobs)}


def _bump_usage(conn: sqlite3.Connection, uid: int, nbytes: int, nblobs: int) -> None:
    if nbytes or nblobs:
        conn.execute(
            "INSERT INTO uid_usage(uid, bytes, blobs) VALUES(?,?,?) ON CONFLICT(uid) DO UPDATE"
            " SET bytes=bytes+excluded.bytes, blobs=blobs+excluded.blobs",
            (uid, nbytes, nblobs),
        )


def take(conn: sqlite3.Connection, uid: int, blobs: Counter[str]) -> None:
    """Add ``blobs[b]`` uid-references to each ``b`` (already live in ``blob_refs``; call after the incref).

    Steps, one DAG level at a time: bump the blobs the uid holds already;
    insert the others and charge their stored size; descend into the
    children (``blob_edges``) of those just inserted.
    """
    level = +blobs
    while level:
        keys = list(level)
        have = {str(r[0]) for r in _rows(conn, "SELECT blob FROM uid_refs WHERE uid=? AND blob IN ({})", [uid], keys)}
        conn.executemany(
            "UPDATE uid_refs SET refcount=refcount+? WHERE uid=? AND blob=?",
            [(level[b], uid, b) for b in keys if b in have],
        )
        born = [b for b in keys if b not in have]
        conn.executemany("INSERT INTO uid_refs(uid, blob, refcount) VALUES(?,?,?)", [(uid, b, level[b]) for b in born])
        sizes = _stored(conn, born)
        _bump_usage(conn, uid, sum(sizes.values()), len(born))
        level = Counter(_children(conn, born))


def release(conn: sqlite3.Connection, uid: int, blobs: Counter[str]) -> None:
    """Remove ``blobs[b]`` uid-references from each ``b`` (call BEFORE the catalog's decref: it needs the
    edges and sizes of blobs that are about to die)."""
    level = +blobs
    while level:
        keys = list(level)
        counts = {
            str(b): int(n)
            for b, n in _rows(conn, "SELECT blob, refcount FROM uid_refs WHERE uid=? AND blob IN ({})", [uid], keys)
        }
        conn.executemany(
            "UPDATE uid_refs SET refcount=refcount-? WHERE uid=? AND blob=?",
            [(level[b], uid, b) for b in keys if b in counts and counts[b] > level[b]],
        )
        die = [b for b in keys if b in counts and counts[b] <= level[b]]
        conn.executemany("DELETE FROM uid_refs WHERE uid=? AND blob=?", [(uid, b) for b in die])
        sizes = _stored(conn, die)
        _bump_usage(conn, uid, -sum(sizes.values()), -len(die))
        level = Counter(_children(conn, die))


def used(conn: sqlite3.Connection, uid: int) -> tuple[int, int]:
    """(bytes, distinct blobs) charged to ``uid``: one row."""
    row = conn.execute("SELECT bytes, blobs FROM uid_usage WHERE uid=?", (uid,)).fetchone()
    return (0, 0) if row is None else (int(row[0]), int(row[1]))


def would_add(
    conn: sqlite3.Connection,
    uid: int,
    roots: Iterable[str],
    children: Callable[[str], Iterable[str]],
    stored_size: Callable[[str], int],
) -> int:
    """Bytes that referencing ``roots`` would add to ``uid``'s charge (read-only; hold the db lock).

    The walk stops at blobs the uid holds already.  Blobs not yet live in
    the catalog (just written by the attempt) are sized by ``stored_size``
    and descended through ``children`` (what the writer knows); live ones
    by ``blob_refs`` and ``blob_edges``.
    """
    seen: set[str] = set()
    total = 0
    level = set(roots)
    while level:
        keys = sorted(level - seen)
        seen.update(keys)
        held = {str(r[0]) for r in _rows(conn, "SELECT blob FROM uid_refs WHERE uid=? AND blob IN ({})", [uid], keys)}
        new = [b for b in keys if b not in held]
        live = _stored(conn, new)
        total += sum(live.values()) + sum(stored_size(b) for b in new if b not in live)
        nxt = set(_children(conn, [b for b in new if b in live]))
        for b in new:
            if b not in live:
                nxt.update(children(b))
        level = nxt - seen
    return total


def backfill(conn: sqlite3.Connection) -> None:
    """Attribute every reference to a uid and rebuild ``uid_refs``/``uid_usage`` (inside a transaction).

    A checkpoint's references go to its owner; a head's to its sandbox's
    owner, else (sandbox row gone) to the owner of the checkpoint it stands
    on, else to uid -1 (nobody's quota; it is released with the head).
    """
    conn.execute(
        "UPDATE refs SET uid=(SELECT owner_uid FROM checkpoints WHERE 'ck:' || checkpoints.id = refs.owner)"
        " WHERE uid IS NULL AND owner LIKE 'ck:%'"
    )
    conn.execute(
        "UPDATE refs SET uid=COALESCE("
        " (SELECT owner_uid FROM sandboxes WHERE 'head:' || sandboxes.id = refs.owner),"
        " (SELECT c.owner_uid FROM heads h JOIN checkpoints c ON c.id = h.checkpoint_id"
        "  WHERE 'head:' || h.sandbox_id = refs.owner)) WHERE uid IS NULL AND owner LIKE 'head:%'"
    )
    conn.execute("UPDATE refs SET uid=-1 WHERE uid IS NULL")
    conn.execute("DELETE FROM uid_refs")
    conn.execute("DELETE FROM uid_usage")
    # reach(uid, blob): blobs live for the uid (UNION de-duplicates, so the recursion ends on a DAG);
    # a blob's uid refcount is its direct references from the uid's owners plus its parents in reach.
    conn.execute(
        "WITH RECURSIVE reach(uid, blob) AS ("
        " SELECT uid, blob FROM refs"
        " UNION SELECT reach.uid, e.child FROM reach JOIN blob_edges e ON e.parent = reach.blob)"
        " INSERT INTO uid_refs(uid, blob, refcount)"
        " SELECT uid, blob, COUNT(*) FROM ("
        "  SELECT uid, blob FROM refs"
        "  UNION ALL SELECT reach.uid, e.child FROM reach JOIN blob_edges e ON e.parent = reach.blob)"
        " GROUP BY uid, blob"
    )
    conn.execute(
        "INSERT INTO uid_usage(uid, bytes, blobs)"
        " SELECT u.uid, COALESCE(SUM(b.stored), 0), COUNT(*) FROM uid_refs u"
        " LEFT JOIN blob_refs b ON b.blob = u.blob GROUP BY u.uid"
    )
    conn.execute(
        "INSERT INTO meta(key, value) VALUES(?, '1') ON CONFLICT(key) DO UPDATE SET value=excluded.value",
        (BACKFILLED_KEY,),
    )
