"""crabd's registry of sandboxes, turns and commands (tables documented in ``store/db.py``).

A sandbox row is written in state ``creating`` *before* its container is
created and flipped to ``running`` after it started, so after a crash at any
point the daemon knows which containers it may have made (see
``coordinator.sandboxes``).  Turn rows of removed sandboxes are deleted with
them.
"""

from __future__ import annotations

import functools
import json
import sqlite3
from dataclasses import asdict, replace

from crabd.errors import AlreadyExists
from crabd.models import (
    CheckpointPolicy,
    CommandRecord,
    RecoveryMode,
    RetentionPolicy,
    SandboxRecord,
    SandboxSpec,
    SandboxState,
    TurnCheckpointState,
    TurnRecord,
)
from crabd.store import identity
from crabd.store.db import Database, Tx

#: Turns of a sandbox that keep their session state (see ``Registry.prune_turns``).
SESSION_STATES_KEPT = 16


def spec_from_json(text: str) -> SandboxSpec:
    """The spec stored as ``text``; parsed once per distinct text (every lookup of a sandbox reads its spec).

    The cached spec is frozen but for its ``env_vars`` dict, so each caller
    gets a copy of that: a caller's change never reaches the next lookup.
    """
    cached = _parsed_spec(text)
    return replace(cached, env_vars=dict(cached.env_vars))


@functools.lru_cache(maxsize=4096)
def _parsed_spec(text: str) -> SandboxSpec:
    data = json.loads(text)
    data["env_vars"] = dict(data.get("env_vars") or {})
    known = set(SandboxSpec.__dataclass_fields__)
    # Stored as their strings; back to members here, where they leave the database.
    data["checkpoints"] = CheckpointPolicy(data.get("checkpoints", CheckpointPolicy.AUTO))
    data["recovery"] = RecoveryMode(data.get("recovery", RecoveryMode.MANUAL))
    retention = data.get("retention")
    data["retention"] = RetentionPolicy(**retention) if retention else None
    return SandboxSpec(**{k: v for k, v in data.items() if k in known})


def spec_to_json(spec: SandboxSpec) -> str:
    return json.dumps(asdict(spec), sort_keys=True)


