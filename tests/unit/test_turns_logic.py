"""Turn bookkeeping on fake backends: numbers, turn-end checkpoints, branches, and what a turn number names."""

from __future__ import annotations

from pathlib import Path

import pytest

from crabd.errors import CheckpointFailed, InvalidRequest, SandboxDead
from tests.fakes import ALICE, build_stack, engine_running, run, spec


def test_turn_ends_number_and_checkpoint_the_turns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    st = build_stack(tmp_path, monkeypatch)

    async def body() -> None:
        rec = await st.service.create(ALICE, spec("a", checkpoints="fs"))
        baseline = st.checkpointer.head_id(rec.id)
        async with engine_running(st):
            first = await st.turn(ALICE, rec.id, "one")
            second = await st.turn(ALICE, rec.id, "two")
        assert (first.number, second.number) == (1, 2)
        assert (first.checkpoint_state, second.checkpoint_state) == ("done", "done")
        assert first.checkpoint_id and second.checkpoint_id
        ck1, ck2 = st.catalog.get(first.checkpoint_id), st.catalog.get(second.checkpoint_id)
        assert (ck1.turn, ck2.turn) == (1, 2)
        assert (ck1.parent_id, ck2.parent_id) == (baseline, ck1.id)
        assert st.checkpointer.head_id(rec.id) == ck2.id
        assert [t.number for t in await st.service.turns(ALICE, "a", 0)] == [1, 2]
        fresh = st.registry.get_sandbox(rec.id)
        assert fresh is not None and (fresh.turn, fresh.turn_open) == (2, False)
        # Turn 0 is the creation checkpoint; a turn names the state it ended in.
        assert st.checkpointer.resolve_turn(fresh, 0).id == baseline
        assert st.checkpointer.resolve_turn(fresh, 1).id == ck1.id
        assert st.stored_files(st.checkpointer.resolve_turn(fresh, 2)) == {"state.txt": "two"}

    run(body())


def test_turns_open_and_close_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    st = build_stack(tmp_path, monkeypatch)

    async def body() -> None:
        await st.service.create(ALICE, spec("a", checkpoints="none"))
        async with engine_running(st):
            with pytest.raises(InvalidRequest, match="no open turn"):
                await st.service.end_turn(ALICE, "a")
            opened = await st.service.begin_turn(ALICE, "a")
            with pytest.raises(InvalidRequest, match="already open"):
                await st.service.begin_turn(ALICE, "a")
            ended = await st.service.end_turn(ALICE, "a", wait=True)
        assert opened.number == ended.number == 1
        assert opened.ended_at is None and ended.ended_at is not None
        # Policy "none": nothing to checkpoint, and a turn naming no stored state cannot be resolved.
        assert ended.checkpoint_state == "none" and ended.checkpoint_id is None
        rec = st.registry.get_sandbox("a")
        assert rec is not None
        with pytest.raises(InvalidRequest):
            st.checkpointer.resolve_turn(rec, 1)
        with pytest.raises(InvalidRequest):
            st.checkpointer.resolve_turn(rec, 9)

    run(body())


