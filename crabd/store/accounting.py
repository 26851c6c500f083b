"""Per-uid store accounting, and the journal of blobs one checkpoint attempt wrote.

**What a uid is charged.**  Blobs are content-addressed and shared (between
a sandbox's checkpoints, its forks, and other users' identical files), so
"who owns a blob" has no single answer.  A uid is charged, for each of its
checkpoints that exists, the bytes that checkpoint *added* to the store when
it was taken: ``stats.new_bytes`` (compressed bytes of the blob files it
wrote that were not there before: file contents, index pages, delta,
session state, process image pages).  It is:

* cheap: one ``SUM`` answered from an index on (owner, new_bytes)
  (``store/db.py``): 0.6 ms for a uid with 10,000 of 100,000 checkpoints,
  against 25 ms scanning the table (measured on the dev host); no blob walk;
* explainable: ``crabctl checkpoint inspect`` shows each checkpoint's
  ``new_bytes``, and the use is their sum;
* monotone with what a user does: deleting a checkpoint gives back what it
  was charged (even if the bytes stay live because someone else's
  checkpoint references them: then that sharer was not charged for them —
  the store holds one copy, and it is charged once, to whoever wrote it).

A fork charges nothing until its sandbox's own checkpoints add bytes.

**The journal.**  :func:`journal` opens a set that every blob file born in
the same context (:func:`note_written`, called by the blob store when it
renames a new file into place) is added to.  ``asyncio.to_thread`` copies
the context into its worker, so the threads one checkpoint attempt runs
record into that attempt's set.  When the attempt fails, those of its blobs
that nothing references are removed (``Housekeeper.release``, under the
store lock held exclusively: no other checkpoint may be between "found this
blob already stored" and "published it").
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

from crabd.store.db import Database

_written: contextvars.ContextVar[set[str] | None] = contextvars.ContextVar("crab_blobs_written", default=None)


def note_written(hex_: str) -> None:
    """A new blob file ``hex_`` was just put in place (no-op outside a :func:`journal`)."""
    seen = _written.get()
    if seen is not None:
        seen.add(hex_)


@contextlib.contextmanager
def journal() -> Iterator[set[str]]:
    """Collect the blobs written in this context (and the worker threads it starts) until exit."""
    seen: set[str] = set()
    token = _written.set(seen)
    try:
        yield seen
    finally:
        _written.reset(token)


#: The expression must stay exactly that of the index ``checkpoints_owner_bytes`` (store/db.py).
USED_SQL = (
    "SELECT COALESCE(SUM(CAST(json_extract(stats_json, '$.new_bytes') AS INTEGER)), 0)"
    " FROM checkpoints WHERE owner_uid=?"
)


def store_bytes_used(db: Database, uid: int) -> int:
    """Bytes charged to ``uid``: the sum of its checkpoints' ``new_bytes`` (see the module doc)."""
    with db.lock:
        row = db.conn.execute(USED_SQL, (uid,)).fetchone()
    return int(row[0] or 0)


def recent_new_bytes(db: Database, sandbox_id: str, last: int = 3) -> int:
    """The most any of ``sandbox_id``'s newest ``last`` checkpoints added (an estimate of its next one)."""
    with db.lock:
        row = db.conn.execute(
            "SELECT MAX(n) FROM (SELECT CAST(COALESCE(json_extract(stats_json, '$.new_bytes'), 0) AS INTEGER) AS n"
            " FROM checkpoints WHERE sandbox_id=? ORDER BY created_at DESC LIMIT ?)",
            (sandbox_id, last),
        ).fetchone()
    return int(row[0] or 0)


def checkpoint_count(db: Database, uid: int) -> int:
    with db.lock:
        row = db.conn.execute("SELECT COUNT(*) FROM checkpoints WHERE owner_uid=?", (uid,)).fetchone()
    return int(row[0])
