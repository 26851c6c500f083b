"""A command that is a turn of its own (``run(..., turn=...)``), against a real crabd: one call, same turns."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from crabd.api.v1 import crab_pb2 as pb
from crabd.sdk import AsyncClient, CheckpointFailed, Client, EmbeddedDaemon, InvalidRequest, Sandbox

pytestmark = [pytest.mark.integration, pytest.mark.docker, pytest.mark.criu]


def test_a_command_turn_is_the_turn_three_calls_make(make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox("bookworm")
    r = sb.session.run("echo a > /root/a; echo wrote", turn="durable")
    assert r.stdout == b"wrote\n" and r.exit_code == 0
    ended = r.ended_turn
    assert ended is not None and ended.number == r.turn and not ended.open
    assert ended.decision is not None and ended.decision.kind == "fs"
    assert ended.checkpoint_state == "done" and ended.checkpoint_id in {c.id for c in sb.checkpoints()}
    assert [c.command for c in ended.commands] == ["echo a > /root/a; echo wrote"]

    skipped = sb.run(["cat", "/root/a"], turn="durable")
    assert skipped.stdout == b"a\n" and skipped.ended_turn is not None
    assert skipped.ended_turn.number == ended.number + 1 and skipped.ended_turn.checkpoint_state == "skipped"

    # "deferred": back once the turn is closed; the decision and checkpoint follow before the next action.
    deferred = sb.session.run("echo b > /root/b", turn="deferred").ended_turn
    assert deferred is not None and deferred.decision is None and deferred.checkpoint_state == "pending"
    assert sb.run(["cat", "/root/b"]).stdout == b"b\n"
    listed = {t.number: t for t in sb.turns()}
    assert listed[deferred.number].checkpoint_state == "done" and listed[deferred.number].checkpoint_id

    # A plain command is no turn and carries none.
    assert sb.run(["true"]).ended_turn is None

    # Restoring by the number a command turn returned brings that turn's files back.
    sb.restore(turn=ended.number)
    assert sb.run(["ls", "/root"]).stdout.split() == [b"a"]


def test_streamed_output_comes_before_the_turn_end(make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox("busybox")
    events = list(sb.stream(["sh", "-c", "echo one; echo two >&2"], turn="decided"))
    *chunks, result = events
    assert {(c.stream, c.data) for c in chunks} >= {("stdout", b"one\n"), ("stderr", b"two\n")}  # type: ignore[union-attr]
    assert result.ended_turn is not None and result.ended_turn.decision is not None  # type: ignore[union-attr]


def test_an_open_turn_or_a_bad_word_changes_nothing(client: Client, make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox("busybox")
    sb.begin_turn()
    with pytest.raises(InvalidRequest, match="already open"):
        sb.run(["touch", "/tmp/ran"], turn="durable")
    # Past the SDK's own check, crabd refuses an unknown word before anything runs.
    with pytest.raises(InvalidRequest, match="unknown turn end"):
        list(
            client._send_stream(
                client._stream("Exec", pb.ExecRequest(sandbox=sb.id, argv=["touch", "/tmp/ran"], turn_end="x"), 0)
            )
        )
    # A word of a megabyte: crabd's error quotes it, clipped, and still arrives as InvalidRequest
    # (whole, it passed gRPC's 16 KiB metadata limit and reached the caller as RESOURCE_EXHAUSTED).
    with pytest.raises(InvalidRequest, match=r"unknown turn end .*more characters"):
        list(
            client._send_stream(
                client._stream(
                    "Exec", pb.ExecRequest(sandbox=sb.id, argv=["touch", "/tmp/ran"], turn_end="x" * 2**20), 0
                )
            )
        )
    ended = sb.end_turn(wait=True)
    assert ended.commands == [] and sb.run(["ls", "/tmp"]).stdout == b""


def test_a_durable_command_turn_whose_checkpoint_fails_raises(make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox("bookworm")
    # CRIU 4.2.1 cannot dump io_uring: the turn's full checkpoint fails.
    uring = (
        "import ctypes, time; p = (ctypes.c_uint8 * 120)(); "
        "assert ctypes.CDLL(None).syscall(425, 8, p) >= 0; time.sleep(10**6)"
    )
    sb.run(["sh", "-c", "cat > /root/uring.py"], stdin=uring.encode())
    with pytest.raises(CheckpointFailed) as info:
        sb.session.run("python3 /root/uring.py & sleep 0.5", turn="durable")
    last = sb.turns(limit=1)[0]
    assert info.value.turn == last.number and last.checkpoint_state == "failed" and not last.open


def test_a_command_turn_its_client_abandons_is_still_ended(
    daemon: EmbeddedDaemon, make_sandbox: Callable[..., Sandbox]
) -> None:
    sb = make_sandbox("busybox")

    async def abandon() -> None:
        async with AsyncClient(daemon.socket) as c:
            asb = await c.get(sb.id)
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(asb.run(["sleep", "30"], turn="durable"), 1.0)

    asyncio.run(abandon())
    # crabd ended the turn when the call went away: the next command turn opens (not "already open").
    for _ in range(100):
        last = sb.turns(limit=1)[0]
        if not last.open:
            break
        asyncio.run(asyncio.sleep(0.1))
    # (An abandoned command is killed with its call and leaves no command record.)
    assert not last.open and last.checkpoint_state in ("skipped", "done")
    nxt = sb.run(["true"], turn="durable").ended_turn
    assert nxt is not None and nxt.number == last.number + 1
