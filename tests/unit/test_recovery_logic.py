"""Recovery on fake backends: back to the head, and which turns that loses."""

from __future__ import annotations

from pathlib import Path

import pytest

from crabd.errors import AlreadyExists, CheckpointFailed, DockerError, InvalidRequest
from crabd.models import SandboxRecord, SandboxState
from tests.fakes import ALICE, Stack, build_stack, engine_running, run, spec


def _kill(st: Stack, rec: SandboxRecord) -> str:
    fresh = st.registry.get_sandbox(rec.id)
    assert fresh is not None
    st.backend.kill(fresh.container_id)
    return fresh.container_id


def test_recovery_loses_the_turns_after_the_head(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    st = build_stack(tmp_path, monkeypatch)

    async def body() -> None:
        rec = await st.service.create(ALICE, spec("a", checkpoints="fs"))
        async with engine_running(st):
            await st.turn(ALICE, rec.id, "one")
            await st.turn(ALICE, rec.id, "two")
            st.faults.arm("fs.store")
            with pytest.raises(CheckpointFailed):
                await st.turn(ALICE, rec.id, "three")
            st.faults.disarm("fs.store")
            await st.service.begin_turn(ALICE, "a")  # turn 4 never ends
            st.write(rec.id, "state.txt", "four")
            head = st.checkpointer.head_id(rec.id)
            dead = _kill(st, rec)
            got = await st.service.recover(ALICE, "a")
        assert got.checkpoint.id == head and got.checkpoint.turn == 2
        assert got.lost_turns == [3, 4]
        assert got.sandbox.state is SandboxState.RUNNING
        assert got.sandbox.container_id != dead
        assert st.files(rec.id) == {"state.txt": "two"}

    run(body())


def test_recovery_right_after_a_checkpoint_loses_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    st = build_stack(tmp_path, monkeypatch)

    async def body() -> None:
        rec = await st.service.create(ALICE, spec("a", checkpoints="fs"))
        async with engine_running(st):
            await st.turn(ALICE, rec.id, "one")
            _kill(st, rec)
            got = await st.service.recover(ALICE, "a")
            assert got.lost_turns == []
            # After the recovery (a new branch) the old line's turns are never counted again.
            await st.turn(ALICE, rec.id, "two")
            await st.service.begin_turn(ALICE, "a")
            _kill(st, rec)
            again = await st.service.recover(ALICE, "a")
        assert again.checkpoint.turn == 2
        assert again.lost_turns == [3]

    run(body())


def test_turns_before_a_restore_are_not_lost_by_a_crash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    st = build_stack(tmp_path, monkeypatch)

    async def body() -> None:
        rec = await st.service.create(ALICE, spec("a", checkpoints="none"))
        base = st.checkpointer.head_id(rec.id)
        assert base is None  # policy none: no baseline either
        ckpt = await st.service.create_checkpoint(ALICE, "a", "manual", "fs")
        async with engine_running(st):
            await st.turn(ALICE, rec.id, "one")
            await st.turn(ALICE, rec.id, "two")
            await st.service.restore(ALICE, "a", ckpt.id, -1)
            await st.turn(ALICE, rec.id, "three")  # policy none: no checkpoint, so lost
            _kill(st, rec)
            got = await st.service.recover(ALICE, "a")
        # Turns 1 and 2 were left behind by the restore, not lost by the crash.
        assert got.checkpoint.id == ckpt.id
        assert got.lost_turns == [3]

    run(body())


def test_recovery_is_refused_where_it_cannot_help(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    st = build_stack(tmp_path, monkeypatch)

    async def body() -> None:
        running = await st.service.create(ALICE, spec("running", checkpoints="fs"))
        bare = await st.service.create(ALICE, spec("bare", checkpoints="none"))
        with pytest.raises(InvalidRequest, match="is running"):
            await st.service.recover(ALICE, "running")
        dead = _kill(st, bare)
        with pytest.raises(InvalidRequest, match="no checkpoint"):
            await st.service.recover(ALICE, "bare")
        got = st.registry.get_sandbox(bare.id)
        assert got is not None and (got.state, got.container_id) == (SandboxState.DEAD, dead)
        assert st.registry.get_sandbox(running.id) is not None

    run(body())


def test_automatic_recovery_backs_off_after_a_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    st = build_stack(tmp_path, monkeypatch)

    async def body() -> None:
        auto = await st.service.create(ALICE, spec("auto", checkpoints="fs", recovery="auto"))
        manual = await st.service.create(ALICE, spec("manual", checkpoints="fs"))
        _kill(st, auto)
        _kill(st, manual)
        st.faults.arm("backend.create")
        assert await st.recovery.sweep() == []
        attempts = st.faults.calls["backend.create"]
        # Marked dead by the sweep, but a failed recovery is not retried at once.
        for rec in (auto, manual):
            got = st.registry.get_sandbox(rec.id)
            assert got is not None and got.state is SandboxState.DEAD
        st.faults.disarm("backend.create")
        assert await st.recovery.sweep() == []
        assert st.faults.calls["backend.create"] == attempts
        # Once the back-off has passed it is; a "manual" sandbox never is.
        st.recovery._failed[auto.id] = (1, 0.0)
        assert await st.recovery.sweep() == [auto.id]
        got = st.registry.get_sandbox(auto.id)
        assert got is not None and got.state is SandboxState.RUNNING
        got = st.registry.get_sandbox(manual.id)
        assert got is not None and got.state is SandboxState.DEAD

    run(body())


def test_a_failed_recovery_leaves_the_sandbox_dead_and_its_head(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    st = build_stack(tmp_path, monkeypatch)

    async def body() -> None:
        rec = await st.service.create(ALICE, spec("a", checkpoints="fs"))
        head = st.checkpointer.head_id(rec.id)
        dead = _kill(st, rec)
        st.faults.arm("backend.start")
        with pytest.raises(DockerError):
            await st.service.recover(ALICE, "a")
        got = st.registry.get_sandbox(rec.id)
        assert got is not None
        assert (got.state, got.container_id, got.branch) == (SandboxState.DEAD, dead, 0)
        assert st.checkpointer.head_id(rec.id) == head
        assert set(st.backend.containers) == {dead}  # the new container was removed again

    run(body())


def test_an_import_bounds_the_lost_turns_it_reports_and_keeps_the_identity(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ImportSandbox: a caller's absurd ``last_turn`` is refused before anything is made; a sane one is reported."""
    st = build_stack(tmp_path, monkeypatch)

    async def body() -> None:
        rec = await st.service.create(ALICE, spec("mover", checkpoints="fs"))
        async with engine_running(st):
            await st.turn(ALICE, rec.id, "one")
            ck = await st.service.create_checkpoint(ALICE, rec.id, "move", "fs")
            with pytest.raises(AlreadyExists):
                await st.service.import_sandbox(ALICE, ck.id, -1)  # it lives here already
            await st.service.remove(ALICE, rec.id, force=True, keep_checkpoints=True)
            with pytest.raises(InvalidRequest, match="at most 100000"):
                await st.service.import_sandbox(ALICE, ck.id, 10**15)
            assert st.registry.list_sandboxes(None) == []
            got = await st.service.import_sandbox(ALICE, ck.id, ck.turn + 2)
        assert (got.sandbox.id, got.sandbox.name) == (rec.id, "mover")
        assert got.lost_turns == [ck.turn + 1, ck.turn + 2]

    run(body())


def test_the_watch_reads_every_sandbox_only_when_due(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Between full passes the watch only polls the inits' pidfds; a death found elsewhere brings one forward."""
    from crabd.coordinator import recovery as recovery_mod

    st = build_stack(tmp_path, monkeypatch)
    full: list[int] = []
    real_sweep = st.recovery.sweep

    async def counted() -> list[str]:
        full.append(st.recovery._ticks)
        return await real_sweep()

    monkeypatch.setattr(st.recovery, "sweep", counted)
    monkeypatch.setattr(recovery_mod, "FULL_SWEEP_EVERY", 4)

    async def body() -> None:
        auto = await st.service.create(ALICE, spec("auto", checkpoints="fs", recovery="auto"))
        other = await st.service.create(ALICE, spec("other", checkpoints="fs"))
        assert await st.recovery._tick() == []  # the first tick is a full pass
        _kill(st, auto)  # the fake's inits are no real processes: no pidfd tells
        for _ in range(3):
            assert await st.recovery._tick() == []
        assert full == [1]
        assert await st.recovery._tick() == [auto.id]  # the next full pass finds and recovers it
        assert full == [1, 5]
        _kill(st, other)
        await st.service.get(ALICE, other.id)  # a request finds it dead: SandboxManager.deaths moves
        await st.recovery._tick()
        assert full == [1, 5, 6]

    run(body())