class Registry:
    """Sandboxes, turns and commands, in the shared :class:`Database`."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self._db = db.conn
        self._lock = db.lock

    def _tx(self, *, durable: bool = True) -> Tx:
        return self.db.tx(durable=durable)

    # --- sandboxes ------------------------------------------------------------

    def insert_sandbox(self, rec: SandboxRecord) -> None:
        """Insert ``rec``; refused (PermissionDenied, nothing written) if its id ever belonged to another uid,
        and (AlreadyExists, nothing written) if another sandbox has its name."""
        with self._tx() as db:
            identity.claim(db, rec.id, rec.owner_uid, "fork" if rec.origin else "create")
            try:
                db.execute(
                    "INSERT INTO sandboxes(id, name, owner_uid, spec_json, image, container_id, state, created_at,"
                    " origin, branch, shard) VALUES(?,?,?,?,?,?,?,?,?,?,?)",
                    (
                        rec.id,
                        rec.name,
                        rec.owner_uid,
                        spec_to_json(rec.spec),
                        rec.image,
                        rec.container_id,
                        rec.state.value,
                        rec.created_at,
                        rec.origin,
                        rec.branch,
                        rec.shard,
                    ),
                )
            except sqlite3.IntegrityError as exc:
                # Several crabd processes ([daemon] workers) check a name each under its own lock:
                # the one that loses the race to the UNIQUE name gets what a taken name gets, not a
                # StoreError (Tx rolls the claim above back; any other constraint stays a StoreError).
                if "sandboxes.name" not in str(exc):
                    raise
                raise AlreadyExists(f"a sandbox named {rec.name!r} already exists", name=rec.name) from exc

    def update_sandbox(
        self,
        sandbox_id: str,
        *,
        state: SandboxState | None = None,
        container_id: str | None = None,
        exit_code: int | None = None,
        oom_killed: bool | None = None,
        dead_reason: str | None = None,
        branch: int | None = None,
        revive: bool = False,
    ) -> None:
        """Set the given columns; ``revive`` clears a dead sandbox's exit code and reason."""
        sets: list[str] = ["exit_code=NULL", "oom_killed=0", "dead_reason=''"] if revive else []
        args: list[object] = []
        for col, val in (
            ("state", state.value if state else None),
            ("container_id", container_id),
            ("exit_code", exit_code),
            ("oom_killed", None if oom_killed is None else int(oom_killed)),
            ("dead_reason", dead_reason),
            ("branch", branch),
        ):
            if val is not None:
                sets.append(f"{col}=?")
                args.append(val)
        if not sets:
            return
        with self._tx() as db:
            db.execute(f"UPDATE sandboxes SET {', '.join(sets)} WHERE id=?", (*args, sandbox_id))

    def set_spec(self, sandbox_id: str, spec: SandboxSpec) -> None:
        """Replace a sandbox's spec (only its retention policy changes after creation)."""
        with self._tx() as db:
            db.execute("UPDATE sandboxes SET spec_json=? WHERE id=?", (spec_to_json(spec), sandbox_id))

    def delete_sandbox(self, sandbox_id: str) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM commands WHERE sandbox_id=?", (sandbox_id,))
            db.execute("DELETE FROM turns WHERE sandbox_id=?", (sandbox_id,))
            db.execute("DELETE FROM sandboxes WHERE id=?", (sandbox_id,))

    def _row_to_sandbox(self, row: sqlite3.Row | tuple[object, ...]) -> SandboxRecord:
        """A :data:`_SANDBOX_SELECT` row: the sandbox's columns, then its last turn's number and end (NULL: none)."""
        (sid, name, owner, spec_json, image, cid, state, created, exit_code, oom, reason, origin, branch) = row[:13]
        turn, ended_at, shard = row[13], row[14], row[15]
        rec = SandboxRecord(
            id=str(sid),
            name=str(name),
            owner_uid=int(str(owner)),
            spec=spec_from_json(str(spec_json)),
            image=str(image),
            container_id=str(cid),
            state=SandboxState(str(state)),
            created_at=float(str(created)),
            exit_code=None if exit_code is None else int(str(exit_code)),
            oom_killed=bool(oom),
            dead_reason=str(reason),
            origin=str(origin),
            branch=int(str(branch)),
            shard=int(str(shard)),
        )
        if turn is not None:
            rec.turn = int(str(turn))
            rec.turn_open = ended_at is None
        return rec

    #: A sandbox row with its last turn, in one statement: a list of a thousand sandboxes used to
    #: be a thousand and one queries (the turn looked up per row), 19-25 ms on the event loop.
    #: The turn's number is the last of its primary key (sandbox_id, number): an index lookup.
    _SANDBOX_SELECT = (
        "SELECT s.id, s.name, s.owner_uid, s.spec_json, s.image, s.container_id, s.state, s.created_at,"
        " s.exit_code, s.oom_killed, s.dead_reason, s.origin, s.branch, t.number, t.ended_at, s.shard"
        " FROM sandboxes s LEFT JOIN turns t ON t.sandbox_id = s.id"
        " AND t.number = (SELECT MAX(number) FROM turns WHERE sandbox_id = s.id)"
    )

    def get_sandbox(self, ref: str) -> SandboxRecord | None:
        """By id, then by name."""
        with self._lock:
            row = self._db.execute(f"{self._SANDBOX_SELECT} WHERE s.id=?", (ref,)).fetchone()
            if row is None:
                row = self._db.execute(f"{self._SANDBOX_SELECT} WHERE s.name=?", (ref,)).fetchone()
            return None if row is None else self._row_to_sandbox(row)

    def list_sandboxes(self, owner_uid: int | None = None) -> list[SandboxRecord]:
        with self._lock:
            if owner_uid is None:
                rows = self._db.execute(f"{self._SANDBOX_SELECT} ORDER BY s.created_at").fetchall()
            else:
                rows = self._db.execute(
                    f"{self._SANDBOX_SELECT} WHERE s.owner_uid=? ORDER BY s.created_at", (owner_uid,)
                ).fetchall()
            return [self._row_to_sandbox(r) for r in rows]

    def count_sandboxes(self, owner_uid: int | None = None) -> int:
        """How many sandboxes (``owner_uid``'s, or all): the quota check and the daemon's status, without a list."""
        with self._lock:
            if owner_uid is None:
                row = self._db.execute("SELECT COUNT(*) FROM sandboxes").fetchone()
            else:
                row = self._db.execute("SELECT COUNT(*) FROM sandboxes WHERE owner_uid=?", (owner_uid,)).fetchone()
            return int(row[0])

    def sandbox_names(self, owner_uid: int | None = None) -> dict[str, str]:
        """Id to name of the sandboxes (``owner_uid``'s, or all): what a short id is resolved against."""
        with self._lock:
            if owner_uid is None:
                rows = self._db.execute("SELECT id, name FROM sandboxes").fetchall()
            else:
                rows = self._db.execute("SELECT id, name FROM sandboxes WHERE owner_uid=?", (owner_uid,)).fetchall()
            return {str(i): str(n) for i, n in rows}

    def shard_loads(self, shards: int) -> list[int]:
        """How many sandboxes each of ``shards`` processes owns (where a create is placed: daemon/shards.py)."""
        with self._lock:
            return _shard_loads(self._db, shards)

    def rehome_shards(self, shards: int) -> int:
        """Sandboxes owned by a process there is no longer (``[daemon] workers`` lowered): to the least loaded.

        Run by the main process before it starts any other, so no process
        holds them meanwhile; returns how many moved.
        """
        with self._tx() as db:
            orphans = [str(r[0]) for r in db.execute("SELECT id FROM sandboxes WHERE shard<0 OR shard>=?", (shards,))]
            loads = _shard_loads(db, shards)
            for sid in orphans:
                to = loads.index(min(loads))
                loads[to] += 1
                db.execute("UPDATE sandboxes SET shard=? WHERE id=?", (to, sid))
        return len(orphans)

    def name_taken(self, name: str) -> bool:
        with self._lock:
            return self._db.execute("SELECT 1 FROM sandboxes WHERE name=? OR id=?", (name, name)).fetchone() is not None

    # --- turns ----------------------------------------------------------------

    def open_turn(self, sandbox_id: str, started_at: float, *, implicit: bool) -> TurnRecord:
        with self._tx(durable=False) as db:  # the turn log: group-committed (store/db.py)
            row = db.execute("SELECT COALESCE(MAX(number), 0) FROM turns WHERE sandbox_id=?", (sandbox_id,)).fetchone()
            number = int(row[0]) + 1
            # The branch the turn starts on: a restore bumps the sandbox's branch, so the turns of
            # one line of history (since the last restore) are those of the current branch.
            db.execute(
                "INSERT INTO turns(sandbox_id, number, started_at, implicit, branch)"
                " VALUES(?,?,?,?,(SELECT branch FROM sandboxes WHERE id=?))",
                (sandbox_id, number, started_at, int(implicit), sandbox_id),
            )
            got = db.execute(
                "SELECT branch FROM turns WHERE sandbox_id=? AND number=?", (sandbox_id, number)
            ).fetchone()
        branch = None if got is None or got[0] is None else int(got[0])
        return TurnRecord(sandbox_id, number, started_at, implicit=implicit, branch=branch)

    def seed_turn(self, sandbox_id: str, number: int, at: float, checkpoint_id: str, branch: int) -> None:
        """Record turn ``number`` as ended at ``at`` in ``checkpoint_id`` (a sandbox that came from another host).

        The turns before it stayed with the host the sandbox left; this one row
        makes the next turn here number ``number + 1`` and lets ``--turn number``
        resolve to the checkpoint it arrived from.
        """
        with self._tx() as db:
            db.execute(
                "INSERT INTO turns(sandbox_id, number, started_at, ended_at, implicit, branch, checkpoint_id,"
                " checkpoint_state) VALUES(?,?,?,?,1,?,?,?)",
                (sandbox_id, number, at, at, branch, checkpoint_id, TurnCheckpointState.DONE.value),
            )

    def close_turn(
        self, sandbox_id: str, number: int, ended_at: float, session_state_json: str | None, *, keep: int = 0
    ) -> None:
        """End turn ``number``; with ``keep``, prune to the last ``keep`` turns in the same transaction."""
        with self._tx(durable=False) as db:  # the turn log: group-committed (store/db.py)
            db.execute(
                "UPDATE turns SET ended_at=?, session_state_json=? WHERE sandbox_id=? AND number=?",
                (ended_at, session_state_json, sandbox_id, number),
            )
            if keep > 0:
                _prune_turns(db, sandbox_id, keep)

    def set_decision(self, sandbox_id: str, number: int, decision_json: str, checkpoint_id: str | None) -> None:
        """What the inspector decided at the end of turn ``number``, and the checkpoint that followed."""
        with self._tx(durable=False) as db:  # the turn log: group-committed (store/db.py)
            db.execute(
                "UPDATE turns SET decision_json=?, checkpoint_id=? WHERE sandbox_id=? AND number=?",
                (decision_json, checkpoint_id, sandbox_id, number),
            )

    def set_turn_checkpoint(
        self,
        sandbox_id: str,
        number: int,
        state: TurnCheckpointState,
        checkpoint_id: str | None = None,
        error: str | None = None,
        *,
        basis_id: str | None = None,
    ) -> None:
        """Where turn ``number``'s checkpoint stands: pending, done, skipped, failed, lost or none.

        ``basis_id`` (with "skipped"): the checkpoint whose state the turn ended in.
        """
        with self._tx(durable=False) as db:  # the turn log: group-committed (store/db.py)
            db.execute(
                "UPDATE turns SET checkpoint_state=?, checkpoint_id=COALESCE(?, checkpoint_id), checkpoint_error=?,"
                " basis_id=COALESCE(?, basis_id) WHERE sandbox_id=? AND number=?",
                (state, checkpoint_id, error, basis_id, sandbox_id, number),
            )

    def lose_pending_turns(self, reason: str, shard: int = 0) -> int:
        """Turns whose checkpoint was queued when crabd stopped: they have none, and say why.

        A checkpoint published just before the stop, whose turn was not yet
        marked done, is found in the catalog and the turn marked done instead.
        Only the turns of ``shard``'s sandboxes (and, for shard 0, of rows no
        sandbox has any more): another process's queue is still alive.
        """
        mine = "sandbox_id IN (SELECT id FROM sandboxes WHERE shard=?)"
        if shard == 0:
            mine = f"({mine} OR sandbox_id NOT IN (SELECT id FROM sandboxes))"
        with self._tx() as db:
            found = (
                "SELECT c.id FROM checkpoints c WHERE c.sandbox_id=turns.sandbox_id AND c.turn=turns.number"
                " AND c.created_at >= turns.ended_at"
                # The sandbox's owner's only (an id is never its owner's alone by itself: store/identity.py).
                " AND c.owner_uid=(SELECT s.owner_uid FROM sandboxes s WHERE s.id=turns.sandbox_id)"
                " ORDER BY c.created_at DESC LIMIT 1"
            )
            pending = TurnCheckpointState.PENDING
            db.execute(
                f"UPDATE turns SET checkpoint_state=?, checkpoint_id=({found})"
                f" WHERE checkpoint_state=? AND {mine} AND EXISTS({found})",
                (TurnCheckpointState.DONE, pending, shard),
            )
            cur = db.execute(
                f"UPDATE turns SET checkpoint_state=?, checkpoint_error=? WHERE checkpoint_state=? AND {mine}",
                (TurnCheckpointState.LOST, reason, pending, shard),
            )
            return int(cur.rowcount)

    def add_command(self, sandbox_id: str, turn: int, rec: CommandRecord) -> None:
        with self._tx(durable=False) as db:  # the turn log: group-committed (store/db.py)
            db.execute(
                "INSERT INTO commands VALUES(?,?,?,?,?,?,?,?,?,?,?)",
                (
                    sandbox_id,
                    turn,
                    rec.seq,
                    rec.kind,
                    rec.command,
                    rec.exit_code,
                    int(rec.timed_out),
                    rec.started_at,
                    rec.duration_s,
                    rec.stdout_bytes,
                    rec.stderr_bytes,
                ),
            )

    def next_seq(self, sandbox_id: str, turn: int) -> int:
        with self._lock:
            row = self._db.execute(
                "SELECT COALESCE(MAX(seq), 0) FROM commands WHERE sandbox_id=? AND turn=?", (sandbox_id, turn)
            ).fetchone()
            return int(row[0]) + 1

    _TURN_COLS = (
        "number, started_at, ended_at, implicit, session_state_json, decision_json, checkpoint_id,"
        " checkpoint_state, checkpoint_error, basis_id, branch"
    )

    @staticmethod
    def _opt(value: object) -> str | None:
        return None if value is None else str(value)

    def _row_to_turn(self, sandbox_id: str, row: tuple[object, ...], cmds: list[CommandRecord]) -> TurnRecord:
        number, started, ended, implicit, state_json, decision_json, ckpt_id, ck_state, ck_error, basis, branch = row
        opt = self._opt
        return TurnRecord(
            sandbox_id,
            int(str(number)),
            float(str(started)),
            None if ended is None else float(str(ended)),
            bool(implicit),
            cmds,
            opt(state_json),
            opt(decision_json),
            opt(ckpt_id),
            None if ck_state is None else TurnCheckpointState(str(ck_state)),
            opt(ck_error),
            opt(basis),
            None if branch is None else int(str(branch)),
        )

    def last_turn(self, sandbox_id: str) -> TurnRecord | None:
        """The sandbox's newest turn, without its commands (an implicit turn may hold thousands)."""
        with self._lock:
            row = self._db.execute(
                f"SELECT {self._TURN_COLS} FROM turns WHERE sandbox_id=? ORDER BY number DESC LIMIT 1", (sandbox_id,)
            ).fetchone()
            return None if row is None else self._row_to_turn(sandbox_id, tuple(row), [])

    def get_turn(self, sandbox_id: str, number: int) -> TurnRecord | None:
        """Turn ``number`` of the sandbox, without its commands; None if it has none of that number."""
        with self._lock:
            row = self._db.execute(
                f"SELECT {self._TURN_COLS} FROM turns WHERE sandbox_id=? AND number=?", (sandbox_id, number)
            ).fetchone()
            return None if row is None else self._row_to_turn(sandbox_id, tuple(row), [])

    def list_turns(self, sandbox_id: str, limit: int = 0) -> list[TurnRecord]:
        with self._lock:
            q = f"SELECT {self._TURN_COLS} FROM turns WHERE sandbox_id=? ORDER BY number DESC"
            rows = self._db.execute(
                q + (" LIMIT ?" if limit > 0 else ""), (sandbox_id, limit) if limit > 0 else (sandbox_id,)
            ).fetchall()
            turns: list[TurnRecord] = []
            for row in reversed(rows):
                cmds = self._db.execute(
                    "SELECT seq, kind, command, exit_code, timed_out, started_at, duration_s, stdout_bytes,"
                    " stderr_bytes FROM commands WHERE sandbox_id=? AND turn=? ORDER BY seq",
                    (sandbox_id, row[0]),
                ).fetchall()
                commands = [
                    CommandRecord(
                        int(c[0]),
                        str(c[1]),
                        str(c[2]),
                        int(c[3]),
                        bool(c[4]),
                        float(c[5]),
                        float(c[6]),
                        int(c[7]),
                        int(c[8]),
                    )
                    for c in cmds
                ]
                turns.append(self._row_to_turn(sandbox_id, tuple(row), commands))
            return turns

    def prune_turns(self, sandbox_id: str, keep: int) -> int:
        """Keep the sandbox's last ``keep`` turns (and their commands); return how many went.

        Only the last :data:`SESSION_STATES_KEPT` keep their session state
        (the latest one is what a revived session and a checkpoint fall back
        on), so listing every kept turn stays bounded too.  Turn numbers go
        on from the highest kept (``open_turn``), and checkpoints stay
        addressable by id: a pruned turn's number just no longer resolves.
        Group-committed like the rest of the turn log: a prune lost in a
        crash only leaves a few turns more, and the next one catches up.
        """
        with self._tx(durable=False) as db:
            return _prune_turns(db, sandbox_id, keep)

    def latest_session_state(self, sandbox_id: str) -> str | None:
        with self._lock:
            row = self._db.execute(
                "SELECT session_state_json FROM turns WHERE sandbox_id=? AND session_state_json IS NOT NULL"
                " ORDER BY number DESC LIMIT 1",
                (sandbox_id,),
            ).fetchone()
            return None if row is None else str(row[0])


