"""A command that is a turn of its own (``run(..., turn=...)``): begin, command, end in one call, on fakes."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from crabd.errors import CheckpointFailed, InvalidRequest, SandboxDead
from crabd.models import TurnEnd
from crabd.sdk._requests import ExecOptions, session_request
from tests.fakes import ALICE, Stack, build_stack, engine_running, run, spec


def writes(st: Stack, sandbox_id: str, text: str) -> Callable[[], Awaitable[str]]:
    """A command's stand-in: it writes state.txt (the fake init runs no processes) and returns a token."""

    async def command() -> str:
        st.write(sandbox_id, "state.txt", text)
        return f"wrote {text}"

    return command


def test_each_turn_end_word_returns_at_its_point(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    st = build_stack(tmp_path, monkeypatch)

    async def body() -> None:
        rec = await st.service.create(ALICE, spec("a", checkpoints="auto"))
        flow = st.service.flow
        async with engine_running(st):
            out, durable = await flow.command_turn(rec, TurnEnd.DURABLE, writes(st, rec.id, "one"))
            assert out == "wrote one"
            assert (durable.number, durable.checkpoint_state) == (1, "done") and durable.checkpoint_id
            assert st.stored_files(st.catalog.get(durable.checkpoint_id)) == {"state.txt": "one"}

            _, decided = await flow.command_turn(rec, TurnEnd.DECIDED, writes(st, rec.id, "two"))
            assert decided.number == 2 and decided.decision_json is not None
            assert decided.checkpoint_state in ("pending", "done")

            _, deferred = await flow.command_turn(rec, TurnEnd.DEFERRED, writes(st, rec.id, "three"))
            # Closed, not yet decided: the decision is made in the background, the next action waits for it.
            assert deferred.number == 3 and deferred.decision_json is None and deferred.checkpoint_state == "pending"
            await flow.settle(rec.id)
            turns = await st.service.turns(ALICE, "a", 0)
            assert [(t.number, t.checkpoint_state) for t in turns] == [(1, "done"), (2, "done"), (3, "done")]
            assert st.stored_files(st.catalog.get(turns[-1].checkpoint_id or "")) == {"state.txt": "three"}
        fresh = st.registry.get_sandbox(rec.id)
        assert fresh is not None and (fresh.turn, fresh.turn_open) == (3, False)

    run(body())


def test_a_command_that_fails_or_is_cancelled_still_ends_its_turn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    st = build_stack(tmp_path, monkeypatch)

    async def body() -> None:
        rec = await st.service.create(ALICE, spec("a", checkpoints="fs"))
        flow = st.service.flow
        async with engine_running(st):

            async def dies() -> None:
                st.write(rec.id, "state.txt", "half")
                raise SandboxDead("sandbox a is dead: container exited with code 137", sandbox="a")

            with pytest.raises(SandboxDead):
                await flow.command_turn(rec, TurnEnd.DURABLE, dies)
            fresh = st.registry.get_sandbox(rec.id)
            assert fresh is not None and (fresh.turn, fresh.turn_open) == (1, False)

            # A call its client abandons (grpc.aio cancels the handler) mid-command: the turn is ended too.
            started = asyncio.Event()

            async def hangs() -> None:
                started.set()
                await asyncio.sleep(3600)

            task = asyncio.create_task(flow.command_turn(rec, TurnEnd.DURABLE, hangs))
            await started.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            fresh = st.registry.get_sandbox(rec.id)
            assert fresh is not None and (fresh.turn, fresh.turn_open) == (2, False)
            # So the next turn opens: not "turn 2 is already open".
            _, third = await flow.command_turn(rec, TurnEnd.DURABLE, writes(st, rec.id, "on"))
            assert third.number == 3 and third.checkpoint_state == "done"

    run(body())


def test_a_durable_turn_whose_checkpoint_fails_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    st = build_stack(tmp_path, monkeypatch)

    async def body() -> None:
        rec = await st.service.create(ALICE, spec("a", checkpoints="fs"))
        async with engine_running(st):
            st.faults.arm("fs.capture")
            with pytest.raises(CheckpointFailed, match="turn 1"):
                await st.service.flow.command_turn(rec, TurnEnd.DURABLE, writes(st, rec.id, "lost"))
            st.faults.disarm("fs.capture")
            (turn,) = await st.service.turns(ALICE, "a", 0)
            assert (turn.number, turn.checkpoint_state, turn.checkpoint_id) == (1, "failed", None)

    run(body())


def test_an_open_turn_or_a_bad_word_refuses_before_the_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    st = build_stack(tmp_path, monkeypatch)

    async def body() -> None:
        rec = await st.service.create(ALICE, spec("a", checkpoints="fs"))
        ran: list[str] = []

        async def command() -> None:
            ran.append("ran")

        async with engine_running(st):
            await st.service.begin_turn(ALICE, "a")
            with pytest.raises(InvalidRequest, match="already open"):
                await st.service.flow.command_turn(rec, TurnEnd.DURABLE, command)
            assert ran == []
            # The word is checked before the sandbox is even looked up.
            with pytest.raises(InvalidRequest, match="unknown turn end 'later'"):
                await st.service.command_edge.session_run(
                    ALICE, "no-such-sandbox", "true", timeout_s=0, max_output=0, sink=None, turn_end="later"
                )
            fresh = st.registry.get_sandbox(rec.id)
            assert fresh is not None and (fresh.turn, fresh.turn_open) == (1, True)

    run(body())


def test_the_sdk_checks_the_word_before_sending() -> None:
    assert ExecOptions("true", turn="durable").request("sb", stream=False).turn_end == "durable"
    assert ExecOptions("true").request("sb", stream=False).turn_end == ""
    assert session_request("sb", "true", turn=TurnEnd.DEFERRED).turn_end == "deferred"
    with pytest.raises(InvalidRequest, match="unknown turn end"):
        ExecOptions("true", turn="soon").request("sb", stream=False)


def test_commands_in_several_sessions_share_and_end_the_sandboxs_turns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A turn is the sandbox's: a command turn that starts while another runs joins its turn; each
    command's end ends the turn open then, and one whose turn another end closed gets a turn of its own."""
    st = build_stack(tmp_path, monkeypatch)

    async def body() -> None:
        rec = await st.service.create(ALICE, spec("a", checkpoints="fs"))
        flow = st.service.flow
        async with engine_running(st):
            release = asyncio.Event()

            async def slow() -> str:
                st.write(rec.id, "slow.txt", "started")
                await release.wait()
                st.write(rec.id, "slow.txt", "ended")
                return "slow"

            long = asyncio.create_task(flow.command_turn(rec, TurnEnd.DURABLE, slow))
            await asyncio.sleep(0.05)
            # Another session's command meanwhile: it joins the open turn (no "already open"), and its
            # end ends that turn while the slow command still runs.
            _, quick = await flow.command_turn(rec, TurnEnd.DURABLE, writes(st, rec.id, "quick"))
            assert quick.number == 1 and quick.checkpoint_state == "done" and not long.done()
            assert st.stored_files(st.catalog.get(quick.checkpoint_id or "")) == {
                "slow.txt": "started",
                "state.txt": "quick",
            }
            release.set()
            out, own = await long
            # Its turn was closed by the quick one's end: what it did after that is a turn of its own.
            assert out == "slow" and own.number == 2 and own.checkpoint_state == "done"
            assert st.stored_files(st.catalog.get(own.checkpoint_id or ""))["slow.txt"] == "ended"
        fresh = st.registry.get_sandbox(rec.id)
        assert fresh is not None and (fresh.turn, fresh.turn_open) == (2, False)

    run(body())


def test_command_turns_that_finish_together_each_end_a_turn(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Gathered commands (ROCK's clients gather over sessions) finishing at once: none is left without a turn."""
    st = build_stack(tmp_path, monkeypatch)

    async def body() -> None:
        rec = await st.service.create(ALICE, spec("a", checkpoints="fs"))
        flow = st.service.flow
        async with engine_running(st):
            go = asyncio.Event()

            def together(i: int) -> Callable[[], Awaitable[str]]:
                async def command() -> str:
                    await go.wait()
                    st.write(rec.id, f"f{i}.txt", str(i))
                    return str(i)

                return command

            running = [asyncio.create_task(flow.command_turn(rec, TurnEnd.DEFERRED, together(i))) for i in range(5)]
            await asyncio.sleep(0.05)
            go.set()
            done = await asyncio.gather(*running)
            assert sorted(out for out, _ in done) == ["0", "1", "2", "3", "4"]
            numbers = [t.number for _, t in done]
            assert len(set(numbers)) == len(numbers)  # each ended a turn of its own
            await flow.settle(rec.id)
        fresh = st.registry.get_sandbox(rec.id)
        assert fresh is not None and not fresh.turn_open

    run(body())
