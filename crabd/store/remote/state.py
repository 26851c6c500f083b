"""What this host knows of the remote tier, kept in crab's database (tables in ``store/db.py``).

``remote_index`` has one row per checkpoint whose manifest is in the bucket:
the ones this host uploaded (written right after the manifest's put) and
the ones ``crabctl store sync`` found there.  A local checkpoint is
``remote`` exactly when it has a row.  Rows keep the manifest's metadata,
not its blob lists, so listing the cluster's checkpoints costs no bucket
reads.

``remote_blobs`` remembers blobs known to be in the bucket, so that the next
checkpoint of a sandbox uploads only its new blobs.  It is a cache: a blob
missing from it is uploaded again (a conditional put, answered "already
there"); a sync that finds the bucket emptied clears it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from crabd.store.blobrefs import _select_in
from crabd.store.db import Database, sandbox_owner_filter

_ENTRY_COLS = "checkpoint_id, sandbox_id, owner_uid, host, created_at, meta_json"


@dataclass(frozen=True)
class RemoteEntry:
    """A checkpoint the remote tier holds (a row of ``remote_index``)."""

    id: str
    sandbox_id: str
    owner_uid: int
    host: str
    created_at: float
    meta: dict[str, Any]


class RemoteState:
    def __init__(self, db: Database) -> None:
        self.db = db

    # --- the closure a manifest lists ------------------------------------------------

    def closure(self, roots: Iterable[str]) -> tuple[dict[str, int], dict[str, list[str]]]:
        """Every live blob reachable from ``roots``: their sizes, and the edges among them.

        One query per level and batch: a first checkpoint of a big tree
        reaches tens of thousands of blobs.
        """
        sizes: dict[str, int] = {}
        edges: dict[str, list[str]] = {}
        level = sorted(set(roots))
        with self.db.lock:
            conn = self.db.conn
            while level:
                for blob, size in _select_in(
                    conn, "SELECT blob, size FROM blob_refs WHERE blob IN ({})", level, columns=2
                ):
                    sizes[str(blob)] = int(size)
                nxt: set[str] = set()
                for parent, child in _select_in(
                    conn, "SELECT parent, child FROM blob_edges WHERE parent IN ({})", level, columns=2
                ):
                    edges.setdefault(str(parent), []).append(str(child))
                    nxt.add(str(child))
                level = sorted(nxt - sizes.keys())
        return sizes, edges

    # --- blobs ------------------------------------------------------------------------

    def known_blobs(self, blobs: Iterable[str]) -> set[str]:
        with self.db.lock:
            return {
                str(b)
                for b in _select_in(self.db.conn, "SELECT blob FROM remote_blobs WHERE blob IN ({})", list(blobs))
            }

    def add_blobs(self, blobs: Iterable[str]) -> None:
        with self.db.tx() as conn:
            conn.executemany("INSERT OR IGNORE INTO remote_blobs(blob) VALUES(?)", [(b,) for b in blobs])

    def forget_blobs(self) -> None:
        with self.db.tx() as conn:
            conn.execute("DELETE FROM remote_blobs")

    # --- checkpoints --------------------------------------------------------------------

    def record(self, meta: dict[str, Any]) -> None:
        """The manifest with this metadata (``manifest.manifest_meta``) is in the bucket."""
        with self.db.tx() as conn:
            conn.execute(
                "INSERT INTO remote_index(checkpoint_id, sandbox_id, owner_uid, host, created_at, meta_json, seen_at)"
                " VALUES(?,?,?,?,?,?,?) ON CONFLICT(checkpoint_id) DO NOTHING",
                (
                    str(meta["id"]),
                    str(meta["sandbox_id"]),
                    int(meta["owner_uid"]),
                    str(meta["host"]),
                    float(meta["created_at"]),
                    json.dumps(meta, sort_keys=True),
                    time.time(),
                ),
            )

    def forget(self, ckpt_ids: Iterable[str]) -> None:
        with self.db.tx() as conn:
            conn.executemany("DELETE FROM remote_index WHERE checkpoint_id=?", [(c,) for c in ckpt_ids])

    def remote_of(self, ckpt_ids: Iterable[str]) -> set[str]:
        """Which of ``ckpt_ids`` the remote tier holds."""
        with self.db.lock:
            return {
                str(c)
                for c in _select_in(
                    self.db.conn, "SELECT checkpoint_id FROM remote_index WHERE checkpoint_id IN ({})", list(ckpt_ids)
                )
            }

    def entry(self, ckpt_id: str) -> RemoteEntry | None:
        with self.db.lock:
            row = self.db.conn.execute(
                f"SELECT {_ENTRY_COLS} FROM remote_index WHERE checkpoint_id=?",
                (ckpt_id,),
            ).fetchone()
        return None if row is None else _entry(row)

    def entries(self, *, sandbox_id: str | None = None, owner_uid: int | None = None) -> list[RemoteEntry]:
        where, args = sandbox_owner_filter(sandbox_id, owner_uid)
        q = "SELECT checkpoint_id, sandbox_id, owner_uid, host, created_at, meta_json FROM remote_index" + where
        with self.db.lock:
            rows = self.db.conn.execute(q + " ORDER BY created_at, checkpoint_id", args).fetchall()
        return [_entry(r) for r in rows]

    def known_ids(self) -> set[str]:
        with self.db.lock:
            return {str(r[0]) for r in self.db.conn.execute("SELECT checkpoint_id FROM remote_index")}

    def not_uploaded(self) -> list[str]:
        """Local checkpoints the remote tier does not hold yet, oldest first."""
        with self.db.lock:
            rows = self.db.conn.execute(
                "SELECT id FROM checkpoints WHERE id NOT IN (SELECT checkpoint_id FROM remote_index)"
                " ORDER BY created_at, rowid"
            ).fetchall()
        return [str(r[0]) for r in rows]


def _entry(row: tuple[Any, ...]) -> RemoteEntry:
    return RemoteEntry(
        id=str(row[0]),
        sandbox_id=str(row[1]),
        owner_uid=int(row[2]),
        host=str(row[3]),
        created_at=float(row[4]),
        meta=json.loads(row[5]),
    )
