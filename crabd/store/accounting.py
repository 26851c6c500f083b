"""Per-uid store accounting, and the journal of blobs one checkpoint attempt wrote.

**What a uid is charged** is ``store/charges.py``: the stored bytes of every
distinct blob its checkpoints and its live sandboxes' heads reference,
each once however many of them share it, in full even when another uid
references it too.  It is:

* cheap: one row (``uid_usage``), maintained in the transactions that
  publish, adopt and delete checkpoints and move heads; what a checkpoint
  about to be published adds (:func:`would_add`) is a walk that stops at
  blobs the uid holds already;
* explainable: ``crabctl checkpoint inspect`` shows each checkpoint's
  ``new_bytes`` (what it wrote to the store) and its stats keep
  ``charged_bytes`` (what it added to its owner's charge when published);
  the use is what the uid's checkpoints and sandboxes hold, so deleting a
  checkpoint gives back only what nothing else of the uid still holds;
* not escapable by delete-and-rewrite: deleting a sandbox's head
  checkpoint leaves its index live as the sandbox's stat index, which is
  charged to the sandbox's owner (issue 33's bypass: 600 MiB held, 0
  charged).

A fork is charged to its owner for what its head (the stat index written
for it) references, as soon as it exists.

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
from collections.abc import Callable, Iterable, Iterator

from crabd.store import charges
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


def store_bytes_used(db: Database, uid: int) -> int:
    """Bytes charged to ``uid`` (see the module doc): one row."""
    with db.lock:
        return charges.used(db.conn, uid)[0]


def store_blobs_held(db: Database, uid: int) -> int:
    """Distinct blobs charged to ``uid``."""
    with db.lock:
        return charges.used(db.conn, uid)[1]


def would_add(
    db: Database,
    uid: int,
    roots: Iterable[str],
    children: Callable[[str], Iterable[str]],
    stored_size: Callable[[str], int],
) -> int:
    """Bytes that referencing ``roots`` (blobs just stored, or live ones) would add to ``uid``'s charge.

    ``children``/``stored_size`` describe blobs the catalog does not hold
    yet (what their writer knows); see ``charges.would_add``.
    """
    with db.lock:
        return charges.would_add(db.conn, uid, roots, children, stored_size)


def recent_new_bytes(db: Database, sandbox_id: str, last: int = 3) -> int:
    """The most any of ``sandbox_id``'s newest ``last`` checkpoints added to its owner's charge (an estimate
    of its next one; ``new_bytes`` for checkpoints from before ``charged_bytes`` was recorded)."""
    with db.lock:
        row = db.conn.execute(
            "SELECT MAX(n) FROM (SELECT CAST(COALESCE(json_extract(stats_json, '$.charged_bytes'),"
            " json_extract(stats_json, '$.new_bytes'), 0) AS INTEGER) AS n"
            " FROM checkpoints WHERE sandbox_id=? ORDER BY created_at DESC LIMIT ?)",
            (sandbox_id, last),
        ).fetchone()
    return int(row[0] or 0)


def checkpoint_count(db: Database, uid: int) -> int:
    with db.lock:
        row = db.conn.execute("SELECT COUNT(*) FROM checkpoints WHERE owner_uid=?", (uid,)).fetchone()
    return int(row[0])