def _shard_loads(db: sqlite3.Connection, shards: int) -> list[int]:
    """Sandboxes per process, for processes ``0..shards-1`` (rows of others are not counted)."""
    loads = [0] * shards
    for shard, n in db.execute("SELECT shard, COUNT(*) FROM sandboxes GROUP BY shard"):
        if 0 <= int(shard) < shards:
            loads[int(shard)] = int(n)
    return loads


def _prune_turns(db: sqlite3.Connection, sandbox_id: str, keep: int) -> int:
    """:meth:`Registry.prune_turns` inside the caller's transaction."""
    row = db.execute("SELECT COALESCE(MAX(number), 0) FROM turns WHERE sandbox_id=?", (sandbox_id,)).fetchone()
    top = int(row[0])
    db.execute(
        "UPDATE turns SET session_state_json=NULL WHERE sandbox_id=? AND number<=? AND session_state_json IS NOT NULL",
        (sandbox_id, top - SESSION_STATES_KEPT),
    )
    if top <= keep:
        return 0
    db.execute("DELETE FROM commands WHERE sandbox_id=? AND turn<=?", (sandbox_id, top - keep))
    return int(db.execute("DELETE FROM turns WHERE sandbox_id=? AND number<=?", (sandbox_id, top - keep)).rowcount)
