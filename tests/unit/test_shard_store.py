"""The store's side of crabd as several processes ([daemon] workers): ownership, rehoming, turns, leases."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from crabd.coordinator.leases import Leases
from crabd.errors import CheckpointNotFound
from crabd.models import SandboxRecord, SandboxSpec, SandboxState, TurnCheckpointState
from crabd.store import leasing
from crabd.store.catalog import Catalog
from crabd.store.db import Database
from crabd.store.registry import Registry


@pytest.fixture
def two(tmp_path: Path) -> Iterator[tuple[Database, Database]]:
    """Two connections to one database: two crabd processes."""
    a, b = Database(tmp_path / "r.db"), Database(tmp_path / "r.db")
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def _sandbox(reg: Registry, sid: str, shard: int) -> None:
    spec = SandboxSpec(env="base")
    reg.insert_sandbox(SandboxRecord(sid, sid, 1000, spec, "img", "", SandboxState.RUNNING, 0.0, shard=shard))


def test_a_row_keeps_its_shard_and_loads_are_counted(two: tuple[Database, Database]) -> None:
    a, b = two
    _sandbox(Registry(a), "s0", 0)
    _sandbox(Registry(b), "s1", 1)
    _sandbox(Registry(b), "s1b", 1)
    reg = Registry(a)
    got = reg.get_sandbox("s1")
    assert got is not None and got.shard == 1
    assert [r.shard for r in reg.list_sandboxes(None)] == [0, 1, 1]
    assert reg.shard_loads(3) == [1, 2, 0]


def test_rows_of_a_process_there_is_no_longer_are_rehomed_evenly(two: tuple[Database, Database]) -> None:
    a, _ = two
    reg = Registry(a)
    for i in range(6):
        _sandbox(reg, f"s{i}", i % 3)  # shards 0, 1, 2, 0, 1, 2
    assert reg.rehome_shards(2) == 2  # workers 3 -> 2: shard 2's two sandboxes move
    assert reg.shard_loads(2) == [3, 3]
    assert reg.rehome_shards(2) == 0  # idempotent


def test_a_start_loses_only_its_own_pending_turns(two: tuple[Database, Database]) -> None:
    # Another process's queue is alive: its pending turns are not lost when this one restarts.
    a, b = two
    ra, rb = Registry(a), Registry(b)
    _sandbox(ra, "s0", 0)
    _sandbox(rb, "s1", 1)
    for reg, sid in ((ra, "s0"), (rb, "s1")):
        turn = reg.open_turn(sid, 1.0, implicit=False)
        reg.close_turn(sid, turn.number, 2.0, None)
        reg.set_turn_checkpoint(sid, turn.number, TurnCheckpointState.PENDING)
    assert rb.lose_pending_turns("stopped", shard=1) == 1
    t0, t1 = ra.last_turn("s0"), ra.last_turn("s1")
    assert t0 is not None and t1 is not None
    assert t0.checkpoint_state == TurnCheckpointState.PENDING and t1.checkpoint_state == TurnCheckpointState.LOST
    # Shard 0 also takes the turns whose sandbox row is gone.
    with a.tx() as conn:
        conn.execute("DELETE FROM sandboxes WHERE id='s1'")
        conn.execute("UPDATE turns SET checkpoint_state=? WHERE sandbox_id='s1'", (TurnCheckpointState.PENDING,))
    assert ra.lose_pending_turns("stopped", shard=0) == 2


def test_a_lease_taken_in_one_process_is_seen_by_retention_in_another(two: tuple[Database, Database]) -> None:
    a, b = two
    with b.tx() as conn:
        conn.execute(
            "INSERT INTO checkpoints(id, sandbox_id, sandbox_name, owner_uid, branch, turn, kind, created_at,"
            " image, spec_json, index_blob, delta_blob, stats_json) VALUES('c1','s','s','1000',0,1,'fs',0,'i',"
            "'{}','x','y','{}')"
        )
    mine, theirs = Leases(Catalog(a), shard=0), Leases(Catalog(b), shard=1)

    async def body() -> None:
        async with theirs.hold("c1"):
            assert mine.held() == {"c1"}
        assert mine.held() == set()
        with pytest.raises(CheckpointNotFound):
            async with theirs.hold("nope"):
                pass

    asyncio.run(body())
    # A process that died holding one: its successor drops it, and only its own.
    with b.tx() as conn:
        leasing.add(conn, 1, "c1")
        leasing.add(conn, 0, "c1")
    assert theirs.drop_dead() == 1 and mine.held() == {"c1"}
    assert mine.drop_dead() == 1 and mine.held() == set()