def test_a_failed_turn_checkpoint_is_recorded_with_its_turn(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    st = build_stack(tmp_path, monkeypatch)

    async def body() -> None:
        rec = await st.service.create(ALICE, spec("a", checkpoints="fs"))
        head = st.checkpointer.head_id(rec.id)
        async with engine_running(st):
            st.faults.arm("fs.capture")
            with pytest.raises(CheckpointFailed, match="turn 1"):
                await st.turn(ALICE, rec.id, "lost")
            st.faults.disarm("fs.capture")
            (turn,) = await st.service.turns(ALICE, "a", 0)
            assert (turn.checkpoint_state, turn.checkpoint_id) == ("failed", None)
            assert turn.checkpoint_error is not None and "fs.capture" in turn.checkpoint_error
            assert [(f.turn, f.kind) for f in st.catalog.failures(rec.id)] == [(1, "fs")]
            assert st.checkpointer.head_id(rec.id) == head
            fresh = st.registry.get_sandbox(rec.id)
            assert fresh is not None
            with pytest.raises(InvalidRequest, match="failed"):
                st.checkpointer.resolve_turn(fresh, 1)
            # The next turn is checkpointed again, on top of the old head.
            nxt = await st.turn(ALICE, rec.id, "next")
        assert (nxt.number, nxt.checkpoint_state) == (2, "done")
        assert nxt.checkpoint_id is not None and st.catalog.get(nxt.checkpoint_id).parent_id == head

    run(body())


def test_a_restore_starts_a_branch_and_turn_numbers_count_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    st = build_stack(tmp_path, monkeypatch)

    async def body() -> None:
        rec = await st.service.create(ALICE, spec("a", checkpoints="fs"))
        async with engine_running(st):
            t1 = await st.turn(ALICE, rec.id, "one")
            await st.turn(ALICE, rec.id, "two")
            await st.service.begin_turn(ALICE, "a")
            st.write(rec.id, "state.txt", "three, unfinished")
            # Restoring by turn number; the open turn 3 is ended (and checkpointed) first.
            restored = await st.service.restore(ALICE, "a", "", 1)
            assert restored.branch == 1
            assert st.files(rec.id) == {"state.txt": "one"}
            assert t1.checkpoint_id is not None
            assert st.checkpointer.head_id(rec.id) == t1.checkpoint_id
            t4 = await st.turn(ALICE, rec.id, "four")
        turns = await st.service.turns(ALICE, "a", 0)
        assert [(t.number, t.branch, t.checkpoint_state) for t in turns] == [
            (1, 0, "done"),
            (2, 0, "done"),
            (3, 0, "done"),
            (4, 1, "done"),
        ]
        assert t4.checkpoint_id is not None
        assert st.catalog.get(t4.checkpoint_id).parent_id == t1.checkpoint_id
        assert st.catalog.get(t4.checkpoint_id).branch == 1
        # Turn 3 still names its own end state, though the head moved away from it.
        fresh = st.registry.get_sandbox(rec.id)
        assert fresh is not None
        three = st.checkpointer.resolve_turn(fresh, 3)
        assert st.stored_files(three) == {"state.txt": "three, unfinished"}

    run(body())


def test_only_the_last_turns_are_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    st = build_stack(tmp_path, monkeypatch, quota={"turns_kept": 3})

    async def body() -> None:
        rec = await st.service.create(ALICE, spec("a", checkpoints="none"))
        async with engine_running(st):
            for i in range(5):
                await st.turn(ALICE, rec.id, str(i))
        assert [t.number for t in await st.service.turns(ALICE, "a", 0)] == [3, 4, 5]
        assert [t.number for t in await st.service.turns(ALICE, "a", 2)] == [4, 5]

    run(body())


def test_a_turn_end_decided_in_the_background_is_pending_then_decided(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    st = build_stack(tmp_path, monkeypatch)

    async def body() -> None:
        rec = await st.service.create(ALICE, spec("a", checkpoints="auto"))
        async with engine_running(st):
            await st.service.begin_turn(ALICE, "a")
            st.write(rec.id, "state.txt", "changed")
            ended = await st.service.end_turn(ALICE, "a", decide=False)
            # Returned before the inspector decided: no decision, the checkpoint pending (in the registry too).
            assert ended.decision_json is None and ended.checkpoint_state == "pending"
            # The next action waits for the decision and its checkpoint.
            await st.service.begin_turn(ALICE, "a")
            (first, _open) = await st.service.turns(ALICE, "a", 0)
            assert first.checkpoint_state == "done" and first.checkpoint_id
            assert first.decision_json is not None and "created /state.txt" in first.decision_json

            # A turn end that cannot be decided (the container died meanwhile) is recorded, not lost.
            async def dead(*_: object) -> None:
                raise SandboxDead("sandbox a is dead: container exited with code 137", sandbox="a")

            monkeypatch.setattr(st.service.flow.inspection, "plan", dead)
            await st.service.end_turn(ALICE, "a", decide=False)
            await st.service.flow.settle(rec.id)
            second = (await st.service.turns(ALICE, "a", 0))[-1]
            assert second.checkpoint_state == "failed"
            assert second.checkpoint_error is not None and "could not be decided" in second.checkpoint_error

    run(body())
