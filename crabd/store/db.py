"""crabd's one SQLite database: the sandbox registry and the checkpoint catalog.

Both live in ``<state_dir>/registry.db`` so that an operation touching both
(a restore moves a sandbox to a new container *and* moves its checkpoint
head) commits in one transaction.  SQLite does not make transactions across
attached WAL databases atomic, which is why this is one file.

Durability: WAL mode.  A transaction commits in one of two ways:

* **durable** (the default: checkpoints, sandboxes, refs, everything but the
  turn log): ``synchronous=FULL``, the WAL is fsynced before COMMIT returns,
  so what it wrote survives kill -9 and power loss;
* **group-committed** (``tx(durable=False)``: the per-turn rows, i.e. turns,
  their decisions and checkpoint states, and commands): ``synchronous=NORMAL``,
  COMMIT returns once the WAL frames are written to the kernel, which is
  enough to survive kill -9 of crabd (the frames are in the page cache; the
  next open reads them).  A flusher thread (started by the first such
  commit: a database that never group-commits has none) fsyncs the WAL at most
  :data:`GROUP_COMMIT_S` after such a commit, and any durable commit fsyncs
  it anyway (the WAL is one sequential file: syncing it syncs every frame
  before), so a power loss or kernel crash can lose at most the turn log of
  the last few milliseconds, never a published checkpoint, and never a turn
  row without the rows written before it.  Why: a skip turn wrote five rows
  in five transactions, each an fsync (issue 34).

Schema (version 8)::

    meta(key TEXT PK, value TEXT)                      -- schema_version
    sandboxes(id TEXT PK, name TEXT UNIQUE, owner_uid INT, spec_json TEXT,
              image TEXT, container_id TEXT,
              state TEXT,                             -- creating|running|stopped|dead
              created_at REAL, exit_code INT NULL, oom_killed INT, dead_reason TEXT,
              origin TEXT,                            -- checkpoint it was forked from ('' = none)
              branch INT,                             -- bumped by every in-place restore
              shard INT)                              -- the crabd process that owns it (daemon/shards.py)
    turns(sandbox_id, number, started_at, ended_at NULL, implicit, session_state_json NULL,
          decision_json NULL,                     -- the inspector's decision (crabd.inspector.model.Decision)
          checkpoint_id NULL,                     -- the checkpoint the turn end took, if any
          checkpoint_state NULL,                  -- pending|done|skipped|failed|lost|none (NULL: before v4)
          checkpoint_error NULL,                  -- why it failed or was lost
          basis_id NULL,                          -- skipped turns: the checkpoint whose state the turn ended in
                                                  -- (the head it was compared with); NULL before v5
          branch NULL)                            -- the sandbox's branch when the turn opened (NULL before v5)
    commands(sandbox_id, turn, seq, kind, command, exit_code, timed_out, started_at,
             duration_s, stdout_bytes, stderr_bytes)
    checkpoints(id TEXT PK, sandbox_id TEXT, sandbox_name TEXT, owner_uid INT,
                parent_id TEXT NULL,                  -- previous checkpoint of its branch
                branch INT, turn INT, kind TEXT,      -- kind: fs | full
                created_at REAL, label TEXT,
                image TEXT, spec_json TEXT,           -- enough to fork it after its sandbox is gone
                index_blob TEXT, delta_blob TEXT, session_blob TEXT NULL, process_blob TEXT NULL,
                racy_ns INT,                          -- see crabd.backends.overlay.scan
                kept INT, stats_json TEXT,
                pinned INT,                           -- `crabctl checkpoint pin`: retention never thins it
                provenance TEXT)                      -- signed statement of its producer (crabd/trust/provenance.py)
    heads(sandbox_id TEXT PK, checkpoint_id TEXT, stat_blob TEXT NULL, racy_ns INT)
    refs(owner TEXT, blob TEXT, PK(owner, blob),       -- owner: "ck:<id>" or "head:<sandbox>"
         uid INT NULL)                                 -- whom it is charged to (store/charges.py)
    uid_refs(uid INT, blob TEXT, refcount INT, PK(uid, blob))   -- blobs live for a uid (store/charges.py)
    uid_usage(uid INT PK, bytes INT, blobs INT)                 -- their stored bytes: the store quota's measure
    blob_refs(blob TEXT PK, refcount INT, size INT, stored INT)
    blob_edges(parent TEXT, child TEXT, PK(parent, child))
    failures(id INT PK, sandbox_id TEXT, turn INT, kind TEXT, at REAL,   -- checkpoints that were not made
             error TEXT, log_path TEXT)
    remote_index(checkpoint_id TEXT PK,               -- checkpoints whose manifest is in the remote tier
                 sandbox_id TEXT, owner_uid INT, host TEXT, created_at REAL,
                 meta_json TEXT, seen_at REAL)        -- the manifest less its blob lists
    remote_blobs(blob TEXT PK)                        -- blobs known to be in the remote tier
    sandbox_ids(id TEXT PK, owner_uid INT,            -- every sandbox id ever used here, and its one owner
                first_seen REAL, source TEXT)         -- (never deleted: store/identity.py)
    failures.owner_uid INT NULL                       -- the sandbox's owner (NULL: recorded before it)
    reservations(id TEXT PK, shard INT, uid INT, sandboxes INT, forks INT)   -- store/reservations.py
    leases(id TEXT PK, shard INT, checkpoint_id TEXT)                        -- store/leasing.py

Version 1 (issue 3) had only meta, sandboxes (without origin and branch),
turns and commands; version 2 (issue 4) had turns without decision_json and
checkpoint_id; version 3 (issue 6) without checkpoint_state and
checkpoint_error; version 4 without basis_id and branch (rows from before
v5 keep NULL there: see ``coordinator/turnmap.py`` for how such turns are
resolved); version 5 without the remote tables; version 6 without
checkpoints.pinned; version 7 without sandboxes.shard (every sandbox then
belonged to the one process there was: shard 0).  :func:`_migrate` upgrades
any of them in place.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import threading
from pathlib import Path
from types import TracebackType

from crabd.errors import StoreError, StoreFull
from crabd.store import charges, leasing, reservations

log = logging.getLogger("crabd.store")

SCHEMA_VERSION = 8

#: How long a transaction waits for another process's writer before failing.
BUSY_S = 30.0

_SCHEMA_V1 = """
CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS sandboxes(
    id TEXT PRIMARY KEY, name TEXT NOT NULL UNIQUE, owner_uid INTEGER NOT NULL,
    spec_json TEXT NOT NULL, image TEXT NOT NULL, container_id TEXT NOT NULL DEFAULT '',
    state TEXT NOT NULL, created_at REAL NOT NULL, exit_code INTEGER,
    oom_killed INTEGER NOT NULL DEFAULT 0, dead_reason TEXT NOT NULL DEFAULT '');
