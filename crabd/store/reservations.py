"""Sandboxes being made right now, per uid, seen by every crabd process (issue 34).

A create, fork or import reserves the sandboxes it is making before any
work starts, so two requests can never both pass the quota check and
together exceed it.  With one process an in-memory counter did that; with
several (``[daemon] workers``) the requests may run in different processes,
so the count lives in the shared database and the check and the
reservation are one write transaction (``BEGIN IMMEDIATE``: SQLite lets one
writer at a time in, across processes).

Table::

    reservations(id TEXT PK,          -- random, one per request
                 shard INT,           -- the process that holds it
                 uid INT,             -- whom the sandboxes will belong to
                 sandboxes INT,       -- being made
                 forks INT)           -- of those, made by a fork (max_concurrent_forks)

A uid's count is its sandboxes past ``creating`` plus its reservations: a
request's sandbox is counted by its reservation until the request ends,
and by its row from then on.  Between the row turning ``running`` and the
reservation's release (two transactions in a row, no wait between them) it
is counted twice, so a request of another crabd process in that instant
may be refused one sandbox early, never admitted one too many.

A row lives while its request runs.  A process that dies leaves its rows;
the process that takes its place drops them (:func:`drop_shard`) before it
serves, so a crash never holds a uid's quota.  Group-committed (store/db.py):
a row lost to a power loss is a request that died with the host.
"""

from __future__ import annotations

import secrets
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from crabd.vocabulary import SandboxState

if TYPE_CHECKING:  # db.py makes this module's table
    from crabd.store.db import Database

SCHEMA = """
CREATE TABLE IF NOT EXISTS reservations(id TEXT PRIMARY KEY, shard INTEGER NOT NULL, uid INTEGER NOT NULL,
    sandboxes INTEGER NOT NULL, forks INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS reservations_uid ON reservations(uid);
"""


@dataclass(frozen=True)
class UidSandboxes:
    """One uid's sandboxes: owned (registry rows past ``creating``) and being made (reserved)."""

    owned: int
    making: int
    forking: int


def _read(conn: sqlite3.Connection, uid: int) -> UidSandboxes:
    execute = conn.execute
    # A row still ``creating`` is a request's sandbox in the making: its reservation counts it
    # already (counting both refused concurrent creates well below the limit).
    owned = int(
        execute(
            "SELECT COUNT(*) FROM sandboxes WHERE owner_uid=? AND state<>?", (uid, SandboxState.CREATING.value)
        ).fetchone()[0]
    )
    making, forking = execute(
        "SELECT COALESCE(SUM(sandboxes), 0), COALESCE(SUM(forks), 0) FROM reservations WHERE uid=?", (uid,)
    ).fetchone()
    return UidSandboxes(owned=owned, making=int(making), forking=int(forking))


def reserve(
    db: Database, *, shard: int, uid: int, sandboxes: int, forks: int, admit: Callable[[UidSandboxes], None]
) -> str:
    """Reserve for ``uid`` if ``admit`` (which raises to refuse) lets it; returns the reservation's id."""
    rid = secrets.token_hex(8)
    with db.tx(durable=False) as conn:
        admit(_read(conn, uid))
        conn.execute(
            "INSERT INTO reservations(id, shard, uid, sandboxes, forks) VALUES(?,?,?,?,?)",
            (rid, shard, uid, sandboxes, forks),
        )
    return rid


def release(db: Database, rid: str) -> None:
    with db.tx(durable=False) as conn:
        conn.execute("DELETE FROM reservations WHERE id=?", (rid,))


def current(db: Database, uid: int) -> UidSandboxes:
    with db.lock:
        return _read(db.conn, uid)


def drop_shard(db: Database, shard: int | None) -> int:
    """What a dead process of ``shard`` held (None: every process's, no other being alive): its requests
    died with it.  Returns how many rows went."""
    with db.tx(durable=False) as conn:
        if shard is None:
            return int(conn.execute("DELETE FROM reservations").rowcount)
        return int(conn.execute("DELETE FROM reservations WHERE shard=?", (shard,)).rowcount)
