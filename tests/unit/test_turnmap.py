"""Turn numbers to checkpoints, and lost turns, over a real registry and catalog (no Docker)."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from crabd.coordinator.turnmap import CREATED_LABEL, lost_turns, resolve_turn
from crabd.errors import InvalidRequest, SandboxBusy
from crabd.models import CheckpointKind, CheckpointRecord, SandboxRecord, SandboxSpec, SandboxState, TurnCheckpointState
from crabd.store.catalog import Catalog
from crabd.store.db import Database
from crabd.store.registry import Registry


def _nothing(_blob: str) -> set[str]:
    return set()


def _size(_blob: str) -> tuple[int, int]:
    return 0, 0


class World:
    """One database; sandboxes that take turns, checkpoints, restores and forks as crabd records them."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self.reg = Registry(db)
        self.cat = Catalog(db)
        self.clock = 100.0

    def tick(self) -> float:
        self.clock += 1.0
        return self.clock

    def sandbox(self, sid: str, origin: str = "") -> SandboxRecord:
        rec = SandboxRecord(
            sid, sid, 0, SandboxSpec(env="bookworm"), "img", "c", SandboxState.RUNNING, self.tick(), origin=origin
        )
        self.reg.insert_sandbox(rec)
        if origin:
            self.cat.set_head(sid, origin, None, 0, _nothing, _size)
        return self.rec(sid)

    def rec(self, sid: str) -> SandboxRecord:
        got = self.reg.get_sandbox(sid)
        assert got is not None
        return got

    def checkpoint(self, sid: str, turn: int, label: str = "") -> CheckpointRecord:
        head = self.cat.head(sid)
        n = len(self.cat.list_checkpoints())
        ck = CheckpointRecord(
            id=f"ck-{n}",
            sandbox_id=sid,
            sandbox_name=sid,
            owner_uid=0,
            parent_id=head.checkpoint.id if head and head.checkpoint else None,
            branch=self.rec(sid).branch,
            turn=turn,
            kind=CheckpointKind.FS,
            created_at=self.tick(),
            label=label,
            image="img",
            spec_json="{}",
            index_blob=f"index-{n}",
            delta_blob="",
        )
        self.cat.publish(ck, _nothing, _size)
        return ck

    def created(self, sid: str) -> CheckpointRecord:
        return self.checkpoint(sid, 0, CREATED_LABEL)

    def turn(self, sid: str, outcome: str, *, error: str = "") -> int:
        """A turn ended with ``outcome``: done (takes a checkpoint), skipped, failed, lost, none, pending."""
        t = self.reg.open_turn(sid, self.tick(), implicit=False)
        head = self.cat.head(sid)
        self.reg.close_turn(sid, t.number, self.tick(), "{}")
        if outcome == "done":
            self.reg.set_turn_checkpoint(sid, t.number, TurnCheckpointState.PENDING)
            ck = self.checkpoint(sid, t.number)
            self.reg.set_turn_checkpoint(sid, t.number, TurnCheckpointState.DONE, ck.id)
        elif outcome == "skipped":
            basis = head.checkpoint.id if head and head.checkpoint else None
            self.reg.set_turn_checkpoint(sid, t.number, TurnCheckpointState.SKIPPED, basis_id=basis)
        else:
            self.reg.set_turn_checkpoint(sid, t.number, TurnCheckpointState(outcome), None, error or None)
        return t.number

    def restore(self, sid: str, ck: CheckpointRecord) -> None:
        with self.db.tx() as conn:
            self.reg.update_sandbox(sid, branch=self.rec(sid).branch + 1)
            self.cat.set_head(sid, ck.id, None, 0, _nothing, _size, conn=conn)

    def resolve(self, sid: str, turn: int) -> str:
        return resolve_turn(self.reg, self.cat, self.rec(sid), turn).id

    def ck_of(self, sid: str, turn: int) -> CheckpointRecord:
        t = self.reg.get_turn(sid, turn)
        assert t is not None and t.checkpoint_id
        return self.cat.get(t.checkpoint_id)


@pytest.fixture
def w(tmp_path: Path) -> Iterator[World]:
    with Database(tmp_path / "registry.db") as db:
        yield World(db)


def test_a_skipped_turn_resolves_to_its_own_line_after_a_restore(w: World) -> None:
    # The reproduced bug: turns 1 (fs), 2 (fs), 3 (skip); restore(turn=1); restore(turn=3) gave turn 1's state.
    w.sandbox("sb")
    ck0 = w.created("sb")
    one, two, three = w.turn("sb", "done"), w.turn("sb", "done"), w.turn("sb", "skipped")
    ck1, ck2 = w.ck_of("sb", one), w.ck_of("sb", two)
    w.restore("sb", ck1)
    assert w.resolve("sb", three) == ck2.id
    assert (w.resolve("sb", 0), w.resolve("sb", one), w.resolve("sb", two)) == (ck0.id, ck1.id, ck2.id)
    # The turns after the restore go on counting; a skip there is the restored state.
    four = w.turn("sb", "skipped")
    assert four == 4 and w.resolve("sb", four) == ck1.id
    assert w.reg.get_turn("sb", four) is not None and w.reg.get_turn("sb", four).branch == 1  # type: ignore[union-attr]
    # An explicit checkpoint labelled like turn 3's never stands in for the turn's own end state.
    w.checkpoint("sb", three, "explicit")
    assert w.resolve("sb", three) == ck2.id