CREATE TABLE IF NOT EXISTS turns(
    sandbox_id TEXT NOT NULL, number INTEGER NOT NULL, started_at REAL NOT NULL,
    ended_at REAL, implicit INTEGER NOT NULL DEFAULT 0, session_state_json TEXT,
    PRIMARY KEY(sandbox_id, number));
CREATE TABLE IF NOT EXISTS commands(
    sandbox_id TEXT NOT NULL, turn INTEGER NOT NULL, seq INTEGER NOT NULL, kind TEXT NOT NULL,
    command TEXT NOT NULL, exit_code INTEGER NOT NULL, timed_out INTEGER NOT NULL,
    started_at REAL NOT NULL, duration_s REAL NOT NULL, stdout_bytes INTEGER NOT NULL,
    stderr_bytes INTEGER NOT NULL, PRIMARY KEY(sandbox_id, turn, seq));
"""

_SCHEMA_V2 = """
CREATE TABLE IF NOT EXISTS checkpoints(
    id TEXT PRIMARY KEY, sandbox_id TEXT NOT NULL, sandbox_name TEXT NOT NULL, owner_uid INTEGER NOT NULL,
    parent_id TEXT, branch INTEGER NOT NULL, turn INTEGER NOT NULL, kind TEXT NOT NULL,
    created_at REAL NOT NULL, label TEXT NOT NULL DEFAULT '', image TEXT NOT NULL, spec_json TEXT NOT NULL,
    index_blob TEXT NOT NULL, delta_blob TEXT NOT NULL, session_blob TEXT, process_blob TEXT,
    racy_ns INTEGER NOT NULL DEFAULT 0, kept INTEGER NOT NULL DEFAULT 0, stats_json TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS checkpoints_sandbox ON checkpoints(sandbox_id, created_at);
CREATE INDEX IF NOT EXISTS checkpoints_parent ON checkpoints(parent_id);
-- Per-uid store accounting (store/accounting.py): the SUM is answered from this index alone.
CREATE INDEX IF NOT EXISTS checkpoints_owner_bytes
    ON checkpoints(owner_uid, CAST(json_extract(stats_json, '$.new_bytes') AS INTEGER));
CREATE TABLE IF NOT EXISTS heads(sandbox_id TEXT PRIMARY KEY, checkpoint_id TEXT NOT NULL, stat_blob TEXT,
    racy_ns INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS refs(owner TEXT NOT NULL, blob TEXT NOT NULL, PRIMARY KEY(owner, blob));
CREATE TABLE IF NOT EXISTS blob_refs(blob TEXT PRIMARY KEY, refcount INTEGER NOT NULL,
    size INTEGER NOT NULL, stored INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS blob_edges(parent TEXT NOT NULL, child TEXT NOT NULL, PRIMARY KEY(parent, child));
CREATE INDEX IF NOT EXISTS blob_edges_child ON blob_edges(child);
CREATE TABLE IF NOT EXISTS failures(id INTEGER PRIMARY KEY AUTOINCREMENT, sandbox_id TEXT NOT NULL,
    turn INTEGER NOT NULL, kind TEXT NOT NULL, at REAL NOT NULL, error TEXT NOT NULL, log_path TEXT NOT NULL);
"""

_SCHEMA_V6 = """
CREATE TABLE IF NOT EXISTS remote_index(checkpoint_id TEXT PRIMARY KEY, sandbox_id TEXT NOT NULL,
    owner_uid INTEGER NOT NULL, host TEXT NOT NULL, created_at REAL NOT NULL, meta_json TEXT NOT NULL,
    seen_at REAL NOT NULL);
CREATE INDEX IF NOT EXISTS remote_index_sandbox ON remote_index(sandbox_id, created_at);
CREATE TABLE IF NOT EXISTS remote_blobs(blob TEXT PRIMARY KEY);
"""

# The sandbox id ledger (store/identity.py).  The backfill is idempotent (INSERT OR IGNORE); the
# earliest use of an id decides its owner, so a squat made before the ledger existed does not win.
_SCHEMA_IDS = """
CREATE TABLE IF NOT EXISTS sandbox_ids(id TEXT PRIMARY KEY, owner_uid INTEGER NOT NULL,
    first_seen REAL NOT NULL, source TEXT NOT NULL);
INSERT OR IGNORE INTO sandbox_ids(id, owner_uid, first_seen, source)
SELECT sid, uid, at, 'backfill' FROM (
    SELECT id AS sid, owner_uid AS uid, created_at AS at FROM sandboxes
    UNION ALL SELECT sandbox_id, owner_uid, created_at FROM checkpoints
    UNION ALL SELECT sandbox_id, owner_uid, created_at FROM remote_index
) ORDER BY at, sid;
UPDATE failures SET owner_uid=(SELECT owner_uid FROM sandbox_ids WHERE id=failures.sandbox_id)
    WHERE owner_uid IS NULL;
"""
_FAILURE_COLUMNS_IDS = (("owner_uid", "INTEGER"),)

_SANDBOX_COLUMNS_V2 = (
    ("origin", "TEXT NOT NULL DEFAULT ''"),
    ("branch", "INTEGER NOT NULL DEFAULT 0"),
)
#: Issue 34: which of crabd's processes owns a sandbox (0 for every row made before there were several).
_SANDBOX_COLUMNS_SHARD = (("shard", "INTEGER NOT NULL DEFAULT 0"),)
_CHECKPOINT_COLUMNS_V7 = (("pinned", "INTEGER NOT NULL DEFAULT 0"),)
#: Issue 33: who produced a checkpoint, signed ('' = nobody said; see crabd/trust/provenance.py).
_CHECKPOINT_COLUMNS_PROVENANCE = (("provenance", "TEXT NOT NULL DEFAULT ''"),)
#: Per-uid charges (issue 33): NULL on references from before them, filled by ``charges.backfill``.
_REF_COLUMNS_CHARGES = (("uid", "INTEGER"),)
_TURN_COLUMNS = (
    ("decision_json", "TEXT"),
    ("checkpoint_id", "TEXT"),
    ("checkpoint_state", "TEXT"),
    ("checkpoint_error", "TEXT"),
    ("basis_id", "TEXT"),
    ("branch", "INTEGER"),
)


#: At most this long between a group-committed transaction and the fsync of the WAL that makes it
#: survive a power loss (it survives kill -9 at once).
GROUP_COMMIT_S = 0.005


class Database:
    """One connection shared by the registry and the catalog, guarded by one lock.

    Reads take :attr:`lock`; writes go through :meth:`tx`.  Use as a
    context manager or call :meth:`close`.
    """

    def __init__(self, path: Path, *, group_commit_s: float = GROUP_COMMIT_S) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.lock = threading.RLock()
        self._flusher = _WalFlusher(Path(f"{path}-wal"), group_commit_s)
        try:
            # Several crabd processes may share the file ([daemon] workers): a writer waits for
            # another's transaction (milliseconds) rather than failing with "database is locked".
            self.conn = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None, timeout=BUSY_S)
            self.conn.execute("PRAGMA journal_mode=WAL")
            self.conn.execute("PRAGMA synchronous=FULL")
            self._migrate()
        except sqlite3.Error as exc:
            raise StoreError(
                f"cannot open crab's database {path}: {exc}",
                hint="Check the state dir's disk and permissions; crabd must run as root.",
            ) from exc

    def _migrate(self) -> None:
        # executescript() commits on its own; every statement is idempotent.
        self.conn.executescript(_SCHEMA_V1)
        for table, columns in (("sandboxes", _SANDBOX_COLUMNS_V2), ("turns", _TURN_COLUMNS)):
            self._add_columns(table, columns)
        self.conn.executescript(_SCHEMA_V2)
        self.conn.executescript(_SCHEMA_V6)
        self._add_columns("checkpoints", _CHECKPOINT_COLUMNS_V7)
        self._add_columns("failures", _FAILURE_COLUMNS_IDS)
        self.conn.executescript(_SCHEMA_IDS)
        self._add_columns("checkpoints", _CHECKPOINT_COLUMNS_PROVENANCE)
        self._add_columns("refs", _REF_COLUMNS_CHARGES)
        self._add_columns("sandboxes", _SANDBOX_COLUMNS_SHARD)
        self.conn.executescript(charges.SCHEMA)
        self.conn.executescript(reservations.SCHEMA)
        self.conn.executescript(leasing.SCHEMA)
        with self.tx() as db:
            if db.execute("SELECT 1 FROM meta WHERE key=?", (charges.BACKFILLED_KEY,)).fetchone() is None:
                charges.backfill(db)
        with self.tx() as db:
            db.execute(
                "INSERT INTO meta(key, value) VALUES('schema_version', ?) "
                "ON CONFLICT(key) DO UPDATE SET value=excluded.value",
                (str(SCHEMA_VERSION),),
            )

    def _add_columns(self, table: str, columns: tuple[tuple[str, str], ...]) -> None:
        have = {str(r[1]) for r in self.conn.execute(f"PRAGMA table_info({table})")}
        with self.tx() as db:
            for name, decl in columns:
                if name not in have:
                    db.execute(f"ALTER TABLE {table} ADD COLUMN {name} {decl}")

    def tx(self, *, durable: bool = True) -> Tx:
        """One write transaction: ``with db.tx() as conn: ...`` (BEGIN IMMEDIATE ... COMMIT/ROLLBACK).

        ``durable=False``: group-committed (the module's docstring): it survives kill -9 at once and a
        power loss within :data:`GROUP_COMMIT_S`.  Inside a durable transaction it is durable too.
        """
        return Tx(self.conn, self.lock, None if durable else self._flusher)

    def close(self) -> None:
        self._flusher.close()
        with self.lock:
            self.conn.close()

    def __enter__(self) -> Database:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def sandbox_owner_filter(sandbox_id: str | None, owner_uid: int | None) -> tuple[str, list[str]]:
    """A WHERE clause (" WHERE 1=1 AND ...") and its arguments for the optional sandbox and owner filters
    that listings of checkpoints share (owner uids are stored as text)."""
    clause, args = " WHERE 1=1", []
    if sandbox_id is not None:
        clause += " AND sandbox_id=?"
        args.append(sandbox_id)
    if owner_uid is not None:
        clause += " AND owner_uid=?"
        args.append(str(owner_uid))
    return clause, args


def translate(exc: sqlite3.Error, path: Path | str) -> StoreError:
    """A CrabError for an SQLite failure (a full disk is StoreFull: nothing was changed)."""
    text = str(exc)
    if isinstance(exc, sqlite3.OperationalError) and ("full" in text or "disk I/O" in text):
        return StoreFull(f"crab's database {path} could not be written: {text}", path=str(path))
    return StoreError(f"crab's database {path} failed: {text}")


class Tx:
    """A write transaction under the database lock.  Nested use joins the outer transaction.

    SQLite errors raised inside it are rolled back and re-raised as
    :class:`StoreError` (or :class:`StoreFull`).
    """

    def __init__(self, conn: sqlite3.Connection, lock: threading.RLock, grouped: _WalFlusher | None = None) -> None:
        self._conn = conn
        self._lock = lock
        self._outer = False
        #: Set: a group-committed transaction, and who fsyncs the WAL after it.
        self._grouped = grouped

    def __enter__(self) -> sqlite3.Connection:
        self._lock.acquire()
        try:
            self._outer = not self._conn.in_transaction
            if self._outer:
                # Per transaction (the connection's setting may only change outside one).
                self._conn.execute("PRAGMA synchronous=NORMAL" if self._grouped else "PRAGMA synchronous=FULL")
                self._conn.execute("BEGIN IMMEDIATE")
        except BaseException:
            self._lock.release()
            raise
        return self._conn

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        try:
            if self._outer:
                if t is None:
                    try:
                        self._conn.execute("COMMIT")
                    except sqlite3.Error as exc:
                        self._rollback()
                        raise translate(exc, _db_path(self._conn)) from exc
                    if self._grouped is not None:
                        self._grouped.due()
                else:
                    self._rollback()
            if isinstance(e, sqlite3.Error):
                raise translate(e, _db_path(self._conn)) from e
        finally:
            self._lock.release()

    def _rollback(self) -> None:
        # SQLite may have rolled back already (e.g. after SQLITE_FULL).
        if self._conn.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                self._conn.execute("ROLLBACK")


def _db_path(conn: sqlite3.Connection) -> str:
    row = conn.execute("PRAGMA database_list").fetchone()
    return str(row[2]) if row else "registry.db"


class _WalFlusher:
    """fsyncs the WAL file at most ``delay_s`` after a group-committed transaction asked for it (a thread).

    fsync(2) on any descriptor of the file writes back all of its dirty
    pages, so one call covers every frame the commits before it wrote.  If it
    fails (the disk is gone) the error is logged and the next one tries again:
    the durable commits report such an error themselves.

    The thread starts with the first :meth:`due`, not with the database: most
    databases (``crabctl``'s, a test's, a tool's) only ever commit durably.
    """

    def __init__(self, wal: Path, delay_s: float) -> None:
        self.wal = wal
        self.delay_s = delay_s
        self._wake = threading.Event()
        self._closing = threading.Event()
        #: Guards starting the thread, against a second start and against a start after close().
        self._start_lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def due(self) -> None:
        if self._thread is None:
            with self._start_lock:
                if self._thread is None and not self._closing.is_set():
                    thread = threading.Thread(target=self._run, name="crab-wal-flush", daemon=True)
                    thread.start()
                    self._thread = thread
        self._wake.set()

    def _run(self) -> None:
        while not self._closing.is_set():
            self._wake.wait()
            # Gather the commits of the next few ms into one fsync (close() cuts the wait short).
            self._closing.wait(self.delay_s)
            self._wake.clear()
            self.flush()

    def flush(self) -> None:
        try:
            fd = os.open(self.wal, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            return  # checkpointed and removed: nothing is pending
        except OSError as exc:
            log.warning("the database's WAL could not be opened to sync it", extra={"error": str(exc)})
            return
        try:
            os.fsync(fd)
        except OSError as exc:
            log.warning("syncing the database's WAL failed", extra={"error": str(exc)})
        finally:
            os.close(fd)

    def close(self) -> None:
        """Flush what is pending and stop the thread (if it was ever started)."""
        with self._start_lock:
            self._closing.set()
            thread = self._thread
        self._wake.set()
        if thread is not None:
            thread.join(timeout=5)
        self.flush()
