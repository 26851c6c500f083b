from __future__ import annotations

import time
from pathlib import Path

import pytest

from crabd.errors import AlreadyExists
from crabd.models import CommandRecord, SandboxRecord, SandboxSpec, SandboxState
from crabd.store.db import Database
from crabd.store.registry import Registry


def _rec(sid: str, name: str, owner: int = 0) -> SandboxRecord:
    spec = SandboxSpec(env="busybox", name=name, cpus=0.5, env_vars={"A": "b"})
    return SandboxRecord(sid, name, owner, spec, "img", "", SandboxState.CREATING, time.time())


def test_sandbox_rows_round_trip_and_survive_reopen(tmp_path: Path) -> None:
    db = tmp_path / "registry.db"
    with Database(db) as d:
        reg = Registry(d)
        reg.insert_sandbox(_rec("a1", "one", owner=1000))
        reg.update_sandbox("a1", state=SandboxState.RUNNING, container_id="c" * 64)
    with Database(db) as d:
        reg = Registry(d)
        got = reg.get_sandbox("one")
        assert got is not None and got.id == "a1" and got.owner_uid == 1000
        assert got.state is SandboxState.RUNNING and got.container_id == "c" * 64
        assert got.spec.env_vars == {"A": "b"} and got.spec.cpus == 0.5
        assert reg.get_sandbox("a1") is not None
        assert reg.get_sandbox("zzz") is None
        assert [r.id for r in reg.list_sandboxes(1000)] == ["a1"]
        assert reg.list_sandboxes(0) == []
        assert reg.name_taken("one") and reg.name_taken("a1") and not reg.name_taken("two")


def test_a_listing_carries_each_sandboxs_last_turn_and_counts_match_it(tmp_path: Path) -> None:
    """One statement lists the sandboxes with their last turn (it was one query per row)."""
    with Database(tmp_path / "r.db") as d:
        reg = Registry(d)
        reg.insert_sandbox(_rec("a1", "one", owner=1000))
        reg.insert_sandbox(_rec("a2", "two", owner=1000))
        reg.insert_sandbox(_rec("b1", "three", owner=2000))
        reg.open_turn("a1", 1.0, implicit=False)
        reg.close_turn("a1", 1, 2.0, None)
        reg.open_turn("a1", 3.0, implicit=False)  # a1: turn 2, open
        reg.open_turn("b1", 1.0, implicit=False)
        reg.close_turn("b1", 1, 2.0, None)  # b1: turn 1, closed; a2: no turn
        listed = {r.id: (r.turn, r.turn_open) for r in reg.list_sandboxes(None)}
        assert listed == {"a1": (2, True), "a2": (0, False), "b1": (1, False)}
        got = reg.get_sandbox("one")
        assert got is not None and (got.turn, got.turn_open) == (2, True)
        assert [r.id for r in reg.list_sandboxes(1000)] == ["a1", "a2"]
        assert reg.count_sandboxes(None) == 3 and reg.count_sandboxes(1000) == 2 and reg.count_sandboxes(7) == 0
        assert reg.sandbox_names(1000) == {"a1": "one", "a2": "two"}
        assert reg.sandbox_names(None) == {"a1": "one", "a2": "two", "b1": "three"}


def test_names_are_unique(tmp_path: Path) -> None:

    with Database(tmp_path / "r.db") as d:
        reg = Registry(d)
        reg.insert_sandbox(_rec("a1", "same"))
        # The one check across crabd's processes ([daemon] workers): the name's UNIQUE constraint.
        with pytest.raises(AlreadyExists, match="already exists"):
            reg.insert_sandbox(_rec("a2", "same"))
        assert [r.id for r in reg.list_sandboxes(None)] == ["a1"]


def test_turns_commands_and_session_state(tmp_path: Path) -> None:
    with Database(tmp_path / "r.db") as d:
        reg = Registry(d)
        reg.insert_sandbox(_rec("a1", "one"))
        t1 = reg.open_turn("a1", 1.0, implicit=False)
        assert t1.number == 1
        reg.add_command("a1", 1, CommandRecord(reg.next_seq("a1", 1), "exec", "ls", 0, False, 1.0, 0.1, 3, 0))
        reg.add_command("a1", 1, CommandRecord(reg.next_seq("a1", 1), "session", "cd /", 0, False, 1.2, 0.1, 0, 0))
        reg.close_turn("a1", 1, 2.0, '{"cwd": "/"}')
        t2 = reg.open_turn("a1", 3.0, implicit=True)
        assert t2.number == 2
        turns = reg.list_turns("a1")
        assert [t.number for t in turns] == [1, 2]
        assert [c.seq for c in turns[0].commands] == [1, 2] and turns[0].ended_at == 2.0
        assert turns[1].open and turns[1].implicit
        assert reg.latest_session_state("a1") == '{"cwd": "/"}'
        assert [t.number for t in reg.list_turns("a1", limit=1)] == [2]
        rec = reg.get_sandbox("a1")
        assert rec is not None and rec.turn == 2 and rec.turn_open
        reg.delete_sandbox("a1")
        assert reg.list_turns("a1") == [] and reg.get_sandbox("a1") is None


def test_wal_mode(tmp_path: Path) -> None:
    import sqlite3

    with Database(tmp_path / "r.db"):
        mode = sqlite3.connect(tmp_path / "r.db").execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"


def test_the_open_turn_is_found_without_reading_its_commands(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every command asks for the open turn: an implicit one with thousands of commands must not be read whole."""
    from crabd.coordinator.turns import TurnKeeper

    with Database(tmp_path / "r.db") as d:
        reg = Registry(d)
        reg.insert_sandbox(_rec("a1", "one"))
        keeper = TurnKeeper(reg)
        assert keeper.current("a1") is None
        number = keeper.ensure_open("a1")
        for i in range(3):
            reg.add_command(
                "a1", number, CommandRecord(reg.next_seq("a1", number), "exec", f"c{i}", 0, False, 1, 0, 0, 0)
            )
        monkeypatch.setattr(reg, "list_turns", lambda *a, **k: pytest.fail("read the turns with their commands"))
        current = keeper.current("a1")
        assert current is not None and (current.number, current.open, current.implicit) == (number, True, True)
        assert keeper.ensure_open("a1") == number
        monkeypatch.undo()
        ended = keeper.end("a1", number, None)
        assert [c.command for c in ended.commands] == ["c0", "c1", "c2"] and not ended.open
        assert keeper.current("a1") is None