def test_turns_whose_state_no_checkpoint_holds_are_refused(w: World) -> None:
    w.sandbox("sb")
    w.created("sb")
    failed = w.turn("sb", "failed", error="CRIU refused")
    lost = w.turn("sb", "lost", error="crabd stopped")
    none = w.turn("sb", "none")
    pending = w.turn("sb", "pending")
    with pytest.raises(InvalidRequest, match="failed: CRIU refused"):
        w.resolve("sb", failed)
    with pytest.raises(InvalidRequest, match="was lost: crabd stopped"):
        w.resolve("sb", lost)
    with pytest.raises(InvalidRequest, match="policy is 'none'"):
        w.resolve("sb", none)
    with pytest.raises(SandboxBusy, match="still being taken"):
        w.resolve("sb", pending)
    with pytest.raises(InvalidRequest, match="no turn 9"):
        w.resolve("sb", 9)
    with pytest.raises(InvalidRequest, match=">= 0"):
        w.resolve("sb", -1)
    t = w.reg.open_turn("sb", w.tick(), implicit=True)
    with pytest.raises(InvalidRequest, match="still open"):
        w.resolve("sb", t.number)


def test_a_deleted_checkpoint_is_not_replaced_by_another(w: World) -> None:
    w.sandbox("sb")
    w.created("sb")
    one = w.turn("sb", "done")
    skipped = w.turn("sb", "skipped")
    w.turn("sb", "done")
    w.cat.delete(w.ck_of("sb", one).id)
    for turn in (one, skipped):
        with pytest.raises(InvalidRequest, match="deleted"):
            w.resolve("sb", turn)
    w2 = w.sandbox("none-policy")
    with pytest.raises(InvalidRequest, match="no checkpoint of its creation"):
        w.resolve(w2.id, 0)


def test_a_fork_numbers_its_own_turns(w: World) -> None:
    w.sandbox("parent")
    w.created("parent")
    p1, p2 = w.turn("parent", "done"), w.turn("parent", "done")
    origin = w.ck_of("parent", p2)
    w.sandbox("clone", origin=origin.id)
    c1 = w.turn("clone", "skipped")  # ended in the state it was forked from
    c2 = w.turn("clone", "done")
    assert (c1, c2) == (p1, p2)
    assert w.resolve("clone", 0) == origin.id
    assert w.resolve("clone", c1) == origin.id
    assert w.resolve("clone", c2) == w.ck_of("clone", c2).id
    assert w.resolve("parent", p1) == w.ck_of("parent", p1).id


def _legacy(w: World, sid: str, number: int) -> None:
    """Make a turn row look written before schema v5 (no basis, no branch)."""
    with w.db.tx() as conn:
        conn.execute("UPDATE turns SET basis_id=NULL, branch=NULL WHERE sandbox_id=? AND number=?", (sid, number))


def test_legacy_skipped_turns_resolve_only_when_certain(w: World) -> None:
    w.sandbox("sb")
    w.created("sb")
    one, two = w.turn("sb", "done"), w.turn("sb", "skipped")
    _legacy(w, "sb", two)
    assert w.resolve("sb", two) == w.ck_of("sb", one).id  # no restore since: it was the head then
    w.turn("sb", "done")
    w.restore("sb", w.ck_of("sb", one))
    with pytest.raises(InvalidRequest, match="ambiguous"):
        w.resolve("sb", two)
    # Rows from before checkpoint states (schema < 4): the checkpoint taken for the turn at its end.
    five = w.turn("sb", "done")
    with w.db.tx() as conn:
        conn.execute("UPDATE turns SET checkpoint_state=NULL, checkpoint_id=NULL WHERE number=?", (five,))
    assert w.resolve("sb", five) == w.cat.by_turn("sb", five, 0)[0].id


def test_recovery_loses_only_turns_of_the_current_line(w: World) -> None:
    w.sandbox("sb")
    w.created("sb")
    one = w.turn("sb", "done")
    w.turn("sb", "done")
    ck1 = w.ck_of("sb", one)
    w.restore("sb", ck1)
    w.turn("sb", "skipped")  # ended in ck1's state
    rec = w.rec("sb")
    turns = w.reg.list_turns("sb")
    # Turn 2 was left behind by the restore, not lost by a crash; turn 3 is ck1's state.
    assert lost_turns(turns, ck1, rec) == []
    four = w.turn("sb", "failed")
    five = w.turn("sb", "skipped")
    assert lost_turns(w.reg.list_turns("sb"), ck1, w.rec("sb")) == [four, five]
    # Once a turn of this line took a checkpoint, only what ended after it counts.
    six = w.turn("sb", "done")
    seven = w.turn("sb", "skipped")
    head = w.ck_of("sb", six)
    assert lost_turns(w.reg.list_turns("sb"), head, w.rec("sb")) == []
    eight = w.reg.open_turn("sb", w.tick(), implicit=True).number
    assert lost_turns(w.reg.list_turns("sb"), head, w.rec("sb")) == [eight]
    assert seven not in lost_turns(w.reg.list_turns("sb"), head, w.rec("sb"))


def test_schema_v4_turns_gain_basis_and_branch(tmp_path: Path) -> None:
    path = tmp_path / "registry.db"
    conn = sqlite3.connect(path)
    conn.executescript(
        "CREATE TABLE turns(sandbox_id TEXT NOT NULL, number INTEGER NOT NULL, started_at REAL NOT NULL,"
        " ended_at REAL, implicit INTEGER NOT NULL DEFAULT 0, session_state_json TEXT, decision_json TEXT,"
        " checkpoint_id TEXT, checkpoint_state TEXT, checkpoint_error TEXT, PRIMARY KEY(sandbox_id, number));"
        "INSERT INTO turns(sandbox_id, number, started_at, ended_at, checkpoint_state)"
        " VALUES('s1', 1, 1.0, 2.0, 'skipped');"
    )
    conn.commit()
    conn.close()
    with Database(path) as db:
        [t] = Registry(db).list_turns("s1")
        assert t.checkpoint_state == "skipped" and t.basis_id is None and t.branch is None
        assert db.conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0] == "8"
